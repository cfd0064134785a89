/* A prompt chunk after a cached prefix: its two partial attentions merged.
 *
 * A chunk attends to the cached prefix (every pair allowed) and to itself (causal) as two calls
 * of torch's fused CPU kernel, each with its log-sum-exp (cpu_attention.prefix_then_causal).
 * Merging them in torch took a stack, a softmax over the two, a product, a sum and two casts,
 * each a pass over the chunk's outputs (about 1.5 ms a layer for 512 rows of the bundled
 * model's 9 heads on 2 cores, against 1.9 for the two kernel calls; a tenth of a 4,096-token
 * prefill); here one pass, threads over the rows, written straight in (t, heads, dim) order. With m the larger of the
 * two log-sum-exps, out = (e^(l1-m) o1 + e^(l2-m) o2) / (e^(l1-m) + e^(l2-m)) in fp32, rounded
 * to bf16 where the outputs are bf16: torch's formula (softmax's weights, then their sum).
 * o1 holds each KV head's `group` query heads one after the other (query head h = kvh * group
 * + j at row j * t + r of KV head kvh: the prefix call folds the group into its rows); o2 one
 * row per (query head, r). st: element strides of o1 (KV head, row), l1 (KV head, row), o2
 * (head, row), l2 (head, row); d is unit stride. */
#include "kvchat.h"
#include "vec.h"

static inline void merge_two_row(const void *o1, const void *o2, float w1, float w2, void *out, int64_t d, int bf16) {
    const int64_t dv = d / LANES * LANES;
    if (bf16) {
        const uint16_t *a = o1, *b = o2;
        uint16_t *o = out;
        for (int64_t c = 0; c < dv; c += LANES) store_bf16(o + c, load_bf16(a + c) * w1 + load_bf16(b + c) * w2);
        for (int64_t c = dv; c < d; c++) o[c] = bf16_from_float(bf16_float(a[c]) * w1 + bf16_float(b[c]) * w2);
    } else {
        const float *a = o1, *b = o2;
        float *o = out;
        for (int64_t c = 0; c < dv; c += LANES) store(o + c, load(a + c) * w1 + load(b + c) * w2);
        for (int64_t c = dv; c < d; c++) o[c] = a[c] * w1 + b[c] * w2;
    }
}

void kv_merge_two(const void *o1, const float *l1, const void *o2, const float *l2, const int64_t *st, void *out,
                  int64_t t, int64_t heads, int64_t group, int64_t d, int64_t bf16, int threads) {
    const int64_t size = bf16 ? 2 : 4;
    #pragma omp parallel for num_threads(t * heads * d >= PARALLEL_FLOATS ? threads : 1) schedule(static)
    for (int64_t r = 0; r < t; r++)
        for (int64_t h = 0; h < heads; h++) {
            const int64_t kvh = h / group, r1 = (h % group) * t + r;
            const float a = l1[kvh * st[2] + r1 * st[3]], b = l2[h * st[6] + r * st[7]];
            const float m = a > b ? a : b, e1 = expf(a - m), e2 = expf(b - m), s = e1 + e2;
            merge_two_row((const char *)o1 + (kvh * st[0] + r1 * st[1]) * size,
                          (const char *)o2 + (h * st[4] + r * st[5]) * size, e1 / s, e2 / s,
                          (char *)out + (r * heads + h) * d * size, d, (int)bf16);
        }
}
