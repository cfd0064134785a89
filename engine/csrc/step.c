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
 * - kv_add_rms_norm_rows, kv_silu_mul_rows: the first two over a prompt chunk's rows;
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
 * another order than torch's, so fp32 tolerance, not bits. r may come as bf16 (rh: a bf16
 * prefill's product output, widened exactly) and y may go out as bf16 (yh: rounded to nearest
 * even, the next product's input); the sums are the same either way. */
static inline void add_norm_row(float *x, const float *r, const uint16_t *rh, const float *w, float *y,
                                uint16_t *yh, int64_t k, float eps) {
    const int64_t kv = k / LANES * LANES;
    const int add = r != NULL || rh != NULL;
    f16v acc = {0};
    for (int64_t j = 0; j < kv; j += LANES) {
        f16v v = load(x + j);
        if (add) {
            v += r != NULL ? load(r + j) : load_bf16(rh + j);
            store(x + j, v);
        }
        acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t j = kv; j < k; j++) {
        if (add) x[j] += r != NULL ? r[j] : bf16_float(rh[j]);
        ss += x[j] * x[j];
    }
    const float inv = 1.0f / sqrtf(ss / (float)k + eps);
    if (yh == NULL) {
        for (int64_t j = 0; j < k; j++) y[j] = x[j] * inv * w[j];
        return;
    }
    for (int64_t j = 0; j < kv; j += LANES) store_bf16(yh + j, load(x + j) * inv * load(w + j));
    for (int64_t j = kv; j < k; j++) yh[j] = bf16_from_float(x[j] * inv * w[j]);
}

void kv_add_rms_norm(float *x, const float *r, const float *w, float *y, int64_t b, int64_t k, float eps) {
    for (int64_t i = 0; i < b; i++)
        add_norm_row(x + i * k, r != NULL ? r + i * k : NULL, NULL, w, y + i * k, NULL, k, eps);
}

/* x: (b, k) read only (r is NULL: x is not written) */
void kv_rms_norm(const float *x, const float *w, float *y, int64_t b, int64_t k, float eps) {
    kv_add_rms_norm((float *)x, NULL, w, y, b, k, eps);
}

