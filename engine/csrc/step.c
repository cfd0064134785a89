/* What surrounds the products in a decode step, and the whole step in one call.
 *
 * Between its two kernels (gemv.c's products, decode.c's attention) a decode step in torch ran
 * about 1,800 small ops and 240 ctypes calls (the residual adds, RoPE, SiLU, the slicing):
 * at two to six microseconds each, a fifth of a step on a busy 2-core machine. Here they are
 * fused where the data already is:
 * - kv_add_rms_norm: the residual add and the next RMSNorm in one pass over the row;
 * - kv_silu_mul: SiLU(gate) * up out of the fused gate/up projection, into the down
 *   projection's input;
 * - kv_rope_write (write.c): RoPE on q and k and the cache write in one pass;
 * - kv_decode_step: every layer of a decode step of B rows (one per sequence) and the
 *   logits, calling the kernels above and the products and attention in order: one call
 *   from Python per step instead of about eight per layer.
 * The arithmetic is Llama.forward's; the sums are the kernels' own (gemv.c, decode.c), so a
 * row of a batch gets the bits it gets alone.
 */
#include "kvchat.h"
#include "vec.h"

/* e^x for any x, 16 at a time: x = n ln2 + r with n = round(x / ln2), r taken from x with ln2
 * in two parts (Cody and Waite), so r's error stays within u |r| at any |x| (a single
 * product x / ln2 would carry |x| u into the result); e^r by its Taylor series to r^7 (under
 * 1e-8 relative for |r| <= ln2 / 2), 2^n added to the exponent. Below -87 the result is
 * e^-87 (1.6e-38, where 1 + it is 1 all the same); past 88.72 (e^x near fp32's largest) it is
 * inf, as torch's exp gives, so that silu of a very negative gate is -0 as in torch. */
static inline f16v vexp_any(f16v x) {
    const i16v lo = x < -87.0f, hi = x > 88.72f;
    x = vselect(lo, splat(-87.0f), x);
    x = vselect(hi, splat(88.72f), x);
    const f16v f = x * 1.4426950408889634f + 0.5f;
    i16v n = __builtin_convertvector(f, i16v);                  /* toward zero ... */
    n += (i16v)(__builtin_convertvector(n, f16v) > f);           /* ... then floor: true is -1 */
    const f16v nf = __builtin_convertvector(n, f16v);
    const f16v r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187e-06f;  /* ln2 = hi + lo; n hi exact */
    const f16v p = vexp_poly(r);
    const i16v e = (i16v)p + (n << 23);
    return vselect(hi, splat(INFINITY), (f16v)e);
}

/* ---- x += r; y = x / sqrt(mean(x^2) + eps) * w, row by row ---------------------------------- */
/* torch's CPU rms_norm is eight ops, about 27 us for one row of 576 (measured), and the add
 * before it one more. The squares are summed in sixteen lanes, then pairwise, then the tail:
 * another order than torch's, so fp32 tolerance, not bits. */
static inline void add_norm_row(float *x, const float *r, const float *w, float *y, int64_t k, float eps) {
    const int64_t kv = k / LANES * LANES;
    f16v acc = {0};
    for (int64_t j = 0; j < kv; j += LANES) {
        f16v v = load(x + j);
        if (r != NULL) {
            v += load(r + j);
            store(x + j, v);
        }
        acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t j = kv; j < k; j++) {
        if (r != NULL) x[j] += r[j];
        ss += x[j] * x[j];
    }
    const float inv = 1.0f / sqrtf(ss / (float)k + eps);
    for (int64_t j = 0; j < k; j++) y[j] = x[j] * inv * w[j];
}

void kv_add_rms_norm(float *x, const float *r, const float *w, float *y, int64_t b, int64_t k, float eps) {
    for (int64_t i = 0; i < b; i++) add_norm_row(x + i * k, r != NULL ? r + i * k : NULL, w, y + i * k, k, eps);
}

