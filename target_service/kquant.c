/* kquant: y = x · Wᵀ (+ b) with W held in the GGUF's own K-quant codes
   (Q4_K, Q6_K), x rounded to bfloat16, products and sums in float32.
   Loaded by target_service/kquant.py; the layout and the numerics are
   described there. Two paths, chosen at build time:

   KQ_AVX512 (AVX-512 F/BW + AVX512_BF16): 16 lanes; each lane covers 16
   consecutive weights of a 256-weight super-block (lane l: k = 16l .. 16l+15),
   as pairs (k, k+1) for vdpbf16ps. Register p (0..7) of a super-block holds,
   in lane l, the pair k = 16l + 2p, 16l + 2p + 1. The activations are
   permuted into the same order once per call.

   KQ_AVX2 (AVX2 + FMA): 8 float32 lanes, weights widened to float32 and
   multiplied with FMA, two registers side by side covering the same 16 lanes
   (see the AVX2 section).

   Every output y[m][n] is the same sequence of float32 operations whatever
   the number of rows M, the tile that computes it or the thread: per
   super-block a fresh dot product over its eight registers in order, one
   scale FMA (and one min FMA for Q4_K) into the row's accumulator, then a
   fixed horizontal sum and the bias. */

#include <immintrin.h>
#include <math.h>
#include <x86intrin.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#define KQ_Q4K 0
#define KQ_Q6K 1

/* bytes of one row's super-block in the packed weights */
#define BLOCK_Q4K (128 + 24)
#define BLOCK_Q6K (128 + 64 + 20)

/* per super-block metadata, repacked at load (see kquant.py)
   Q4_K: float d, dmin; uint8 sc[8], m[8]            (24 bytes)
   Q6_K: float d; int8 sc[16]                          (20 bytes) */
typedef struct { float d, dmin; uint8_t sc[8]; uint8_t m[8]; } meta4_t;
typedef struct { float d; int8_t sc[16]; } meta6_t;

typedef struct {
    int kind;
    int64_t M, K, N;
    const uint8_t* w;    /* [N/8][K/256][8 rows][block]: a block is 128 bytes of 4-bit codes (two
                            registers per 32 bytes), Q6_K: 64 bytes of 2-bit high parts (four
                            registers per 32 bytes), then its meta4_t / meta6_t */
    const float* bias;   /* [N] or NULL */
    const void* xp;      /* permuted activations: AVX-512: bf16 [M][K]; AVX2: float [M][K] */
    const float* xsum;   /* [M][K/16]: sums of the bf16-rounded x over each lane's 16 weights */
    float* y;            /* [M][N] */
    /* 8-bit activations (kq_linear_a8; xp and xsum unused): */
    const int8_t* xq;    /* [M][K] int8 codes in the a8 register order (see the a8 section) */
    const float* dx;     /* [M][K/16] the scale of each lane's 16 codes */
    const float* xs8;    /* [M][K/16] dx · (the sum of the lane's codes) */
    const int32_t* xo;   /* [M][K/16] −32 · (the sum of the lane's codes): Q6_K's offset, exact */
    int a8;
    /* any other work split over the pool (kq_attention): task(ctx, lo, hi)
       for its units [lo, hi) instead of the output rows */
    void (*task)(const void* ctx, int64_t lo, int64_t hi);
    const void* ctx;
    int64_t units;
} job_t;

/* an output: the tile's sum plus the bias */
static inline void store_out(const job_t* j, int64_t m, int64_t n, float v) {
    if (j->bias) v += j->bias[n];
    j->y[m * j->N + n] = v;
}

/* super-block b of the group of 8 rows from row n (its 8 rows' blocks
   contiguous), fetching the group's blocks prefetch_ahead super-blocks ahead
   into L2 (_MM_HINT_T1). Without it a 1-row pass is bound by memory latency,
   not bandwidth: the out-of-order window covers about one KiB of the weight
   stream, and the hardware prefetchers alone kept the memory bus half idle
   (Zen 4, all 197 layers of the 1.5B at 1 row: 41-51 ms against 30-35 ms
   for a plain read of the same bytes). Fetching into L1 (T0) instead filled
   its few miss buffers and cost more than it saved at long distances;
   into L2, 4-16 super-blocks ahead gave 10-25 % at 1 row and 7-9 % at
   4-8 rows (docs/benchmarks.md). kq_set_prefetch lets calibration choose
   per machine, 0 included. */
static int prefetch_ahead = 16;  /* super-blocks; 0 = the hardware prefetcher alone (kq_set_prefetch) */

static inline const uint8_t* group_block(const job_t* j, int64_t n, int64_t b, int64_t BS) {
    const uint8_t* blk = j->w + ((n / 8) * (j->K / 256) + b) * 8 * BS;
    if (prefetch_ahead)
        for (int64_t off = 0; off < 8 * BS; off += 64)
            _mm_prefetch((const char*)(blk + prefetch_ahead * 8 * BS + off), _MM_HINT_T1);
    return blk;
}

/* how many super-blocks ahead the kernel fetches its weights in software
   (0: not at all; at most 64); returns the setting now in force. Timing
   only: the results are the same bits whatever it is. */
int kq_set_prefetch(int ahead) {
    if (ahead >= 0) prefetch_ahead = ahead > 64 ? 64 : ahead;
    return prefetch_ahead;
}

static inline uint16_t f32_to_bf16(float f) {
    /* round to nearest even, as vcvtneps2bf16 (NaN kept quiet) */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffff) > 0x7f800000) return (uint16_t)((v.u >> 16) | 0x40);
    uint32_t r = 0x7fff + ((v.u >> 16) & 1);
    return (uint16_t)((v.u + r) >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)h) << 16;
    return v.f;
}

/* one super-block of an activation row, each element rounded to bf16 (kept
   as float32, exactly), and its 16 lane sums (16 consecutive elements each) */
static void round_block(const float* xr, float blk[256], float* xs16) {
    for (int t = 0; t < 256; t++) blk[t] = bf16_to_f32(f32_to_bf16(xr[t]));
    for (int l = 0; l < 16; l++) {
        float s = 0.0f;
        for (int t = 0; t < 16; t++) s += blk[16 * l + t];
        xs16[l] = s;
    }
}

/* the bf16 bits of a float32 that is a bf16 value */
static inline uint16_t bits_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)(v.u >> 16);
}

/* ------------------------------------------------------------------ AVX-512 */
#ifdef KQ_AVX512

/* activations for the kernel: xp[m][b*256 + p*32 + 2l + j] = bf16(x[m][b*256 + 16l + 2p + j]) */
static void prepare_x(const float* x, int64_t M, int64_t K, uint16_t* xp, float* xsum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 256; b++) {
            float blk[256];
            round_block(x + m * K + b * 256, blk, xsum + m * (K / 16) + b * 16);
            uint16_t* dst = xp + m * K + b * 256;
            for (int p = 0; p < 8; p++)
                for (int l = 0; l < 16; l++)
                    for (int j = 0; j < 2; j++) dst[p * 32 + 2 * l + j] = bits_bf16(blk[16 * l + 2 * p + j]);
        }
}

/* registers 2pp and 2pp + 1 of one super-block, as bf16 of 128 + q: a code
   q < 128 under the exponent of 128 is the bf16 number 128 + q exactly
   (0x4300 | q), so one bitwise operation widens it, with no table. The
   offset is taken out with the lane's input sum: Σ q·x = Σ (128 + q)·x −
   128·Σ x (the sums lose about 4 of float32's 24 bits to the offset, far
   below the bf16 rounding of x). */
static inline void decode_pair(int kind, const uint8_t* lo, const uint8_t* hi, int pp, __m512i* w0, __m512i* w1) {
    const __m512i m0f = _mm512_set1_epi16(0x000f);
    const __m512i e128 = _mm512_set1_epi16(0x4300);
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(lo + pp * 32)));
    /* (A & B) | C = 0xEA */
    __m512i c0 = _mm512_ternarylogic_epi32(v, m0f, e128, 0xEA);
    __m512i c1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m0f, e128, 0xEA);
    if (kind == KQ_Q6K) {
        /* the high 2 bits of registers 4(pp/2) .. 4(pp/2) + 3 share 32 bytes,
           fields 2j (bits 2j, 2j + 1); ours are j = 2(pp % 2) and 2(pp % 2) + 1,
           moved to bits 4-5: A | (B & C) = 0xF8 */
        const __m512i m30 = _mm512_set1_epi16(0x0030);
        __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(hi + (pp >> 1) * 32)));
        __m512i h0 = (pp & 1) ? h : _mm512_slli_epi16(h, 4);
        __m512i h1 = (pp & 1) ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
        c0 = _mm512_ternarylogic_epi32(c0, h0, m30, 0xF8);
        c1 = _mm512_ternarylogic_epi32(c1, h1, m30, 0xF8);
    }
    *w0 = c0;
    *w1 = c1;
}

