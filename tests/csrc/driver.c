/* The C kernels run as a program, for a CPU this machine is not (tests/test_native_arm.py
 * cross-compiles it for aarch64 and runs it under qemu-user): commands in on stdin, results
 * out on stdout, both as little-endian binary.
 *
 *   1 gemv:   int64 b, n, k; float x[b*k], w[n*k]                -> float y[b*n]
 *   2 rms:    int64 b, k; float eps, x[b*k], w[k]                 -> float y[b*k]
 *   3 decode: int64 batch, hk, g, d, bs, nb, width, cache; float scale; int32 tables[batch*width],
 *             lens[batch]; float q[batch*hk*g*d]; k, v[nb*bs*hk*d] (cache 0: float, 1: fp8 bytes,
 *             2: bf16 bits, 3: fp16 bits); if fp8: float ks, vs[nb*bs*hk]
 *                                                                 -> int32 rc; float out[batch*hk*g*d]
 *   4 write:  int64 rows, hk, d, nb, bs, cache; float k[rows*hk*d], v[rows*hk*d]; int64 slots[rows]
 *                                                                 -> int32 rc; the caches, then fp8's scales
 *   5 add+norm: int64 b, k; float eps, x[b*k], r[b*k], w[k]       -> float x + r [b*k], y[b*k]
 *   6 silu*up:  int64 b, n; float gate_up[b*2n]                   -> float out[b*n]
 *   0 end.
 */
#include <stdio.h>
#include <stdlib.h>

#include "kvchat.h"

static void *take(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL || fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "driver: short input\n");
        exit(2);
    }
    return p;
}

static int64_t i64(void) {
    int64_t *p = take(8), v = *p;
    free(p);
    return v;
}

static float f32(void) {
    float *p = take(4), v = *p;
    free(p);
    return v;
}

static void give(const void *p, size_t n) { fwrite(p, 1, n, stdout); }

int main(void) {
    for (;;) {
        const int64_t kind = i64();
        if (kind == 0) break;
        if (kind == 1) {
            const int64_t b = i64(), n = i64(), k = i64();
            float *x = take(4 * b * k), *w = take(4 * n * k), *y = malloc(4 * b * n);
            kv_gemv(x, w, y, b, n, k, 1);
            give(y, 4 * b * n);
            free(x), free(w), free(y);
        } else if (kind == 5) {
            const int64_t b = i64(), k = i64();
            const float eps = f32();
            float *x = take(4 * b * k), *r = take(4 * b * k), *w = take(4 * k), *y = malloc(4 * b * k);
            kv_add_rms_norm(x, r, w, y, b, k, eps);
            give(x, 4 * b * k);
            give(y, 4 * b * k);
            free(x), free(r), free(w), free(y);
        } else if (kind == 6) {
            const int64_t b = i64(), n = i64();
            float *gu = take(8 * b * n), *out = malloc(4 * b * n);
            kv_silu_mul(gu, out, b, n);
            give(out, 4 * b * n);
            free(gu), free(out);
        } else if (kind == 2) {
            const int64_t b = i64(), k = i64();
            const float eps = f32();
            float *x = take(4 * b * k), *w = take(4 * k), *y = malloc(4 * b * k);
            kv_rms_norm(x, w, y, b, k, eps);
            give(y, 4 * b * k);
            free(x), free(w), free(y);
        } else if (kind == 3) {
            const int64_t batch = i64(), hk = i64(), g = i64(), d = i64(), bs = i64(), nb = i64(), width = i64(),
                          cache = i64(), fp8 = cache == 1;
            const float scale = f32();
            int32_t *tables = take(4 * batch * width), *lens = take(4 * batch);
            float *q = take(4 * batch * hk * g * d);
            const size_t el = fp8 ? 1 : (cache >= 2 ? 2 : 4), cells = nb * bs * hk * d;
            void *k = take(el * cells), *v = take(el * cells);
            float *ks = fp8 ? take(4 * nb * bs * hk) : NULL, *vs = fp8 ? take(4 * nb * bs * hk) : NULL;
            float *out = malloc(4 * batch * hk * g * d);
            DecodeArgs a = {k, v, ks, vs, tables, lens, width, width, nb, bs * hk * d, hk * d, d,
                            bs * hk, hk, 1, batch, bs, hk, g, d, hk * g * d, 0, scale, cache >= 2 ? cache - 1 : 0};
            const int32_t rc = kv_decode(&a, q, out, 2, 1);
            give(&rc, 4);
            give(out, 4 * batch * hk * g * d);
            free(tables), free(lens), free(q), free(k), free(v), free(ks), free(vs), free(out);
        } else if (kind == 4) {
            const int64_t rows = i64(), hk = i64(), d = i64(), nb = i64(), bs = i64(), cache = i64(), fp8 = cache == 1;
            float *src_k = take(4 * rows * hk * d), *src_v = take(4 * rows * hk * d);
            int64_t *slots = take(8 * rows);
            const size_t el = fp8 ? 1 : (cache >= 2 ? 2 : 4), cells = nb * bs * hk * d;
            void *k = calloc(cells, el), *v = calloc(cells, el);
            float *ks = fp8 ? calloc(nb * bs * hk, 4) : NULL, *vs = fp8 ? calloc(nb * bs * hk, 4) : NULL;
            WriteArgs a = {k, v, ks, vs, bs * hk * d, hk * d, d, bs * hk, hk, 1, nb, bs, hk, d,
                           src_k, src_v, hk * d, hk * d, d, cache >= 2 ? cache - 1 : 0};
            const int32_t rc = kv_write(&a, slots, rows, 1);
            give(&rc, 4);
            give(k, el * cells);
            give(v, el * cells);
            if (fp8) {
                give(ks, 4 * nb * bs * hk);
                give(vs, 4 * nb * bs * hk);
            }
            free(src_k), free(src_v), free(slots), free(k), free(v), free(ks), free(vs);
        } else {
            fprintf(stderr, "driver: unknown command %lld\n", (long long)kind);
            return 2;
        }
    }
    return 0;
}