/* x: (b, k) read only (r is NULL: x is not written) */
void kv_rms_norm(const float *x, const float *w, float *y, int64_t b, int64_t k, float eps) {
    kv_add_rms_norm((float *)x, NULL, w, y, b, k, eps);
}

/* ---- silu(gate) * up ------------------------------------------------------------------------ */
/* gate / (1 + e^-gate) * up: torch's formula and order (F.silu, then the product) */
void kv_silu_mul(const float *gate_up, float *out, int64_t b, int64_t n) {
    const int64_t nv = n / LANES * LANES;
    for (int64_t i = 0; i < b; i++) {
        const float *g = gate_up + i * 2 * n, *u = g + n;
        float *o = out + i * n;
        for (int64_t j = 0; j < nv; j += LANES) {
            const f16v gv = load(g + j);
            store(o + j, gv / (1.0f + vexp_any(-gv)) * load(u + j));
        }
        for (int64_t j = nv; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* ---- the whole step -------------------------------------------------------------------------- */
static int product(const StepArgs *s, const float *x, const void *w, float *y, int64_t b, int64_t n, int64_t k,
                   int threads) {
    if (s->bf16)
        return kv_gemv_bf16(x, (const uint16_t *)w, y, b, n, k, threads) != 0 ? -2 : 0;
    kv_gemv(x, (const float *)w, y, b, n, k, threads);
    return 0;
}

int kv_decode_step(const StepArgs *s, float *x, float *work, float *logits, int splits, int threads) {
    const DecodeArgs *a = &s->attn;
    const int64_t b = a->batch, hid = s->hidden, hq = s->heads, hk = a->kv_heads, d = a->dim, inter = s->inter;
    const int64_t nqkv = (hq + 2 * hk) * d;
    if (kv_decode_check(a, splits) != 0 || hq != hk * a->group || a->q_stride != hq * d)
        return -1;
    for (int64_t t = 0; t < b; t++)
        if (s->slots[t] < 0 || s->slots[t] >= s->write.num_blocks * s->write.block_size ||
            s->pos[t] < 0 || s->pos[t] >= s->n_pos)
            return -1;
    float *h = work, *qkv = h + b * hid, *q = qkv + b * nqkv, *o = q + b * hq * d, *att = o + b * hq * d;
    float *gu = att + b * hid, *act = gu + 2 * b * inter;
    const float *res = NULL;      /* the last block's output, added to x before the next norm */
    for (int64_t i = 0; i < s->n_layers; i++) {
        const LayerArgs *l = s->layers + i;
        kv_add_rms_norm(x, res, l->attn_norm, h, b, hid, s->eps);
        if (product(s, h, l->wqkv, qkv, b, nqkv, hid, threads) != 0)
            return -2;
        WriteArgs w = s->write;
        w.k = l->k, w.v = l->v, w.ks = l->ks, w.vs = l->vs;
        kv_rope_write_rows(&w, qkv, nqkv, hq, s->cos, s->sin, s->pos, s->slots, q, b, threads);
        DecodeArgs at = *a;
        at.k = l->k, at.v = l->v, at.ks = l->ks, at.vs = l->vs;
        if (kv_decode(&at, q, o, splits, threads) != 0 || product(s, o, l->wo, att, b, hid, hq * d, threads) != 0)
            return -2;
        kv_add_rms_norm(x, att, l->mlp_norm, h, b, hid, s->eps);
        if (product(s, h, l->w_gate_up, gu, b, 2 * inter, hid, threads) != 0)
            return -2;
        kv_silu_mul(gu, act, b, inter);
        if (product(s, act, l->w_down, att, b, hid, inter, threads) != 0)
            return -2;
        res = att;
    }
    kv_add_rms_norm(x, res, s->final_norm, h, b, hid, s->eps);
    return product(s, h, s->lm_head, logits, b, s->vocab, hid, threads);
}