/* lane l: S = d * sc[l/2] and, in *mins, what multiplies the lane's input
   sum: 128·S (the code offset) + dmin * m[l/2] */
static inline __m512 scales_q4(const meta4_t* mt, __m512* mins) {
    const __m128i idx = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m128i sc = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->sc), idx);
    __m128i mn = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->m), idx);
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(mt->d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    const __m512 m = _mm512_mul_ps(_mm512_set1_ps(mt->dmin), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
    *mins = _mm512_fmadd_ps(_mm512_set1_ps(128.0f), s, m);
    return s;
}

/* lane l: S = d * sc[l] and, in *mins, 160·S (the offset 128 and Q6_K's 32) */
static inline __m512 scales_q6(const meta6_t* mt, __m512* mins) {
    __m128i sc = _mm_loadu_si128((const __m128i*)mt->sc);
    const __m512 s = _mm512_mul_ps(_mm512_set1_ps(mt->d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    *mins = _mm512_mul_ps(_mm512_set1_ps(160.0f), s);
    return s;
}

/* one tile: the 8 weight rows of one group (rows n .. n + 7, n a multiple
   of 8) x MB activation rows over all of K, reading the group's blocks as one
   stream. Per super-block and output: two dot products in float32 lanes, over
   the even and the odd registers (in order), added; times the lane scales
   into the accumulator, minus the offsets (and Q4_K's mins) times the lane
   input sums. Within a super-block the rows go NR at a time, their chains
   interleaved register pair by register pair, so the multiply-adds of
   different outputs overlap instead of waiting on each other's latency.
   KIND, NR and MB are constants in every instance. */
static inline __attribute__((always_inline)) void tile_body(const job_t* j, int64_t n, int64_t m0,
                                                            const int KIND, const int NR, const int MB) {
    const int64_t KB = j->K / 256;
    const int64_t KS = j->K / 16;
    const int64_t BS = KIND == KQ_Q4K ? BLOCK_Q4K : BLOCK_Q6K;
    __m512 acc[8][MB];
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    const uint16_t* xb = (const uint16_t*)j->xp + m0 * j->K;
    const float* xs = j->xsum + m0 * KS;
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t* blk = group_block(j, n, b, BS);
        for (int r0 = 0; r0 < 8; r0 += NR) {
            __m512 da[NR][MB], db[NR][MB];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
                for (int i = 0; i < MB; i++) da[r][i] = db[r][i] = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int pp = 0; pp < 4; pp++) {
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    const uint8_t* rb = blk + (r0 + r) * BS;
                    __m512i w0, w1;
                    decode_pair(KIND, rb, rb + 128, pp, &w0, &w1);
#pragma GCC unroll 8
                    for (int i = 0; i < MB; i++) {
                        const uint16_t* xr = xb + i * j->K + b * 256 + pp * 64;
                        da[r][i] = _mm512_dpbf16_ps(da[r][i], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xr));
                        db[r][i] = _mm512_dpbf16_ps(db[r][i], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xr + 32));
                    }
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                const uint8_t* rb = blk + (r0 + r) * BS;
                __m512 s, mn;
                if (KIND == KQ_Q4K) s = scales_q4((const meta4_t*)(rb + 128), &mn);
                else s = scales_q6((const meta6_t*)(rb + 192), &mn);
#pragma GCC unroll 8
                for (int i = 0; i < MB; i++) {
                    __m512 a = _mm512_fmadd_ps(s, _mm512_add_ps(da[r][i], db[r][i]), acc[r0 + r][i]);
                    acc[r0 + r][i] = _mm512_fnmadd_ps(mn, _mm512_loadu_ps(xs + i * KS + b * 16), a);
                }
            }
        }
    }
    for (int r = 0; r < 8 && n + r < j->N; r++)
        for (int i = 0; i < MB; i++) {
            store_out(j, m0 + i, n + r, _mm512_reduce_add_ps(acc[r][i]));
        }
}

#else  /* ------------------------------------------------------------- AVX2 */

/* AVX2 layout: 8 float32 lanes; register (t, h) of a super-block (t = 0..15,
   h = 0..1) holds, in lane l, the weight k = 16 (8h + l) + t: lane L = 8h + l
   covers the same 16 weights as the AVX-512 lane L. The activations are
   permuted the same way: xp[m][b*256 + t*16 + h*8 + l] = bf16(x[m][b*256 + 16(8h+l) + t]),
   kept as float32. */
static void prepare_x(const float* x, int64_t M, int64_t K, float* xp, float* xsum) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 256; b++) {
            float blk[256];
            round_block(x + m * K + b * 256, blk, xsum + m * (K / 16) + b * 16);
            float* dst = xp + m * K + b * 256;
            for (int t = 0; t < 16; t++)
                for (int L = 0; L < 16; L++) dst[t * 16 + L] = blk[16 * L + t];
        }
}


/* the sum of 16 float32 lanes held as two registers of 8 (lanes 0-7, 8-15),
   in _mm512_reduce_add_ps's order: lane i + lane i + 8, then + 4, + 2, + 1 */
static inline float hsum16(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 0x55));
    return _mm_cvtss_f32(s4);
}

/* codes of registers (t, h) and (t + 1, h), t even: 8 bytes, low and high nibbles */
static inline void codes_lo(const uint8_t* lo, int t, int h, __m256i* a, __m256i* b) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(lo + ((t >> 1) * 2 + h) * 8)));
    *a = _mm256_and_si256(v, _mm256_set1_epi32(15));
    *b = _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi32(15));
}

/* the high 2 bits of registers (t .. t + 3, h), t a multiple of 4, at bits 4-5 */
static inline void codes_hi(const uint8_t* hi, int t, int h, __m256i out[4]) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(hi + ((t >> 2) * 2 + h) * 8)));
    const __m256i m30 = _mm256_set1_epi32(0x30);
    out[0] = _mm256_and_si256(_mm256_slli_epi32(v, 4), m30);
    out[1] = _mm256_and_si256(_mm256_slli_epi32(v, 2), m30);
    out[2] = _mm256_and_si256(v, m30);
    out[3] = _mm256_and_si256(_mm256_srli_epi32(v, 2), m30);
}

static inline void scales_avx2(int kind, const uint8_t* meta, __m256 s[2], __m256 mn[2]) {
    if (kind == KQ_Q4K) {
        const meta4_t* mt = (const meta4_t*)meta;
        const __m128i idx = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        __m128i sc = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->sc), idx);
        __m128i m = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->m), idx);
        for (int h = 0; h < 2; h++) {
            __m128i sh = h ? _mm_srli_si128(sc, 8) : sc, mh = h ? _mm_srli_si128(m, 8) : m;
            s[h] = _mm256_mul_ps(_mm256_set1_ps(mt->d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sh)));
            mn[h] = _mm256_mul_ps(_mm256_set1_ps(mt->dmin), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mh)));
        }
    } else {
        const meta6_t* mt = (const meta6_t*)meta;
        __m128i sc = _mm_loadu_si128((const __m128i*)mt->sc);
        for (int h = 0; h < 2; h++) {
            __m128i sh = h ? _mm_srli_si128(sc, 8) : sc;
            s[h] = _mm256_mul_ps(_mm256_set1_ps(mt->d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sh)));
            mn[h] = _mm256_setzero_ps();
        }
    }
}

/* one tile: the 8 weight rows of one group x MB activation rows, as the
   AVX-512 tile; per super-block and output the lanes L < 8 and L >= 8 (h = 0,
   1) are two registers, each a dot product over t = 0..15 in order, times its
   lane scales into its accumulator (minus offsets and mins as above); the two
   accumulators are added at the end. */
