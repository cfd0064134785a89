/* Decode attention over the paged cache: one query per head for each of B sequences, each
 * against its own cached K/V read through its own block table, in place (any block order,
 * either pool layout), fp32, bf16, fp16, or fp8 e4m3 with one scale per (slot, KV head).
 *
 * Split-K: every (sequence, KV head, stretch of blocks) is a work item with its own running
 * max, sum and output (online softmax, Milakov & Gimelshein 2018), merged at the end by
 * log-sum-exp (flash-decoding, Dao et al. 2023). A sequence's stretches depend on its own
 * length and the thread count only, so a sequence gets the same bits batched or alone; the
 * threads take items as they come (short sequences beside long ones balance). K rows of fp8
 * and 16-bit caches are widened a tile at a time into a buffer the core keeps in L1 (fp8's to
 * bf16 where the build has AVX512-BF16: scores_bf16(), and p V in bf16 too: pv_bf16()); V rows
 * are widened in registers as p V loads them (pv(); fp8's into the buffer too where vectors
 * are narrower than 16 lanes). No fp32 copy of the cache is ever written.
 */
#include "kvchat.h"
#include "vec.h"

#define TILE 16         /* cached rows per tile, all in one block: one vector of scores */
#define MAX_GROUP 16    /* query heads per KV head */
#define MAX_DIM 256     /* head_dim */
#define SMALL 8192      /* cached values (rows x KV heads x head_dim) below which one thread decodes */

/* A tile's rows of an fp8 or 16-bit cache (kind 0: e4m3, KV_BF16, KV_FP16; src + off, rows
 * `stride` elements apart) widened exactly into fp32 rows `dim` apart at dst, and the next
 * chunk's same tile (src + next, its first pf_rows rows) fetched meanwhile, a line at a time:
 * fetched a whole chunk at once, the rows waited for the core's line buffers. Into L2, not L1:
 * the fetches into L1 stalled the widening (B = 8 at 4,096 tokens on rows scaled as ours
 * write them, ms a layer: fp8 1.03 -> 0.96, bf16 1.51 -> 1.38; in a decode step of B = 8 at
 * 1,024 tokens the attention went 7.9 -> 7.4 ms (fp8), 11.0 -> 10.3 (bf16)).
 * e4m3: each byte's sign placed at bit 31 and its exponent and mantissa at bits 20-26 of a
 * float32 give the value times 2^-120, exactly (see engine/cpu_attention.py), and that is
 * what is stored: item() puts the 2^120 into factors it applies once a row or once an item
 * (FP8_HALF), not once an element. An e4m3 subnormal is a float32 subnormal here, and a
 * multiply that meets one takes a microcode assist on x86: a cache of unscaled N(0, 1) values
 * (1.2% e4m3 subnormals) decoded B = 8 at 4,096 tokens in 3.2 ms a layer against 1.0 without
 * them. Our writes scale each row to 448, so a subnormal is under 1/28,672 of its row's
 * largest value: 0.23% of the 16-byte vectors of the bundled model's cache after 2,048 tokens
 * hold one. An assist-free widening (an integer add to the exponent, subnormals fixed up apart) cost more
 * than those assists on that cache: 1.19-1.28 ms a layer against 1.03 on rows scaled as ours.
 * The scales are applied to the scores and p (item()). */
static inline void widen_rows(const void *src, int64_t off, int64_t next, int64_t stride, int rows, int pf_rows,
                              int64_t dim, float *dst, int kind) {
    const int64_t size = kind ? 2 : 1;                    /* bytes an element */
    const char *base = (const char *)src + off * size, *pf = (const char *)src + next * size;
    for (int r = 0; r < rows; r++) {
        const char *row = base + r * stride * size;
        float *out = dst + r * dim;
        if (kind == 0)
            for (int64_t c = 0; c < dim; c += LANES) {
                const i16v bits = (widen((const int8_t *)row + c) << 20) & (int32_t)0x87F00000u;
                store(out + c, (f16v)bits);
            }
        else
            for (int64_t c = 0; c < dim; c += VLANES) {
                const uint16_t *h = (const uint16_t *)row + c;
                const fnv x = kind == KV_BF16 ? widen_bf16(h) : widen_fp16(h);
                memcpy(out + c, &x, sizeof x);
            }
        if (r < pf_rows)
            for (int64_t c = 0; c < dim * size; c += 64) __builtin_prefetch(pf + r * stride * size + c, 0, 2);
    }
}

/* fp8 K on AVX512-BF16 (K_DOT): an e4m3 byte's sign placed at bit 15 and its exponent and
 * mantissa at bits 4-10 of a bf16 give its value times 2^-120, as widen_rows()'s float32 does
 * (a bf16 is a float32's top half), 32 values in three instructions and half the buffer; the
 * item's queries, already times 2^60, are rounded to bf16 once (nearest even), and vdpbf16ps
 * adds two exact products per lane: half the multiply-adds of scores() for the same K tile.
 * So the scores differ from the float32 path's by the queries' rounding (a relative 2^-8 of
 * each product) and by what vdpbf16ps treats as zero: its inputs and sums under 2^-126 (an
 * e4m3 subnormal, below 1/28,672 of its row's largest value as our writes scale them, and
 * products under 2^-66 of the unscaled ones): tests/tolerance.py's dot_bf16 bound. No
 * subnormal reaches a multiply, so no microcode assist either. 2 Zen 4 cores, ms a layer (two
 * builds taking turns, K_DOT against the float32 widening): eight sequences at 4,096 tokens
 * 0.858 -> 0.796, one 0.113 -> 0.101, eight at 256 0.068 -> 0.064; with pv_bf16() as well
 * (against K_DOT's scores alone) 0.804 -> 0.692, 0.105 -> 0.091, 0.067 -> 0.060. */