/* ---- silu(gate) * up ------------------------------------------------------------------------ */
/* gate / (1 + e^-gate) * up: torch's formula and order (F.silu, then the product) */
static inline void silu_mul_row(const float *g, const float *u, float *o, int64_t n) {
    const int64_t nv = n / LANES * LANES;
    for (int64_t j = 0; j < nv; j += LANES) {
        const f16v gv = load(g + j);
        store(o + j, gv / (1.0f + vexp_any(-gv)) * load(u + j));
    }
    for (int64_t j = nv; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* the same on bf16 rows with torch's two roundings to bf16 (F.silu's output, then the
 * product's): each computed in fp32 from the widened inputs */
static inline void silu_mul_row_bf16(const uint16_t *g, const uint16_t *u, uint16_t *o, int64_t n) {
    const int64_t nv = n / LANES * LANES;
    for (int64_t j = 0; j < nv; j += LANES) {
        const f16v gv = load_bf16(g + j);
        const f16v s = round_bf16(gv / (1.0f + vexp_any(-gv)));
        store_bf16(o + j, s * load_bf16(u + j));
    }
    for (int64_t j = nv; j < n; j++) {
        const float gj = bf16_float(g[j]);
        o[j] = bf16_from_float(bf16_float(bf16_from_float(gj / (1.0f + expf(-gj)))) * bf16_float(u[j]));
    }
}

void kv_silu_mul(const float *gate_up, float *out, int64_t b, int64_t n) {
    for (int64_t i = 0; i < b; i++) silu_mul_row(gate_up + i * 2 * n, gate_up + i * 2 * n + n, out + i * n, n);
}

/* ---- a prefill chunk's rows ------------------------------------------------------------------ */
/* The same two ops over the hundreds of rows of a prompt chunk, threads over the rows, with
 * the casts to and from a bf16 prefill's product rows folded in. torch ran the norm as eight
 * ops and a cast, each a pass over the chunk: a 4,096-token bf16 prefill of the bundled model
 * on a 2-core Xeon spent 100 ms in its norms, 52 here. A row gets the bits it gets in a
 * decode step. Threads over the rows where the call has PARALLEL_FLOATS values, or `from`
 * rows or more (a decode step's, from 2: see kv_decode_step). */
static void add_norm_rows(float *x, const void *r, int64_t r_bf16, const float *w, void *y, int64_t y_bf16,
                          int64_t b, int64_t k, float eps, int threads, int64_t from) {
    #pragma omp parallel for num_threads(b * k >= PARALLEL_FLOATS || b >= from ? threads : 1) schedule(static)
    for (int64_t i = 0; i < b; i++)
        add_norm_row(x + i * k, r != NULL && !r_bf16 ? (const float *)r + i * k : NULL,
                     r != NULL && r_bf16 ? (const uint16_t *)r + i * k : NULL, w,
                     y_bf16 ? NULL : (float *)y + i * k, y_bf16 ? (uint16_t *)y + i * k : NULL, k, eps);
}

static void silu_mul_rows(const void *gate_up, void *out, int64_t b, int64_t n, int64_t bf16, int threads,
                          int64_t from) {
    #pragma omp parallel for num_threads(b * n >= PARALLEL_FLOATS || b >= from ? threads : 1) schedule(static)
    for (int64_t i = 0; i < b; i++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + i * 2 * n;
            silu_mul_row_bf16(g, g + n, (uint16_t *)out + i * n, n);
        } else {
            const float *g = (const float *)gate_up + i * 2 * n;
            silu_mul_row(g, g + n, (float *)out + i * n, n);
        }
    }
}

void kv_add_rms_norm_rows(float *x, const void *r, int64_t r_bf16, const float *w, void *y, int64_t y_bf16,
                          int64_t b, int64_t k, float eps, int threads) {
    add_norm_rows(x, r, r_bf16, w, y, y_bf16, b, k, eps, threads, INT64_MAX);
}

void kv_silu_mul_rows(const void *gate_up, void *out, int64_t b, int64_t n, int64_t bf16, int threads) {
    silu_mul_rows(gate_up, out, b, n, bf16, threads, INT64_MAX);
}

/* ---- the whole step -------------------------------------------------------------------------- */
static int product(const StepArgs *s, const float *x, const void *w, float *y, int64_t b, int64_t n, int64_t k,
                   int threads) {
    if (s->bf16)
        return kv_gemv_bf16(x, (const uint16_t *)w, y, b, n, k, threads) != 0 ? -2 : 0;
    kv_gemv(x, (const float *)w, y, b, n, k, threads);
    return 0;
}

/* The norms, SiLU and RoPE write run on the step's threads from two rows up: between the
 * products the threads are awake, and each row was written by both (each thread its share of
 * the product's columns), so one thread alone fetched half of it from the other core. B = 8 at
 * 256 tokens on 2 Zen 4 cores spent 1.5-1.9 ms a step in these, against 0.2 for B = 1. A row's
 * bits do not depend on the thread that computes it. */
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
        WriteArgs w = s->write;
        w.k = l->k, w.v = l->v, w.ks = l->ks, w.vs = l->vs;
        kv_prefetch_slots(&w, s->slots, b);   /* the slots' lines on their way while the products run */
        add_norm_rows(x, res, 0, l->attn_norm, h, 0, b, hid, s->eps, threads, 2);
        if (product(s, h, l->wqkv, qkv, b, nqkv, hid, threads) != 0)
            return -2;
        kv_rope_write_rows(&w, qkv, nqkv, hq, s->cos, s->sin, s->pos, s->slots, q, b, threads, 2);
        DecodeArgs at = *a;
        at.k = l->k, at.v = l->v, at.ks = l->ks, at.vs = l->vs;
        if (kv_decode(&at, q, o, splits, threads) != 0 || product(s, o, l->wo, att, b, hid, hq * d, threads) != 0)
            return -2;
        add_norm_rows(x, att, 0, l->mlp_norm, h, 0, b, hid, s->eps, threads, 2);
        if (product(s, h, l->w_gate_up, gu, b, 2 * inter, hid, threads) != 0)
            return -2;
        silu_mul_rows(gu, act, b, inter, 0, threads, 2);
        if (product(s, act, l->w_down, att, b, hid, inter, threads) != 0)
            return -2;
        res = att;
    }
    add_norm_rows(x, res, 0, s->final_norm, h, 0, b, hid, s->eps, threads, 2);
    return product(s, h, s->lm_head, logits, b, s->vocab, hid, threads);
}
