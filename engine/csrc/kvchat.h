/* The C kernels' interface: what engine/native_abi.py mirrors with ctypes and
 * tests/csrc/driver.c calls directly. Plain C, no torch headers: torch's C++ ABI differs
 * between versions, C's does not. kv_sizes() lets a caller check that its copies of the four
 * structures have this layout before it calls anything. */
#ifndef KVCHAT_H
#define KVCHAT_H

#include <stdint.h>

#define KV_BF16 1       /* DecodeArgs.half, WriteArgs.half */
#define KV_FP16 2

typedef struct {
    const void *k, *v;            /* the layer's K and V storage: float32, bf16 or fp16 bits, or e4m3 bytes */
    const float *ks, *vs;         /* fp8: one scale per (slot, KV head); NULL otherwise */
    const int32_t *tables;        /* (batch, table_stride): each sequence's block ids */
    const int32_t *lens;          /* (batch,): rows each sequence reads, its new one included;
                                     NULL: one sequence of `length` rows */
    int64_t table_stride, max_blocks, num_blocks;
    int64_t block_stride, row_stride, head_stride;            /* in elements, for k and v */
    int64_t sblock_stride, srow_stride, shead_stride;         /* in elements, for ks and vs */
    int64_t batch, block_size, kv_heads, group, dim;
    int64_t q_stride;             /* elements between sequences in q; heads and dims contiguous */
    int64_t length;
    float scale;
    int64_t half;                 /* a 16-bit cache: KV_BF16 or KV_FP16 (ks, vs NULL); 0: fp32, or fp8 where ks is set */
} DecodeArgs;

typedef struct {
    void *k, *v;                  /* the layer's cache storage, as in DecodeArgs */
    float *ks, *vs;               /* fp8 scales, or NULL for an fp32, bf16 or fp16 cache */
    int64_t block_stride, row_stride, head_stride, sblock_stride, srow_stride, shead_stride;
    int64_t num_blocks, block_size, kv_heads, dim;
    const float *src_k, *src_v;   /* the new rows: (rows, kv_heads, dim), unit stride in dim */
    int64_t k_row_stride, v_row_stride, src_head_stride;
    int64_t half;                 /* as in DecodeArgs; each value rounded to nearest even */
} WriteArgs;

/* One layer's weights and cache for kv_decode_step. */
typedef struct {
    const void *wqkv, *wo, *w_gate_up, *w_down;   /* (n, k) fp32, or bf16 bits where StepArgs.bf16 */
    const float *attn_norm, *mlp_norm;            /* (hidden,) */
    void *k, *v;                                  /* the layer's cache, as in DecodeArgs */
    float *ks, *vs;                               /* fp8 scales, or NULL */
} LayerArgs;

/* A decode step of `attn.batch` rows, one per sequence, through every layer (step.c). attn and
 * write carry the batch's tables, lengths and the cache geometry; their k, v, ks, vs (and
 * write's sources) are set per layer from `layers`. */
typedef struct {
    DecodeArgs attn;
    WriteArgs write;
    const LayerArgs *layers;
    const float *final_norm;      /* (hidden,) */
    const void *lm_head;          /* (vocab, hidden), fp32 or bf16 as the layers' */
    const float *cos, *sin;       /* (n_pos, dim) RoPE tables, rotate-half layout */
    const int64_t *pos, *slots;   /* (batch,) each row's position and flat cache slot */
    int64_t n_layers, hidden, heads, inter, vocab, n_pos, bf16;
    float eps;
} StepArgs;

/* x: (b, k); w: (n, k); y: (b, n) = x w^T; all contiguous fp32 (gemv.c) */
void kv_gemv(const float *x, const float *w, float *y, int64_t b, int64_t n, int64_t k, int threads);
/* the same with w in bf16 bits; 0, or -1 when out of memory (gemv_bf16.c) */
int kv_gemv_bf16(const float *x, const uint16_t *w, float *y, int64_t b, int64_t n, int64_t k, int threads);
/* 1 when kv_gemv_bf16 uses AVX512-BF16's vdpbf16ps (x rounded to bf16), 0 when it widens w (gemv_bf16.c) */
int kv_bf16_native(void);
/* kv_gemv_bf16's rows on AMX tiles (gemv_amx.c): 0, or -1 where the tiles do not serve (no AMX in
 * this build or from the OS, kv_amx_use(0), 33 rows or more, n % 16 or k % 32) */
