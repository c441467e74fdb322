"""The ``bf16w`` backend's kernel: ``y = x · Wᵀ + b`` with W stored as
bfloat16 and everything else (x, products, sums, y) in float32, for CPUs
with AVX2 and FMA but no native BF16 GEMM.

Why: decoding a small batch of tokens is bound by reading the weights. A
bf16 copy halves the bytes of a float32 one, but on AVX2 CPUs torch's bf16
GEMM runs a slow reference kernel whose cost grows with every token in the
pass (a k-token verify costs k steps), and oneDNN refuses bf16 there. This
kernel widens bf16 to float32 in registers (exact: bf16 is the top half of a
float32) and accumulates with FMA, so one pass of k ≤ 16 tokens costs about
one weight read. A prompt (128 rows or more) is bound by the arithmetic
instead and takes a blocked path: weights widened once per 64-row x 512-column
panel that stays in cache while every row passes over it.

Numerics: each output y[m, n] is the same sequence of float32 operations
whatever the number of rows M, the batch, the path (blocked or not) or the
thread that computes it (8-lane FMA over K, a fixed horizontal sum, a scalar
tail, then the bias), so a 1-token step, a k-token verify and a batched
verify agree bit for bit on the linear layers. The model's numerics are "bfloat16 weights, float32
activations": the checkpoint is loaded in bf16 (every weight rounded once,
as the bf16 eager path rounds them) and everything but the linear weights is
widened to float32 (``backends.apply_backend``).

The C source below is compiled once per machine with the system C compiler
(``cc``/``gcc``, ``-O3 -mavx2 -mfma``) into a cache directory and loaded with
ctypes; ctypes releases the GIL during the call, so the weight's rows (the
output's columns, N) are split across threads of a small pool, in blocks of
_ROW_ALIGN; every thread reads all M activation rows. No compiler or no AVX2/FMA: the
backend is not eligible (``available()`` says why).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
import torch

from target_service import cbuild

C_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x55));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_bf16x8(const uint16_t* p) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

/* The next weight rows are fetched while this block computes: every 32 k
   each pass asks for the same k of the same rows one block (4 rows) ahead.
   Without it the hardware prefetcher leaves the memory bus idle whenever a
   verify pass (M > 1) is computing, and t(k) grows by the compute instead of
   hiding it (measured: M = 5 cost 1.6x M = 1 without, 1.15x with). */
#define PREFETCH_AHEAD(K) (4 * (K))

/* One block: NR weight rows (rows[]) against MB activation rows (xs[]),
   NR x MB accumulators. Every output y[m][n] is: 8-lane FMA over
   k = 0, 8, ..., K8-8 in order; hsum256; the scalar tail k = K8..K-1 in
   order; + bias. The same sequence for every block shape, weight layout and
   thread, so an output never depends on the rows beside it. */
#define BLOCK(NR, MB)                                                                      \
static void block_##NR##_##MB(const float* const* xs, int64_t K, const uint16_t* const* rows, \
                              float out[][8]) {                                            \
    const int64_t K8 = K - (K % 8);                                                        \
    __m256 acc[NR][MB];                                                                    \
    for (int r = 0; r < NR; r++)                                                           \
        for (int i = 0; i < MB; i++) acc[r][i] = _mm256_setzero_ps();                      \
    for (int64_t k = 0; k < K8; k += 8) {                                                  \
        __m256 wv[NR];                                                                     \
        if ((k & 31) == 0)                                                                 \
            for (int r = 0; r < NR; r++)                                                   \
                _mm_prefetch((const char*)(rows[r] + PREFETCH_AHEAD(K) + k), _MM_HINT_T0); \
        for (int r = 0; r < NR; r++) wv[r] = load_bf16x8(rows[r] + k);                     \
        for (int i = 0; i < MB; i++) {                                                     \
            for (int r = 0; r < NR; r++)                                                   \
                acc[r][i] = _mm256_fmadd_ps(wv[r], _mm256_loadu_ps(xs[i] + k), acc[r][i]); \
        }                                                                                  \
    }                                                                                      \
    for (int r = 0; r < NR; r++)                                                           \
        for (int i = 0; i < MB; i++) {                                                     \
            float s = hsum256(acc[r][i]);                                                  \
            for (int64_t k = K8; k < K; k++) s += bf16_to_f32(rows[r][k]) * xs[i][k];     \
            out[r][i] = s;                                                                 \
        }                                                                                  \
}
BLOCK(4, 1)
BLOCK(4, 2)
BLOCK(2, 3)
BLOCK(2, 4)
BLOCK(2, 5)
BLOCK(2, 6)

typedef void (*blockfn)(const float* const*, int64_t, const uint16_t* const*, float[][8]);

/* The same block over one chunk [k0, k0 + L) of K, for the blocked path:
   weight rows already widened to float32 (exact) in a panel, and the lanes
   carried in accp from chunk to chunk (k0 and every chunk but the last are
   multiples of 8, so lane by lane it is the same FMA sequence as one pass
   over K); the last chunk adds the horizontal sum and the scalar tail.
   Each activation vector is loaded once per k and kept in a register for
   the NR rows: the empty asm stops the compiler from folding one load into
   every FMA, which made this arithmetic-bound path wait on loads. */
#define BLOCKC(NR, MB)                                                                        \
static void blockc_##NR##_##MB(const float* const* xs, int64_t k0, int64_t L, const float* const* rows, \
                               float* accp, int first, int last, float out[][8]) {            \
    const int64_t L8 = L - (L % 8);                                                          \
    __m256 acc[NR][MB];                                                                      \
    for (int r = 0; r < NR; r++)                                                             \
        for (int i = 0; i < MB; i++)                                                         \
            acc[r][i] = first ? _mm256_setzero_ps() : _mm256_load_ps(accp + (r * MB + i) * 8); \
    for (int64_t k = 0; k < L8; k += 8) {                                                    \
        __m256 wv[NR];                                                                       \
        for (int r = 0; r < NR; r++) wv[r] = _mm256_load_ps(rows[r] + k);                   \
        for (int i = 0; i < MB; i++) {                                                       \
            __m256 xv = _mm256_loadu_ps(xs[i] + k0 + k);                                     \
            __asm__("" : "+x"(xv));                                                          \
            for (int r = 0; r < NR; r++) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]); \
        }                                                                                    \
    }                                                                                        \
    if (!last) {                                                                             \
        for (int r = 0; r < NR; r++)                                                         \
            for (int i = 0; i < MB; i++) _mm256_store_ps(accp + (r * MB + i) * 8, acc[r][i]); \
        return;                                                                              \
    }                                                                                        \
    for (int r = 0; r < NR; r++)                                                             \
        for (int i = 0; i < MB; i++) {                                                       \
            float s = hsum256(acc[r][i]);                                                    \
            for (int64_t k = L8; k < L; k++) s += rows[r][k] * xs[i][k0 + k];               \
            out[r][i] = s;                                                                   \
        }                                                                                    \
}
BLOCKC(2, 3)
BLOCKC(2, 4)
BLOCKC(2, 5)
BLOCKC(2, 6)

typedef void (*blockcfn)(const float* const*, int64_t, int64_t, const float* const*, float*, int, int, float[][8]);

/* The blocked path (a prompt, a large batch): PANEL_ROWS weight rows at a
   time, KC of K at a time, widened once into a float32 panel (PANEL_ROWS x
   KC x 4 = 128 KB, in L2) that every group of activation rows passes over
   (a group's KC slice, 6 x 2 KB, stays in L1). Below BLOCKED_MIN_ROWS rows
   widening a panel costs more than it saves (measured on Zen 3: a loss at
   48 rows, mixed at 128, 1.1-1.5x faster at 500). */
#define KC 512
#define PANEL_ROWS 64
#define BLOCKED_MIN_ROWS 128

/* The next group of activation rows, from row m, when `parts` groups of
   balanced sizes are left: points xs[] at its rows (unused slots repeat the
   first) and returns its size. */
static inline int64_t next_group(const float* x, int64_t M, int64_t K, int64_t m, int64_t parts,
                                 const float** xs) {
    const int64_t left = M - m;
    const int64_t mb = left / parts + (left % parts ? 1 : 0);
    for (int i = 0; i < 8; i++) xs[i] = x + (m + (i < mb ? i : 0)) * K;
    return mb;
}

static inline void store_out(float* y, int64_t N, int64_t m, int64_t n, int64_t nb, int64_t mb,
                             const float* bias, float out[][8]) {
    for (int64_t r = 0; r < nb; r++) {
        const float b = bias ? bias[n + r] : 0.0f;
        for (int64_t i = 0; i < mb; i++) y[(m + i) * N + n + r] = out[r][i] + b;
    }
}

static int linear_blocked(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                          float* y, int64_t N, int64_t n0, int64_t n1, int64_t groups) {
    const int64_t pairs = PANEL_ROWS / 2;
    float out[4][8];
    const float* xs[8];
    const float* frows[2];
    float* panel = (float*)aligned_alloc(64, PANEL_ROWS * KC * sizeof(float));
    float* accs = (float*)aligned_alloc(64, groups * pairs * 12 * 8 * sizeof(float));
    if (!panel || !accs) {
        free(panel);
        free(accs);
        return 1;
    }
    for (int64_t p = n0; p < n1; p += PANEL_ROWS) {
        const int64_t pe = (n1 - p) < PANEL_ROWS ? n1 : p + PANEL_ROWS;
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t L = (K - k0) < KC ? (K - k0) : KC;
            const int first = k0 == 0, last = k0 + L == K;
            for (int64_t r = 0; r < pe - p; r++) {
                const uint16_t* src = w + (p + r) * K + k0;
                float* dst = panel + r * KC;
                int64_t k = 0;
                for (; k + 8 <= L; k += 8) _mm256_store_ps(dst + k, load_bf16x8(src + k));
                for (; k < L; k++) dst[k] = bf16_to_f32(src[k]);
            }
            int64_t m = 0;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t mb = next_group(x, M, K, m, groups - g, xs);
                const blockcfn f = mb == 3 ? blockc_2_3 : mb == 4 ? blockc_2_4 : mb == 5 ? blockc_2_5 : blockc_2_6;
                for (int64_t n = p, j = 0; n < pe; n += 2, j++) {
                    const int64_t nb = (pe - n) < 2 ? (pe - n) : 2;
                    for (int r = 0; r < 2; r++) frows[r] = panel + (n - p + (r < nb ? r : 0)) * KC;
                    f(xs, k0, L, frows, accs + (g * pairs + j) * 96, first, last, out);
                    if (last) store_out(y, N, m, n, nb, mb, bias, out);
                }
                m += mb;
            }
        }
    }
    free(panel);
    free(accs);
    return 0;
}

/* y[m*N + n] = sum_k x[m*K + k] * w[n*K + k] (+ bias[n]) for m in [0, M), n in [n0, n1).
   The M activation rows go in as few groups of at most six as possible, of
   balanced sizes (M = 8: 4 + 4). Below BLOCKED_MIN_ROWS (steps, verify
   passes, small batches: bound by reading the weights) weight rows go four
   at a time, widened as they load, so a pass of up to six tokens reads and
   widens each weight once; from BLOCKED_MIN_ROWS on (prompts: bound by the
   arithmetic) the blocked path above. Returns 1 if its scratch cannot be
   allocated. */
int specdec_bf16w_linear(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                         float* y, int64_t N, int64_t n0, int64_t n1) {
    float out[4][8];
    const float* xs[8];
    const uint16_t* rows[4];
    const int64_t groups = (M + 5) / 6;
    if (M >= BLOCKED_MIN_ROWS) return linear_blocked(x, M, K, w, bias, y, N, n0, n1, groups);
    for (int64_t n = n0; n < n1; n += 4) {
        const int64_t nb = (n1 - n) < 4 ? (n1 - n) : 4;
        for (int r = 0; r < 4; r++) rows[r] = w + (n + (r < nb ? r : 0)) * K;
        int64_t m = 0;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t mb = next_group(x, M, K, m, groups - g, xs);
            if (mb == 1) {
                block_4_1(xs, K, rows, out);
            } else if (mb == 2) {
                block_4_2(xs, K, rows, out);
            } else {
                const blockfn f = mb == 3 ? block_2_3 : mb == 4 ? block_2_4 : mb == 5 ? block_2_5 : block_2_6;
                f(xs, K, rows, out);
                f(xs, K, rows + 2, out + 2);
            }
            store_out(y, N, m, n, nb, mb, bias, out);
            m += mb;
        }
    }
    return 0;
}
"""

_FLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-fno-fast-math", "-ffp-contract=off"]
_ROW_ALIGN = 4  # rows of W per block: thread ranges start on a block boundary
_lock = threading.Lock()


def _cpu_ok() -> str:
    from target_service.backends import cpu_info

    flags = set(cpu_info().flags)
    missing = [f for f in ("avx2", "fma") if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else ""


def kernels() -> list[cbuild.Kernel]:
    """The library this backend loads (for ``python -m target_service.cbuild build``)."""
    return [cbuild.Kernel("bf16w", C_SOURCE, tuple(_FLAGS))]


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled kernel, "") or (None, why not)."""
    why = _cpu_ok()
    if why:
        return None, why
    dll, why = cbuild.load(kernels()[0])
    if dll is None:
        return None, why
    fn = dll.specdec_bf16w_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    return dll, ""


def available() -> tuple[bool, str]:
    """Whether the kernel runs here, and if not, why."""
    lib, why = _library()
    return lib is not None, why


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_threads = 0  # threads the kernel splits the weight's rows (output columns) over (0 = torch.get_num_threads())


def set_threads(threads: int) -> None:
    global _threads
    _threads = max(0, int(threads))


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=max(1, threads - 1), thread_name_prefix="specdec-bf16w")
            _pool_size = threads
        return _pool


def linear(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 · weight [N, K] bfloat16ᵀ + bias [N] float32 → [..., N] float32."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the bf16w kernel is not available: {why}")
    n, k = weight_bf16.shape
    x2, m = cbuild.float_rows(x, k)
    y = torch.empty((m, n), dtype=torch.float32)
    fn = lib.specdec_bf16w_linear
    xp, wp, yp = x2.data_ptr(), weight_bf16.data_ptr(), y.data_ptr()
    bp = bias.data_ptr() if bias is not None else None
    threads = max(1, _threads or torch.get_num_threads())
    blocks = (n + _ROW_ALIGN - 1) // _ROW_ALIGN
    parts = min(threads, blocks)
    if parts <= 1:
        if fn(xp, m, k, wp, bp, yp, n, 0, n) != 0:
            raise MemoryError("bf16w kernel: scratch allocation failed")
    else:
        per = (blocks + parts - 1) // parts
        ranges = [(i * per * _ROW_ALIGN, min(n, (i + 1) * per * _ROW_ALIGN)) for i in range(parts)]
        ranges = [r for r in ranges if r[0] < r[1]]
        pool = _executor(threads)
        futs = [pool.submit(fn, xp, m, k, wp, bp, yp, n, lo, hi) for lo, hi in ranges[1:]]
        rc = [fn(xp, m, k, wp, bp, yp, n, *ranges[0])] + [f.result() for f in futs]
        if any(rc):
            raise MemoryError("bf16w kernel: scratch allocation failed")
    return y.reshape(*x.shape[:-1], n)


class Bf16WeightLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is stored as bfloat16 and applied with
    the float32-accumulating kernel (see the module docstring)."""

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        w = lin.weight.detach().to(torch.bfloat16).contiguous()
        self.register_buffer("weight", w, persistent=False)
        b = lin.bias
        self.register_buffer("bias", None if b is None else b.detach().float().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, weights=bf16, accumulate=fp32"