static inline __attribute__((always_inline)) void tile_body(const job_t* j, int64_t n, int64_t m0,
                                                            const int KIND, const int NR, const int MB) {
    const int64_t KB = j->K / 256;
    const int64_t KS = j->K / 16;
    const int64_t BS = KIND == KQ_Q4K ? BLOCK_Q4K : BLOCK_Q6K;
    const __m256i off32 = _mm256_set1_epi32(32);
    __m256 acc[8][MB][2];
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < MB; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    const float* xb = (const float*)j->xp + m0 * j->K;
    const float* xs = j->xsum + m0 * KS;
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t* blk = group_block(j, n, b, BS);
        for (int r0 = 0; r0 < 8; r0 += NR) {
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m256 dot[NR][MB];
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
                    for (int i = 0; i < MB; i++) dot[r][i] = _mm256_setzero_ps();
#pragma GCC unroll 8
                for (int t = 0; t < 16; t += 2) {
#pragma GCC unroll 8
                    for (int r = 0; r < NR; r++) {
                        const uint8_t* rb = blk + (r0 + r) * BS;
                        __m256i c[2];
                        codes_lo(rb, t, h, &c[0], &c[1]);
                        if (KIND == KQ_Q6K) {
                            __m256i hb[4];
                            codes_hi(rb + 128, t & ~3, h, hb);
                            c[0] = _mm256_sub_epi32(_mm256_or_si256(c[0], hb[t & 3]), off32);
                            c[1] = _mm256_sub_epi32(_mm256_or_si256(c[1], hb[(t & 3) + 1]), off32);
                        }
#pragma GCC unroll 2
                        for (int u = 0; u < 2; u++) {
                            const __m256 wv = _mm256_cvtepi32_ps(c[u]);
#pragma GCC unroll 8
                            for (int i = 0; i < MB; i++)
                                dot[r][i] = _mm256_fmadd_ps(
                                    wv, _mm256_loadu_ps(xb + i * j->K + b * 256 + (t + u) * 16 + h * 8), dot[r][i]);
                        }
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    const uint8_t* rb = blk + (r0 + r) * BS;
                    __m256 s[2], mn[2];
                    scales_avx2(KIND, rb + (KIND == KQ_Q4K ? 128 : 192), s, mn);
#pragma GCC unroll 8
                    for (int i = 0; i < MB; i++) {
                        acc[r0 + r][i][h] = _mm256_fmadd_ps(s[h], dot[r][i], acc[r0 + r][i][h]);
                        if (KIND == KQ_Q4K)
                            acc[r0 + r][i][h] = _mm256_fnmadd_ps(
                                mn[h], _mm256_loadu_ps(xs + i * KS + b * 16 + h * 8), acc[r0 + r][i][h]);
                    }
                }
            }
        }
    }
    for (int r = 0; r < 8 && n + r < j->N; r++)
        for (int i = 0; i < MB; i++) store_out(j, m0 + i, n + r, hsum16(acc[r][i][0], acc[r][i][1]));
}

#endif


/* ------------------------------------------------------ 8-bit activations
   kq_linear_a8: the same weights (the file's codes and scales), with each
   input lane of 16 consecutive elements quantized to int8 with its own
   float32 scale (dx = max|x| / 127, codes rint(x · (127 / max|x|)), half to even),
   and the products of codes summed exactly in int32 (AVX-512 VNNI
   vpdpbusd; AVX2 two vpmaddubsw added as int16, then vpmaddwd; no
   saturation: |q| <= 63, |xq| <= 127, so a pair sum is within ±16002 and
   two within ±32004). Per super-block, output and lane l (16 weights, sub-block
   scale S_l = d·sc, Q4_K min M_l = dmin·m):
       acc_l += (S_l · dx_l) · float(Σ q·xq)      [Q6_K: Σ (q+32)·xq − 32 Σ xq, in int32]
       acc_l −= M_l · (dx_l · Σ xq)              [Q4_K only]
   then the 16 lanes are summed in the tree order of _mm512_reduce_add_ps
   (lane i with i + 8, then i + 4, i + 2, i + 1) and the bias added. The
   AVX2 build does the same operations on two halves of 8 lanes in the same
   order, so both builds give the same bits.

   Layout (weights and activations alike): register p (0..3) of a
   super-block is 64 bytes; byte i belongs to lane i / 4 and is the weight
   k = 16 (i / 4) + 4p + i % 4. Weights: 128 bytes of 4-bit codes (byte
   pp·64 + i: register 2pp in the low nibble, 2pp + 1 in the high), Q6_K's
   64 bytes of high 2-bit parts (byte i: register p's at bits 2p, 2p + 1),
   then the meta as above. */

/* one row's activations for kq_linear_a8, 16 elements (one lane) at a time
   in AVX2 registers (both builds): |x| by clearing the sign, the lane's max,
   d = max / 127 and inv = 127 / max in float32 (0 when max is 0), codes
   rint(x · inv) (round half to even) clamped to ±127, their int32 sum; then
   the lane's 16 codes go out as four 32-bit words, word p to register p. The
   same float32 operations as the scalar form they replaced (one multiply and
   one rounding per element), so the same codes and scales. */
static void prepare_a8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs, int32_t* xo) {
    const __m256 sign = _mm256_set1_ps(-0.0f), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 256; b++) {
            const float* xr = x + m * K + b * 256;
            int8_t* dst = xq + m * K + b * 256;
            for (int l = 0; l < 16; l++) {
                const __m256 a0 = _mm256_loadu_ps(xr + 16 * l), a1 = _mm256_loadu_ps(xr + 16 * l + 8);
                __m256 mx = _mm256_max_ps(_mm256_andnot_ps(sign, a0), _mm256_andnot_ps(sign, a1));
                __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
                m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
                m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 0x55));
                const float amax = _mm_cvtss_f32(m4);
                const float d = amax / 127.0f;
                const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
                const __m256 vi = _mm256_set1_ps(inv);
                const int rnd = _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC;
                __m256 r0 = _mm256_round_ps(_mm256_mul_ps(a0, vi), rnd);
                __m256 r1 = _mm256_round_ps(_mm256_mul_ps(a1, vi), rnd);
                r0 = _mm256_max_ps(_mm256_min_ps(r0, hi), lo);
                r1 = _mm256_max_ps(_mm256_min_ps(r1, hi), lo);
                const __m256i q0 = _mm256_cvtps_epi32(r0), q1 = _mm256_cvtps_epi32(r1);
                __m256i s8 = _mm256_add_epi32(q0, q1);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
                s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x55));
                const int32_t sum = _mm_cvtsi128_si32(s4);
                /* 16 int32 codes -> 16 int8 in order: packs work per 128-bit half */
                const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xd8);
                const __m128i b16 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
                int32_t words[4];
                _mm_storeu_si128((__m128i*)words, b16);
                for (int p = 0; p < 4; p++) memcpy(dst + p * 64 + 4 * l, &words[p], 4);
                const int64_t o = m * (K / 16) + b * 16 + l;
                dx[o] = d;
                xs[o] = d * (float)sum;
                xo[o] = -32 * sum;
            }
        }
}

#ifdef KQ_AVX512
/* lane scales S_l and, for Q4_K, mins M_l (zero for Q6_K) */
static inline __m512 lane_scales(int kind, const uint8_t* meta, __m512* mins) {
    if (kind == KQ_Q4K) {
        const meta4_t* mt = (const meta4_t*)meta;
        const __m128i idx = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        __m128i sc = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->sc), idx);
        __m128i mn = _mm_shuffle_epi8(_mm_loadl_epi64((const __m128i*)mt->m), idx);
        *mins = _mm512_mul_ps(_mm512_set1_ps(mt->dmin), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
        return _mm512_mul_ps(_mm512_set1_ps(mt->d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    }
    const meta6_t* mt = (const meta6_t*)meta;
    *mins = _mm512_setzero_ps();
    return _mm512_mul_ps(_mm512_set1_ps(mt->d),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)mt->sc))));
}

/* registers 2pp and 2pp + 1 of one row's super-block as unsigned bytes */
static inline void decode_a8(int kind, const uint8_t* rb, int pp, __m512i* w0, __m512i* w1) {
    const __m512i m0f = _mm512_set1_epi8(0x0f);
    const __m512i v = _mm512_loadu_si512((const void*)(rb + pp * 64));
    __m512i c0 = _mm512_and_si512(v, m0f);
    __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), m0f);
    if (kind == KQ_Q6K) {
        const __m512i m30 = _mm512_set1_epi8(0x30);
        const __m512i h = _mm512_loadu_si512((const void*)(rb + 128));
        /* register p's 2 bits at bits 4-5: p = 0: h << 4, 1: h << 2, 2: h, 3: h >> 2 */
        const __m512i h0 = pp ? h : _mm512_slli_epi16(h, 4);
        const __m512i h1 = pp ? _mm512_srli_epi16(h, 2) : _mm512_slli_epi16(h, 2);
        c0 = _mm512_ternarylogic_epi32(c0, h0, m30, 0xF8);
        c1 = _mm512_ternarylogic_epi32(c1, h1, m30, 0xF8);
    }
    *w0 = c0;
    *w1 = c1;
}

