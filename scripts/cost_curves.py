"""The target's forward cost t(k) per (dtype, backend) on this machine,
in-process: the curves start-up calibration chooses from, measured more
thoroughly, with each pair's logits against eager float32 and the prefill
time of a long prompt (TTFT).

    .venv/bin/python scripts/cost_curves.py --out docs/bench/cost-curves-avx2
    # the AVX2 class on an AVX-512 machine (see docs/benchmarks.md for what it does not cover)
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        .venv/bin/python scripts/cost_curves.py --out docs/bench/cost-curves-avx2-emulated

Writes cost_curves.json, cost_curves.md and cost_curves.png into --out.
Run it alone: another process on a 2-core machine distorts the timings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec.models import DEFAULT_TARGET  # noqa: E402 (after the sys.path line)
from target_service.backends import compute_threads, cpu_info, eligible_pairs, set_compute_threads  # noqa: E402
from target_service.calibration import pick_pair  # noqa: E402
from target_service.loading import load_model, measure_forward_curve, parse_dtype  # noqa: E402


def machine() -> dict[str, object]:
    info = cpu_info()
    return {
        "cpu": info.model, "isa": info.isa, "flags": list(info.flags), "aten_capability": info.capability,
        "mkldnn_bf16": info.mkldnn_bf16, "threads": compute_threads(), "cores": os.cpu_count(),
        "torch": torch.__version__, "python": platform.python_version(),
        "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                if k in os.environ},
    }


@torch.inference_mode()
def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False, logits_to_keep=ids.shape[1]).logits[0].float()


@torch.inference_mode()
def prefill_ms(model: torch.nn.Module, n: int, reps: int = 1) -> float:
    g = torch.Generator().manual_seed(1)
    best = float("inf")
    for _ in range(reps):
        ids = torch.randint(100, 30_000, (1, n), generator=g)
        t0 = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        best = min(best, (time.perf_counter() - t0) * 1000.0)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_TARGET, help="model spec (specdec.models.resolve)")
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--pairs", default="", help="dtype/backend,... (default: every eligible pair on this CPU)")
    p.add_argument("--ks", default="1,2,3,4,5,6,8,12,16")
    p.add_argument("--kv", type=int, default=100, help="tokens of KV cache behind each pass")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefill", type=int, default=500, help="prompt tokens for the TTFT measurement (0 = skip)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("cost-curves-out"))
    a = p.parse_args()

    from specdec.models import default_cache_dir, resolve

    if a.threads:
        torch.set_num_threads(a.threads)
    set_compute_threads(a.threads)
    resolved = resolve(a.model, Path(a.cache_dir or default_cache_dir()))
    cpu = torch.device("cpu")
    pairs = [tuple(x.split("/")) for x in a.pairs.split(",") if x] or eligible_pairs(cpu)
    ks = [int(k) for k in a.ks.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(100, 30_000, (1, 100), generator=g)
    ref = None
    if ("float32", "eager") in pairs:  # the reference first
        pairs = [("float32", "eager")] + [x for x in pairs if x != ("float32", "eager")]
    results: dict[str, dict[str, object]] = {}
    for dtype, backend in pairs:
        key = f"{dtype}/{backend}"
        print(f"[cost-curves] {key}: loading", flush=True)
        model = load_model(resolved.hf_dir, parse_dtype(dtype), backend, cpu, resolved.name)
        t0 = time.perf_counter()
        curve = measure_forward_curve(model, cpu, ks, a.kv, budget_s=1e9)
        row: dict[str, object] = {"dtype": dtype, "backend": backend, "t_ms": curve,
                                  "measure_s": round(time.perf_counter() - t0, 1)}
        lg = logits_of(model, probe)
        if ref is None and (dtype, backend) == ("float32", "eager"):
            ref = lg
        if ref is not None:
            row["max_abs_logit_diff_vs_fp32_eager"] = float((lg - ref).abs().max())
            row["argmax_agreement_vs_fp32_eager"] = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
        if a.prefill:
            row["prefill_ms"] = {str(a.prefill): round(prefill_ms(model, a.prefill), 1)}
        results[key] = row
        print(f"[cost-curves] {key}: " + " ".join(f"k={k}:{v:.0f}" for k, v in curve.items()), flush=True)
        del model, lg
        gc.collect()
    choice = pick_pair({(r["dtype"], r["backend"]): r["t_ms"] for r in results.values()})  # type: ignore[misc]
    res = {"machine": machine(), "model": resolved.name, "kv_tokens": a.kv, "ks": ks, "pairs": results,
           "auto_choice": "/".join(choice.pair), "scores_tok_s": {"/".join(k): round(v, 3) for k, v in choice.scores.items()},
           "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    (a.out / "cost_curves.json").write_text(json.dumps(res, indent=2))
    md = to_markdown(res)
    (a.out / "cost_curves.md").write_text(md)
    plot(res, a.out / "cost_curves.png")
    print(md)
    return 0


def to_markdown(res: dict) -> str:  # type: ignore[type-arg]
    m = res["machine"]
    ks = res["ks"]
    lines = [f"{res['model']}, {res['kv_tokens']} tokens of KV, median of 3, ms per forward pass of k tokens. "
             f"Machine: {m['cpu']}, {m['isa']}, {m['threads']} threads, torch {m['torch']}"
             + (f", env {m['env']}" if m["env"] else "") + f". Command: `{res['command']}`", "",
             "| dtype/backend | " + " | ".join(f"k={k}" for k in ks) + " | t(8)/t(1) | prefill | max Δlogit vs fp32 eager | argmax agree | AUTO score tok/s |",
             "|---" * (len(ks) + 6) + "|"]
    for key, r in res["pairs"].items():
        t = {int(k): v for k, v in r["t_ms"].items()}
        pre = ", ".join(f"{n} tok {v:.0f} ms" for n, v in r.get("prefill_ms", {}).items())
        diff = r.get("max_abs_logit_diff_vs_fp32_eager")
        agree = r.get("argmax_agreement_vs_fp32_eager")
        mark = " (chosen)" if key == res["auto_choice"] else ""
        lines.append(f"| {key}{mark} | " + " | ".join(f"{t[k]:.0f}" for k in ks)
                     + f" | {t[8] / t[1]:.2f} | {pre} | {'' if diff is None else f'{diff:.1e}'} | "
                     f"{'' if agree is None else f'{agree:.0%}'} | {res['scores_tok_s'][key]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:  # type: ignore[type-arg]
    from specdec_app.bench_report import plot_curves

    series = {key + (" (auto)" if key == res["auto_choice"] else ""): {int(k): v for k, v in r["t_ms"].items()}
              for key, r in res["pairs"].items()}
    plot_curves(series, path, f"{res['model']} on {res['machine']['isa']}")


if __name__ == "__main__":
    raise SystemExit(main())
