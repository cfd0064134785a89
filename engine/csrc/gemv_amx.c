/* y = x W^T for a decode step's rows (1 to 32) against bf16 weights, on AMX tiles (Sapphire
 * Rapids and later Xeons).
 *
 * With vdpbf16ps (gemv_bf16.c) one row is a read of W, but eight rows are not: the bundled
 * model's products took 9.3 ms a step for one row and 13.8 for eight, the multiply-adds
 * (2.2 GFLOP) no longer hidden under the 269 MB read. tdpbf16ps does a 16 x 16 x 32 block of
 * them in one instruction, so here 1 to 32 rows cost one read of W:
 * - tdpbf16ps multiplies a 16 x 32 bf16 tile A by a 32 x 16 tile B laid out in pairs (row p of
 *   B holds, for each of 16 columns, the two bf16 at k = 2p and 2p + 1) into 16 x 16 fp32;
 * - A is 16 rows of W where they lie, 64 bytes of each (W is row-major); B is x's rows rounded
 *   to bf16 (nearest even, as gemv_bf16.c rounds them) with their pairs transposed, once per
 *   call: at most 32 x k values;
 * - each tile of sums holds 16 outputs of each of up to 16 rows of x, written out through a
 *   small transpose.
 * Each thread takes a contiguous run of W's rows and fetches each row some k steps ahead of
 * its loads, the stream running on into the next rows. One or two rows of x: 16 weight rows at
 * a time, 8 steps ahead, which reads W as fast as vdpbf16ps does (8.8-9.0 ms for a step of
 * the bundled model's products either way, weights from memory; 32 rows at a time 4 steps
 * ahead were 5-10% slower, 4 or 12 steps ahead 4-10%). More rows: 32 at a time, 4 ahead (2-3%
 * faster than 16 there).
 * Every output's sum runs over k in the same order whatever the batch, so a row gets the bits
 * it gets alone. Shapes the tiles do not cut evenly (n % 16, k % 32) and builds without AMX
 * decline (-1), and gemv_bf16.c's loop serves.
 * Linux gives a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM);
 * kv_amx() asks once. kv_amx_use(0) sets the tiles aside (KVCHAT_AMX=0, and the tests of the
 * vdpbf16ps loop on a CPU that has both).
 */
#define _GNU_SOURCE     /* syscall() under -std=c11 */
#include "kvchat.h"
#include "vec.h"

#if !defined(KVCHAT_PORTABLE) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_MAX_ROWS 32     /* rows of x: two B tiles */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static int use = 1;         /* kv_amx_use */

int kv_amx(void) {
    static int state = 0;   /* 0: not asked yet; 1: granted; -1: refused */
    if (state == 0) {
        int granted;
        #pragma omp critical(kv_amx_request)
        granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        state = granted ? 1 : -1;
    }
    return use && state > 0;
}

int kv_amx_use(int on) {
    const int was = use;
    use = on != 0;
    return was;
}

/* x (b, k) rounded to bf16 into B tiles: tile (kb, half) row p holds pair p of k block kb for
 * rows half * 16 .. half * 16 + 15 of x. The columns past b keep whatever they held: each sum
 * reads only its own column of B, so they reach only sums that are never written out (and
 * tdpbf16ps raises no exceptions). */
static void pack_x(const float *x, int64_t b, int64_t k, uint32_t *xp) {
    const int64_t kbs = k / 32, halves = (b + 15) / 16;
    for (int64_t i = 0; i < b; i++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            uint32_t pairs[16];
            store_bf16((uint16_t *)pairs, load(x + i * k + kb * 32));
            store_bf16((uint16_t *)pairs + 16, load(x + i * k + kb * 32 + 16));
            uint32_t *t = xp + (kb * halves + i / 16) * 256 + i % 16;
            for (int p = 0; p < 16; p++) t[p * 16] = pairs[p];
        }
}

/* a tile of sums (16 weight rows by 16 rows of x, in buf) into y's rows i0 .. i0 + rows - 1,
 * columns n0 .. n0 + 15 */
static inline void put(const float *buf, int64_t rows, float *y, int64_t n, int64_t i0, int64_t n0) {
    for (int64_t i = 0; i < rows; i++) {
        float *yr = y + (i0 + i) * n + n0;
        for (int r = 0; r < 16; r++) yr[r] = buf[r * 16 + i];
    }
}