static inline __attribute__((always_inline)) void tile_a8_body(const job_t* j, int64_t n, int64_t m0,
                                                               const int KIND, const int NR, const int MB) {
    const int64_t KB = j->K / 256;
    const int64_t KS = j->K / 16;
    const int64_t BS = KIND == KQ_Q4K ? BLOCK_Q4K : BLOCK_Q6K;
    __m512 acc[8][MB];
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    const int8_t* xb = j->xq + m0 * j->K;
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t* blk = group_block(j, n, b, BS);
        __m512i init[MB];
#pragma GCC unroll 8
        for (int i = 0; i < MB; i++)
            init[i] = KIND == KQ_Q6K ? _mm512_loadu_si512((const void*)(j->xo + (m0 + i) * KS + b * 16))
                                     : _mm512_setzero_si512();
        for (int r0 = 0; r0 < 8; r0 += NR) {
            __m512i s[NR][MB];
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++)
#pragma GCC unroll 8
                for (int i = 0; i < MB; i++) s[r][i] = init[i];
#pragma GCC unroll 2
            for (int pp = 0; pp < 2; pp++) {
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    __m512i w0, w1;
                    decode_a8(KIND, blk + (r0 + r) * BS, pp, &w0, &w1);
#pragma GCC unroll 8
                    for (int i = 0; i < MB; i++) {
                        const int8_t* xr = xb + i * j->K + b * 256 + pp * 128;
                        s[r][i] = _mm512_dpbusd_epi32(s[r][i], w0, _mm512_loadu_si512((const void*)xr));
                        s[r][i] = _mm512_dpbusd_epi32(s[r][i], w1, _mm512_loadu_si512((const void*)(xr + 64)));
                    }
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                __m512 mn;
                const __m512 sc = lane_scales(KIND, blk + (r0 + r) * BS + (KIND == KQ_Q4K ? 128 : 192), &mn);
#pragma GCC unroll 8
                for (int i = 0; i < MB; i++) {
                    const int64_t o = (m0 + i) * KS + b * 16;
                    const __m512 sd = _mm512_mul_ps(sc, _mm512_loadu_ps(j->dx + o));
                    __m512 a = _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(s[r][i]), acc[r0 + r][i]);
                    if (KIND == KQ_Q4K) a = _mm512_fnmadd_ps(mn, _mm512_loadu_ps(j->xs8 + o), a);
                    acc[r0 + r][i] = a;
                }
            }
        }
    }
    for (int r = 0; r < 8 && n + r < j->N; r++)
        for (int i = 0; i < MB; i++) store_out(j, m0 + i, n + r, _mm512_reduce_add_ps(acc[r][i]));
}

#else  /* AVX2: the 16 lanes as two registers of 8 (h = 0: lanes 0-7); lane scales from scales_avx2 */

/* half h of registers 2pp and 2pp + 1 */
static inline void decode_a8(int kind, const uint8_t* rb, int pp, int h, __m256i* w0, __m256i* w1) {
    const __m256i m0f = _mm256_set1_epi8(0x0f);
    const __m256i v = _mm256_loadu_si256((const __m256i*)(rb + pp * 64 + h * 32));
    __m256i c0 = _mm256_and_si256(v, m0f);
    __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m0f);
    if (kind == KQ_Q6K) {
        const __m256i m30 = _mm256_set1_epi8(0x30);
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(rb + 128 + h * 32));
        const __m256i h0 = pp ? hb : _mm256_slli_epi16(hb, 4);
        const __m256i h1 = pp ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
        c0 = _mm256_or_si256(c0, _mm256_and_si256(h0, m30));
        c1 = _mm256_or_si256(c1, _mm256_and_si256(h1, m30));
    }
    *w0 = c0;
    *w1 = c1;
}

/* Σ over each 32-bit lane's 8 bytes of w0·x0 and w1·x1 (w unsigned, x
   signed), added to s: the two vpmaddubsw pair sums (each within ±2·63·127)
   are added as int16 (within ±32004: no saturation) before one vpmaddwd, so
   the int32 sum is the same exact integer as two separate dot products */
static inline __m256i dot8(__m256i s, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
    return _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* The AVX2 a8 tile: per super-block, NR weight rows at a time, both halves
   (lanes 0-7, 8-15) of each row decoded together and its lane scales
   computed once for both. The integer sums are exact whatever their order;
   each accumulator gets one FMA (and one min term) per super-block in block
   order, as the AVX-512 tile's lanes, so the same bits. */
static inline __attribute__((always_inline)) void tile_a8_body(const job_t* j, int64_t n, int64_t m0,
                                                               const int KIND, const int NR, const int MB) {
    const int64_t KB = j->K / 256;
    const int64_t KS = j->K / 16;
    const int64_t BS = KIND == KQ_Q4K ? BLOCK_Q4K : BLOCK_Q6K;
    __m256 acc[8][MB][2];
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < MB; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    const int8_t* xb = j->xq + m0 * j->K;
    for (int64_t b = 0; b < KB; b++) {
        const uint8_t* blk = group_block(j, n, b, BS);
        for (int r0 = 0; r0 < 8; r0 += NR) {
            __m256i s[NR][MB][2];
#pragma GCC unroll 8
            for (int i = 0; i < MB; i++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i init = KIND == KQ_Q6K
                        ? _mm256_loadu_si256((const __m256i*)(j->xo + (m0 + i) * KS + b * 16 + h * 8))
                        : _mm256_setzero_si256();
#pragma GCC unroll 8
                    for (int r = 0; r < NR; r++) s[r][i][h] = init;
                }
#pragma GCC unroll 2
            for (int pp = 0; pp < 2; pp++) {
#pragma GCC unroll 8
                for (int r = 0; r < NR; r++) {
                    __m256i w[2][2];
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) decode_a8(KIND, blk + (r0 + r) * BS, pp, h, &w[h][0], &w[h][1]);
#pragma GCC unroll 8
                    for (int i = 0; i < MB; i++)
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++) {
                            const int8_t* xr = xb + i * j->K + b * 256 + pp * 128 + h * 32;
                            s[r][i][h] = dot8(s[r][i][h], w[h][0], _mm256_loadu_si256((const __m256i*)xr),
                                              w[h][1], _mm256_loadu_si256((const __m256i*)(xr + 64)));
                        }
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < NR; r++) {
                __m256 sc[2], mn[2];
                scales_avx2(KIND, blk + (r0 + r) * BS + (KIND == KQ_Q4K ? 128 : 192), sc, mn);
#pragma GCC unroll 8
                for (int i = 0; i < MB; i++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const int64_t o = (m0 + i) * KS + b * 16 + h * 8;
                        const __m256 sd = _mm256_mul_ps(sc[h], _mm256_loadu_ps(j->dx + o));
                        __m256 a = _mm256_fmadd_ps(sd, _mm256_cvtepi32_ps(s[r][i][h]), acc[r0 + r][i][h]);
                        if (KIND == KQ_Q4K) a = _mm256_fnmadd_ps(mn[h], _mm256_loadu_ps(j->xs8 + o), a);
                        acc[r0 + r][i][h] = a;
                    }
            }
        }
    }
    for (int r = 0; r < 8 && n + r < j->N; r++)
        for (int i = 0; i < MB; i++) store_out(j, m0 + i, n + r, hsum16(acc[r][i][0], acc[r][i][1]));
}
#endif

/* a tile per (rows per group, rows per chain group), for each weight kind */
#define TILE(MB, NR)                                                                     \
static void tile_##MB(const job_t* j, int64_t n, int64_t m0) {                          \
    if (j->kind == KQ_Q4K) tile_body(j, n, m0, KQ_Q4K, NR, MB);                          \
    else tile_body(j, n, m0, KQ_Q6K, NR, MB);                                            \
}
#define TILE_A8(MB, NR)                                                                  \
static void tile_a8_##MB(const job_t* j, int64_t n, int64_t m0) {                       \
    if (j->kind == KQ_Q4K) tile_a8_body(j, n, m0, KQ_Q4K, NR, MB);                       \
    else tile_a8_body(j, n, m0, KQ_Q6K, NR, MB);                                         \
}