#if !defined(KVCHAT_PORTABLE) && defined(__AVX512BF16__) && VLANES == 16
#define K_DOT 1
static inline void widen_rows_bf16(const void *src, int64_t off, int64_t next, int64_t stride, int rows,
                                   int pf_rows, int64_t dim, uint16_t *dst) {
    const int8_t *base = (const int8_t *)src + off, *pf = (const int8_t *)src + next;
    const __m512i keep = _mm512_set1_epi16((short)0x87F0);     /* sign, exponent and mantissa */
    for (int r = 0; r < rows; r++) {
        const int8_t *row = base + r * stride;
        for (int64_t c = 0; c < dim; c += 32) {            /* each byte sign-extended to 16 bits, up 4 */
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row + c)));
            _mm512_storeu_si512(dst + r * dim + c, _mm512_and_si512(_mm512_slli_epi16(w, 4), keep));
        }
        if (r < pf_rows)
            for (int64_t c = 0; c < dim; c += 64) __builtin_prefetch(pf + r * stride + c, 0, 2);
    }
}

/* scores()'s sums with bf16 queries qj and K rows kt (dim = 32 n32 apart): each row's lanes
 * summed by the same transpose_sum */
static inline __attribute__((always_inline)) void scores_bf16(const uint16_t *qj, const uint16_t *kt, int rows,
                                                              const int n32, float *sc) {
    __m512bh qv[MAX_DIM / 32];
    for (int c = 0; c < n32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qj + c * 32);
    fnv a[VLANES];
    for (int i = 0; i < VLANES; i++) {
        __m512 x = _mm512_setzero_ps();
        if (i < rows)
            for (int c = 0; c < n32; c++)
                x = _mm512_dpbf16_ps(x, qv[c], (__m512bh)_mm512_loadu_si512(kt + (i * n32 + c) * 32));
        a[i] = (fnv)x;
    }
    const fnv t = transpose_sum(a);
    memcpy(sc, &t, sizeof t);
}
#else
#define K_DOT 0
#endif

/* one query's scores against a tile's first `rows` rows (the rest of the TILE zero):
 * sc[r] = q . k_r, VLANES rows at a time, each row's sum one accumulator over the row's
 * vectors in order, their lanes summed by one transpose_sum. With 16-lane vectors (32
 * registers) q is held whole and the rows are read one after another: read a vector at a time
 * across 16 rows, each multiply-add touched another line, and the kernel waited on them (2
 * Zen 4 cores, fp32 cache, ms a layer, the two builds taking turns: eight sequences at 256
 * tokens 0.164 -> 0.139, at 1,024 0.53 -> 0.43, at 4,096 1.98 -> 1.56; one at 4,096 0.287 ->
 * 0.241; bf16 and fp8 at 4,096, whose K rows are widened into a buffer first, 4-6% faster).
 * With 8-lane vectors (16 registers) q is read a vector at a time as before: held whole it
 * left no room for the accumulators (the bf16 cache 5% slower in the AVX2 build). Same sums
 * either way. Rows past `rows` are never read: the last tile may end a block, or the pool.
 * Inlined with rows = TILE for a full tile, where the test on each row folds away, and with
 * ld = head_dim where rows are contiguous (the offsets then constants, not 16 of them spilled).
 * nn: vectors of the machine's width in a row (head_dim / VLANES). `pf`, when not NULL: the
 * next chunk's tile, whose rows [pf_lo, pf_hi) are fetched into L2 meanwhile (item(): each
 * query a share). */
static inline __attribute__((always_inline)) void scores(const float *qj, const float *kt, int64_t ld, int rows,
                                                         const int nn, float *sc, const float *pf, int pf_lo,
                                                         int pf_hi) {
#if VLANES == 16
    fnv qv[MAX_DIM / VLANES];
    for (int c = 0; c < nn; c++) qv[c] = loadn(qj + c * VLANES);
#endif
    for (int r0 = 0; r0 < TILE; r0 += VLANES) {
        fnv a[VLANES];
        for (int i = 0; i < VLANES; i++) a[i] = (fnv){0};
#if VLANES == 16    /* row by row: a row's lines one after another, q's vectors held in registers */
        for (int i = 0; i < VLANES; i++)
            if (r0 + i < rows)
                for (int c = 0; c < nn; c++) a[i] += qv[c] * loadn(kt + (r0 + i) * ld + c * VLANES);
        if (pf != NULL)
            for (int i = 0; i < VLANES; i++)
                if (r0 + i >= pf_lo && r0 + i < pf_hi)
                    for (int c = 0; c < nn; c++) __builtin_prefetch(pf + (r0 + i) * ld + c * VLANES, 0, 2);
#else               /* vector by vector: 16 registers hold q's vector and the accumulators, not all of q */
        for (int c = 0; c < nn; c++) {
            const fnv qv = loadn(qj + c * VLANES);
            for (int i = 0; i < VLANES; i++)
                if (r0 + i < rows) a[i] += qv * loadn(kt + (r0 + i) * ld + c * VLANES);
            if (pf != NULL && c * VLANES % 16 == 0)     /* once per 64-byte line */
                for (int i = 0; i < VLANES; i++)
                    if (r0 + i >= pf_lo && r0 + i < pf_hi) __builtin_prefetch(pf + (r0 + i) * ld + c * VLANES, 0, 2);
        }
#endif
        const fnv t = transpose_sum(a);
        memcpy(sc + r0, &t, sizeof t);
    }
}

