"""Two versions of the kquant kernel side by side on every linear layer of
the real target, and the memory they could stream at best.

The sources are kquant.c files (the working tree's, or a git revision's:
``REV:target_service/kquant.c``); each is compiled with the flags the
service uses and run over the same packed weights (all 197 matrices of the
1.5B, far beyond the caches), M activation rows at a time, in interleaved
rounds so that the VM's drift hits every variant alike. The outputs of every
variant must be bit-identical to the first one's (a timing change must not
change a bit). ``--read-bound`` adds a plain multi-threaded read of the same
packed bytes, layer by layer: what the kernel could reach if it were bound by
memory alone.

    .venv/bin/python scripts/kquant_ab.py --sources HEAD~1:target_service/kquant.c,target_service/kquant.c \
        --rows 1,4,8 --prefetch 16 --read-bound --out bench-out/kquant-ab

Writes results.json, results.md and kquant_ab.png into --out.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_READ_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
/* sums [p, p + bytes) as 64-byte lines, split in contiguous parts over the threads */
float kq_read(const uint8_t* p, int64_t bytes, int threads) {
    float tot = 0;
    #pragma omp parallel num_threads(threads) reduction(+:tot)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        int64_t lines = bytes / 64, per = (lines + T - 1) / T, a = t * per;
        int64_t b = a + per < lines ? a + per : lines;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        int64_t i = a;
        for (; i + 2 <= b; i += 2) {
            s0 = _mm256_add_ps(s0, _mm256_loadu_ps((const float*)(p + i * 64)));
            s1 = _mm256_add_ps(s1, _mm256_loadu_ps((const float*)(p + i * 64 + 32)));
            s2 = _mm256_add_ps(s2, _mm256_loadu_ps((const float*)(p + i * 64 + 64)));
            s3 = _mm256_add_ps(s3, _mm256_loadu_ps((const float*)(p + i * 64 + 96)));
        }
        for (; i < b; i++) s0 = _mm256_add_ps(s0, _mm256_loadu_ps((const float*)(p + i * 64)));
        __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
        float v[8];
        _mm256_storeu_ps(v, s);
        for (int k = 0; k < 8; k++) tot += v[k];
    }
    return tot;
}
"""


def source_text(spec: str) -> str:
    """A file path, or REV:path read from git."""
    if ":" in spec and not Path(spec).exists():
        return subprocess.run(["git", "show", spec], cwd=REPO, check=True, capture_output=True, text=True).stdout
    return Path(spec).read_text()