int kv_gemv_amx(const float *x, const uint16_t *w, float *y, int64_t b, int64_t n, int64_t k, int threads);
/* 1 when the tiles may serve: built with AMX, granted by the OS, not set aside */
int kv_amx(void);
/* 0 sets the tiles aside (vdpbf16ps serves), 1 allows them; returns the previous setting */
int kv_amx_use(int on);
/* rows of x per tile in kv_gemv: 8 with AVX-512, else 2 (vec.h: the tile shapes) */
int kv_gemv_tile(void);
/* the sum of x's n floats, threads over contiguous shares: the bench's read probe (gemv.c) */
double kv_read_sum(const float *x, int64_t n, int threads);
/* x, y: (b, k); w: (k,): y = x / sqrt(mean(x^2) + eps) * w (gemv.c) */
void kv_rms_norm(const float *x, const float *w, float *y, int64_t b, int64_t k, float eps);
/* q, out: (batch, heads, dim); 0, or -1 when declined (decode.c) */
int kv_decode(const DecodeArgs *a, const float *q, float *out, int splits, int threads);
/* n rows into flat slots; 0, or -1 (nothing written) when a slot is outside the pool (write.c) */
int kv_write(const WriteArgs *a, const int64_t *slots, int64_t n, int threads);
/* x: (b, k) set to x + r when r is not NULL; y: (b, k) = x / sqrt(mean(x^2) + eps) * w (step.c) */
void kv_add_rms_norm(float *x, const float *r, const float *w, float *y, int64_t b, int64_t k, float eps);
/* gate_up: (b, 2 n), gate then up; out: (b, n) = silu(gate) * up (step.c) */
void kv_silu_mul(const float *gate_up, float *out, int64_t b, int64_t n);
/* a prompt chunk's rows, threads over them (step.c): kv_add_rms_norm with r in bf16 bits where
 * r_bf16 and y rounded to bf16 bits where y_bf16; kv_silu_mul on fp32 rows, or on bf16 bits in
 * and out where bf16 (torch's two roundings) */
void kv_add_rms_norm_rows(float *x, const void *r, int64_t r_bf16, const float *w, void *y, int64_t y_bf16,
                          int64_t b, int64_t k, float eps, int threads);
void kv_silu_mul_rows(const void *gate_up, void *out, int64_t b, int64_t n, int64_t bf16, int threads);
/* qkv: n rows at a stride of qkv_stride, each `heads` q heads, kv_heads k heads, kv_heads v
 * heads of dim floats; cos, sin: (n_pos, dim). q_out: (n, heads, dim) = RoPE(q); RoPE(k) and v
 * go to their slots as kv_write writes them. 0, or -1 (nothing written) when a slot or a
 * position is out of range (write.c) */
int kv_rope_write(const WriteArgs *a, const float *qkv, int64_t qkv_stride, int64_t heads, const float *cos,
                  const float *sin, int64_t n_pos, const int64_t *pos, const int64_t *slots, float *q_out, int64_t n,
                  int threads);
/* a prompt chunk's attention to the cached prefix (o1, l1) and to itself (o2, l2) merged by
 * log-sum-exp into out (t, heads, d), fp32 or bf16 as the inputs; st: the inputs' element
 * strides (merge.c) */
void kv_merge_two(const void *o1, const float *l1, const void *o2, const float *l2, const int64_t *st, void *out,
                  int64_t t, int64_t heads, int64_t group, int64_t d, int64_t bf16, int threads);
/* x: (batch, hidden) the rows' embeddings, left holding the residual stream; work: (batch,
 * 2 hidden + (heads + 2 kv_heads) dim + 2 heads dim + 3 inter) floats; logits: (batch, vocab).
 * 0; -1 (nothing written) when a length, block id, slot or position is out of range or the
 * geometry is not served; -2 when out of memory (step.c) */
int kv_decode_step(const StepArgs *s, float *x, float *work, float *logits, int splits, int threads);
/* sizes[0..3] = sizeof DecodeArgs, WriteArgs, LayerArgs, StepArgs (write.c) */
void kv_sizes(int64_t *sizes);

/* inside the library: kv_decode's checks alone (decode.c); the rows of kv_rope_write
 * without its checks (write.c) */
int kv_decode_check(const DecodeArgs *a, int splits);
void kv_rope_write_rows(const WriteArgs *a, const float *qkv, int64_t qkv_stride, int64_t heads, const float *cos,
                        const float *sin, const int64_t *pos, const int64_t *slots, float *q_out, int64_t n,
                        int threads, int64_t rows);
/* the cache lines of n rows' slots fetched for writing (write.c) */
void kv_prefetch_slots(const WriteArgs *a, const int64_t *slots, int64_t n);

#endif
