/* A step's new K/V rows written into their pool slots: copied for an fp32 cache, rounded to
 * bf16 or fp16 for a 16-bit one, quantized to
 * e4m3 with one scale per (row, KV head) for an fp8 one, with the bytes torch's own conversion
 * gives. The rows may belong to any number of sequences: each carries its own flat slot.
 * kv_rope_write does the same for K straight out of the fused qkv projection, rotated on the
 * way (and rotates q beside it): one pass over the new rows instead of torch's six ops. */
#include "kvchat.h"
#include "vec.h"

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

/* float32 -> fp16 bits, rounding to nearest even, as torch's conversion (c10's
 * fp16_ieee_from_fp32_value): 65520 and up to inf, NaN to 0x7E00, each with its sign */
static inline uint16_t fp16_from_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    bits &= 0x7FFFFFFFu;
    if (bits > 0x7F800000u) return sign | 0x7E00u;
    if (bits >= 0x477FF000u) return sign | 0x7C00u;
    if (bits < 0x38800000u) {               /* below 2^-14: an fp16 subnormal, rounded by an fp32 add */
        float x;
        memcpy(&x, &bits, 4);
        x += 0.5f;                          /* the spacing at 0.5, 2^-24, is fp16's subnormal step */
        memcpy(&bits, &x, 4);
        return sign | (uint16_t)(bits - 0x3F000000u);
    }
    bits += ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((bits >> 13) & 1u);
    return sign | (uint16_t)(bits >> 13);
}

/* one KV head's row x (dim floats) into flat slot `slot`: copied (bf16, fp16: rounded), or for an fp8 cache with one
 * scale per (row, KV head), amax / 448 (amax at least 1e-12), each value divided by it,
 * clamped to +-448 and rounded: the same float32 operations, in the same order, as
 * attention.quantize_fp8. side 0 is K, 1 is V. */
static inline void put(const WriteArgs *a, int64_t slot, int64_t h, int side, const float *x) {
    const int64_t d = a->dim, blk = slot / a->block_size, off = slot % a->block_size;
    const int64_t dst = blk * a->block_stride + off * a->row_stride + h * a->head_stride;
    if (a->ks == NULL && a->half) {
        uint16_t *out = (uint16_t *)(side ? a->v : a->k) + dst;
        if (a->half == KV_BF16)
            for (int64_t c = 0; c < d; c++) out[c] = bf16_from_float(x[c]);
        else
            for (int64_t c = 0; c < d; c++) out[c] = fp16_from_float(x[c]);
        return;
    }
    if (a->ks == NULL) {
        memcpy((float *)(side ? a->v : a->k) + dst, x, sizeof(float) * d);
        return;
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

/* the cache lines rows t = 0 .. n-1 will be written to (kv_rope_write_rows), fetched for writing
 * ahead of time: kv_decode_step asks before a layer's products, so that the writes after them
 * do not wait on memory one slot at a time */
void kv_prefetch_slots(const WriteArgs *a, const int64_t *slots, int64_t n) {
    const int64_t size = a->ks != NULL ? 1 : a->half ? 2 : 4, bytes = a->dim * size;
    for (int64_t t = 0; t < n; t++) {
        const int64_t blk = slots[t] / a->block_size, off = slots[t] % a->block_size;
        for (int64_t h = 0; h < a->kv_heads; h++) {
            const int64_t dst = (blk * a->block_stride + off * a->row_stride + h * a->head_stride) * size;
            for (int64_t c = 0; c < bytes; c += 64) {
                __builtin_prefetch((char *)a->k + dst + c, 1, 3);
                __builtin_prefetch((char *)a->v + dst + c, 1, 3);
            }
            if (a->ks != NULL) {
                const int64_t at = blk * a->sblock_stride + off * a->srow_stride + h * a->shead_stride;
                __builtin_prefetch(a->ks + at, 1, 3);
                __builtin_prefetch(a->vs + at, 1, 3);
            }
        }
    }
}

static int slots_in_pool(const WriteArgs *a, const int64_t *slots, int64_t n) {
    if (a->half < 0 || a->half > KV_FP16)
        return 0;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= a->num_blocks * a->block_size)
            return 0;
    return 1;
}

/* rows t = 0 .. n-1 go to flat slots[t] = block * block_size + offset */
int kv_write(const WriteArgs *a, const int64_t *slots, int64_t n, int threads) {
    if (!slots_in_pool(a, slots, n))
        return -1;
    #pragma omp parallel for num_threads(n * a->kv_heads * a->dim > PARALLEL_FLOATS ? threads : 1) schedule(static)
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < a->kv_heads; h++) {
            put(a, slots[t], h, 0, a->src_k + t * a->k_row_stride + h * a->src_head_stride);
            put(a, slots[t], h, 1, a->src_v + t * a->v_row_stride + h * a->src_head_stride);
        }
    return 0;
}

/* ---- RoPE on the way in -------------------------------------------------------------------- */
/* rotate-half RoPE of one head: out = x cos + (-x2, x1) sin, with c, s the position's (dim,)
 * rows of the tables (each half repeated). The roundings of model.apply_rope: a product, a
 * product, their difference or sum (one fused multiply-add where the target has it). */
static inline void rope_head(const float *x, const float *c, const float *s, float *out, int64_t d) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        out[j] = x[j] * c[j] - x[j + half] * s[j];
        out[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
    }
}

/* threads: as many as serve; 1 below PARALLEL_FLOATS values, unless `rows` rows or more (a decode
 * step's rows, kv_decode_step: its threads are already awake) */
void kv_rope_write_rows(const WriteArgs *a, const float *qkv, int64_t qkv_stride, int64_t heads, const float *cos,
                        const float *sin, const int64_t *pos, const int64_t *slots, float *q_out, int64_t n,
                        int threads, int64_t rows) {
    const int64_t d = a->dim, hk = a->kv_heads;
    #pragma omp parallel for num_threads(n * (heads + 2 * hk) * d > PARALLEL_FLOATS || n >= rows ? threads : 1) \
        schedule(static)
    for (int64_t t = 0; t < n; t++) {
        const float *row = qkv + t * qkv_stride, *c = cos + pos[t] * d, *s = sin + pos[t] * d;
        float k[1024];     /* one rotated K head: dim is at most 1024 (kv_rope_write checks; the step 256) */
        for (int64_t h = 0; h < heads; h++) rope_head(row + h * d, c, s, q_out + (t * heads + h) * d, d);
        for (int64_t h = 0; h < hk; h++) {
            rope_head(row + (heads + h) * d, c, s, k, d);
            put(a, slots[t], h, 0, k);
            put(a, slots[t], h, 1, row + (heads + hk + h) * d);
        }
    }
}

int kv_rope_write(const WriteArgs *a, const float *qkv, int64_t qkv_stride, int64_t heads, const float *cos,
                  const float *sin, int64_t n_pos, const int64_t *pos, const int64_t *slots, float *q_out, int64_t n,
                  int threads) {
    if (a->dim % 2 || a->dim > 1024 || !slots_in_pool(a, slots, n))
        return -1;
    for (int64_t t = 0; t < n; t++)
        if (pos[t] < 0 || pos[t] >= n_pos)
            return -1;
    kv_rope_write_rows(a, qkv, qkv_stride, heads, cos, sin, pos, slots, q_out, n, threads, INT64_MAX);
    return 0;
}

void kv_sizes(int64_t *sizes) {
    sizes[0] = sizeof(DecodeArgs);
    sizes[1] = sizeof(WriteArgs);
    sizes[2] = sizeof(LayerArgs);
    sizes[3] = sizeof(StepArgs);
}