/* Activation rows go in groups of at most MAX_MB (balanced sizes), each
   group a pass over a weight panel that stays in L2. Four, not eight: with
   eight rows a chain group holds one weight row, and decoding it for every
   group of four rows instead costs less than the register spills of eight
   (measured on Zen 5, all of the 1.5B's layers: 0.82x the time at 8 rows,
   0.83x at 6, the same at 1-4 and 16). TILE(MB, NR): NR weight rows per
   chain group, about 16 chains (NR x MB x 2) at a time. */
#ifdef KQ_AVX512
#define MAX_MB 4
TILE(1, 8)
TILE(2, 4)
TILE(3, 2)
TILE(4, 2)
TILE_A8(1, 8)
TILE_A8(2, 4)
TILE_A8(3, 2)
TILE_A8(4, 2)
typedef void (*tilefn)(const job_t*, int64_t, int64_t);
static const tilefn TILES[5] = { 0, tile_1, tile_2, tile_3, tile_4 };
static const tilefn TILES_A8[5] = { 0, tile_a8_1, tile_a8_2, tile_a8_3, tile_a8_4 };
#else
#define MAX_MB 4
TILE(1, 2)
TILE(2, 2)
TILE(3, 1)
TILE(4, 1)
/* a8: both halves of a weight row at a time, so NR x MB x 2 chains (4, 4, 6,
   8); NR = 2 at one row measured the same as 4, and NR = 1 at two rows 5 %
   faster than 2 (Zen 3, scripts/kquant_ab.py) */
TILE_A8(1, 2)
TILE_A8(2, 1)
TILE_A8(3, 1)
TILE_A8(4, 1)
typedef void (*tilefn)(const job_t*, int64_t, int64_t);
static const tilefn TILES[5] = { 0, tile_1, tile_2, tile_3, tile_4 };
static const tilefn TILES_A8[5] = { 0, tile_a8_1, tile_a8_2, tile_a8_3, tile_a8_4 };
#endif

/* rows [n0, n1) of the output for every activation row: weight panels of
   PANEL rows, each passed over by every group of at most MAX_MB activation rows
   (balanced sizes), so a prompt reads each panel from memory once */
#define PANEL 32
static void run_rows(const job_t* j, int64_t n0, int64_t n1) {
    const int64_t groups = (j->M + MAX_MB - 1) / MAX_MB;
    for (int64_t p = n0; p < n1; p += PANEL) {
        const int64_t pe = (n1 - p) < PANEL ? n1 : p + PANEL;
        int64_t m = 0;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t left = j->M - m, parts = groups - g;
            const int64_t mb = left / parts + (left % parts ? 1 : 0);
            const tilefn f = j->a8 ? TILES_A8[mb] : TILES[mb];
            for (int64_t n = p; n < pe; n += 8) f(j, n, m);
            m += mb;
        }
    }
}

/* ------------------------------------------------------------- thread pool */
#define MAX_THREADS 64
static pthread_t workers[MAX_THREADS];
static int nthreads = 1;               /* including the caller */
static const job_t* volatile cur_job;
static int64_t ranges[MAX_THREADS + 1];
static atomic_int generation;
static atomic_int pending;
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
/* a worker spins this many TSC ticks (about 0.1 ms) for the next call before
   it sleeps: the linear layers of one forward pass come microseconds apart,
   and the cores are left free between forward passes */
#define SPIN_TICKS 300000ULL

static void futex_wait(atomic_int* addr, int val) { syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0); }
static void futex_wake(atomic_int* addr) { syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0); }

static int start_gen[MAX_THREADS];  /* the generation when each worker was created */

static void* worker_main(void* arg) {
    const int id = (int)(intptr_t)arg;
    /* not the generation now: a call may already have been dispatched
       between pthread_create and this line, and it must not be missed */
    int seen = start_gen[id];
    for (;;) {
        int g;
        unsigned long long t0 = __rdtsc();
        while ((g = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
            if (__rdtsc() - t0 < SPIN_TICKS) {
                _mm_pause();
            } else {
                futex_wait(&generation, seen);
                t0 = __rdtsc();
            }
        }
        seen = g;
        if (id < nthreads) {
            const job_t* j = cur_job;
            if (ranges[id] < ranges[id + 1]) {
                if (j->task) j->task(j->ctx, ranges[id], ranges[id + 1]);
                else run_rows(j, ranges[id], ranges[id + 1]);
            }
            atomic_fetch_sub_explicit(&pending, 1, memory_order_acq_rel);
        }
    }
    return NULL;
}

static int started = 0;
int kq_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&pool_mu);
    for (int i = started ? started : 1; i < n; i++) {
        start_gen[i] = atomic_load(&generation);
        if (pthread_create(&workers[i], NULL, worker_main, (void*)(intptr_t)i) != 0) {
            n = i;
            break;
        }
        started = i + 1;
    }
    if (!started) started = 1;
    nthreads = n;
    pthread_mutex_unlock(&pool_mu);
    return n;
}

/* runs a prepared job over the pool: thread ranges on multiples of 8 rows */
static void dispatch(job_t* j) {
    pthread_mutex_lock(&pool_mu);
    const int T = nthreads;
    if (j->task) {
        const int64_t per = (j->units + T - 1) / T;
        for (int t = 0; t <= T; t++) {
            int64_t r = (int64_t)t * per;
            ranges[t] = r < j->units ? r : j->units;
        }
    } else {
        const int64_t blocks = (j->N + 7) / 8;
        const int64_t per = (blocks + T - 1) / T;
        for (int t = 0; t <= T; t++) {
            int64_t r = (int64_t)t * per * 8;
            ranges[t] = r < j->N ? r : j->N;
        }
    }
    if (T > 1) {
        cur_job = j;
        atomic_store(&pending, T - 1);
        atomic_fetch_add_explicit(&generation, 1, memory_order_release);
        futex_wake(&generation);
    }
    if (j->task) {
        if (ranges[0] < ranges[1]) j->task(j->ctx, ranges[0], ranges[1]);
    } else {
        run_rows(j, ranges[0], ranges[1]);
    }
    if (T > 1)
        while (atomic_load_explicit(&pending, memory_order_acquire) > 0) _mm_pause();
    pthread_mutex_unlock(&pool_mu);
}

static void* scratch(int64_t bytes) { return aligned_alloc(64, ((bytes + 63) / 64) * 64); }

/* y = x · Wᵀ (+ bias), bf16 activations; returns 0, or 1 if scratch cannot be allocated */
int kq_linear(int kind, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias,
              float* y, int64_t N) {
    if (!started) kq_set_threads(1);
#ifdef KQ_AVX512
    void* xp = scratch(M * K * 2);
#else
    void* xp = scratch(M * K * 4);
#endif
    float* xsum = (float*)scratch(M * (K / 16) * 4);
    if (!xp || !xsum) {
        free(xp);
        free(xsum);
        return 1;
    }
    prepare_x(x, M, K, xp, xsum);
    job_t j = { kind, M, K, N, w, bias, xp, xsum, y, NULL, NULL, NULL, NULL, 0 };
    dispatch(&j);
    free(xp);
    free(xsum);
    return 0;
}

/* y = x · Wᵀ (+ bias), 8-bit activations (weights in the a8 layout); returns
   0, or 1 if scratch cannot be allocated */
int kq_linear_a8(int kind, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                 float* y, int64_t N) {
    if (!started) kq_set_threads(1);
    int8_t* xq = (int8_t*)scratch(M * K);
    float* dx = (float*)scratch(M * (K / 16) * 4);
    float* xs = (float*)scratch(M * (K / 16) * 4);
    int32_t* xo = (int32_t*)scratch(M * (K / 16) * 4);
    if (!xq || !dx || !xs || !xo) {
        free(xq);
        free(dx);
        free(xs);
        free(xo);
        return 1;
    }
    prepare_a8(x, M, K, xq, dx, xs, xo);
    job_t j = { kind, M, K, N, w, bias, NULL, NULL, y, xq, dx, xs, xo, 1 };
    dispatch(&j);
    free(xq);
    free(dx);
    free(xs);
    free(xo);
    return 0;
}

/* 1 when built for AVX-512 BF16, 0 for AVX2 */
int kq_isa(void) {
#ifdef KQ_AVX512
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------ a decoder layer's small ops
   The element-wise work between the linear layers of a decoder layer
   (target_service/fastlayers.py), one call each instead of several torch
   ops. Plain C (no intrinsics): both builds compile the same float32
   operations in the same order (-ffp-contract=off), so they give the same
   bits. Each row is computed alone, whatever the rows beside it. */

/* sum of squares of x[0..K): 16 float32 lanes (element i into lane i % 16,
   in order), then the lanes summed pairwise (lane l += lane l + w for
   w = 8, 4, 2, 1) */
static float sum_squares(const float* x, int64_t K) {
    float acc[16];
    for (int l = 0; l < 16; l++) acc[l] = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= K; i += 16)
        for (int l = 0; l < 16; l++) {
            const float p = x[i + l] * x[i + l];
            acc[l] = acc[l] + p;
        }
    for (int l = 0; i < K; i++, l++) {
        const float p = x[i] * x[i];
        acc[l] = acc[l] + p;
    }
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] = acc[l] + acc[l + w];
    return acc[0];
}

