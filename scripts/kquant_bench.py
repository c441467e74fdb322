"""The target's linear layers alone, per backend, rows M = 1..16: what one
forward pass of M tokens costs in the matrix products, interleaved so that a
slow spell of the machine hits every backend alike.

Backends: kquant (each build this CPU runs), int4 (ATen int4 for Q4_K, bf16
for the 6-bit tensors: the int4 backend as served), bf16 (oneDNN where
native, else torch). Every linear layer of the model is built from the GGUF
(distinct weights, far beyond the caches), as the services build them.

    .venv/bin/python scripts/kquant_bench.py --out docs/bench/kquant-kernel
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 .venv/bin/python scripts/kquant_bench.py --builds avx2 ...

Writes results.json, results.md and kquant.png into --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_layers(gguf: Path, backend: str, build: str | None) -> list:
    import torch

    from specdec.models import gguf_blocks
    from target_service import kquant, quant

    f = quant.GgufFile(gguf)
    layers = []
    for name, t in f.tensors.items():
        if name == "token_embd.weight" or t.kind not in ("Q4_K", "Q6_K"):
            continue
        if backend in ("kquant", "kquant-a8"):
            layers.append(kquant.KQuantLinear(gguf_blocks.decode(t.data, t.kind, t.n, t.k), None, build,
                                              "a8" if backend == "kquant-a8" else "bf16"))
        elif backend == "int4" and t.kind == "Q4_K":
            packed, sz = quant.int4_pack(gguf_blocks.decode(t.data, t.kind, t.n, t.k))
            layers.append(quant.Int4Linear(t.k, t.n, packed, sz, None))
        else:  # bf16: the int4 backend's 6-bit tensors, or every tensor
            w = torch.from_numpy(gguf_blocks.decode(t.data, t.kind, t.n, t.k).dequantize())
            layers.append(quant.Bf16Linear(w, None, t.kind))
    return layers


def main() -> int:
    import torch

    from target_service import kquant
    from target_service.backends import cpu_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=Path.home() / ".cache/specdec/gguf/qwen2.5-coder-1.5b-instruct.gguf")
    p.add_argument("--builds", default="", help="kquant builds (default: this CPU's)")
    p.add_argument("--backends", default="kquant-a8,kquant,int4,bf16")
    p.add_argument("--rows", default="1,2,4,6,8,16")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefetch", default="",
                   help="kquant software-prefetch distances to compare, in super-blocks (e.g. 4,0); "
                        "default: the kernel's own setting only")
    p.add_argument("--out", type=Path, default=Path("kquant-bench"))
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    builds = [b for b in a.builds.split(",") if b] or [kquant.isa()]
    prefetch = [int(d) for d in a.prefetch.split(",") if d]
    variants: dict[str, list] = {}
    ahead: dict[str, tuple[str, int]] = {}  # kquant variant -> (build, prefetch distance)
    for backend in a.backends.split(","):
        for build in (builds if backend.startswith("kquant") else [None]):
            key = f"{backend}/{build}" if backend.startswith("kquant") else backend
            print(f"[kquant_bench] building {key}", file=sys.stderr, flush=True)
            layers = build_layers(a.gguf, backend, build)
            gc.collect()
            if backend.startswith("kquant") and prefetch:
                for d in prefetch:  # the same layers, another prefetch distance
                    variants[f"{key}/prefetch{d}"] = layers
                    ahead[f"{key}/prefetch{d}"] = (build, d)
            else:
                variants[key] = layers
    for build in builds:
        kquant._library(build)[0].kq_set_threads(a.threads)  # type: ignore[union-attr]
    times: dict[str, dict[int, list[float]]] = {k: {m: [] for m in rows} for k in variants}
    xs = {m: {k: torch.randn(m, k) for k in (1536, 8960)} for m in rows}
    for rnd in range(a.rounds + 1):
        for key, layers in variants.items():
            # torch keeps one thread beside the kquant kernel (as the services
            # run it); after torch's own multi-threaded ops its idle OpenMP
            # workers spin for a while and would take the kernel's second
            # core: let them fall asleep first
            torch.set_num_threads(1 if key.startswith("kquant") else a.threads)
            if key in ahead:
                kquant.set_prefetch(ahead[key][1], ahead[key][0])
            time.sleep(0.3)
            for m in rows:
                t0 = time.perf_counter()
                for lin in layers:
                    lin(xs[m][lin.in_features])
                if rnd:  # the first round warms up
                    times[key][m].append((time.perf_counter() - t0) * 1e3)
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    info = cpu_info()
    res = {"meta": {"cpu": info.model, "isa": info.isa, "threads": a.threads, "rounds": a.rounds,
                    "torch": torch.__version__, "gguf": a.gguf.name, "date": time.strftime("%Y-%m-%d %H:%M"),
                    "command": " ".join(sys.argv)},
           "median_ms": med, "min_ms": {k: {m: min(v) for m, v in t.items()} for k, t in times.items()}}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"All linear layers of `{a.gguf.name}` (197 matrices), ms per pass of M rows, median of "
             f"{a.rounds} interleaved rounds; {info.model}, {info.isa}, {a.threads} threads.", "",
             "| backend | " + " | ".join(f"M={m}" for m in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for key in med:
        lines.append(f"| {key} | " + " | ".join(f"{med[key][m]:.1f}" for m in rows) + " |")
    md = "\n".join(lines) + "\n"
    (a.out / "results.md").write_text(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key in med:
            ax.plot(rows, [med[key][m] for m in rows], marker="o", label=key)
        ax.set_xlabel("rows M (tokens in the pass)")
        ax.set_ylabel("ms, all linear layers")
        ax.set_title(f"{a.gguf.name}: linear layers per backend ({info.capability})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(a.out / "kquant.png", dpi=120)
    except ImportError:
        pass
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
