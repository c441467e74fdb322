"""The ``kquant`` kernel: linear layers computed from the GGUF's own K-quant
codes (Q4_K, Q6_K) with bfloat16 activations and float32 sums, for x86-64
CPUs. The C source is target_service/kquant.c; this module packs the codes
once at load time and calls the kernel through ctypes (which releases the
GIL; the kernel splits the output rows over its own small thread pool).

Why our own kernel: torch's weight-only int4 kernel
(``_weight_int4pack_mm_for_cpu``) handles Q4_K's groups of 32, but not
Q6_K's groups of 16 (its smallest group is 32), and its cost grows steeply
with the rows of a pass (measured on a 2-core Zen 5: 26 ms for all of the
1.5B target's linear layers at 1 row, 82 ms at 8), which is what a k-token
verify needs to be cheap. oneDNN's bf16 GEMM of a dequantized copy reads
3.5× the bytes. docs/benchmarks.md ("Quantized target") has the figures.

Numerics (the same for a 1-token step, a k-token verify, a batch and a
prompt; each output is one fixed sequence of operations whatever the rows
beside it, the tile or the thread):

- the weights are the file's: Q4_K w = (d·sc)·q − (dmin·m), Q6_K
  w = (d·sc)·(q − 32), with d, dmin widened exactly from float16 and the
  products d·sc, dmin·m exact in float32;
- each input element is rounded once to bfloat16 (round to nearest even);
- per 256-weight super-block and output, the codes times the rounded inputs
  are summed in float32 lanes of 16 weights (AVX-512 BF16: ``vdpbf16ps``
  over pairs; AVX2: FMA), the lane sums are multiplied by their sub-block
  scale (and the mins times the lane's input sum subtracted) into float32
  accumulators, which are summed in a fixed order at the end; then the bias.

The AVX-512 BF16 and the AVX2 builds sum in different orders, so their
logits differ in the last bits: a machine's numerics are named by its
calibration (``GetModelInfo``), as for every other backend.

8-bit activations (``acts="a8"``, backend ``kquant-a8``; what llama.cpp does
for K-quants, at a finer grain): each input lane of 16 consecutive elements
becomes int8 codes round(x·127/max|x|) with its float32 scale max|x|/127; the
codes times the weight codes are summed exactly in int32 (AVX-512 VNNI
``vpdpbusd``; AVX2 ``vpmaddubsw`` + ``vpmaddwd``, which cannot saturate at
these magnitudes); per super-block and lane the sum is scaled by
(sub-block scale × input scale) in float32 and Q4_K's min term subtracted,
and the lanes are summed in one fixed tree. Both builds perform the same
float32 operations in the same order, so they give the same bits, and the
weights take one layout for both (``pack(..., "a8")``). The integer products
are far cheaper than the bf16 ones: on CPUs where the bf16 path is
compute-bound (Zen 4 runs 512-bit ``vdpbf16ps`` at half rate, AVX2 has no
bf16 product) this is what makes a k-token verify cost about one step. It
rounds the input more coarsely than bf16 (8 bits per 16 elements against 8
significant bits each): its fidelity against the file is below ``kquant``'s
and above transformers' bf16 computation's, so ``auto`` chooses it where
calibration finds it within that bound and faster.
"""

from __future__ import annotations

import ctypes
import functools
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from specdec.models.gguf_blocks import Blocks
from target_service import cbuild

