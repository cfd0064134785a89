/* What kvchat's C kernels share: a 16-float vector type and the few operations on it.
 *
 * Written with GCC/Clang vector extensions, so one source compiles to AVX-512, AVX2, SSE or
 * NEON code, whatever -march/-mcpu asks for. The only intrinsics are x86 ones in widen(),
 * widen_bf16() and widen_fp16(), each under its own #if; KVCHAT_PORTABLE sets them aside, so
 * that the tests can run the plain code a compiler for another architecture sees
 * (engine/native.py builds it).
 */
#ifndef KVCHAT_VEC_H
#define KVCHAT_VEC_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if !defined(KVCHAT_PORTABLE) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif

typedef float f16v __attribute__((vector_size(64)));
typedef float f8v __attribute__((vector_size(32)));
typedef float f4v __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef int8_t b16v __attribute__((vector_size(16)));

#define LANES 16
#define PARALLEL_FLOATS 65536     /* values a call needs for its threads: fewer, one (a region's start costs more) */

static inline f16v load(const float *p) { f16v v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, f16v v) { memcpy(p, &v, sizeof v); }
static inline f16v splat(float x) { return (f16v){0} + x; }
/* a's lanes where mask is set (all ones), b's elsewhere */
static inline f16v vselect(i16v mask, f16v a, f16v b) { return (f16v)(((i16v)a & mask) | ((i16v)b & ~mask)); }

/* bf16 <-> fp32, one or sixteen at a time. Widening is exact (the bits moved up 16 places);
 * rounding is to nearest even with NaN to the one quiet NaN 0x7FC0, torch's scalar conversion
 * (c10's round_to_nearest_even), so rows rounded here hold the bits x.to(torch.bfloat16) gives
 * (but a NaN: torch's vector path makes it 0xFFFF). */
