/* y = x W^T for a few rows of x: the products of a decode step (the norms: step.c).
 *
 * A decode step of B sequences multiplies B rows by every weight matrix. On a CPU that is
 * bound by reading the weights (538 MB a step for the bundled model in fp32), so each weight
 * row is read from memory once for all B rows: a thread takes R weight rows at a time and
 * runs every tile of X rows of x against them while they sit in L1. One row (B = 1) reads
 * ROWS_ONE weight rows per pass with x held in L1: torch's one-row product (MKL) streamed the
 * weights at about 21 GB/s on 2 cores where this streams 30+. The tile shapes per build, and
 * why the tile is written in the machine's vector width: vec.h.
 *
 * Every output y[b, i] is summed in the same order whatever the tile: sixteen lanes over k
 * (the accumulation that tile() writes once), their pairwise sum, then k's tail. So a row of
 * a batch gets the bits it gets alone, and a conversation decodes the same tokens batched or
 * not. A bf16 weight path (AVX512-BF16's vdpbf16ps) replaces tile()'s loop body: weight rows
 * of bf16 pairs against x converted to bf16 once per call; the tiling and threads stay.
 */
#include "kvchat.h"
#include "vec.h"

#define SMALL 32768     /* multiply-adds below which one thread computes */

/* R weight rows (at w, stride k) against X rows of x (stride k) into y (stride n). Inlined with
 * R and X constant: the accumulators stay in registers. Lane l of an output's 16 lanes is lane
 * l % VLANES of its accumulator l / VLANES, so the sums are the same on every width. `next`, when not
 * NULL, is the next R rows a thread will read: fetched into L2 meanwhile (see column()). Into L1
 * (prefetcht0), 8 rows of x against lm_head took 9.7-10.0 ms on one Xeon core, into L2 9.0-9.1,
 * and 4.78-4.86 ms on two against 5.0-5.15. One core's weights alone stream at 15 GB/s (one
 * row of x: 7.6 ms), so at 8 rows the products' compute still adds to the read. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, int64_t n,
                                                       int64_t k, const int R, const int X, const float *next,
                                                       const int p0, const int p1) {
    const int64_t kv = k / LANES * LANES;
    fnv acc[F32_XS][TILE_ROWS][SUBS];
    for (int b = 0; b < X; b++)
        for (int r = 0; r < R; r++)
            for (int s = 0; s < SUBS; s++) acc[b][r][s] = (fnv){0};
    for (int64_t j = 0; j < kv; j += LANES) {
        if (next != NULL)
            for (int r = p0; r < p1; r++) __builtin_prefetch(next + r * k + j, 0, 2);
        for (int s = 0; s < SUBS; s++) {
            fnv wv[TILE_ROWS];
            for (int r = 0; r < R; r++) wv[r] = loadn(w + r * k + j + s * VLANES);
            for (int b = 0; b < X; b++) {
                const fnv xv = loadn(x + b * k + j + s * VLANES);
                for (int r = 0; r < R; r++) acc[b][r][s] += wv[r] * xv;
            }
        }
    }
#if VLANES == 16
    if (X * R <= VLANES) {      /* every output's lanes summed at once: one transpose, not X R hsums */
        fnv all[VLANES];
        for (int i = 0; i < VLANES; i++) all[i] = i < X * R ? acc[i / R][i % R][0] : (fnv){0};
        float sums[VLANES];
        const fnv t = transpose_sum(all);
        memcpy(sums, &t, sizeof t);
        for (int b = 0; b < X; b++)
            for (int r = 0; r < R; r++) {
                float s = sums[b * R + r];
                for (int64_t j = kv; j < k; j++) s += w[r * k + j] * x[b * k + j];
                y[b * n + r] = s;
            }
        return;
    }
#endif
    for (int b = 0; b < X; b++)
        for (int r = 0; r < R; r++) {
            float s = hsum_subs(acc[b][r]);
            for (int64_t j = kv; j < k; j++) s += w[r * k + j] * x[b * k + j];
            y[b * n + r] = s;
        }
}

/* every row of x (b of them) against the R weight rows at w, F32_XS rows at a time. The
 * first tile reads the rows from memory (or from where the tiles before fetched them) and the
 * others find them in L1. So that memory streams all the while they compute, the next R rows
 * (`next`) are fetched a share per tile: tile t of T fetches rows [t R / T, (t+1) R / T). When
 * each tile fetched all R (the lines already on their way merge), the first tile's fetches
 * filled the core's line buffers and waited for memory, and the other tiles computed with
 * memory idle: compute and memory time added up (B = 8 of 256 tokens: a step 1.73x B = 1's). */