KINDS = {"Q4_K": 0, "Q6_K": 1}
_SOURCE = Path(__file__).with_name("kquant.c")
_COMMON = ["-O3", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off", "-pthread"]
_ISAS = {
    "avx512bf16": ["-DKQ_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni",
                   "-mavx2", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
}
_lock = threading.Lock()


def isa() -> str | None:
    """The kernel build this CPU runs (``avx512bf16`` or ``avx2``), or None.
    A torch capped below AVX-512 (``ATEN_CPU_CAPABILITY=avx2``, the AVX2
    emulation of docs/benchmarks.md) gets the AVX2 build too."""
    from target_service.backends import cpu_info

    info = cpu_info()
    flags = set(info.flags)
    if {"avx512f", "avx512_bf16", "avx512_vnni"} <= flags and _has_avx512bw() and info.capability not in ("AVX2", "DEFAULT"):
        return "avx512bf16"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _has_avx512bw() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return "avx512bw" in line.split()
    except OSError:
        pass
    return False


def _kernel(which: str) -> cbuild.Kernel:
    return cbuild.Kernel(f"kquant-{which}", _SOURCE.read_text(), tuple(_COMMON + _ISAS[which]))


def kernels() -> list[cbuild.Kernel]:
    """Every ISA build of the kernel (for ``python -m target_service.cbuild build``)."""
    return [_kernel(which) for which in _ISAS]


@functools.lru_cache(maxsize=2)
def _library(which: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    which = which or isa()
    if which is None:
        return None, "the CPU has neither AVX-512 BF16 nor AVX2 with FMA"
    dll, why = cbuild.load(_kernel(which))
    if dll is None:
        return None, why
    dll.kq_linear.restype = ctypes.c_int
    dll.kq_linear.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    dll.kq_linear_a8.restype = ctypes.c_int
    dll.kq_linear_a8.argtypes = dll.kq_linear.argtypes
    dll.kq_set_threads.restype = ctypes.c_int
    dll.kq_set_threads.argtypes = [ctypes.c_int]
    dll.kq_set_prefetch.restype = ctypes.c_int
    dll.kq_set_prefetch.argtypes = [ctypes.c_int]
    return dll, ""


def available() -> tuple[bool, str]:
    lib, why = _library()
    return lib is not None, why


def set_threads(threads: int) -> int:
    """Threads the kernel splits its output rows over (the caller's included)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the kquant kernel is not available: {why}")
    return int(lib.kq_set_threads(max(1, int(threads))))


#: the kernel's own software-prefetch distance (super-blocks ahead)
DEFAULT_PREFETCH = 16


def set_prefetch(ahead: int, which: str | None = None) -> int:
    """How many super-blocks ahead the kernel fetches its weights in
    software (0: the hardware prefetchers alone); returns the setting in
    force. It changes timing only, never a result bit (tested). Calibration
    times ``DEFAULT_PREFETCH`` against 0 and keeps the faster one per
    machine (docs/benchmarks.md, "the kernel's software prefetch")."""
    lib, why = _library(which)
    if lib is None:
        raise RuntimeError(f"the kquant kernel is not available: {why}")
    return int(lib.kq_set_prefetch(int(ahead)))


def tune_prefetch(forward: "Callable[[int], None]", reset: "Callable[[], None]", which: str | None = None,
                  candidates: tuple[int, ...] = (DEFAULT_PREFETCH, 0), ks: tuple[int, ...] = (1, 8),
                  rounds: int = 5) -> dict[str, object]:
    """Times ``forward(k)`` (a model pass; ``reset()`` after each, untimed)
    under each software-prefetch distance, interleaved round by round so a
    slow spell of the machine hits them alike, and leaves the fastest in
    force: the lowest sum over ``ks`` of the median ms. Returns
    {"prefetch": chosen, "ms": {distance: {k: median ms}}}."""
    times: dict[int, dict[int, list[float]]] = {d: {k: [] for k in ks} for d in candidates}
    for k in ks:  # warm-up
        forward(k)
        reset()
    for _ in range(rounds):
        for d in candidates:
            set_prefetch(d, which)
            for k in ks:
                t0 = time.perf_counter()
                forward(k)
                times[d][k].append((time.perf_counter() - t0) * 1e3)
                reset()
    med = {d: {k: round(statistics.median(v), 3) for k, v in per.items()} for d, per in times.items()}
    best = min(candidates, key=lambda d: (sum(med[d].values()), candidates.index(d)))
    set_prefetch(best, which)
    return {"prefetch": best, "ms": {str(d): {str(k): v for k, v in m.items()} for d, m in med.items()}}


def prefetch(which: str | None = None) -> int:
    """The software-prefetch distance in force."""
    lib, why = _library(which)
    if lib is None:
        raise RuntimeError(f"the kquant kernel is not available: {why}")
    return int(lib.kq_set_prefetch(-1))


# ------------------------------------------------------- weight memory
#: the packed weights live in 32 MiB anonymous mappings advised for
#: transparent huge pages: the kernel streams them, and the hardware
#: prefetchers stop at page boundaries. Measured: in a process that had loaded
#: other models first, only 0.3 of 1.0 GB landed in huge pages by plain
#: allocation and a decoding step cost 1.3-1.8x as much.
_CHUNK = 32 << 20
_arena_lock = threading.Lock()
_arena: list = [None, 0]  # [current mmap, bytes used]


def _weight_buffer(nbytes: int) -> np.ndarray:
    """A 64-byte aligned uint8 array of ``nbytes`` from the huge-page arena
    (its mapping is freed once no array from it is left)."""
    import mmap

    size = (nbytes + 63) // 64 * 64
    with _arena_lock:
        m, used = _arena
        if m is None or used + size > len(m):
            length = max(_CHUNK, (size + (2 << 20) - 1) // (2 << 20) * (2 << 20))
            m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    m.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
            used = 0
        _arena[0], _arena[1] = m, used + size
    return np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=used)


# -------------------------------------------------------------- packing
def _idx512() -> np.ndarray:
    """[8, 32]: the super-block position of word i of AVX-512 register p."""
    p, i = np.meshgrid(np.arange(8), np.arange(32), indexing="ij")
    return 16 * (i // 2) + 2 * p + (i % 2)


def _idx2() -> np.ndarray:
    """[16, 2, 8]: the super-block position of lane l of AVX2 register (t, h)."""
    t, h, lane = np.meshgrid(np.arange(16), np.arange(2), np.arange(8), indexing="ij")
    return 16 * (8 * h + lane) + t


def _idx_a8() -> np.ndarray:
    """[4, 64]: the super-block position of byte i of a8 register p."""
    p, i = np.meshgrid(np.arange(4), np.arange(64), indexing="ij")
    return 16 * (i // 4) + 4 * p + (i % 4)


#: the weight layouts: the bf16-activation kernel's, per build, and the
#: 8-bit-activation kernel's (one layout for both builds)
LAYOUTS = ("avx512bf16", "avx2", "a8")


def pack(b: Blocks, which: str) -> np.ndarray:
    """The packed weights of a decoded Q4_K / Q6_K tensor in layout ``which``
    (a build's bf16-activation layout, or ``a8``; see kquant.c): uint8 [N/8, K/256, 8, block], each row's block the
    4-bit codes in the build's register layout, Q6_K's high 2 bits (its 6-bit
    codes q split into q & 15 and q >> 4), then the super-block's d (dmin)
    and integer scales (mins)."""
    if b.kind not in KINDS or b.d is None or b.sub_scale is None:
        raise ValueError(f"kquant packs Q4_K and Q6_K blocks, not {b.kind}")
    n, k = b.shape
    kb = k // 256
    q = b.codes.astype(np.int16)
    if b.kind == "Q6_K":
        q = q + 32
    q = q.astype(np.uint8).reshape(n, kb, 256)
    if which == "avx512bf16":
        reg = q[:, :, _idx512()]  # [n, kb, 8, 32]
        lo4, hi2 = reg & 15, reg >> 4
        lo = lo4[:, :, 0::2, :] | (lo4[:, :, 1::2, :] << 4)  # [n, kb, 4, 32]
        hi = None
        if b.kind == "Q6_K":
            h = hi2.reshape(n, kb, 2, 4, 32)
            hi = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
    elif which == "avx2":
        reg = q[:, :, _idx2()]  # [n, kb, 16, 2, 8]
        lo4, hi2 = reg & 15, reg >> 4
        lo = lo4[:, :, 0::2] | (lo4[:, :, 1::2] << 4)  # [n, kb, 8, 2, 8]
        hi = None
        if b.kind == "Q6_K":
            h = hi2.reshape(n, kb, 4, 4, 2, 8)
            hi = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
    elif which == "a8":
        reg = q[:, :, _idx_a8()]  # [n, kb, 4, 64]
        lo4, hi2 = reg & 15, reg >> 4
        lo = lo4[:, :, 0::2, :] | (lo4[:, :, 1::2, :] << 4)  # [n, kb, 2, 64]
        hi = None
        if b.kind == "Q6_K":
            hi = hi2[:, :, 0] | (hi2[:, :, 1] << 2) | (hi2[:, :, 2] << 4) | (hi2[:, :, 3] << 6)  # [n, kb, 64]
    else:
        raise ValueError(f"unknown kquant layout {which!r}")
    d = b.d.astype("<f4").reshape(n, kb, 1).view(np.uint8)
    if b.kind == "Q4_K":
        assert b.dmin is not None and b.sub_min is not None
        dmin = b.dmin.astype("<f4").reshape(n, kb, 1).view(np.uint8)
        meta = np.concatenate([d, dmin, b.sub_scale.astype(np.uint8), b.sub_min.astype(np.uint8)], axis=-1)
    else:
        meta = np.concatenate([d, b.sub_scale.astype(np.int8).view(np.uint8)], axis=-1)
    parts = [lo.reshape(n, kb, 128)] + ([] if hi is None else [hi.reshape(n, kb, 64)]) + [meta]
    blocks = np.concatenate(parts, axis=-1)  # [n, kb, block bytes]
    if n % 8:  # whole groups of 8 rows (the padding rows are computed and dropped)
        blocks = np.concatenate([blocks, np.repeat(blocks[-1:], 8 - n % 8, axis=0)])
    g = blocks.shape[0] // 8
    return np.ascontiguousarray(blocks.reshape(g, 8, kb, -1).transpose(0, 2, 1, 3))


#: input numerics: ``bf16`` (each element rounded to bfloat16, float32
#: products) or ``a8`` (int8 codes per lane of 16 elements with a float32
#: scale, exact int32 products; backend ``kquant-a8``)
ACTS = ("bf16", "a8")


class KQuantLinear(torch.nn.Module):
    """An ``nn.Linear`` computed by the kquant kernel from a Q4_K or Q6_K
    tensor's codes (float32 in, float32 out), with ``acts`` numerics for its
    input."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None, which: str | None = None,
                 acts: str = "bf16") -> None:
        super().__init__()
        which = which or isa()
        if which is None:
            raise ValueError("the kquant kernel needs AVX-512 BF16 or AVX2 with FMA")
        if acts not in ACTS:
            raise ValueError(f"unknown kquant activations {acts!r}; one of {', '.join(ACTS)}")
        self.which, self.acts = which, acts
        self.kind = blocks.kind
        self.out_features, self.in_features = blocks.shape
        packed = pack(blocks, "a8" if acts == "a8" else which)
        buf = _weight_buffer(packed.nbytes).reshape(packed.shape)
        buf[...] = packed
        self.packed = torch.from_numpy(buf)
        self.bias = None if bias is None else bias.detach().float().contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lib, why = _library(self.which)
        if lib is None:
            raise RuntimeError(f"the kquant kernel is not available: {why}")
        k, n = self.in_features, self.out_features
        x2, m = cbuild.float_rows(x, k)
        y = torch.empty((m, n), dtype=torch.float32)
        fn = lib.kq_linear_a8 if self.acts == "a8" else lib.kq_linear
        rc = fn(KINDS[self.kind], x2.data_ptr(), m, k, self.packed.data_ptr(),
                None if self.bias is None else self.bias.data_ptr(), y.data_ptr(), n)
        if rc != 0:
            raise MemoryError("kquant kernel: scratch allocation failed")
        return y.reshape(*x.shape[:-1], n)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def extra_repr(self) -> str:
        acts = "int8 per 16, int32 sums" if self.acts == "a8" else "bf16, sums=fp32"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weights={self.kind} codes, activations={acts} ({self.which})")


# ------------------------------------------------- projections in one call
def concat_blocks(parts: list[Blocks]) -> Blocks:
    """Blocks of the same kind and K stacked along N (the output rows)."""
    def cat(field: str) -> np.ndarray | None:
        vals = [getattr(b, field) for b in parts]
        return None if vals[0] is None else np.concatenate(vals, axis=0)

    first = parts[0]
    return Blocks(first.kind, cat("codes"), cat("scale"), cat("minimum"), first.group,  # type: ignore[arg-type]
                  d=cat("d"), dmin=cat("dmin"), sub_scale=cat("sub_scale"), sub_min=cat("sub_min"))


class FusedProjection(torch.nn.Module):
    """Several linear layers of one input (q, k, v; gate, up) as one kernel
    call: one pass over the stacked weights, so a decoding step makes fewer
    calls (each costs its dispatch and the wait for the pool). Each member
    (``FusedSlice``) returns its columns of the shared output; the output is
    computed once per input tensor and dropped when every member has taken
    its part. Every output row is computed exactly as its own layer would
    compute it (the kernel's rows are independent), so the numerics are
    unchanged (tests/test_quant.py)."""

    def __init__(self, blocks: list[Blocks], biases: list[torch.Tensor | None], which: str | None = None,
                 acts: str = "bf16") -> None:
        super().__init__()
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach().float() if b is not None else torch.zeros(blk.shape[0])
                              for b, blk in zip(biases, blocks)])
        self.linear = KQuantLinear(concat_blocks(blocks), bias, which, acts)
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for b in blocks:
            self.bounds.append((start, start + b.shape[0]))
            start += b.shape[0]
        # the input the shared output was computed from (held, so that its
        # identity cannot be reused by another tensor while cached)
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._taken: set[int] = set()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._x or self._out is None or index in self._taken:
            self._out, self._x, self._taken = self.linear(x), x, set()
        out = self._out
        self._taken.add(index)
        if len(self._taken) == len(self.bounds):
            self._out, self._x = None, None
        lo, hi = self.bounds[index]
        return out[..., lo:hi]


class FusedSlice(torch.nn.Module):
    """One member of a ``FusedProjection``, in place of its ``nn.Linear``."""

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        self.index = index
        self.in_features = fused.linear.in_features
        lo, hi = fused.bounds[index]
        self.out_features = hi - lo
        object.__setattr__(self, "fused", fused)  # shared, not a child: no double counting in modules()
        self.shared = fused if index == 0 else None  # registered once, as the first member's child

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.index)  # type: ignore[attr-defined]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of a fused call"