/* RMSNorm of M rows of K, as transformers' (float32): y = w · (h · r) with
   r = 1 / sqrt(sum(h²) / K + eps), the sum as sum_squares. With res (not
   NULL), h = x + res first, written to h (which may be x). Without res h is
   x itself (h may be NULL). */
void kq_rmsnorm(const float* x, const float* res, float* h, const float* w, float eps, int64_t M, int64_t K,
                float* y) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        const float* hr = xr;
        if (res) {
            float* hw = h + m * K;
            const float* rr = res + m * K;
            for (int64_t i = 0; i < K; i++) hw[i] = xr[i] + rr[i];
            hr = hw;
        }
        const float var = sum_squares(hr, K) / (float)K;
        const float r = 1.0f / sqrtf(var + eps);
        float* yr = y + m * K;
        for (int64_t i = 0; i < K; i++) {
            const float t = hr[i] * r;
            yr[i] = w[i] * t;
        }
    }
}

/* rotary embedding as transformers' apply_rotary_pos_emb (x·cos +
   rotate_half(x)·sin, the same products and sums): src holds B·T rows (row
   b·T + t at src + (b·T + t)·stride) of H heads of D; cos and sin are
   [B][T][D]; out is [B][H][T][D] */
static void rope_rows(const float* src, int64_t stride, int64_t B, int64_t T, int64_t H, int64_t D,
                      const float* cos, const float* sin, int64_t csb, float* out);

void kq_rope(const float* src, int64_t stride, int64_t B, int64_t T, int64_t H, int64_t D, const float* cos,
             const float* sin, float* out) {
    rope_rows(src, stride, B, T, H, D, cos, sin, T * D, out);
}

/* kq_rope with cos and sin [B][T][D] at a batch stride of csb floats (0:
   one [T][D] for every batch row) */
static void rope_rows(const float* src, int64_t stride, int64_t B, int64_t T, int64_t H, int64_t D,
                      const float* cos, const float* sin, int64_t csb, float* out) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float* row = src + (b * T + t) * stride;
            const float* c = cos + b * csb + t * D;
            const float* s = sin + b * csb + t * D;
            for (int64_t hh = 0; hh < H; hh++) {
                const float* x = row + hh * D;
                float* o = out + ((b * H + hh) * T + t) * D;
                for (int64_t d = 0; d < half; d++) {
                    const float a = x[d] * c[d], p = x[d + half] * s[d];
                    o[d] = a - p;
                }
                for (int64_t d = half; d < D; d++) {
                    const float a = x[d] * c[d], p = x[d - half] * s[d];
                    o[d] = a + p;
                }
            }
        }
}

/* src rows (stride apart) of H heads of D to [B][H][T][D] */
void kq_heads(const float* src, int64_t stride, int64_t B, int64_t T, int64_t H, int64_t D, float* out) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t hh = 0; hh < H; hh++)
                memcpy(out + ((b * H + hh) * T + t) * D, src + (b * T + t) * stride + hh * D, (size_t)D * 4);
}

/* 16 float32 lanes: one 512-bit register on the AVX-512 build, two 256-bit
   ones on the AVX2 build, with the same per-lane operations (FMA included)
   on both, so both give the same bits */
#ifdef KQ_AVX512
typedef __m512 l16;
static inline l16 l_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void l_store(float* p, l16 v) { _mm512_storeu_ps(p, v); }
static inline l16 l_set1(float x) { return _mm512_set1_ps(x); }
static inline l16 l_add(l16 a, l16 b) { return _mm512_add_ps(a, b); }
static inline l16 l_sub(l16 a, l16 b) { return _mm512_sub_ps(a, b); }
static inline l16 l_mul(l16 a, l16 b) { return _mm512_mul_ps(a, b); }
static inline l16 l_max(l16 a, l16 b) { return _mm512_max_ps(a, b); }
static inline l16 l_fma(l16 a, l16 b, l16 c) { return _mm512_fmadd_ps(a, b, c); }
/* 2^n for integral n in [-126, 127] */
static inline l16 l_pow2(l16 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
static inline __m256 l_half_sum(l16 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#else
typedef struct { __m256 lo, hi; } l16;
static inline l16 l_load(const float* p) { l16 r = { _mm256_loadu_ps(p), _mm256_loadu_ps(p + 8) }; return r; }
static inline void l_store(float* p, l16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline l16 l_set1(float x) { l16 r = { _mm256_set1_ps(x), _mm256_set1_ps(x) }; return r; }
static inline l16 l_add(l16 a, l16 b) { l16 r = { _mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi) }; return r; }
static inline l16 l_sub(l16 a, l16 b) { l16 r = { _mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi) }; return r; }
static inline l16 l_mul(l16 a, l16 b) { l16 r = { _mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi) }; return r; }
static inline l16 l_max(l16 a, l16 b) { l16 r = { _mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi) }; return r; }
static inline l16 l_fma(l16 a, l16 b, l16 c) {
    l16 r = { _mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi) };
    return r;
}
static inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline l16 l_pow2(l16 n) { l16 r = { pow2_8(n.lo), pow2_8(n.hi) }; return r; }
static inline __m256 l_half_sum(l16 a) { return _mm256_add_ps(a.lo, a.hi); }
#endif

