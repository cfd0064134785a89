/* A step's new K/V rows written into their pool slots: copied for an fp32 cache, quantized to
 * e4m3 with one scale per (row, KV head) for an fp8 one, with the bytes torch's own conversion
 * gives. The rows may belong to any number of sequences: each carries its own flat slot. */
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

/* rows t = 0 .. n-1 go to flat slots[t] = block * block_size + offset. fp8: one scale per
 * (row, KV head), amax / 448 (amax at least 1e-12), each value divided by it, clamped to +-448
 * and rounded: the same float32 operations, in the same order, as attention.quantize_fp8. */
int kv_write(const WriteArgs *a, const int64_t *slots, int64_t n, int threads) {
    const int64_t d = a->dim;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] < 0 || slots[t] >= a->num_blocks * a->block_size)
            return -1;
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
    return 0;
}

void kv_sizes(int64_t *sizes) {
    sizes[0] = sizeof(DecodeArgs);
    sizes[1] = sizeof(WriteArgs);
}