def main() -> int:
    import torch

    from scripts.kquant_bench import build_layers
    from target_service import cbuild, kquant
    from target_service.backends import cpu_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", type=Path, default=Path.home() / ".cache/specdec/gguf/qwen2.5-coder-1.5b-instruct.gguf")
    p.add_argument("--sources", required=True, help="comma-separated kquant.c sources: paths or REV:path")
    p.add_argument("--acts", default="bf16", choices=list(kquant.ACTS))
    p.add_argument("--build", default="", help="kernel build (avx512bf16 or avx2; default: this CPU's)")
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefetch", type=int, default=-1, help="software-prefetch distance for every variant (-1: each's own)")
    p.add_argument("--read-bound", action="store_true", help="also time a plain read of the same packed bytes")
    p.add_argument("--out", type=Path, default=Path("bench-out/kquant-ab"))
    a = p.parse_args()
    which = a.build or kquant.isa()
    if which is None:
        raise SystemExit("this CPU runs no kquant build")
    rows = [int(r) for r in a.rows.split(",")]
    specs = [s for s in a.sources.split(",") if s]
    flags = tuple(kquant._COMMON + kquant._ISAS[which])
    libs = []
    for i, spec in enumerate(specs):
        dll, why = cbuild.load(cbuild.Kernel(f"kquant-ab{i}-{which}", source_text(spec), flags))
        if dll is None:
            raise SystemExit(f"{spec}: {why}")
        fn = dll.kq_linear_a8 if a.acts == "a8" else dll.kq_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        dll.kq_set_threads(a.threads)
        if a.prefetch >= 0:
            dll.kq_set_prefetch(a.prefetch)
        libs.append((spec, fn))
    reader = None
    if a.read_bound:
        rd, why = cbuild.load(cbuild.Kernel("kquant-ab-read", _READ_SOURCE, ("-O3", "-fPIC", "-shared", "-mavx2",
                                                                              "-fopenmp")))
        if rd is None:
            raise SystemExit(f"read kernel: {why}")
        rd.kq_read.restype = ctypes.c_float
        rd.kq_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        reader = rd.kq_read
    print(f"[kquant_ab] packing the layers of {a.gguf.name} ({which}, {a.acts})", file=sys.stderr, flush=True)
    layers = build_layers(a.gguf, "kquant-a8" if a.acts == "a8" else "kquant", which)
    nbytes = sum(lin.packed.numel() for lin in layers)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xs = {m: {k: torch.randn(m, k) for k in {lin.in_features for lin in layers}} for m in rows}

    def run(fn, m: int, keep: bool) -> list:
        outs = []
        for lin in layers:
            y = torch.empty(m, lin.out_features)
            fn(kquant.KINDS[lin.kind], xs[m][lin.in_features].data_ptr(), m, lin.in_features, lin.packed.data_ptr(),
               None, y.data_ptr(), lin.out_features)
            if keep:
                outs.append(y)
        return outs

    identical = {}
    for m in rows:
        ref = run(libs[0][1], m, True)
        for spec, fn in libs[1:]:
            got = run(fn, m, True)
            identical[f"{spec} M={m}"] = all(torch.equal(x, y) for x, y in zip(ref, got))
    names = [spec for spec, _ in libs] + (["plain read of the same bytes"] if reader else [])
    times: dict[str, dict[int, list[float]]] = {n: {m: [] for m in rows} for n in names}
    for rnd in range(a.rounds + 1):
        for m in rows:
            for spec, fn in libs:
                t0 = time.perf_counter()
                run(fn, m, False)
                if rnd:
                    times[spec][m].append((time.perf_counter() - t0) * 1e3)
            if reader is not None:
                t0 = time.perf_counter()
                for lin in layers:
                    reader(lin.packed.data_ptr(), lin.packed.numel(), a.threads)
                if rnd:
                    times[names[-1]][m].append((time.perf_counter() - t0) * 1e3)
    med = {n: {m: statistics.median(v) for m, v in t.items()} for n, t in times.items()}
    info = cpu_info()
    res = {"meta": {"cpu": info.model, "isa": info.isa, "flags": info.flags, "build": which, "acts": a.acts,
                    "threads": a.threads, "rounds": a.rounds, "prefetch": a.prefetch, "bytes": nbytes,
                    "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)},
           "bit_identical": identical, "median_ms": med,
           "min_ms": {n: {m: min(v) for m, v in t.items()} for n, t in times.items()}}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=2))
    lines = [f"All linear layers of `{a.gguf.name}` ({len(layers)} matrices, {nbytes / 1e6:.0f} MB packed), ms per "
             f"pass of M rows, median of {a.rounds} interleaved rounds (GB/s at M = 1 in brackets); {info.model}, "
             f"{info.isa}, build {which}, {a.acts} activations, {a.threads} threads.", "",
             "| variant | " + " | ".join(f"M={m}" for m in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for n in names:
        cells = [f"{med[n][m]:.1f}" + (f" ({nbytes / med[n][m] / 1e6:.1f})" if m == 1 else "") for m in rows]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "Bit-identical to the first source: " + (", ".join(f"{k}: {v}" for k, v in identical.items()) or "-")]
    md = "\n".join(lines) + "\n"
    (a.out / "results.md").write_text(md)
    from specdec_app.bench_report import plot_curves

    plot_curves({n: med[n] for n in names}, a.out / "kquant_ab.png",
                f"kquant A/B ({which}, {a.acts}): all linear layers, ms per pass of k rows")
    print(md)
    return 0 if all(identical.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