/* lane l += lane l + w for w = 8, 4, 2, 1 (the order of sum_squares) */
static inline float l_tree(l16 a) {
    const __m256 s8 = l_half_sum(a);  /* lane l: a[l] + a[l + 8] */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

/* e^x per lane for x <= 0 (Cephes' expf: x = n·ln 2 + r with n = x·log2 e
   rounded to nearest even, a degree-6 polynomial in r, times 2^n), about 1
   ulp; below -87, e^-87. Lanes of x > 0 give garbage (masked by the caller). */
static inline l16 l_exp(l16 x) {
    const l16 xc = l_max(x, l_set1(-87.0f));
    const l16 t = l_mul(xc, l_set1(1.44269504088896341f));
    const l16 n = l_sub(l_add(t, l_set1(12582912.0f)), l_set1(12582912.0f));  /* round to nearest even */
    l16 r = l_sub(xc, l_mul(n, l_set1(0.693359375f)));
    r = l_sub(r, l_mul(n, l_set1(-2.12194440e-4f)));
    const l16 z = l_mul(r, r);
    l16 p = l_set1(1.9875691500e-4f);
    p = l_add(l_mul(p, r), l_set1(1.3981999507e-3f));
    p = l_add(l_mul(p, r), l_set1(8.3334519073e-3f));
    p = l_add(l_mul(p, r), l_set1(4.1665795894e-2f));
    p = l_add(l_mul(p, r), l_set1(1.6666665459e-1f));
    p = l_add(l_mul(p, r), l_set1(5.0000001201e-1f));
    p = l_add(l_add(l_mul(p, z), r), l_set1(1.0f));
    return l_mul(p, l_pow2(n));
}

#define MAX_D 256
typedef struct {
    const float *q, *k, *v;
    int64_t H, T, D, ksb, ksh, kss, vsb, vsh, vss, Hkv, S;
    const uint8_t* mask;
    int64_t msb, mst, mss;
    int causal;
    float scale;
    float* out;
    atomic_int failed;
} attn_t;

/* units [lo, hi) of an attention: unit u is batch row u / Hkv, KV head u %
   Hkv; C = D / 16 (a constant for the usual head size) */
static inline __attribute__((always_inline)) void attn_body(attn_t* a, int64_t lo, int64_t hi, const int64_t C) {
    const int64_t H = a->H, T = a->T, D = a->D, S = a->S, Hkv = a->Hkv;
    const int64_t rep = H / Hkv, R = rep * T;  /* query rows per KV head: row r·T + t is (head r, token t) */
    const int64_t SP = (S + 15) / 16 * 16;
    float* sc = (float*)aligned_alloc(64, (size_t)((R * SP * 4 + 63) / 64 * 64));
    float* den = (float*)malloc((size_t)R * 4);
    uint8_t* use = (uint8_t*)malloc((size_t)(T * SP));
    if (!sc || !den || !use) {
        free(sc); free(den); free(use);
        atomic_store(&a->failed, 1);
        return;
    }
    for (int64_t unit = lo; unit < hi; unit++) {
        const int64_t b = unit / Hkv, g = unit % Hkv;
        for (int64_t t = 0; t < T; t++) {
            uint8_t* u = use + t * SP;
            for (int64_t s = 0; s < S; s++)
                u[s] = a->mask ? (a->mask[b * a->msb + t * a->mst + s * a->mss] != 0)
                               : (uint8_t)(!a->causal || s <= S - T + t);
            for (int64_t s = S; s < SP; s++) u[s] = 0;
        }
        const float* kb = a->k + b * a->ksb + g * a->ksh;
        const float* vb = a->v + b * a->vsb + g * a->vsh;
        const float* qg = a->q + (b * H + g * rep) * T * D;  /* the group's R rows, contiguous */
        /* scores: each key row once for every query row of the group */
        for (int64_t s = 0; s < S; s++) {
            l16 kk[MAX_D / 16];
            for (int64_t c = 0; c < C; c++) kk[c] = l_load(kb + s * a->kss + 16 * c);
            for (int64_t i = 0; i < R; i++) {
                const float* qr = qg + i * D;
                l16 d = l_set1(0.0f);
                for (int64_t c = 0; c < C; c++) d = l_fma(l_load(qr + 16 * c), kk[c], d);
                sc[i * SP + s] = l_tree(d) * a->scale;
            }
        }
        for (int64_t i = 0; i < R; i++) {
            float* row = sc + i * SP;
            const uint8_t* u = use + (i % T) * SP;
            for (int64_t s = S; s < SP; s++) row[s] = 0.0f;
            float mx = -INFINITY;
            for (int64_t s = 0; s < S; s++)
                if (u[s] && row[s] > mx) mx = row[s];
            if (mx == -INFINITY) mx = 0.0f;
            const l16 m16 = l_set1(mx);
            for (int64_t s = 0; s < SP; s += 16) l_store(row + s, l_exp(l_sub(l_load(row + s), m16)));
            for (int64_t s = 0; s < SP; s++) row[s] = u[s] ? row[s] : 0.0f;
        }
        /* weighted sums of the values, in key order: each row's sums in registers */
        for (int64_t i = 0; i < R; i++) {
            l16 ac[MAX_D / 16];
            for (int64_t c = 0; c < C; c++) ac[c] = l_set1(0.0f);
            float dn = 0.0f;
            const float* pr = sc + i * SP;
            for (int64_t s = 0; s < S; s++) {
                const float p = pr[s];
                const l16 pp = l_set1(p);
                const float* vs = vb + s * a->vss;
                for (int64_t c = 0; c < C; c++) ac[c] = l_fma(pp, l_load(vs + 16 * c), ac[c]);
                dn = dn + p;
            }
            const int64_t r = i / T, t = i % T;
            float* o = a->out + ((b * T + t) * H + g * rep + r) * D;
            if (dn > 0.0f) {
                const l16 dd = l_set1(dn);
#ifdef KQ_AVX512
                for (int64_t c = 0; c < C; c++) l_store(o + 16 * c, _mm512_div_ps(ac[c], dd));
#else
                for (int64_t c = 0; c < C; c++) {
                    l16 q16 = { _mm256_div_ps(ac[c].lo, dd.lo), _mm256_div_ps(ac[c].hi, dd.hi) };
                    l_store(o + 16 * c, q16);
                }
#endif
            } else {
                memset(o, 0, (size_t)D * 4);
            }
        }
    }
    free(sc); free(den); free(use);
}

static void attn_units(const void* ctx, int64_t lo, int64_t hi) {
    attn_t* a = (attn_t*)ctx;
    if (a->D == 128) attn_body(a, lo, hi, 8);
    else attn_body(a, lo, hi, a->D / 16);
}

/* Attention of each query row over the keys its mask allows, every row on
   its own (the same operations whatever the other rows, the batch, the
   keys it does not attend or the thread):
     score_s = (q · k_s) · scale          (16 lanes of FMAs over D, then tree16)
     p_s = e^(score_s − max score)        (exp16; 0 where masked)
     out = (Σ_s p_s · v_s) / (Σ_s p_s)    (both sums over s in order, FMAs for the first)
   A masked key adds exact zeros, so left padding or a longer cache leaves
   a row's bits unchanged. q is [B][H][T][D]; keys and values are strided
   [B][Hkv][S][D] (strides in floats: batch, head, position; unit along D);
   query head h reads KV head h / (H / Hkv). mask: NULL (causal when
   causal != 0: row t attends s <= S − T + t; else every key), or bytes
   (nonzero: attend) at mask + b·msb + t·mst + s·mss. out is [B][T][H][D];
   a row that attends nothing gets zeros. The (batch row, KV head) units
   are split over the kernel's threads. D must be a multiple of 16 (at most
   MAX_D). Returns 0; 1 when scratch cannot be allocated; 2 for a shape it
   does not take. */
int kq_attention(const float* q, int64_t B, int64_t H, int64_t T, int64_t D,
                 const float* k, int64_t ksb, int64_t ksh, int64_t kss,
                 const float* v, int64_t vsb, int64_t vsh, int64_t vss, int64_t Hkv, int64_t S,
                 const uint8_t* mask, int64_t msb, int64_t mst, int64_t mss, int causal, float scale, float* out) {
    if (D % 16 || D > MAX_D || Hkv < 1 || H % Hkv) return 2;
    if (!started) kq_set_threads(1);
    attn_t a = { q, k, v, H, T, D, ksb, ksh, kss, vsb, vsh, vss, Hkv, S, mask, msb, mst, mss, causal, scale, out, 0 };
    job_t j;
    memset(&j, 0, sizeof j);
    j.task = attn_units;
    j.ctx = &a;
    j.units = B * Hkv;
    dispatch(&j);
    return atomic_load(&a.failed) ? 1 : 0;
}

/* ------------------------------------------------- a decoder layer in two calls
   fastlayers.py's fast_forward as two C calls per layer around the KV
   cache's update (which stays in Python): kq_layer_pre (input RMSNorm, the
   q/k/v kernel passes, rotary embedding and the heads) and kq_layer_post
   (attention, o_proj, the residual add and the post-attention RMSNorm, the
   gate/up passes, SiLU(gate)·up, down_proj and the last residual add). Each
   step is the very routine fast_forward calls for it (kq_rmsnorm,
   kq_linear / kq_linear_a8, kq_rope, kq_heads, kq_attention), on the same
   inputs, so the bits are fast_forward's; SiLU·up is torch's float32
   arithmetic (see silu_mul). The layer's constants (weights, kinds, sizes)
   are one kq_layer_t, filled once at install time. */

typedef struct {
    int64_t kind, a8, K, N;
    const uint8_t* w;
    const float* bias;
} kq_lin_t;

typedef struct {
    int64_t hidden, H, Hkv, D, inter;
    const float* ln1;
    const float* ln2;
    float eps1, eps2, scale, unused;
    int64_t nqkv;                     /* kernel passes for q, k, v (1 to 3) */
    kq_lin_t qkv[3];
    int64_t qkv_call[3], qkv_off[3];  /* q, k, v: the pass and the first column of its output */
    kq_lin_t o;
    int64_t ngu;                      /* kernel passes for gate, up (1 or 2) */
    kq_lin_t gu[2];
    int64_t gu_call[2], gu_off[2];
    kq_lin_t down;
} kq_layer_t;

static int lin_run(const kq_lin_t* l, const float* x, int64_t M, float* y) {
    return l->a8 ? kq_linear_a8((int)l->kind, x, M, l->K, l->w, l->bias, y, l->N)
                 : kq_linear((int)l->kind, x, M, l->K, l->w, l->bias, y, l->N);
}

/* SLEEF's expf (xexpf, 1-ulp, FMA build), the exp of torch's Vectorized<float>
   (Sleef_expf16_u10 / Sleef_expf8_u10): q = rint(x·log2 e), s = x − q·ln 2 in
   two FMAs, a degree-5 polynomial by FMAs, 1 + s + s²·u, times 2^(q>>1) and
   2^(q − q>>1); 0 below −104, +inf above 100 */
#define SL_R_LN2 1.442695040888963407359924681001892137426645954152985934135449406931f
#define SL_L2U 0.693145751953125f
#define SL_L2L 1.428606765330187045e-06f
#ifdef KQ_AVX512
static inline __m512 sleef_expf(__m512 d) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(SL_R_LN2)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-SL_L2U), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-SL_L2L), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    const __m512i q1 = _mm512_srai_epi32(q, 1), q2 = _mm512_sub_epi32(q, q1);
    const __m512 p1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, _mm512_set1_epi32(0x7f)), 23));
    const __m512 p2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, _mm512_set1_epi32(0x7f)), 23));
    u = _mm512_mul_ps(_mm512_mul_ps(u, p1), p2);
    u = _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u);
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), _mm512_set1_ps(INFINITY));
    return u;
}

