/* kvchat's two CPU kernels for a batch-1 decode step, called through ctypes (engine/native.py).
 *
 * - kv_gemv: y = W x for one row x, fp32. A decode step on the CPU is bound by reading its
 *   weights once; torch's one-row product (MKL) streamed them at about 21 GB/s on 2 cores
 *   where a plain sum streams 30+. Here each thread streams its own rows, eight at a time,
 *   with x held in L1.
 * - kv_decode: one query per head against one sequence's cached K/V, read through its block
 *   table in place (any block order, either pool layout), fp32 or fp8 e4m3 with one scale per
 *   (slot, KV head). Split-K: every (KV head, stretch of blocks) is a work item with its own
 *   running max, sum and output (online softmax, Milakov & Gimelshein 2018), merged at the end
 *   by log-sum-exp (flash-decoding, Dao et al. 2023). fp8 rows are dequantized in registers:
 *   no fp32 copy of the cache is ever written.
 *
 * Written with GCC/Clang vector extensions, so the same source compiles to AVX-512, AVX2 or
 * NEON with -march=native. Threads: OpenMP, with the count passed in by the caller (torch's),
 * and torch's own libgomp shared when it is already loaded (same soname).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef int8_t b16v __attribute__((vector_size(16)));

#define LANES 16
#define ROWS 8          /* weight rows per pass of kv_gemv */
#define TILE 16         /* cached rows per softmax update of kv_decode: one vector of scores */
#define MAX_GROUP 16    /* query heads per KV head */
#define MAX_DIM 256     /* head_dim */

static inline f16v load(const float *p) { f16v v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, f16v v) { memcpy(p, &v, sizeof v); }

static inline float hsum(f16v v) {
    f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* sixteen int8 sign-extended to int32. GCC 12 lowers __builtin_convertvector between these
 * widths one element at a time (seen in its assembly), so x86 takes the one instruction. */
static inline i16v widen(const int8_t *p) {
#if defined(__AVX512F__)
    return (i16v)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256i lo = _mm256_cvtepi8_epi32(b), hi = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    i16v out;
    memcpy(&out, &lo, 32);
    memcpy((char *)&out + 32, &hi, 32);
    return out;
#else
    b16v b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, i16v);
#endif
}

static inline f16v splat(float x) { return (f16v){0} + x; }

/* exp(x) for x <= 0, 16 at a time: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2,
 * e^r by its Taylor series to r^7 (error under 1e-8 relative), 2^n added to the exponent.
 * Below -87 the result is about 1e-38 instead of 0; kv_decode zeroes padding lanes itself. */
static inline f16v vexp(f16v x) {
    f16v t = x * 1.4426950408889634f;
    i16v low = t < -125.0f;
    t = (f16v)(((i16v)t & ~low) | ((i16v)splat(-125.0f) & low));
    i16v n = -__builtin_convertvector(0.5f - t, i16v);          /* round(t): 0.5 - t > 0 */
    f16v r = (t - __builtin_convertvector(n, f16v)) * 0.6931471805599453f;
    f16v p = splat(1.0f / 5040) * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return (f16v)((i16v)p + (n << 23));
}

/* ---- y = W x ------------------------------------------------------------------------------ */
void kv_gemv(const float *x, const float *w, float *y, int64_t n, int64_t k, int threads) {
    const int64_t kv = k / LANES * LANES, groups = n / ROWS;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static) nowait
        for (int64_t gi = 0; gi < groups; gi++) {
            const float *w0 = w + gi * ROWS * k;
            f16v acc[ROWS];
            for (int i = 0; i < ROWS; i++) acc[i] = (f16v){0};
            for (int64_t j = 0; j < kv; j += LANES) {
                f16v xv = load(x + j);
                for (int i = 0; i < ROWS; i++) acc[i] += load(w0 + i * k + j) * xv;
            }
            for (int i = 0; i < ROWS; i++) {
                float s = hsum(acc[i]);
                for (int64_t j = kv; j < k; j++) s += w0[i * k + j] * x[j];
                y[gi * ROWS + i] = s;
            }
        }
        #pragma omp for schedule(static)
        for (int64_t r = groups * ROWS; r < n; r++) {
            const float *wr = w + r * k;
            f16v acc = {0};
            for (int64_t j = 0; j < kv; j += LANES) acc += load(wr + j) * load(x + j);
            float s = hsum(acc);
            for (int64_t j = kv; j < k; j++) s += wr[j] * x[j];
            y[r] = s;
        }
    }
}