/* the chunk's softmax max over vectors: a lane-at-a-time scalar max (vmaxss after vmaxss, each
 * waiting on the last) was an eighth of the kernel's time. A max is a max in any order (the
 * scalar loop's x > m ? x : m in each lane and across them), so the bits are the same. */
static const i16v IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static inline f16v vmax(f16v m, f16v x) { return vselect(x > m, x, m); }
static inline float hmax(f16v v) {         /* halves, quarters, ...: every lane ends with the max */
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

#define CHUNK_TILES 4   /* tiles (of up to TILE rows, each within one block) per softmax update */
#define CHUNK (CHUNK_TILES * TILE)

/* the tile at block b's row r0: its rows (up to TILE, within the block and the sequence's
 * length) returned, and b, r0 moved on to the next tile's */
static inline int next_tile(const DecodeArgs *a, int64_t length, int64_t *b, int64_t *r0) {
    const int64_t in_block = length - *b * a->block_size;
    const int64_t rows_here = in_block < a->block_size ? in_block : a->block_size;
    const int n = (int)(rows_here - *r0 < TILE ? rows_here - *r0 : TILE);
    *r0 += n;
    if (*r0 >= rows_here) ++*b, *r0 = 0;
    return n;
}

/* the tiles of one chunk from block b's row r0 (both moved on past it): each tile's offset into
 * the K/V rows and the scales, and its rows; returns how many tiles (0 at b1) */
static inline int chunk(const DecodeArgs *a, const int32_t *table, int64_t length, int64_t h, int64_t *b,
                        int64_t *r0, int64_t b1, int64_t *off, int64_t *s_off, int *rows) {
    int nt = 0;
    for (; nt < CHUNK_TILES && *b < b1; nt++) {
        off[nt] = table[*b] * a->block_stride + h * a->head_stride + *r0 * a->row_stride;
        s_off[nt] = table[*b] * a->sblock_stride + h * a->shead_stride + *r0 * a->srow_stride;
        rows[nt] = next_tile(a, length, b, r0);
    }
    return nt;
}

/* a work item: KV head `head` of sequence `seq` over its blocks [b0, b1) */
typedef struct { int64_t seq, head, b0, b1; } Item;

static inline int64_t length_of(const DecodeArgs *a, int64_t s) { return a->lens ? a->lens[s] : a->length; }

/* multiply-add chains p V keeps in registers: Q queries x nn vectors of head_dim */
#define PV_REGS (VLANES == 16 ? 24 : 12)
#define MAX_Q 16

/* The kinds of V rows pv() reads: 0 fp32 (the cache's, or fp8's widened into the item's
 * buffer), KV_BF16 and KV_FP16 (the cache's own rows), V_E4M3 (an fp8 cache's own rows, where a
 * vector is 16 lanes: widen_rows()'s widening, one vector at a time; 2 Zen 4 cores, ms a layer
 * at 4,096 tokens, buffer -> registers: one sequence 0.166-0.185 -> 0.139-0.151, eight
 * 1.22-1.96 -> 0.95-0.97). */
#define V_E4M3 3
#define V_IN_PLACE_E4M3 (VLANES == 16)
static inline int64_t v_size(const int kind) { return kind == 0 ? 4 : kind == V_E4M3 ? 1 : 2; }

/* V row r of a tile at vt (elements `ld` apart) from c: fp32 as it is, others widened in
 * registers (exact: the same values widen_rows() would have stored; e4m3's times 2^-120) */
static inline __attribute__((always_inline)) fnv v_at(const void *vt, int64_t ld, int r, int c, const int kind) {
    if (kind == 0)
        return loadn((const float *)vt + r * ld + c * VLANES);
#if V_IN_PLACE_E4M3
    if (kind == V_E4M3) {
        const i16v bits = (widen((const int8_t *)vt + r * ld + c * VLANES) << 20) & (int32_t)0x87F00000u;
        const f16v x = (f16v)bits;
        fnv out;
        memcpy(&out, &x, sizeof out);
        return out;
    }
#endif
    const uint16_t *h = (const uint16_t *)vt + r * ld + c * VLANES;
    return kind == KV_BF16 ? widen_bf16(h) : widen_fp16(h);
}

/* queries j0 .. j0 + Q - 1 of an item's chunk: acc[j] += sum over the chunk's rows of p V. Each
 * output sums its rows in order, whatever Q is. V rows of any `kind` (above), widened here as
 * they are loaded where they are not fp32: each V row is read once for the Q queries, so widening it first into a buffer only added a store
 * and a load per vector (a bf16 cache on 2 Zen 4 cores, ms a layer, buffer -> registers: one
 * sequence at 4,096 tokens 0.24-0.26 -> 0.15-0.17, eight 1.69-1.72 -> 1.09-1.62). K rows stay
 * in the buffer: scores() reads each once per query, and widening them there per query took
 * eight sequences 1.33-1.42 ms against 1.09-1.16. `pf`, when not NULL: the next chunk's V
 * rows, fetched meanwhile (nrows of each tile), a 64-byte line at a time. */
static inline __attribute__((always_inline)) void pv(float *acc, float (*sc)[CHUNK], const void *const *vt,
                                                     const int64_t *ld, const int *rows, int nt, int j0, const int Q,
                                                     const int nn, const int dim, const void *const *pf,
                                                     const int *nrows, const int kind) {
    const int line = (int)(64 / v_size(kind) / VLANES);    /* vectors of a row per 64-byte line */
    fnv o[MAX_Q][MAX_DIM / VLANES];
    for (int j = 0; j < Q; j++)
        for (int c = 0; c < nn; c++) o[j][c] = loadn(acc + (j0 + j) * dim + c * VLANES);
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < rows[t]; r++) {
            fnv p[MAX_Q];
            for (int j = 0; j < Q; j++) p[j] = splatn(sc[j0 + j][t * TILE + r]);
            for (int c = 0; c < nn; c++) {
                const fnv v = v_at(vt[t], ld[t], r, c, kind);
                for (int j = 0; j < Q; j++) o[j][c] += p[j] * v;
            }
            if (pf != NULL && r < nrows[t])
                for (int c = 0; c < nn; c += line)
                    __builtin_prefetch((const char *)pf[t] + (r * ld[t] + c * VLANES) * v_size(kind), 0, 2);
        }
    for (int j = 0; j < Q; j++)
        for (int c = 0; c < nn; c++) memcpy(acc + (j0 + j) * dim + c * VLANES, &o[j][c], sizeof o[j][c]);
}

