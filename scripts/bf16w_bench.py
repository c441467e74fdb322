"""The bf16w kernel side by side with the kernel of another git revision,
interleaved in one process: each linear shape of the 1.5B target at several
row counts M (a step, verify passes, a batch, a prompt), and optionally the
whole model's prefill of a long prompt (the TTFT). Both kernels must give
bit-identical outputs (the script checks it); only the time differs.

    .venv/bin/python scripts/bf16w_bench.py --against 480808e --out docs/bench/bf16w-blocked
    .venv/bin/python scripts/bf16w_bench.py --against 480808e --prefill 500 --out ...   # + the model

Writes bf16w_bench.json, bf16w_bench.md and bf16w_bench.png into --out.
Run it alone: another process on a 2-core machine distorts the timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from target_service import bf16w  # noqa: E402 (after the sys.path line)

SHAPES = [("q/o 1536x1536", 1536, 1536), ("gate/up 8960x1536", 8960, 1536), ("down 1536x8960", 1536, 8960)]


def kernel_of(rev: str | None) -> Any:
    """The compiled kernel of ``rev`` (None: this working tree)."""
    mine = bf16w.C_SOURCE
    if rev is not None:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:target_service/bf16w.py"],
                              capture_output=True, text=True, check=True).stdout
        start = text.index('C_SOURCE = r"""') + len('C_SOURCE = r"""')
        bf16w.C_SOURCE = text[start:text.index('"""', start)]
    try:
        bf16w._library.cache_clear()
        lib, why = bf16w._library()
        if lib is None:
            raise SystemExit(f"the kernel of {rev or 'the working tree'} is not available: {why}")
        return lib
    finally:
        bf16w.C_SOURCE = mine
        bf16w._library.cache_clear()


def interleaved(variants: dict[str, Any], run: Callable[[], torch.Tensor], reps: int) -> dict[str, float]:
    """Median ms per variant, alternating the order each repetition; asserts equal outputs."""
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(reps):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        outs = []
        for name in order:
            bf16w._library = (lambda lib: (lambda: (lib, "")))(variants[name])
            t0 = time.perf_counter()
            outs.append(run())
            times[name].append((time.perf_counter() - t0) * 1e3)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), "the kernels' outputs differ"
    return {v: statistics.median(t) for v, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default=None, help="git revision whose kernel to compare with (default: none)")
    p.add_argument("--ms", default="1,5,8,16,48,128,500", help="row counts M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill", type=int, default=0, help="also time the 1.5B target's prefill of this many tokens")
    p.add_argument("--out", type=Path, default=Path("bf16w-bench-out"))
    a = p.parse_args()
    original = bf16w._library
    variants = {"this tree": kernel_of(None)}
    if a.against:
        variants[a.against] = kernel_of(a.against)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for label, n, k in SHAPES:
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        for m in [int(x) for x in a.ms.split(",")]:
            x = torch.randn(m, k)
            med = interleaved(variants, lambda: bf16w.linear(x, w, None), a.reps)
            rows.append({"shape": label, "m": m, "ms": med,
                         "gflops": {v: 2 * m * n * k / t / 1e6 for v, t in med.items()}})
            print(f"[bf16w-bench] {label} M={m}: " + "  ".join(f"{v} {t:.1f} ms" for v, t in med.items()), flush=True)
    res: dict[str, Any] = {"rows": rows, "variants": list(variants), "threads": torch.get_num_threads(),
                           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M")}
    if a.prefill:
        from specdec.models import DEFAULT_TARGET, default_cache_dir, resolve
        from target_service.loading import load_model, parse_dtype

        bf16w._library = original
        resolved = resolve(DEFAULT_TARGET, Path(default_cache_dir()))
        model = load_model(resolved.hf_dir, parse_dtype("bfloat16"), "bf16w", torch.device("cpu"), resolved.name)
        ids = torch.randint(100, 30_000, (1, a.prefill), generator=torch.Generator().manual_seed(1))

        def prefill() -> torch.Tensor:
            with torch.inference_mode():
                return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.float()

        res["prefill"] = {"tokens": a.prefill, "ms": interleaved(variants, prefill, 3)}
        print(f"[bf16w-bench] prefill {a.prefill}: {res['prefill']['ms']}", flush=True)
    from target_service.backends import cpu_info

    info = cpu_info()
    res["machine"] = {"cpu": info.model, "isa": info.isa, "flags": list(info.flags)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bf16w_bench.json").write_text(json.dumps(res, indent=2))
    vs = list(variants)
    md = [f"bf16w kernel, {info.model} ({info.isa}), {res['threads']} torch thread(s), median of {a.reps}, "
          f"interleaved. Command: `{res['command']}`", "",
          "| shape | M | " + " | ".join(f"{v} ms (GFLOP/s)" for v in vs) + (" | speedup |" if len(vs) > 1 else ""),
          "|---|---|" + "---|" * len(vs) + ("---|" if len(vs) > 1 else "")]
    for r in rows:
        cells = " | ".join(f"{r['ms'][v]:.1f} ({r['gflops'][v]:.0f})" for v in vs)
        md.append(f"| {r['shape']} | {r['m']} | {cells} |" + (f" {r['ms'][vs[1]] / r['ms'][vs[0]]:.2f}× |" if len(vs) > 1 else ""))
    if "prefill" in res:
        pm = res["prefill"]["ms"]
        md += ["", f"Prefill of {a.prefill} tokens, 1.5B target (bf16w), median of 3: "
               + ", ".join(f"{v} {pm[v]:.0f} ms" for v in vs)]
    (a.out / "bf16w_bench.md").write_text("\n".join(md) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(5 * len(SHAPES), 4))
    for ax, (label, _, _) in zip(axes, SHAPES):
        for v in vs:
            pts = [(r["m"], r["gflops"][v]) for r in rows if r["shape"] == label]
            ax.plot([m for m, _ in pts], [g for _, g in pts], marker="o", label=v)
        ax.set_xscale("log")
        ax.set_title(label)
        ax.set_xlabel("rows M")
        ax.set_ylabel("GFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out / "bf16w_bench.png", dpi=90)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
