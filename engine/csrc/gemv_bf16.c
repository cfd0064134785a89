/* y = x W^T with bf16 weights and fp32 rows x: half the bytes of gemv.c's read per step.
 *
 * A decode step on a CPU is bound by reading the weights; bf16 halves them (538 MB -> 269 MB
 * a step for the bundled model). Two inner loops, one tiling (gemv.c's: each weight row read
 * from memory once for all B rows, R rows x X rows of x per tile, the next rows prefetched):
 * - AVX512-BF16 (`vdpbf16ps`, Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and 5):
 *   x is rounded to bf16 once per call (round to nearest even), and each instruction adds 16
 *   lanes of two exact bf16 x bf16 products into fp32 accumulators: 32 multiply-adds;
 * - elsewhere (AVX-512F, AVX2, NEON, plain C): each bf16 weight widened to fp32 (exact: a
 *   16-bit shift) and multiplied with x in fp32: the same bytes read, more instructions.
 * k's tail (k mod 32 or 16) is summed in fp32 from the unrounded x. Every output's order of
 * summation is fixed by k alone, so a row of a batch gets the bits it gets alone.
 */
#include "kvchat.h"
#include "vec.h"

#if !defined(KVCHAT_PORTABLE) && defined(__AVX512BF16__)
#define DPBF16 1
#define STEP 32         /* k per instruction: 16 lanes of bf16 pairs */
#else
#define DPBF16 0
#define STEP LANES
#endif
#define SMALL 32768    /* the tile shapes: vec.h */
/* Where the next weight rows are fetched (`far`): into L2, as gemv.c's, for a batch of one or
 * two rows of x, and of more where the bf16 pairs multiply as they are (or widen in 16 lanes);
 * into L1 for batches of 3 or more widened in 8 lanes (AVX2). The bundled model's products on
 * 2 Zen 4 cores, weights from memory, ms a step (two builds taking turns in one process), L1 -> L2:
 *   vdpbf16ps:       1 row 14.4-14.5 -> 9.9-11.6; 8 rows 21.7 -> 14.4
 *   widened, AVX2:   1 row 16.6 -> 8.5; 2 rows 19.1 -> 13.0; 8 rows 27.3-27.6 -> 31.6-32.3
 *   widened, AVX-512F: 1 row 15.8 -> 11.7; 8 rows 47.6-48.1 either way */
#define MANY_L2 (DPBF16 || VLANES == 16)


#if DPBF16
#define PARTS 1         /* one __m512 accumulator of 16 lanes */
typedef __m512 acc_t;
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(const acc_t *a) { f16v v; memcpy(&v, a, sizeof v); return hsum(v); }
#else
#define PARTS SUBS      /* 16 lanes as SUBS accumulators of the machine's width (vec.h) */
typedef fnv acc_t;
static inline acc_t acc_zero(void) { return (fnv){0}; }
static inline float acc_sum(const acc_t *a) { return hsum_subs(a); }
#endif

/* R weight rows (w, stride k) against X rows of x (stride k; xb: the same rows in bf16 for
 * the DPBF16 loop, stride k) into y (stride n). */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *xb, const uint16_t *w,
                                                       float *y, int64_t n, int64_t k, const int R, const int X,
                                                       const uint16_t *next, const int p0, const int p1,
                                                       const int far) {
    const int64_t kv = k / STEP * STEP;
    acc_t acc[XS_MANY][TILE_ROWS][PARTS];
    for (int b = 0; b < X; b++)
        for (int r = 0; r < R; r++)
            for (int s = 0; s < PARTS; s++) acc[b][r][s] = acc_zero();
    for (int64_t j = 0; j < kv; j += STEP) {
        if (next != NULL && far)
            for (int r = p0; r < p1; r++) __builtin_prefetch(next + r * k + j, 0, 2);
        else if (next != NULL)
            for (int r = p0; r < p1; r++) __builtin_prefetch(next + r * k + j, 0, 3);
#if DPBF16
        __m512bh wv[TILE_ROWS];
        for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * k + j);
        for (int b = 0; b < X; b++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + b * k + j);
            for (int r = 0; r < R; r++) acc[b][r][0] = _mm512_dpbf16_ps(acc[b][r][0], wv[r], xv);
        }
#else
        (void)xb;
        for (int s = 0; s < SUBS; s++) {
            fnv wv[TILE_ROWS];
            for (int r = 0; r < R; r++) wv[r] = widen_bf16(w + r * k + j + s * VLANES);
            for (int b = 0; b < X; b++) {
                const fnv xv = loadn(x + b * k + j + s * VLANES);
                for (int r = 0; r < R; r++) acc[b][r][s] += wv[r] * xv;
            }
        }