/* how many of G queries p V takes at a time: all whose outputs (nn vectors each) fit PV_REGS */
static inline int pv_queries(const int G, const int nn) {
    return G * nn <= PV_REGS ? G : (PV_REGS / nn > 0 ? PV_REGS / nn : 1);
}

/* p V for the item's G queries, Q at a time (pv()), for the kind of V rows (a constant in each call) */
static inline __attribute__((always_inline)) void pv_all(float *acc, float (*sc)[CHUNK], const void *const *vt,
                                                         const int64_t *ld, const int *rows, int nt, const int G,
                                                         const int nn, const int dim, const void *const *pf,
                                                         const int *nrows, const int kind) {
    const int QG = pv_queries(G, nn);
    for (int j0 = 0; j0 + QG <= G; j0 += QG)
        pv(acc, sc, vt, ld, rows, nt, j0, QG, nn, dim, j0 == 0 ? pf : NULL, nrows, kind);
    if (G % QG)
        pv(acc, sc, vt, ld, rows, nt, G - G % QG, G % QG, nn, dim, NULL, nrows, kind);
}

#if K_DOT
/* p V over an fp8 cache on AVX512-BF16: two rows at a time, each row's bytes made bf16 as
 * widen_rows_bf16() makes them, the two rows' values of a dimension side by side in one lane
 * (vpunpck{l,h}wd), against the two rows' p (rounded to bf16 by the softmax update: pb) in
 * every lane: one vdpbf16ps adds both rows to 16 outputs. The unpacks work within 128-bit
 * lanes, so the item's outputs are kept in that order (lane 4k + i of vector 2g is dimension
 * 32g + 8k + i, of vector 2g + 1 dimension 32g + 8k + 4 + i) and put back at its end
 * (unpermute()). A tile's odd last row goes with a row of zeros, never read from the cache. */
static inline __attribute__((always_inline)) void pv_bf16(float *acc, const uint16_t (*pb)[CHUNK],
                                                          const void *const *vt, const int64_t *ld, const int *rows,
                                                          int nt, int j0, const int Q, const int n32,
                                                          const void *const *pf, const int *nrows) {
    static const int8_t ZERO[MAX_DIM] __attribute__((aligned(64))) = {0};
    const __m512i keep = _mm512_set1_epi16((short)0x87F0);
    __m512 o[MAX_Q][MAX_DIM / 16];
    for (int j = 0; j < Q; j++)
        for (int c = 0; c < 2 * n32; c++) o[j][c] = _mm512_loadu_ps(acc + (j0 + j) * n32 * 32 + c * 16);
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < rows[t]; r += 2) {
            const int8_t *x = (const int8_t *)vt[t] + r * ld[t], *y = r + 1 < rows[t] ? x + ld[t] : ZERO;
            __m512bh p[MAX_Q];
            for (int j = 0; j < Q; j++) {
                uint32_t two;                          /* rows r and r + 1 (0 past the tile) */
                memcpy(&two, &pb[j0 + j][t * TILE + r], 4);
                p[j] = (__m512bh)_mm512_set1_epi32((int)two);
            }
            for (int g = 0; g < n32; g++) {
                const __m512i wx = _mm512_and_si512(
                    _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(x + 32 * g))), 4), keep);
                const __m512i wy = _mm512_and_si512(
                    _mm512_slli_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(y + 32 * g))), 4), keep);
                const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(wx, wy), hi = (__m512bh)_mm512_unpackhi_epi16(wx, wy);
                for (int j = 0; j < Q; j++) {
                    o[j][2 * g] = _mm512_dpbf16_ps(o[j][2 * g], p[j], lo);
                    o[j][2 * g + 1] = _mm512_dpbf16_ps(o[j][2 * g + 1], p[j], hi);
                }
            }
            if (pf != NULL)
                for (int i = r; i < r + 2 && i < nrows[t]; i++)
                    for (int c = 0; c < 32 * n32; c += 64)
                        __builtin_prefetch((const char *)pf[t] + i * ld[t] + c, 0, 2);
        }
    for (int j = 0; j < Q; j++)
        for (int c = 0; c < 2 * n32; c++) _mm512_storeu_ps(acc + (j0 + j) * n32 * 32 + c * 16, o[j][c]);
}