/* 16 weight rows (w0) or 32 (two: w1 = w0 + 16 rows too) by all of x's rows (1 or 2 halves of
 * 16 in xp) over all of k, into y at columns n0 ..; `ahead` k steps fetched ahead of the loads,
 * the stream running on into the rows after these (below `end`). Tiles: sums 0, 1 (w0 by x's
 * halves) and 5, 6 (w1's), W 2 and 7, x 3 and 4. Each sum runs over k in order in one tile, so
 * the grouping of rows changes no bit. */
static inline __attribute__((always_inline)) void pass(const uint32_t *xp, const uint16_t *w0, const uint16_t *end,
                                                       float *y, float *buf, int64_t b, int64_t n, int64_t k,
                                                       int64_t n0, const int two, const int ahead) {
    const int64_t kbs = k / 32, halves = (b + 15) / 16, rows = two ? 32 : 16;
    const uint16_t *w1 = w0 + 16 * k;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(5);
        _tile_zero(6);
    }
    for (int64_t kb = 0; kb < kbs; kb++) {
        const uint16_t *next = w0 + (kb + ahead < kbs ? (kb + ahead) * 32 : rows * k + (kb + ahead - kbs) * 32);
        for (int r = 0; r < rows; r++)
            if (next + r * k < end) __builtin_prefetch(next + r * k, 0, 3);
        const uint32_t *xb = xp + kb * halves * 256;
        _tile_loadd(2, w0 + kb * 32, k * 2);
        _tile_loadd(3, xb, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (halves > 1) {
            _tile_loadd(4, xb + 256, 64);
            _tile_dpbf16ps(1, 2, 4);
        }
        if (two) {
            _tile_loadd(7, w1 + kb * 32, k * 2);
            _tile_dpbf16ps(5, 7, 3);
            if (halves > 1) _tile_dpbf16ps(6, 7, 4);
        }
    }
    const int64_t low = b < 16 ? b : 16;
    _tile_stored(0, buf, 64);
    put(buf, low, y, n, 0, n0);
    if (halves > 1) {
        _tile_stored(1, buf, 64);
        put(buf, b - 16, y, n, 16, n0);
    }
    if (two) {
        _tile_stored(5, buf, 64);
        put(buf, low, y, n, 0, n0 + 16);
        if (halves > 1) {
            _tile_stored(6, buf, 64);
            put(buf, b - 16, y, n, 16, n0 + 16);
        }
    }
}

static _Thread_local uint32_t *scratch = NULL;  /* the packed x, kept from call to call */
static _Thread_local int64_t scratch_tiles = 0;

int kv_gemv_amx(const float *x, const uint16_t *w, float *y, int64_t b, int64_t n, int64_t k, int threads) {
    if (b < 1 || b > AMX_MAX_ROWS || n < 16 || n % 16 || k < 32 || k % 32 || !kv_amx())
        return -1;
    const int64_t kbs = k / 32, tiles = n / 16;
    if (scratch_tiles < kbs * 2) {
        free(scratch);
        scratch = aligned_alloc(64, (size_t)(kbs * 2) * 1024);
        scratch_tiles = scratch == NULL ? 0 : kbs * 2;
        if (scratch == NULL) return -2;
    }
    const uint32_t *xp = scratch;
    pack_x(x, b, k, scratch);
    const int parts = threads > 1 && n * k >= PARALLEL_FLOATS ? threads : 1;
    #pragma omp parallel num_threads(parts) if (parts > 1)
    {
        TileConfig cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
        float buf[256] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int part = 0; part < parts; part++) {   /* a contiguous run of W's rows each */
            const int64_t t0 = tiles * part / parts, t1 = tiles * (part + 1) / parts;
            const uint16_t *end = w + t1 * 16 * k;
            int64_t t = t0;
            if (b > 2)      /* 32 weight rows at a time, 4 k steps ahead: 2-3% faster from 4 rows of x up */
                for (; t + 1 < t1; t += 2) pass(xp, w + t * 16 * k, end, y, buf, b, n, k, t * 16, 1, 4);
            for (; t < t1; t++)     /* 16 at a time, 8 ahead: one row as fast as vdpbf16ps (32 were 5-10% slower) */
                pass(xp, w + t * 16 * k, end, y, buf, b, n, k, t * 16, 0, 8);
        }
        _tile_release();
    }
    return 0;
}

#else
int kv_amx(void) { return 0; }

int kv_amx_use(int on) {
    (void)on;
    return 0;
}

int kv_gemv_amx(const float *x, const uint16_t *w, float *y, int64_t b, int64_t n, int64_t k, int threads) {
    (void)x, (void)w, (void)y, (void)b, (void)n, (void)k, (void)threads;
    return -1;
}
#endif