#endif
    }
    for (int b = 0; b < X; b++)
        for (int r = 0; r < R; r++) {
            float s = acc_sum(acc[b][r]);
            for (int64_t j = kv; j < k; j++) s += bf16_float(w[r * k + j]) * x[b * k + j];
            y[b * n + r] = s;
        }
}

/* as gemv.c's column(): the next rows fetched a share per tile, so memory streams while the
 * tiles compute (bf16 weights widened on the AVX2 EPYC, 8 rows of x against lm_head: every
 * tile fetching all of them took 4.8 ms, only the first 5.1 ms) */
static inline __attribute__((always_inline)) void column(const float *x, const uint16_t *xb, const uint16_t *w,
                                                         float *y, int64_t b, int64_t n, int64_t k, const int R,
                                                         const uint16_t *next) {
    const int T = (int)((b + XS_MANY - 1) / XS_MANY), far = b <= 2 || MANY_L2;
    int64_t x0 = 0;
    int t = 0;
    for (; x0 + XS_MANY <= b; x0 += XS_MANY, t++)
        tile(x + x0 * k, xb + x0 * k, w, y + x0 * n, n, k, R, XS_MANY, next, t * R / T, (t + 1) * R / T, far);
    const int p0 = t * R / T, p1 = (t + 1) * R / T;
    switch (b - x0) {
#if XS_MANY > 3
    case 3: tile(x + x0 * k, xb + x0 * k, w, y + x0 * n, n, k, R, 3, next, p0, p1, far); break;
#endif
#if XS_MANY > 2
    case 2: tile(x + x0 * k, xb + x0 * k, w, y + x0 * n, n, k, R, 2, next, p0, p1, far); break;
#endif
    case 1: tile(x + x0 * k, xb + x0 * k, w, y + x0 * n, n, k, R, 1, next, p0, p1, far); break;
    default: break;
    }
}

/* x: (b, k) fp32; w: (n, k) bf16 bits; y: (b, n) fp32; all contiguous. 0, or -1 when the
 * scratch for x in bf16 could not be had (nothing written). */
int kv_gemv_bf16(const float *x, const uint16_t *w, float *y, int64_t b, int64_t n, int64_t k, int threads) {
    if (kv_gemv_amx(x, w, y, b, n, k, threads) == 0)   /* AMX tiles where the CPU and the shape allow */
        return 0;
    uint16_t *xb = NULL;
#if DPBF16
    const int64_t kv = k / STEP * STEP;
    xb = malloc((size_t)(b * k) * sizeof *xb + 64);
    if (xb == NULL) return -1;
    for (int64_t i = 0; i < b; i++)
        for (int64_t j = 0; j < kv; j += STEP) {
            __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i * k + j + 16), _mm512_loadu_ps(x + i * k + j));
            _mm512_storeu_si512(xb + i * k + j, (__m512i)v);
        }
#else
    xb = (uint16_t *)(uintptr_t)x;   /* never read: the widening loop reads x itself */
#endif
    const int64_t rows = b == 1 ? ROWS_ONE : b == 2 ? ROWS_TWO : ROWS_MANY, groups = n / rows;
    #pragma omp parallel num_threads(threads) if (b * n * k >= SMALL)
    {
        #pragma omp for schedule(static) nowait
        for (int64_t gi = 0; gi < groups; gi++) {
            if (b == 1)
                tile(x, xb, w + gi * rows * k, y + gi * rows, n, k, ROWS_ONE, 1,
                     gi + 1 < groups ? w + (gi + 1) * rows * k : NULL, 0, ROWS_ONE, 1);
            else if (b == 2)
                column(x, xb, w + gi * rows * k, y + gi * rows, b, n, k, ROWS_TWO,
                       gi + 1 < groups ? w + (gi + 1) * rows * k : NULL);
            else
                column(x, xb, w + gi * rows * k, y + gi * rows, b, n, k, ROWS_MANY,
                       gi + 1 < groups ? w + (gi + 1) * rows * k : NULL);
        }
        #pragma omp for schedule(static)
        for (int64_t r = groups * rows; r < n; r++) column(x, xb, w + r * k, y + r, b, n, k, 1, NULL);
    }
#if DPBF16
    free(xb);
#endif
    return 0;
}

/* 1 when this build multiplies with vdpbf16ps (x rounded to bf16, and an fp8 cache's scores in
 * decode.c: the queries rounded), 0 when it widens. */
int kv_bf16_native(void) { return DPBF16; }