/* ---- y = x / sqrt(mean(x^2) + eps) * w, one row ------------------------------------------------ */
/* torch's CPU rms_norm is eight ops, about 27 us for one row of 576 (measured): 1.7 ms of a
 * decode step's 61 norms. Sums in another order than torch's: fp32 tolerance, not bits. */
void kv_rms_norm(const float *x, const float *w, float *y, int64_t k, float eps) {
    const int64_t kv = k / LANES * LANES;
    f16v acc = {0};
    for (int64_t j = 0; j < kv; j += LANES) {
        f16v v = load(x + j);
        acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t j = kv; j < k; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)k + eps);
    for (int64_t j = 0; j < k; j++) y[j] = x[j] * r * w[j];
}

/* ---- decode attention over the paged cache ------------------------------------------------- */
typedef struct {
    const void *k, *v;            /* the layer's K and V storage: float32 or e4m3 bytes */
    const float *ks, *vs;         /* fp8: one scale per (slot, KV head); NULL for fp32 */
    const int32_t *table;         /* the sequence's block ids */
    int64_t block_stride, row_stride, head_stride;            /* in elements, for k and v */
    int64_t sblock_stride, srow_stride, shead_stride;         /* in elements, for ks and vs */
    int64_t length, block_size, kv_heads, group, dim;
    float scale;
} DecodeArgs;

/* rows of e4m3 bytes into fp32, unscaled: each byte's sign placed at bit 31 and its exponent
 * and mantissa at bits 20-26 of a float32 give the value times 2^-120, exactly (see
 * engine/cpu_attention.py); times 2^120, also exact, gives the value, so that the products
 * with the queries are ordinary floats rather than subnormals. */
static inline void fp8_rows(const int8_t *src, int64_t stride, int rows, int64_t dim, float *dst) {
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < dim; c += LANES) {
            i16v bits = (widen(src + r * stride + c) << 20) & (int32_t)0x87F00000u;
            store(dst + r * dim + c, (f16v)bits * 0x1p120f);
        }
}