#: the projections that read the same input, by their parent module
FUSABLE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(model: torch.nn.Module, decode: "Callable[[str], Blocks]") -> int:
    """Replaces each run of sibling projections (q/k/v, gate/up) that are
    kquant layers of one kind, with output rows in groups of 8, by one
    ``FusedProjection`` (v_proj is often Q6_K beside Q4_K q/k: then q/k
    alone). ``decode(path)`` gives a layer's blocks (decoded again, one
    parent at a time, so that no more than a few layers' codes are held).
    Returns how many fused calls were made."""
    made = 0
    for parent_name, parent in list(model.named_modules()):
        for group in FUSABLE:
            run: list[str] = []
            for n in group:
                mod = getattr(parent, n, None)
                if not isinstance(mod, KQuantLinear) or mod.out_features % 8:
                    break
                if run and (mod.kind, mod.acts) != (getattr(parent, run[0]).kind, getattr(parent, run[0]).acts):
                    break
                run.append(n)
            if len(run) < 2:
                continue
            mods = [getattr(parent, n) for n in run]
            path = (parent_name + ".") if parent_name else ""
            fused = FusedProjection([decode(path + n) for n in run], [m.bias for m in mods], mods[0].which,
                                    mods[0].acts)
            for i, n in enumerate(run):
                setattr(parent, n, FusedSlice(fused, i))
            made += 1
    return made