/* torch's silu(g) (g / (1 + exp(−g)), Vectorized) then .mul_(u), 16 lanes */
static inline void silu_mul16(const float* g, const float* u, float* o) {
    const __m512 x = _mm512_loadu_ps(g);
    const __m512 e = sleef_expf(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
    const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(o, _mm512_mul_ps(s, _mm512_loadu_ps(u)));
}
#else
static inline __m256 sleef_expf(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(SL_R_LN2)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-SL_L2U), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-SL_L2L), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    const __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, _mm256_set1_epi32(0x7f)), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, _mm256_set1_epi32(0x7f)), 23));
    u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    u = _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
    return u;
}

static inline void silu_mul8(const float* g, const float* u, float* o) {
    const __m256 x = _mm256_loadu_ps(g);
    const __m256 e = sleef_expf(_mm256_xor_ps(x, _mm256_set1_ps(-0.0f)));
    const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(o, _mm256_mul_ps(s, _mm256_loadu_ps(u)));
}

static inline void silu_mul16(const float* g, const float* u, float* o) {
    silu_mul8(g, u, o);
    silu_mul8(g + 8, u + 8, o + 8);
}
#endif

/* out[m][i] = silu(gate[m][i]) · up[m][i] for M rows of I (I a multiple of
   16; gate and up rows gs and us floats apart, out contiguous): torch's
   silu(gate).mul_(up) on float32 where it runs its vectorized loop (every
   element of a row whose length is a multiple of twice its vector width),
   bit for bit */
void kq_silu_mul(const float* gate, int64_t gs, const float* up, int64_t us, int64_t M, int64_t I, float* out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < I; i += 16) silu_mul16(gate + m * gs + i, up + m * us + i, out + m * I + i);
}

/* input RMSNorm, q/k/v, rotary embedding and heads of x [B][T][hidden]:
   qs [B][H][T][D], ks and vs [B][Hkv][T][D]; cos and sin [B][T][D] at batch
   stride csb (0: shared). Returns 0, or 1 if scratch cannot be allocated. */
int kq_layer_pre(const kq_layer_t* L, const float* x, int64_t B, int64_t T, const float* cos, const float* sin,
                 int64_t csb, float* qs, float* ks, float* vs) {
    const int64_t M = B * T, K = L->hidden;
    float* y = (float*)scratch(M * K * 4);
    float* outs[3] = { NULL, NULL, NULL };
    int rc = y ? 0 : 1;
    for (int64_t c = 0; c < L->nqkv && !rc; c++)
        if (!(outs[c] = (float*)scratch(M * L->qkv[c].N * 4))) rc = 1;
    if (!rc) {
        kq_rmsnorm(x, NULL, NULL, L->ln1, L->eps1, M, K, y);
        for (int64_t c = 0; c < L->nqkv && !rc; c++) rc = lin_run(&L->qkv[c], y, M, outs[c]);
    }
    if (!rc) {
        const int64_t heads[3] = { L->H, L->Hkv, L->Hkv };
        float* dst[3] = { qs, ks, vs };
        for (int p = 0; p < 3; p++) {
            const int64_t c = L->qkv_call[p], stride = L->qkv[c].N;
            const float* src = outs[c] + L->qkv_off[p];
            if (p < 2) rope_rows(src, stride, B, T, heads[p], L->D, cos, sin, csb, dst[p]);
            else kq_heads(src, stride, B, T, heads[p], L->D, dst[p]);
        }
    }
    free(y);
    for (int c = 0; c < 3; c++) free(outs[c]);
    return rc;
}

/* the rest of the layer from qs (kq_layer_pre's) and the cache's keys and
   values (strided [B][Hkv][S][D], as kq_attention; mask as kq_attention's,
   causal when NULL): h [B][T][hidden] = the layer's output for x. Returns 0;
   1 if scratch cannot be allocated; 2 for an attention shape kq_attention
   does not take (h untouched). */
int kq_layer_post(const kq_layer_t* L, const float* x, int64_t B, int64_t T, const float* qs,
                  const float* k, int64_t ksb, int64_t ksh, int64_t kss,
                  const float* v, int64_t vsb, int64_t vsh, int64_t vss, int64_t S,
                  const uint8_t* mask, int64_t msb, int64_t mst, int64_t mss, float* h) {
    const int64_t M = B * T, K = L->hidden, I = L->inter;
    float* att = (float*)scratch(M * L->H * L->D * 4);
    float* o = (float*)scratch(M * K * 4);
    float* y = (float*)scratch(M * K * 4);
    float* act = (float*)scratch(M * I * 4);
    float* outs[2] = { NULL, NULL };
    int rc = (att && o && y && act) ? 0 : 1;
    for (int64_t c = 0; c < L->ngu && !rc; c++)
        if (!(outs[c] = (float*)scratch(M * L->gu[c].N * 4))) rc = 1;
    if (!rc)
        rc = kq_attention(qs, B, L->H, T, L->D, k, ksb, ksh, kss, v, vsb, vsh, vss, L->Hkv, S, mask, msb, mst, mss,
                          1, L->scale, att);
    if (!rc) rc = lin_run(&L->o, att, M, o);
    if (!rc) {
        kq_rmsnorm(x, o, h, L->ln2, L->eps2, M, K, y);
        for (int64_t c = 0; c < L->ngu && !rc; c++) rc = lin_run(&L->gu[c], y, M, outs[c]);
    }
    if (!rc) {
        const int64_t cg = L->gu_call[0], cu = L->gu_call[1];
        kq_silu_mul(outs[cg] + L->gu_off[0], L->gu[cg].N, outs[cu] + L->gu_off[1], L->gu[cu].N, M, I, act);
        rc = lin_run(&L->down, act, M, o);  /* o is free again: down_proj's output */
    }
    if (!rc)
        for (int64_t i = 0; i < M * K; i++) h[i] = h[i] + o[i];
    free(att); free(o); free(y); free(act);
    for (int c = 0; c < 2; c++) free(outs[c]);
    return rc;
}

/* One session's pass (B = 1) through nl layers in one call (fast_stack.py):
   per layer kq_layer_pre, its new keys and values copied into the layer's
   cache buffer at rows past .. past + T − 1 (kb[l], vb[l]: [Hkv][cap[l]][D]
   floats, rows below past the cache's tokens), then kq_layer_post over rows
   0 .. past + T − 1, causal: the routines of the two-call path on the same
   inputs, so the same bits. x [T][hidden] is the input and is overwritten;
   the output is in x when nl is even, else in h. qs, ks, vs: scratch of
   [H][T][D], [Hkv][T][D] and [Hkv][T][D] floats. Returns 0, or the first
   failing call's code (1: scratch allocation; 2: an attention shape
   kq_attention does not take); rows past past + T − 1 of a buffer are
   written by the layers that ran, nothing below past. */
int kq_stack(const kq_layer_t* const* L, int64_t nl, float* x, float* h, int64_t T, const float* cos,
             const float* sin, float* qs, float* ks, float* vs, float* const* kb, float* const* vb,
             const int64_t* cap, int64_t past) {
    for (int64_t l = 0; l < nl; l++) {
        const kq_layer_t* P = L[l];
        int rc = kq_layer_pre(P, x, 1, T, cos, sin, 0, qs, ks, vs);
        if (rc) return rc;
        const int64_t D = P->D, hs = cap[l] * D;
        for (int64_t g = 0; g < P->Hkv; g++) {
            memcpy(kb[l] + g * hs + past * D, ks + g * T * D, (size_t)(T * D) * sizeof(float));
            memcpy(vb[l] + g * hs + past * D, vs + g * T * D, (size_t)(T * D) * sizeof(float));
        }
        rc = kq_layer_post(P, x, 1, T, qs, kb[l], P->Hkv * hs, hs, D, vb[l], P->Hkv * hs, hs, D, past + T,
                           NULL, 0, 0, 0, h);
        if (rc) return rc;
        float* t = x;
        x = h;
        h = t;
    }
    return 0;
}