/* pv_all() for pv_bf16() */
static inline __attribute__((always_inline)) void pv_all_bf16(float *acc, const uint16_t (*pb)[CHUNK],
                                                              const void *const *vt, const int64_t *ld,
                                                              const int *rows, int nt, const int G, const int n32,
                                                              const void *const *pf, const int *nrows) {
    const int QG = pv_queries(G, 2 * n32);
    for (int j0 = 0; j0 + QG <= G; j0 += QG)
        pv_bf16(acc, pb, vt, ld, rows, nt, j0, QG, n32, j0 == 0 ? pf : NULL, nrows);
    if (G % QG)
        pv_bf16(acc, pb, vt, ld, rows, nt, G - G % QG, G % QG, n32, NULL, nrows);
}

/* an output row of pv_bf16()'s order put back in dimension order */
static inline void unpermute(float *row, int dim) {
    float tmp[MAX_DIM];
    for (int g = 0; g < dim / 32; g++)
        for (int k = 0; k < 4; k++)
            for (int i = 0; i < 4; i++) {
                tmp[32 * g + 8 * k + i] = row[32 * g + 4 * k + i];
                tmp[32 * g + 8 * k + 4 + i] = row[32 * g + 16 + 4 * k + i];
            }
    memcpy(row, tmp, sizeof(float) * dim);
}
#endif

/* An fp8 cache's rows are widened to their values times 2^-120 (widen_rows()). The 2^120 is
 * split in halves of 2^60 put where they cost least: the item's queries and each row's K scale
 * (the scores come out as before), each row's V scale and, once at the item's end, its G
 * outputs. Powers of two: every product and sum is the old one times a power of two, the same
 * bits, unless one is under 2^-66 (its scaled value then a subnormal float) or a query or
 * scale reaches 2^68 (its scaled value then past the largest float). Multiplying every
 * widened vector by 2^120 instead took, on 2 Zen 4 cores, ms a layer (two builds taking
 * turns): eight sequences at 4,096 tokens 0.894 against 0.853, one 0.130 against 0.123, eight
 * at 256 0.093 against 0.090. */
#define FP8_HALF 0x1p60f

/* one work item: KV head h of one sequence (its table and length) over blocks [b0, b1);
 * leaves the running max m, sum l and the unnormalised output acc (G x dim) of each of the
 * head's G queries. Inlined with G and NV (head_dim / 16) constant. Written in the machine's
 * vector width (vec.h): scores one query at a time, p V as many queries as the registers hold
 * (pv()), so that what a loop holds fits the registers.
 * The rows go in chunks of up to CHUNK_TILES tiles, across blocks: every query's scores for
 * the whole chunk, then one softmax update per query, then p V. One update per 16 rows left
 * the core waiting on the update's chain (max, exp, sum) at every tile. */
