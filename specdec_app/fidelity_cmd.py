"""``specdec fidelity``: every numerics this machine can run for the target,
scored against the model file's exact float32 dequantization by teacher
forcing over text the models did not write (target_service/fidelity.py).
Writes results.json, results.md and fidelity.png into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.models import DEFAULT_TARGET

    p.add_argument("--model", default=DEFAULT_TARGET, help="target model spec (a quantized pair needs its GGUF)")
    p.add_argument("--gguf", default=None, help="the GGUF of a local HF model directory")
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the corpus scored")
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced pass")
    p.add_argument("--pairs", default="all",
                   help="comma-separated dtype/backend pairs, or 'all' (every eligible pair, kquant-a8 and the lossy int4-q8)")
    p.add_argument("--threads", type=int, default=0, help="compute threads (0 = all)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("fidelity-out"))


def _pairs(which: str, gguf: Path | None) -> list[tuple[str, str]]:
    import torch

    from target_service import quant
    from target_service.backends import eligible_pairs

    cpu = torch.device("cpu")
    if which != "all":
        return [tuple(p.strip().split("/", 1)) for p in which.split(",") if p.strip()]  # type: ignore[misc]
    pairs = [p for p in eligible_pairs(cpu, gguf) if p != ("float32", "eager")]
    for explicit in ("int4-q8",):  # the explicit-only (lossy) quantized pair
        if quant.supported(explicit, cpu, gguf)[0]:
            pairs.append(("bfloat16", explicit))
    return pairs


def to_markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [
        f"Fidelity against the exact float32 dequantization of `{m['model']}` ({m['positions']} tokens of the "
        f"Python Language Reference, windows of {m['window']}, corpus `{m['corpus']}`; {m['cpu']}, {m['isa']}).",
        "",
        "| numerics | mean KL (nats) | p99 KL | max KL | top-1 agreement | decisive disagreements | auto may choose |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, f in res["pairs"].items():
        lines.append(f"| {key} | {f['mean_kl']:.2e} | {f['p99_kl']:.2e} | {f['max_kl']:.2e} | "
                     f"{100 * f['top1_agreement']:.2f} % | {f['decisive_disagreements']} | {f['auto']} |")
    lines += ["", "Decisive: the argmax differs where the reference's top-2 logit gap exceeds 0.5. "
              "Auto: the rule of `--target-dtype auto` (a quantized pair's mean KL at most bf16 eager's, "
              "its top-1 agreement at most 0.2 points below, no more decisive disagreements; lossy pairs never)."]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    keys = list(res["pairs"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(keys, [res["pairs"][k]["mean_kl"] for k in keys], color="tab:blue")
    ax.set_xscale("log")
    ax.set_xlabel("mean KL from the exact dequantization (nats, log scale)")
    ax.set_title(f"{res['meta']['model']}: fidelity of each numerics ({res['meta']['positions']} tokens)")
    fig.tight_layout()
    path = out / "fidelity.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(a: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from specdec.models import default_cache_dir, resolve
    from target_service import fidelity
    from target_service.backends import AUTO_QUANT_BACKENDS, QUANT_BACKENDS, cpu_info, set_compute_threads
    from target_service.calibration import fidelity_reference
    from target_service.loading import load_model, parse_dtype

    a.out.mkdir(parents=True, exist_ok=True)
    cache = Path(a.cache_dir or default_cache_dir())
    rm = resolve(a.model, cache)
    gguf = rm.gguf_path or (Path(a.gguf) if a.gguf else None)
    cpu = torch.device("cpu")
    set_compute_threads(a.threads)
    ids, digest = fidelity.corpus_ids(AutoTokenizer.from_pretrained(str(rm.hf_dir)), a.tokens)
    print(f"[fidelity] reference float32/eager over {len(ids)} tokens", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    ref_model = load_model(rm.hf_dir, torch.float32, "eager", cpu, rm.name)
    ref = fidelity.reference_logprobs(fidelity.model_forward(ref_model), ids, a.window)
    del ref_model
    gc.collect()
    results: dict[str, dict[str, Any]] = {}
    for dtype, backend in _pairs(a.pairs, gguf):
        key = f"{dtype}/{backend}"
        print(f"[fidelity] {key}", file=sys.stderr, flush=True)
        model = load_model(rm.hf_dir, parse_dtype(dtype), backend, cpu, rm.name, gguf)
        results[key] = fidelity.compare(fidelity.model_forward(model), ids, ref, a.window, digest).to_dict()
        print(f"[fidelity]   mean KL {results[key]['mean_kl']:.3e}, top-1 {results[key]['top1_agreement']:.4f}",
              file=sys.stderr, flush=True)
        del model
        gc.collect()
    measured = {tuple(k.split("/", 1)): f for k, f in results.items()}
    ref = fidelity_reference(list(measured), measured)  # type: ignore[arg-type]
    best = ref[1] if ref else None
    for key, f in results.items():
        backend = key.split("/")[1]
        if backend not in QUANT_BACKENDS:
            f["auto"] = "yes"
        elif backend == "int4-q8":
            f["auto"] = "no (lossy)"
        elif backend not in AUTO_QUANT_BACKENDS:
            f["auto"] = "no (explicit only: outside the bound)" if best is None or not fidelity.within_bound(f, best) \
                else "no (explicit only)"
        else:
            f["auto"] = "yes" if best is not None and fidelity.within_bound(f, best) else "no (outside the bound)"
    info = cpu_info()
    res = {"meta": {"model": rm.name, "gguf": str(gguf or ""), "positions": len(ids), "window": a.window,
                    "corpus": digest, "cpu": info.model, "isa": info.isa, "torch": torch.__version__,
                    "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M"),
                    "command": " ".join(sys.argv)},
           "pairs": results}
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (a.out / "results.md").write_text(md)
    png = plot(res, a.out)
    print(md)
    if png:
        print(f"wrote {png}")
    return 0