typedef uint16_t h16v __attribute__((vector_size(32)));
typedef uint32_t u16v __attribute__((vector_size(64)));
static inline float bf16_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t bf16_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
static inline f16v load_bf16(const uint16_t *p) {
    h16v h;
    memcpy(&h, p, sizeof h);
    return (f16v)(__builtin_convertvector(h, u16v) << 16);
}
static inline u16v bf16_bits(f16v v) {          /* each lane's bf16 in its low 16 bits */
    const u16v b = (u16v)v, nan = (u16v)(v != v);
    return (((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16) & ~nan) | (0x7FC0u & nan);
}
static inline void store_bf16(uint16_t *p, f16v v) {
    const h16v h = __builtin_convertvector(bf16_bits(v), h16v);
    memcpy(p, &h, sizeof h);
}
static inline f16v round_bf16(f16v v) { return (f16v)(bf16_bits(v) << 16); }   /* v rounded to bf16, as fp32 */

/* the sixteen lanes summed pairwise: the same order on every build */
static inline float hsum(f16v v) {
    f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* The machine's own vector width, VLANES floats, and the products' tile shapes for it (gemv.c,
 * gemv_bf16.c). Their tiles are written in fnv, not f16v: with 16-float vectors on AVX2, GCC
 * split each accumulator into two halves kept on the stack, and every multiply-add loaded and
 * stored its accumulator (seen in its assembly; 12 GFLOP/s on 2 cores, under a tenth of the FMA
 * units' rate). A 16-lane accumulator is SUBS = LANES / VLANES registers; a tile of R weight rows
 * against X rows of x holds X * R * SUBS accumulators, R weight vectors and one of x, so the
 * shape is what the register file holds. ROWS_ONE: weight rows per pass for one row of x;
 * ROWS_MANY x XS_MANY: the tile with several rows of x. */
#if defined(__AVX512F__)
#define VLANES 16
#define ROWS_ONE 8      /* 8 accumulators + 8 weight vectors of 32 registers */
#define ROWS_MANY 4     /* a 4 x 4 tile: 16 accumulators + 4 weights + x */
#define XS_MANY 4
#elif defined(__AVX__)
#define VLANES 8
#define ROWS_ONE 4      /* 8 accumulators + 4 weights + x of 16 registers */
#define ROWS_MANY 2     /* a 2 x 2 tile: 8 accumulators + 2 weights + x */
#define XS_MANY 2
#elif defined(__aarch64__)
#define VLANES 4
#define ROWS_ONE 4      /* 16 accumulators + 4 weights + x of NEON's 32 registers */
#define ROWS_MANY 2     /* a 2 x 2 tile: 16 accumulators + 2 weights + x */
#define XS_MANY 2
#else
#define VLANES 4
#define ROWS_ONE 2      /* SSE's 16 registers: 8 accumulators + 2 weights + x */
#define ROWS_MANY 1     /* a 1 x 2 tile: 8 accumulators + 1 weight + x */
#define XS_MANY 2
#endif
/* ROWS_TWO: weight rows per tile for two rows of x. On AVX-512 one row's 8 (16 accumulators + 8
 * weights + x): the 4 x 2 tile streamed the bundled model's products at 25.2 GB/s, the 8 x 2 at
 * 27.0 (21.2 -> 19.9 ms a step on 2 Xeon cores, 19.3 for one row). Narrower builds keep
 * ROWS_MANY: the registers would not hold it. */
#if VLANES == 16
#define ROWS_TWO ROWS_ONE
#else
#define ROWS_TWO ROWS_MANY
#endif
/* F32_ROWS x F32_XS: gemv.c's fp32 tile for 3 or more rows of x. On AVX-512 a 3 x 8 tile: 24
 * accumulators + 3 weights + x, where the 4 x 4 loaded a weight or x vector for every two
 * multiply-adds. On 2 Zen 4 cores, 8 rows of x through the bundled model's products with weights
 * from memory (a decode step's 538 MB): 19.6-21.7 ms against the 4 x 4's 25.9-29.6, the same
 * bits (two builds taking turns in one process); a 2 x 8 tile was as fast, a 4 x 6 no faster
 * than the 4 x 4. The bf16 tile gained nothing from it (within noise) and keeps ROWS_MANY x
 * XS_MANY. Narrower builds keep theirs: the registers would not hold more. */
#if VLANES == 16
#define F32_ROWS 3
#define F32_XS 8
#else
#define F32_ROWS ROWS_MANY
#define F32_XS XS_MANY
#endif
#define SUBS (LANES / VLANES)
#define TILE_ROWS (ROWS_ONE > ROWS_MANY ? ROWS_ONE : ROWS_MANY)

typedef float fnv __attribute__((vector_size(VLANES * sizeof(float))));

static inline fnv loadn(const float *p) { fnv v; memcpy(&v, p, sizeof v); return v; }

/* VLANES bf16 widened to fp32, exactly: the bits moved up 16 places (gemv_bf16.c's weights,
 * decode.c's bf16 cache) */
static inline fnv widen_bf16(const uint16_t *p) {
#if !defined(KVCHAT_PORTABLE) && defined(__AVX512F__)
    return (fnv)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif !defined(KVCHAT_PORTABLE) && defined(__AVX2__)
    return (fnv)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    uint32_t u[VLANES];
    for (int i = 0; i < VLANES; i++) u[i] = (uint32_t)p[i] << 16;
    fnv out;
    memcpy(&out, u, sizeof out);
    return out;
#endif
}

/* VLANES fp16 widened to fp32, exactly (vcvtph2ps where x86 has it: AVX-512, or F16C beside
 * AVX2). Elsewhere: the exponent and mantissa moved to fp32's place give the value times
 * 2^-112 (an fp16 subnormal becomes an fp32 subnormal), times 2^112, exact, gives the value;
 * an exponent of all ones (inf, NaN) is put back as fp32's own, and the sign on top. */
static inline fnv widen_fp16(const uint16_t *p) {
#if !defined(KVCHAT_PORTABLE) && defined(__AVX512F__)
    return (fnv)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif !defined(KVCHAT_PORTABLE) && defined(__F16C__) && VLANES == 8
    return (fnv)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    typedef uint32_t unv __attribute__((vector_size(VLANES * sizeof(uint32_t))));
    uint32_t u[VLANES];
    for (int i = 0; i < VLANES; i++) u[i] = p[i];
    unv h;
    memcpy(&h, u, sizeof h);
    const unv mag = (h & 0x7FFF) << 13;
    const unv special = (unv)((h & 0x7C00) == 0x7C00);            /* all ones where inf or NaN */
    const unv scaled = (unv)((fnv)mag * 0x1p112f);
    return (fnv)(((scaled & ~special) | ((mag | 0x7F800000u) & special)) | ((h & 0x8000) << 16));
#endif
}

/* x in every lane, as one broadcast instruction. Written as a loop over the lanes (v[i] = x),
 * GCC 12 built the vector a lane at a time: 16 masked broadcasts on AVX-512, 8 inserts on AVX2
 * (seen in its assembly); in decode.c's p V loop, once per cached row and query, that was most
 * of the attention's time. (fnv){0} + x would add. */
static inline fnv splatn(float x) {
    const fnv v = {x};
#if VLANES == 16
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#elif VLANES == 8
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
#else
    return __builtin_shufflevector(v, v, 0, 0, 0, 0);
#endif
}

/* VLANES vectors in, one out: lane r holds the sum of a[r]'s lanes, in hsum's order (halves
 * added, then their halves...), as a transpose-and-add network in the machine's width. Always
 * inlined: GCC 12 left it a function of its own in decode.c's item(), so each tile's sixteen
 * accumulators went through memory to the call (perf: 5.7% of an fp8 decode at B = 8, 4,096
 * tokens); inlined, decode attention at 4,096 tokens took 2-5% less (benchmarks/cpu_attention.py). */
#define PAIR(x, y, ...) (__builtin_shufflevector(x, y, __VA_ARGS__))
static inline __attribute__((always_inline)) fnv transpose_sum(const fnv *a) {
#if VLANES == 16
    fnv x[8], y[4], z[2];
    for (int i = 0; i < 8; i++)
        x[i] = PAIR(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PAIR(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        y[i] = PAIR(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               PAIR(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = PAIR(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               PAIR(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return PAIR(z[0], z[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           PAIR(z[0], z[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif VLANES == 8
    fnv x[4], y[2];
    for (int i = 0; i < 4; i++)
        x[i] = PAIR(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               PAIR(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        y[i] = PAIR(x[2 * i], x[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               PAIR(x[2 * i], x[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return PAIR(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14) + PAIR(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    fnv x[2];
    for (int i = 0; i < 2; i++)
        x[i] = PAIR(a[2 * i], a[2 * i + 1], 0, 1, 4, 5) + PAIR(a[2 * i], a[2 * i + 1], 2, 3, 6, 7);
    return PAIR(x[0], x[1], 0, 2, 4, 6) + PAIR(x[0], x[1], 1, 3, 5, 7);
#endif
}

/* sixteen lanes kept as SUBS accumulators of VLANES, summed as hsum sums one f16v */
static inline float hsum_subs(const fnv *parts) {
    f16v whole;
    memcpy(&whole, parts, sizeof whole);
    return hsum(whole);
}

/* sixteen int8 sign-extended to int32. GCC 12 lowers __builtin_convertvector between these
 * widths one element at a time (seen in its assembly), so x86 takes the one instruction. */
static inline i16v widen(const int8_t *p) {
#if !defined(KVCHAT_PORTABLE) && defined(__AVX512F__)
    return (i16v)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif !defined(KVCHAT_PORTABLE) && defined(__AVX2__)
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

/* exp(x) for x <= 0, 16 at a time: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2,
 * e^r by its Taylor series to r^7 (error under 1e-8 relative), 2^n added to the exponent.
 * Below -87 the result is about 1e-38 instead of 0; the decode kernel zeroes padding lanes. */
static inline f16v vexp_poly(f16v r) {   /* e^r for |r| < ln2: Taylor to r^7 */
    f16v p = splat(1.0f / 5040) * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    return p * r + 1.0f;
}

static inline f16v vexp(f16v x) {
    f16v t = x * 1.4426950408889634f;
    i16v low = t < -125.0f;
    t = vselect(low, splat(-125.0f), t);
    i16v n = -__builtin_convertvector(0.5f - t, i16v);          /* round(t): 0.5 - t > 0 */
    f16v r = (t - __builtin_convertvector(n, f16v)) * 0.6931471805599453f;
    f16v p = vexp_poly(r);
    return (f16v)((i16v)p + (n << 23));
}

#endif