static inline __attribute__((always_inline)) void item(
        const DecodeArgs *a, const int32_t *table, int64_t length, const float *q, int64_t h,
        int64_t b0, int64_t b1, float *m, float *l, float *acc, const Item *then, const int G, const int NV) {
    const int dim = NV * LANES, nn = dim / VLANES;
    float sc[MAX_GROUP][CHUNK] __attribute__((aligned(64)));
#if K_DOT
    uint16_t pbf[MAX_GROUP][CHUNK] __attribute__((aligned(64)));  /* p in bf16 for pv_bf16() */
#endif
    float kbuf[CHUNK_TILES * TILE * MAX_DIM] __attribute__((aligned(64)));
    float vbuf[CHUNK_TILES * TILE * MAX_DIM] __attribute__((aligned(64)));   /* fp8's V where not in place */
    float kf[CHUNK] __attribute__((aligned(64))), vf[CHUNK] __attribute__((aligned(64)));
    const float *kt[CHUNK_TILES];
    const void *vt[CHUNK_TILES];
    int64_t ld[CHUNK_TILES], vld[CHUNK_TILES];
    int rows[CHUNK_TILES];
    const int fp8 = a->ks != NULL, half = fp8 ? 0 : (int)a->half;
    const int vkind = fp8 ? (V_IN_PLACE_E4M3 ? V_E4M3 : 0) : half;   /* pv()'s kind of V rows */
    const float *qh = q + h * G * dim;
    float qs[MAX_GROUP * MAX_DIM] __attribute__((aligned(64)));
    if (fp8) {                                         /* the queries times 2^60 (FP8_HALF) */
        for (int i = 0; i < G * dim; i++) qs[i] = qh[i] * FP8_HALF;
        qh = qs;
    }
    const int kdot = K_DOT && fp8 && dim % 32 == 0;    /* fp8 in bf16: scores_bf16(), pv_bf16() */
    uint16_t qb[K_DOT ? MAX_GROUP * MAX_DIM : 1] __attribute__((aligned(64)));
    const uint16_t *kb[CHUNK_TILES];                   /* each tile's K rows in bf16 (kbuf's first half) */
    if (kdot)
        for (int i = 0; i < G * dim; i++) qb[i] = bf16_from_float(qs[i]);
    for (int j = 0; j < G; j++) {
        for (int c = 0; c < dim; c++) acc[j * dim + c] = 0.0f;
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    int64_t b = b0, r0 = 0;            /* the next tile: block b's rows from r0 */
    while (b < b1) {
        /* this chunk's tiles, then the next chunk's: each of its tiles is fetched into cache a
         * row at a time while this chunk's same tile is converted (fp8, bf16, fp16) or computed (fp32:
         * scores(), pv()). Fetched all at once, the rows waited for the core's line buffers:
         * the fp8 fetch of a whole chunk was a quarter of the kernel's time at 4,096 tokens. */
        int64_t off[CHUNK_TILES], s_off[CHUNK_TILES], next_off[CHUNK_TILES] = {0}, next_soff[CHUNK_TILES] = {0};
        int nrows[CHUNK_TILES] = {0};
        const int nt = chunk(a, table, length, h, &b, &r0, b1, off, s_off, rows);
        int64_t pb = b, pr = r0;
        if (chunk(a, table, length, h, &pb, &pr, b1, next_off, next_soff, nrows) == 0 && then != NULL) {
            int64_t tb = then->b0, tr = 0;       /* the last chunk: the next item's first instead */
            chunk(a, a->tables + then->seq * a->table_stride, length_of(a, then->seq), then->head, &tb, &tr,
                  then->b1, next_off, next_soff, nrows);
        }
        const float *next_k[CHUNK_TILES] = {0};
        const void *next_v[CHUNK_TILES] = {0};
        for (int t = 0; t < nt; t++) {
            if (fp8 || half) {                         /* half is 0 for fp8: widen_rows' kind */
                const int n = nrows[t];
#if K_DOT
                if (kdot) {
                    uint16_t *kbt = (uint16_t *)kbuf + t * TILE * dim;
                    widen_rows_bf16(a->k, off[t], next_off[t], a->row_stride, rows[t], n, dim, kbt);
                    kb[t] = kbt;
                } else
#endif
                widen_rows(a->k, off[t], next_off[t], a->row_stride, rows[t], n, dim, kbuf + t * TILE * dim, half);
                kt[t] = kbuf + t * TILE * dim, ld[t] = dim;
            } else {
                kt[t] = (const float *)a->k + off[t];
                ld[t] = a->row_stride;
                if (nrows[t])
                    next_k[t] = (const float *)a->k + next_off[t];
            }
            if (vkind == 0 && fp8) {                   /* fp8 V widened into the buffer too */
                widen_rows(a->v, off[t], next_off[t], a->row_stride, rows[t], nrows[t], dim, vbuf + t * TILE * dim, 0);
                vt[t] = vbuf + t * TILE * dim, vld[t] = dim;
            } else {                                   /* V read in place, widened as pv() loads it */
                vt[t] = (const char *)a->v + off[t] * v_size(vkind), vld[t] = a->row_stride;
                if (nrows[t])
                    next_v[t] = (const char *)a->v + next_off[t] * v_size(vkind);
            }
            if (fp8) {                                 /* the scales (times 2^60), and the next chunk's */
                for (int r = 0; r < rows[t]; r++) {
                    kf[t * TILE + r] = a->ks[s_off[t] + r * a->srow_stride] * FP8_HALF;
                    vf[t * TILE + r] = a->vs[s_off[t] + r * a->srow_stride] * FP8_HALF;
                }
                for (int r = 0; r < nrows[t]; r++)    /* contiguous scales: one fetch per 16 */
                    if (r % 16 == 0 || a->srow_stride != 1) {
                        __builtin_prefetch(a->ks + next_soff[t] + r * a->srow_stride);
                        __builtin_prefetch(a->vs + next_soff[t] + r * a->srow_stride);
                    }
            }
        }
        /* every query's scores for the chunk, each fetching its share of the next chunk's K rows
         * (fp32): fetched all by the first query's, the fetches bunched in the core's line
         * buffers and the other queries' scores ran with memory idle. 2 Zen 4 cores, the builds
         * taking turns, ms a layer: one sequence at 4,096 tokens 0.222 -> 0.209, eight at 1,024
         * 0.520 -> 0.509, at 4,096 2.06 -> 2.04 (a step of the engine at 4,096: 66.8 -> 60.8 in
         * one A/B, 69.6 -> 69.4 in the next: the host's bandwidth moved more than this) */
#if K_DOT
        if (kdot)
            for (int j = 0; j < G; j++)
                for (int t = 0; t < nt; t++)
                    if (rows[t] == TILE) scores_bf16(qb + j * dim, kb[t], TILE, dim / 32, sc[j] + t * TILE);
                    else scores_bf16(qb + j * dim, kb[t], rows[t], dim / 32, sc[j] + t * TILE);
        else
#endif
        for (int j = 0; j < G; j++)
            for (int t = 0; t < nt; t++) {
                const int lo = j * TILE / G, end = (j + 1) * TILE / G, hi = end < nrows[t] ? end : nrows[t];
                if (rows[t] == TILE && ld[t] == dim)   /* rows one after another: constant offsets */
                    scores(qh + j * dim, kt[t], dim, TILE, nn, sc[j] + t * TILE, next_k[t], lo, hi);
                else if (rows[t] == TILE)
                    scores(qh + j * dim, kt[t], ld[t], TILE, nn, sc[j] + t * TILE, next_k[t], lo, hi);
                else
                    scores(qh + j * dim, kt[t], ld[t], rows[t], nn, sc[j] + t * TILE, next_k[t], lo, hi);
            }
        for (int j = 0; j < G; j++) {                  /* one softmax update per query */
            f16v s[CHUNK_TILES];
            i16v live[CHUNK_TILES];                    /* the lanes of rows the tile has */
            f16v mv = splat(-INFINITY);
            for (int t = 0; t < nt; t++) {
                s[t] = load(sc[j] + t * TILE) * a->scale;
                if (fp8) s[t] *= load(kf + t * TILE);
                live[t] = IOTA < rows[t];
                mv = vmax(mv, vselect(live[t], s[t], splat(-INFINITY)));
            }
            const float cm = hmax(mv), mx = cm > m[j] ? cm : m[j];
            const float alpha = expf(m[j] - mx);
            float sum = 0.0f;
            for (int t = 0; t < nt; t++) {
                f16v p = vselect(live[t], vexp(s[t] - mx), splat(0.0f));
                sum += hsum(p);
                if (fp8) p *= load(vf + t * TILE);
#if K_DOT
                if (kdot) {        /* pv_bf16() reads a short tile's next lane beside its odd last row:
                                    * 0 there, not 0 times vf's unset lane (a NaN would poison the sums) */
                    const f16v pz = vselect(live[t], p, splat(0.0f));
                    __m512 pv16;
                    memcpy(&pv16, &pz, sizeof pz);
                    _mm256_storeu_si256((__m256i *)(pbf[j] + t * TILE), (__m256i)_mm512_cvtneps_pbh(pv16));
                    continue;
                }
#endif
                store(sc[j] + t * TILE, p);
            }
            l[j] = l[j] * alpha + sum;
            m[j] = mx;
            if (alpha != 1.0f)
                for (int c = 0; c < dim; c += VLANES) {
                    const fnv o = loadn(acc + j * dim + c) * alpha;
                    memcpy(acc + j * dim + c, &o, sizeof o);
                }
        }
        /* p V, Q queries at a time, their outputs in registers: each V row loaded once for the
         * Q of them, and Q x nn chains of multiply-adds side by side (one query at a time, the
         * nn chains waited on the multiply-add's latency at every row) */
#if K_DOT
        if (kdot) {
            pv_all_bf16(acc, pbf, vt, vld, rows, nt, G, dim / 32, next_v, nrows);
            continue;
        }
#endif
        switch (vkind) {                               /* each kind a constant in its own call */
        case V_E4M3: pv_all(acc, sc, vt, vld, rows, nt, G, nn, dim, next_v, nrows, V_E4M3); break;
        case KV_BF16: pv_all(acc, sc, vt, vld, rows, nt, G, nn, dim, next_v, nrows, KV_BF16); break;
        case KV_FP16: pv_all(acc, sc, vt, vld, rows, nt, G, nn, dim, next_v, nrows, KV_FP16); break;
        default: pv_all(acc, sc, vt, vld, rows, nt, G, nn, dim, next_v, nrows, 0); break;
        }
    }
    if (fp8)                                           /* the outputs' other 2^60 */
        for (int i = 0; i < G * dim; i++) acc[i] *= FP8_HALF;
#if K_DOT
    if (kdot)
        for (int j = 0; j < G; j++) unpermute(acc + j * dim, dim);
#endif
}

typedef void (*item_fn)(const DecodeArgs *, const int32_t *, int64_t, const float *, int64_t, int64_t, int64_t,
                        float *, float *, float *, const Item *);
#define ITEM(G, NV) \
    static void item_##G##_##NV(const DecodeArgs *a, const int32_t *t, int64_t len, const float *q, int64_t h, \
                                int64_t b0, int64_t b1, float *m, float *l, float *acc, const Item *then) { \
        item(a, t, len, q, h, b0, b1, m, l, acc, then, G, NV); }