/* sixteen vectors in, one out: lane r holds the sum of d[r]'s lanes (a transpose-and-add) */
#define PAIR(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
static inline f16v hsum16(const f16v *d) {
    f16v x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = PAIR(d[2 * i], d[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PAIR(d[2 * i], d[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        y[i] = PAIR(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               PAIR(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = PAIR(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               PAIR(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PAIR(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           PAIR(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* one work item: KV head h over blocks [b0, b1); leaves the running max m, sum l and the
 * unnormalised output acc (G x dim) of each of the head's G queries. Inlined with G and NV
 * (head_dim / 16) constant, so that the queries and outputs stay in registers. */
static inline __attribute__((always_inline)) void item(
        const DecodeArgs *a, const float *q, int64_t h, int64_t b0, int64_t b1,
        float *m, float *l, float *acc, const int G, const int NV) {
    f16v qv[MAX_GROUP][MAX_DIM / LANES], ov[MAX_GROUP][MAX_DIM / LANES], d[TILE], p[MAX_GROUP];
    float kbuf[TILE * MAX_DIM] __attribute__((aligned(64))), vbuf[TILE * MAX_DIM] __attribute__((aligned(64)));
    float kf[TILE], vf[TILE];
    const int fp8 = a->ks != NULL;
    for (int j = 0; j < G; j++) {
        for (int c = 0; c < NV; c++) {
            qv[j][c] = load(q + ((h * G + j) * NV + c) * LANES);
            ov[j][c] = (f16v){0};
        }
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    for (int64_t b = b0; b < b1; b++) {
        const int64_t blk = a->table[b];
        const int64_t in_block = a->length - b * a->block_size;
        const int64_t rows_here = in_block < a->block_size ? in_block : a->block_size;
        const int64_t kv_off = blk * a->block_stride + h * a->head_stride;
        const int64_t s_off = blk * a->sblock_stride + h * a->shead_stride;
        for (int64_t r0 = 0; r0 < rows_here; r0 += TILE) {
            const int rows = (int)(rows_here - r0 < TILE ? rows_here - r0 : TILE);
            const float *kt, *vt;     /* the tile's rows in fp32, at a stride of ld floats */
            int64_t ld;
            if (fp8) {
                fp8_rows((const int8_t *)a->k + kv_off + r0 * a->row_stride, a->row_stride, rows, NV * LANES, kbuf);
                fp8_rows((const int8_t *)a->v + kv_off + r0 * a->row_stride, a->row_stride, rows, NV * LANES, vbuf);
                for (int r = 0; r < rows; r++) {
                    kf[r] = a->ks[s_off + (r0 + r) * a->srow_stride];
                    vf[r] = a->vs[s_off + (r0 + r) * a->srow_stride];
                }
                kt = kbuf, vt = vbuf, ld = NV * LANES;
            } else {
                kt = (const float *)a->k + kv_off + r0 * a->row_stride;
                vt = (const float *)a->v + kv_off + r0 * a->row_stride;
                ld = a->row_stride;
            }
            for (int j = 0; j < G; j++) {             /* scores, then the softmax update */
                for (int r = 0; r < TILE; r++) {
                    d[r] = (f16v){0};
                    if (r < rows)
                        for (int c = 0; c < NV; c++) d[r] += qv[j][c] * load(kt + r * ld + c * LANES);
                }
                f16v sc = hsum16(d) * a->scale;
                if (fp8) sc *= load(kf);
                float mx = m[j];
                for (int r = 0; r < rows; r++) mx = sc[r] > mx ? sc[r] : mx;
                const float alpha = expf(m[j] - mx);
                p[j] = vexp(sc - mx);
                for (int r = rows; r < TILE; r++) p[j][r] = 0.0f;
                l[j] = l[j] * alpha + hsum(p[j]);
                m[j] = mx;
                if (alpha != 1.0f)
                    for (int c = 0; c < NV; c++) ov[j][c] *= alpha;
                if (fp8) p[j] *= load(vf);
            }
            for (int r = 0; r < rows; r++)             /* p V */
                for (int j = 0; j < G; j++) {
                    const f16v pj = splat(p[j][r]);
                    for (int c = 0; c < NV; c++) ov[j][c] += pj * load(vt + r * ld + c * LANES);
                }
        }
    }
    for (int j = 0; j < G; j++)
        for (int c = 0; c < NV; c++) store(acc + (j * NV + c) * LANES, ov[j][c]);
}

#define ITEM(G, NV) \
    static void item_##G##_##NV(const DecodeArgs *a, const float *q, int64_t h, int64_t b0, int64_t b1, \
                                float *m, float *l, float *acc) { item(a, q, h, b0, b1, m, l, acc, G, NV); }
#define ITEMS(G) ITEM(G, 4) ITEM(G, 8)
ITEMS(1) ITEMS(2) ITEMS(3) ITEMS(4) ITEMS(5) ITEMS(6) ITEMS(7) ITEMS(8)
typedef void (*item_fn)(const DecodeArgs *, const float *, int64_t, int64_t, int64_t, float *, float *, float *);
static const item_fn ITEM_FNS[8][2] = {
    {item_1_4, item_1_8}, {item_2_4, item_2_8}, {item_3_4, item_3_8}, {item_4_4, item_4_8},
    {item_5_4, item_5_8}, {item_6_4, item_6_8}, {item_7_4, item_7_8}, {item_8_4, item_8_8}};

/* any other geometry within the limits: the same code with G and NV read at run time */
static void item_any(const DecodeArgs *a, const float *q, int64_t h, int64_t b0, int64_t b1,
                     float *m, float *l, float *acc) {
    item(a, q, h, b0, b1, m, l, acc, (int)a->group, (int)(a->dim / LANES));
}

/* q: (kv_heads * group, dim) fp32; out: the same shape. Returns 0, or -1 when the geometry is
 * outside what this kernel serves (the caller then takes the torch path). */
int kv_decode(const DecodeArgs *a, const float *q, float *out, int splits, int threads) {
    const int64_t g = a->group, d = a->dim, hk = a->kv_heads;
    if (g < 1 || g > MAX_GROUP || d % LANES || d > MAX_DIM || a->length < 1)
        return -1;
    const int64_t blocks = (a->length + a->block_size - 1) / a->block_size;
    if (splits > blocks) splits = (int)blocks;
    if (splits < 1) splits = 1;
    const int64_t items = hk * splits;
    float *m = malloc(sizeof(float) * items * g * (d + 2));
    if (m == NULL) return -1;
    float *l = m + items * g, *acc = l + items * g;
    const int nv = (int)(d / LANES);
    const item_fn fn = g <= 8 && (nv == 4 || nv == 8) ? ITEM_FNS[g - 1][nv / 8] : item_any;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t h = it / splits, sp = it % splits;
        fn(a, q, h, blocks * sp / splits, blocks * (sp + 1) / splits,
                    m + it * g, l + it * g, acc + it * g * d);
    }
    for (int64_t h = 0; h < hk; h++) {                  /* merge the splits by log-sum-exp */
        for (int64_t j = 0; j < g; j++) {
            float mx = -INFINITY, total = 0.0f;
            for (int64_t sp = 0; sp < splits; sp++) {
                float mi = m[(h * splits + sp) * g + j];
                mx = mi > mx ? mi : mx;
            }
            float *o = out + (h * g + j) * d;
            for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
            for (int64_t sp = 0; sp < splits; sp++) {
                const int64_t at = (h * splits + sp) * g + j;
                if (m[at] == -INFINITY) continue;      /* a split with no rows */
                const float w = expf(m[at] - mx);
                total += l[at] * w;
                const float *ai = acc + at * d;
                for (int64_t c = 0; c < d; c++) o[c] += ai[c] * w;
            }
            const float inv = 1.0f / total;
            for (int64_t c = 0; c < d; c++) o[c] *= inv;
        }
    }
    free(m);
    return 0;
}

/* ---- writing new rows into the cache --------------------------------------------------------- */
/* float32 -> e4m3fn, rounding to nearest even: the conversion torch itself does (c10's
 * Float8_e4m3fn), so that a cache written here holds the bytes torch's path would write. Inputs
 * are already clamped to +-448; 480 and above would be NaN (0x7f) as in torch. */
static inline uint8_t e4m3_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= (1087u << 20)) {
        out = 0x7f;
    } else if (bits < (121u << 23)) {       /* below 2^-6: e4m3 subnormal, rounded by an fp32 add */
        const uint32_t magic = 141u << 23;
        float x, m;
        memcpy(&x, &bits, 4);
        memcpy(&m, &magic, 4);
        x += m;
        memcpy(&bits, &x, 4);
        out = (uint8_t)(bits - magic);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        out = (uint8_t)(bits >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

typedef struct {
    void *k, *v;                  /* the layer's cache storage, as in DecodeArgs */
    float *ks, *vs;               /* fp8 scales, or NULL for an fp32 cache */
    int64_t block_stride, row_stride, head_stride, sblock_stride, srow_stride, shead_stride;
    int64_t block_size, kv_heads, dim;
    const float *src_k, *src_v;   /* the new rows: (rows, kv_heads, dim), unit stride in dim */
    int64_t k_row_stride, v_row_stride, src_head_stride;
} WriteArgs;

/* rows t = 0 .. n-1 go to flat slots[t] = block * block_size + offset. fp8: one scale per
 * (row, KV head), amax / 448 (amax at least 1e-12), each value divided by it, clamped to +-448
 * and rounded: the same float32 operations, in the same order, as attention.quantize_fp8. */
void kv_write(const WriteArgs *a, const int64_t *slots, int64_t n, int threads) {
    const int64_t d = a->dim;
    #pragma omp parallel for num_threads(n * a->kv_heads * d > 65536 ? threads : 1) schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const int64_t blk = slots[t] / a->block_size, off = slots[t] % a->block_size;
        for (int64_t h = 0; h < a->kv_heads; h++) {
            const int64_t dst = blk * a->block_stride + off * a->row_stride + h * a->head_stride;
            for (int side = 0; side < 2; side++) {
                const float *x = side ? a->src_v + t * a->v_row_stride + h * a->src_head_stride
                                      : a->src_k + t * a->k_row_stride + h * a->src_head_stride;
                if (a->ks == NULL) {
                    memcpy((float *)(side ? a->v : a->k) + dst, x, sizeof(float) * d);
                    continue;
                }
                float amax = 0.0f;
                for (int64_t c = 0; c < d; c++) amax = fabsf(x[c]) > amax ? fabsf(x[c]) : amax;
                const float scale = (amax > 1e-12f ? amax : 1e-12f) / 448.0f;
                uint8_t *out = (uint8_t *)(side ? a->v : a->k) + dst;
                for (int64_t c = 0; c < d; c++) {
                    float y = x[c] / scale;
                    y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
                    out[c] = e4m3_from_float(y);
                }
                (side ? a->vs : a->ks)[blk * a->sblock_stride + off * a->srow_stride + h * a->shead_stride] = scale;
            }
        }
    }
}