static inline __attribute__((always_inline)) void column(const float *x, const float *w, float *y, int64_t b,
                                                         int64_t n, int64_t k, const int R, const float *next) {
    const int T = (int)((b + F32_XS - 1) / F32_XS);
    int64_t x0 = 0;
    int t = 0;
    for (; x0 + F32_XS <= b; x0 += F32_XS, t++)
        tile(x + x0 * k, w, y + x0 * n, n, k, R, F32_XS, next, t * R / T, (t + 1) * R / T);
    const int p0 = t * R / T, p1 = (t + 1) * R / T;
    switch (b - x0) {   /* the last rows: one tile of what is left */
#if F32_XS > 4
    case 7: tile(x + x0 * k, w, y + x0 * n, n, k, R, 7, next, p0, p1); break;
    case 6: tile(x + x0 * k, w, y + x0 * n, n, k, R, 6, next, p0, p1); break;
    case 5: tile(x + x0 * k, w, y + x0 * n, n, k, R, 5, next, p0, p1); break;
    case 4: tile(x + x0 * k, w, y + x0 * n, n, k, R, 4, next, p0, p1); break;
#endif
#if F32_XS > 3
    case 3: tile(x + x0 * k, w, y + x0 * n, n, k, R, 3, next, p0, p1); break;
#endif
#if F32_XS > 2
    case 2: tile(x + x0 * k, w, y + x0 * n, n, k, R, 2, next, p0, p1); break;
#endif
    case 1: tile(x + x0 * k, w, y + x0 * n, n, k, R, 1, next, p0, p1); break;
    default: break;
    }
}

/* x: (b, k); w: (n, k); y: (b, n); all contiguous fp32. */
void kv_gemv(const float *x, const float *w, float *y, int64_t b, int64_t n, int64_t k, int threads) {
    const int64_t rows = b == 1 ? ROWS_ONE : b == 2 ? ROWS_TWO : F32_ROWS, groups = n / rows;
    /* below SMALL, waking a second thread would cost more than it saves */
    #pragma omp parallel num_threads(threads) if (b * n * k >= SMALL)
    {
        #pragma omp for schedule(static) nowait
        for (int64_t gi = 0; gi < groups; gi++) {
            if (b == 1)   /* fetching the next rows into L2 meanwhile, as the tiles do: on 2 Zen 4 cores the
                             bundled model's products took 13.8 ms against 19.0 without (one process, taking turns) */
                tile(x, w + gi * rows * k, y + gi * rows, n, k, ROWS_ONE, 1,
                     gi + 1 < groups ? w + (gi + 1) * rows * k : NULL, 0, ROWS_ONE);
            else if (b == 2)
                column(x, w + gi * rows * k, y + gi * rows, b, n, k, ROWS_TWO,
                       gi + 1 < groups ? w + (gi + 1) * rows * k : NULL);
            else
                column(x, w + gi * rows * k, y + gi * rows, b, n, k, F32_ROWS,
                       gi + 1 < groups ? w + (gi + 1) * rows * k : NULL);
        }
        #pragma omp for schedule(static)
        for (int64_t r = groups * rows; r < n; r++) column(x, w + r * k, y + r, b, n, k, 1, NULL);
    }
}

/* rows of x per fp32 tile in this build (8: AVX-512; 2: AVX2, SSE, aarch64), so Python can tell how
 * far the C product beats MKL's GEMM here (engine/native.py: max_rows) */
int kv_gemv_tile(void) { return F32_XS; }

/* The read floor the products are measured against (kvchat/bench/floor.py's probe): the sum of
 * x's n floats, each thread one contiguous share, read a vector at a time into four
 * accumulators (nothing else to wait on). torch.sum over the same buffer read 28-30 GB/s on 2
 * Zen 4 cores where this read 46-51 (2 MiB pages): torch's reduction, not memory, was what
 * the probe measured, and the products outran the floor meant to bound them. */
double kv_read_sum(const float *x, int64_t n, int threads) {
    const int64_t step = 4 * LANES, blocks = n / step;
    double total = 0.0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int t = 0; t < threads; t++) {         /* one share a thread, without omp.h */
        const int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
        f16v a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t i = b0 * step; i < b1 * step; i += step) {
            a0 += load(x + i), a1 += load(x + i + LANES);
            a2 += load(x + i + 2 * LANES), a3 += load(x + i + 3 * LANES);
        }
        total += hsum(a0 + a1 + a2 + a3);
    }
    for (int64_t i = blocks * step; i < n; i++) total += x[i];
    return total;
}