#define ITEMS(G) ITEM(G, 4) ITEM(G, 8)
ITEMS(1) ITEMS(2) ITEMS(3) ITEMS(4) ITEMS(5) ITEMS(6) ITEMS(7) ITEMS(8)
static const item_fn ITEM_FNS[8][2] = {
    {item_1_4, item_1_8}, {item_2_4, item_2_8}, {item_3_4, item_3_8}, {item_4_4, item_4_8},
    {item_5_4, item_5_8}, {item_6_4, item_6_8}, {item_7_4, item_7_8}, {item_8_4, item_8_8}};

/* any other geometry within the limits: the same code with G and NV read at run time */
static void item_any(const DecodeArgs *a, const int32_t *t, int64_t len, const float *q, int64_t h,
                     int64_t b0, int64_t b1, float *m, float *l, float *acc, const Item *then) {
    item(a, t, len, q, h, b0, b1, m, l, acc, then, (int)a->group, (int)(a->dim / LANES));
}

/* kv_decode's -1 cases, checked before anything is read or written (kv_decode_step checks
 * them before its first layer) */
int kv_decode_check(const DecodeArgs *a, int splits) {
    const int64_t g = a->group, d = a->dim, bs = a->block_size, nb = a->batch;
    if (g < 1 || g > MAX_GROUP || d % LANES || d > MAX_DIM || bs < 1 || nb < 1 || splits < 1 || a->half < 0 ||
        a->half > KV_FP16)
        return -1;
    for (int64_t s = 0; s < nb; s++) {
        const int64_t len = length_of(a, s), blocks = (len + bs - 1) / bs;
        if (len < 1 || blocks > a->max_blocks)
            return -1;
        for (int64_t b = 0; b < blocks; b++) {
            const int32_t blk = a->tables[s * a->table_stride + b];
            if (blk < 0 || blk >= a->num_blocks)
                return -1;
        }
    }
    return 0;
}

/* the n splits of one (sequence, KV head), items i0 .. i0 + n - 1, merged by log-sum-exp into its
 * g outputs at out (g x d) */
static void merge(const float *m, const float *l, const float *acc, int64_t i0, int64_t n, int64_t g, int64_t d,
                  float *out) {
    for (int64_t j = 0; j < g; j++) {
        float mx = -INFINITY, total = 0.0f;
        for (int64_t sp = 0; sp < n; sp++) {
            const float mi = m[(i0 + sp) * g + j];
            mx = mi > mx ? mi : mx;
        }
        float *o = out + j * d;
        for (int64_t c = 0; c < d; c++) o[c] = 0.0f;
        for (int64_t sp = 0; sp < n; sp++) {
            const int64_t at = (i0 + sp) * g + j;
            if (m[at] == -INFINITY) continue;      /* a stretch with no rows */
            const float w = expf(m[at] - mx);
            total += l[at] * w;
            const float *ai = acc + at * d;
            for (int64_t c = 0; c < d; c++) o[c] += ai[c] * w;
        }
        const float inv = 1.0f / total;
        for (int64_t c = 0; c < d; c++) o[c] *= inv;
    }
}

/* q: (batch, kv_heads * group, dim) at a stride of q_stride between sequences; out: (batch,
 * kv_heads * group, dim) contiguous. Each sequence is cut into min(splits, its blocks)
 * stretches. Returns 0, or -1 when the geometry is outside what this kernel serves or a
 * length or block id is out of range (the caller then takes the torch path, which raises). */
int kv_decode(const DecodeArgs *a, const float *q, float *out, int splits, int threads) {
    const int64_t g = a->group, d = a->dim, hk = a->kv_heads, bs = a->block_size, nb = a->batch;
    if (kv_decode_check(a, splits) != 0)
        return -1;
    int64_t items = 0, rows = 0;
    for (int64_t s = 0; s < nb; s++) {
        const int64_t len = length_of(a, s), blocks = (len + bs - 1) / bs;
        items += hk * (blocks < splits ? blocks : splits);
        rows += len;
    }
    if (rows * hk * d < SMALL)       /* waking a second thread would cost more than it saves */
        threads = 1;
    /* one allocation: the items, each sequence's first item, then each item's m, l and acc */
    char *mem = malloc(sizeof(Item) * items + sizeof(int64_t) * (nb + 1) + sizeof(float) * items * g * (d + 2));
    if (mem == NULL)
        return -1;
    Item *work = (Item *)mem;
    int64_t *first = (int64_t *)(work + items);
    float *m = (float *)(first + nb + 1), *l = m + items * g, *acc = l + items * g;
    int64_t it = 0;
    for (int64_t s = 0; s < nb; s++) {
        const int64_t blocks = (length_of(a, s) + bs - 1) / bs, n = blocks < splits ? blocks : splits;
        first[s] = it;
        for (int64_t h = 0; h < hk; h++)
            for (int64_t sp = 0; sp < n; sp++)
                work[it++] = (Item){s, h, blocks * sp / n, blocks * (sp + 1) / n};
    }
    first[nb] = it;
    const int nv = (int)(d / LANES);
    const item_fn fn = g <= 8 && (nv == 4 || nv == 8) ? ITEM_FNS[g - 1][nv / 8] : item_any;
#define RUN(i, then) fn(a, a->tables + work[i].seq * a->table_stride, length_of(a, work[i].seq), \
                        q + work[i].seq * a->q_stride, work[i].head, work[i].b0, work[i].b1, m + (i) * g, l + (i) * g, \
                        acc + (i) * g * d, then)
    /* Each thread takes runs of consecutive items, so that it knows the item after this one
     * and fetches its first chunk while this one's last computes: at 256 tokens an item is one
     * chunk, and items fetched only when they began waited on memory at every start. One
     * sequence: its items are equal, each thread one run of its share. Several: runs of a few
     * items as threads come free (short sequences beside long ones balance). */
    const int64_t run = nb == 1 ? (items + threads - 1) / threads : (items + 4 * threads - 1) / (4 * threads);
    int64_t taken = 0;
    #pragma omp parallel num_threads(threads)
    {
        for (;;) {
            int64_t i0;
            #pragma omp atomic capture
            { i0 = taken; taken += run; }
            if (i0 >= items) break;
            const int64_t i1 = i0 + run < items ? i0 + run : items;
            for (int64_t i = i0; i < i1; i++) RUN(i, i + 1 < i1 ? &work[i + 1] : NULL);
        }
        /* then the splits merged, in the same team (a team of its own cost a wake-up of the
         * threads per layer) */
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t sh = 0; sh < nb * hk; sh++) {
            const int64_t s = sh / hk, n = (first[s + 1] - first[s]) / hk;
            merge(m, l, acc, first[s] + sh % hk * n, n, g, d, out + sh * g * d);
        }
    }
    free(mem);
    return 0;
}
