"""The C kernels' interface as ctypes sees it (engine/csrc/kvchat.h), and the check a freshly
compiled library passes before any kvchat process maps it.

No torch and no package imports: `check()` runs in a child process of its own (`python
native_abi.py LIBRARY`), so that a library that crashes (an illegal instruction, a bad
mapping) kills the child, not kvchat, and the child starts in a fraction of a second.
"""
from __future__ import annotations

import ctypes
import math
import random
import struct
import sys


class DecodeArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("k", "v", "ks", "vs", "tables", "lens")] + [
        (name, ctypes.c_int64) for name in
        ("table_stride", "max_blocks", "num_blocks", "block_stride", "row_stride", "head_stride",
         "sblock_stride", "srow_stride", "shead_stride", "batch", "block_size", "kv_heads", "group", "dim",
         "q_stride", "length")] + [("scale", ctypes.c_float)] + [("half", ctypes.c_int64)]


class WriteArgs(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("ks", ctypes.c_void_p), ("vs", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in
        ("block_stride", "row_stride", "head_stride", "sblock_stride", "srow_stride", "shead_stride",
         "num_blocks", "block_size", "kv_heads", "dim")] + [
        ("src_k", ctypes.c_void_p), ("src_v", ctypes.c_void_p), ("k_row_stride", ctypes.c_int64),
        ("v_row_stride", ctypes.c_int64), ("src_head_stride", ctypes.c_int64), ("half", ctypes.c_int64)]


class LayerArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm", "k", "v", "ks", "vs")]


class StepArgs(ctypes.Structure):
    _fields_ = [("attn", DecodeArgs), ("write", WriteArgs)] + [
        (name, ctypes.c_void_p) for name in ("layers", "final_norm", "lm_head", "cos", "sin", "pos", "slots")] + [
        (name, ctypes.c_int64) for name in ("n_layers", "hidden", "heads", "inter", "vocab", "n_pos", "bf16")] + [
        ("eps", ctypes.c_float)]


STRUCTS = (DecodeArgs, WriteArgs, LayerArgs, StepArgs)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the kernels' signatures on a loaded library. Raises AttributeError when one is
    missing and OSError when the library's structures differ from these."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kv_gemv.argtypes = [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    lib.kv_gemv.restype = None
    lib.kv_gemv_bf16.argtypes = [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    lib.kv_gemv_bf16.restype = ctypes.c_int
    lib.kv_bf16_native.argtypes = []
    lib.kv_bf16_native.restype = ctypes.c_int
    lib.kv_gemv_amx.argtypes = [ptr] * 3 + [i64] * 3 + [ctypes.c_int]
    lib.kv_gemv_amx.restype = ctypes.c_int
    lib.kv_amx.argtypes = []
    lib.kv_amx.restype = ctypes.c_int
    lib.kv_amx_use.argtypes = [ctypes.c_int]
    lib.kv_amx_use.restype = ctypes.c_int
    lib.kv_gemv_tile.argtypes = []
    lib.kv_gemv_tile.restype = ctypes.c_int
    lib.kv_read_sum.argtypes = [ptr, i64, ctypes.c_int]
    lib.kv_read_sum.restype = ctypes.c_double
    lib.kv_rms_norm.argtypes = [ptr] * 3 + [i64, i64, ctypes.c_float]
    lib.kv_rms_norm.restype = None
    lib.kv_decode.argtypes = [ctypes.POINTER(DecodeArgs), ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.kv_decode.restype = ctypes.c_int
    lib.kv_write.argtypes = [ctypes.POINTER(WriteArgs), ptr, i64, ctypes.c_int]
    lib.kv_write.restype = ctypes.c_int
    lib.kv_add_rms_norm.argtypes = [ptr] * 4 + [i64, i64, ctypes.c_float]
    lib.kv_add_rms_norm.restype = None
    lib.kv_silu_mul.argtypes = [ptr, ptr, i64, i64]
    lib.kv_silu_mul.restype = None
    lib.kv_add_rms_norm_rows.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.kv_add_rms_norm_rows.restype = None
    lib.kv_silu_mul_rows.argtypes = [ptr, ptr, i64, i64, i64, ctypes.c_int]
    lib.kv_silu_mul_rows.restype = None
    lib.kv_merge_two.argtypes = [ptr] * 6 + [i64] * 5 + [ctypes.c_int]
    lib.kv_merge_two.restype = None
    lib.kv_rope_write.argtypes = [ctypes.POINTER(WriteArgs), ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i64,
                                  ctypes.c_int]
    lib.kv_rope_write.restype = ctypes.c_int
    lib.kv_decode_step.argtypes = [ctypes.POINTER(StepArgs), ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.kv_decode_step.restype = ctypes.c_int
    lib.kv_sizes.argtypes = [ptr]
    lib.kv_sizes.restype = None
    sizes = (i64 * len(STRUCTS))()
    lib.kv_sizes(sizes)
    want = tuple(ctypes.sizeof(s) for s in STRUCTS)
    if tuple(sizes) != want:
        raise OSError(f"its structures are {tuple(sizes)} bytes, ctypes expects {want}")
    return lib


# ---- the check -------------------------------------------------------------------------------
def _floats(values) -> ctypes.Array:
    return (ctypes.c_float * len(values))(*values)


def _near(got: float, want: float, scale: float) -> bool:
    return abs(got - want) <= 1e-4 * scale + 1e-6


def _amx_wrong(lib: ctypes.CDLL, rng: random.Random, b: int) -> str | None:
    """kv_gemv_amx on b rows against 32 x 64 bf16 weights (a shape its tiles cut), where the
    build and the OS give it the tiles: None, or what was wrong."""
    xa = [rng.uniform(-1, 1) for _ in range(b * 64)]
    wa = [struct.unpack("<2H", struct.pack("<f", rng.uniform(-1, 1)))[1] for _ in range(32 * 64)]
    ya = _floats([0.0] * (b * 32))
    if lib.kv_gemv_amx(_floats(xa), (ctypes.c_uint16 * len(wa))(*wa), ya, b, 32, 64, 2) != 0:
        return None
    for i in range(b):
        for j in range(32):
            want = math.fsum(xa[i * 64 + c] * _bf16_float(wa[j * 64 + c]) for c in range(64))
            if not _near(ya[i * 32 + j], want, 64 * 100):   # x in bf16: 2^-8 of each term
                return f"kv_gemv_amx gave {ya[i * 32 + j]!r} where {want!r} was due"
    return None


def check(path: str) -> str | None:
    """Load the library at path, call every kernel on a small random case (2 threads), and
    compare with the same arithmetic in Python's double precision. Returns None, or one line
    saying what was wrong. A sanity check of the build (a compiler that emits garbage, a
    library for another CPU), not the kernels' accuracy tests (tests/test_native*.py)."""
    try:
        lib = bind(ctypes.CDLL(path))
    except (OSError, AttributeError) as e:
        return f"it does not load: {e}"
    rng = random.Random(7)
    # gemv and rms_norm: 3 rows, 21 weight rows of 37 (tails in both directions)
    b, n, k = 3, 21, 37
    x = [rng.uniform(-1, 1) for _ in range(b * k)]
    w = [rng.uniform(-1, 1) for _ in range(n * k)]
    y = _floats([0.0] * (b * n))
    lib.kv_gemv(_floats(x), _floats(w), y, b, n, k, 2)
    for i in range(b):
        for j in range(n):
            want = math.fsum(x[i * k + c] * w[j * k + c] for c in range(k))
            if not _near(y[i * n + j], want, k):
                return f"kv_gemv gave {y[i * n + j]!r} where {want!r} was due"
    # the bf16 product: the same weights cut to bf16 (their top 16 bits), x as it is
    wb = [struct.unpack("<2H", struct.pack("<f", v))[1] for v in w]
    wbf = [_bf16_float(h) for h in wb]
    yb = _floats([0.0] * (b * n))
    if lib.kv_gemv_bf16(_floats(x), (ctypes.c_uint16 * len(wb))(*wb), yb, b, n, k, 2) != 0:
        return "kv_gemv_bf16 failed"
    for i in range(b):
        for j in range(n):
            want = math.fsum(x[i * k + c] * wbf[j * k + c] for c in range(k))
            if not _near(yb[i * n + j], want, k * 100):   # x in bf16 where vdpbf16ps serves: 2^-8 of each term
                return f"kv_gemv_bf16 gave {yb[i * n + j]!r} where {want!r} was due"
    if (problem := _amx_wrong(lib, rng, b)) is not None:
        return problem
    yn = _floats([0.0] * (b * k))
    lib.kv_rms_norm(_floats(x), _floats(w[:k]), yn, b, k, 1e-5)
    for i in range(b):
        r = 1 / math.sqrt(math.fsum(v * v for v in x[i * k:(i + 1) * k]) / k + 1e-5)
        for c in range(k):
            if not _near(yn[i * k + c], x[i * k + c] * r * w[c], 1):
                return "kv_rms_norm gave a wrong value"
    xs, res = _floats(x), w[k:k + b * k]          # the add and norm: x += res, then the norm of the sum
    lib.kv_add_rms_norm(xs, _floats(res), _floats(w[:k]), yn, b, k, 1e-5)
    for i in range(b):
        row = [x[i * k + c] + res[i * k + c] for c in range(k)]
        inv = 1 / math.sqrt(math.fsum(v * v for v in row) / k + 1e-5)
        if any(not _near(xs[i * k + c], row[c], 1) or not _near(yn[i * k + c], row[c] * inv * w[c], 1)
               for c in range(k)):
            return "kv_add_rms_norm gave a wrong value"
    gu = [rng.uniform(-30, 30) for _ in range(b * 2 * k)]   # silu(gate) * up, past exp's easy range
    ys = _floats([0.0] * (b * k))
    lib.kv_silu_mul(_floats(gu), ys, b, k)
    for i in range(b):
        for c in range(k):
            gate, up = gu[i * 2 * k + c], gu[i * 2 * k + k + c]
            if not _near(ys[i * k + c], gate / (1 + math.exp(-gate)) * up, abs(gate * up)):
                return "kv_silu_mul gave a wrong value"
    if (problem := _chunk_calls_wrong(lib, rng, x, res, w, gu, b, k)) is not None:
        return problem
    # decode: 2 sequences of 20 and 3 rows, blocks of 4, 1 KV head of 2 queries, d 16
    bs, d, g, lens, table = 4, 16, 2, [20, 3], [[4, 0, 2, 5, 1], [3, 6, 6, 6, 6]]
    nb = 7
    kc = [rng.uniform(-1, 1) for _ in range(nb * bs * d)]
    vc = [rng.uniform(-1, 1) for _ in range(nb * bs * d)]
    q = [rng.uniform(-2, 2) for _ in range(2 * g * d)]
    tables = (ctypes.c_int32 * 10)(*(t for row in table for t in row))
    lens_c = (ctypes.c_int32 * 2)(*lens)
    kbuf, vbuf, out = _floats(kc), _floats(vc), _floats([0.0] * (2 * g * d))
    a = DecodeArgs(ctypes.addressof(kbuf), ctypes.addressof(vbuf), None, None, ctypes.addressof(tables),
                   ctypes.addressof(lens_c), 5, 5, nb, bs * d, d, d, 0, 0, 0, 2, bs, 1, g, d, g * d, 0, 0.25)
    if lib.kv_decode(ctypes.byref(a), _floats(q), out, 2, 2) != 0:
        return "kv_decode declined a case it serves"
    if (problem := _decode_wrong(out, q, kc, vc, table, lens, g, d, bs)) is not None:
        return problem
    # 16-bit caches: the same rows rounded to nearest even (kv_write), then the same decode over
    # them against the rounded values (Python's own roundings: _bf16_bits, struct's half)
    every = (ctypes.c_int64 * (nb * bs))(*range(nb * bs))
    for half, name in ((1, "bf16"), (2, "fp16")):
        rounded = [(_bf16_bits(x), _bf16_float(_bf16_bits(x))) if half == 1 else
                   (struct.unpack("<H", struct.pack("<e", x))[0], struct.unpack("<e", struct.pack("<e", x))[0])
                   for x in list(kbuf) + list(vbuf)]
        kh, vh = (ctypes.c_uint16 * (nb * bs * d))(), (ctypes.c_uint16 * (nb * bs * d))()
        wa = WriteArgs(ctypes.addressof(kh), ctypes.addressof(vh), None, None, bs * d, d, d, 0, 0, 0, nb, bs, 1, d,
                       ctypes.addressof(kbuf), ctypes.addressof(vbuf), d, d, d, half)
        if lib.kv_write(ctypes.byref(wa), every, nb * bs, 2) != 0:
            return f"kv_write refused a {name} cache"
        if list(kh) + list(vh) != [b for b, _ in rounded]:
            return f"kv_write gave a wrong {name} value"
        a.k, a.v, a.half = ctypes.addressof(kh), ctypes.addressof(vh), half
        if lib.kv_decode(ctypes.byref(a), _floats(q), out, 2, 2) != 0:
            return f"kv_decode declined a {name} cache"
        kr = [x for _, x in rounded]
        if (problem := _decode_wrong(out, q, kr[:len(kc)], kr[len(kc):], table, lens, g, d, bs)) is not None:
            return f"{problem} ({name} cache)"
    # write: 2 rows of 1 KV head into an fp8 cache: bytes and scales of round-to-nearest e4m3
    src = [0.5, -448.0 / 3, 3.0, 1e-3] * 4 + [rng.uniform(-4, 4) for _ in range(d)]
    k8, v8, sk, sv = (ctypes.c_uint8 * (nb * bs * d))(), (ctypes.c_uint8 * (nb * bs * d))(), _floats([0.0] * (nb * bs)), _floats([0.0] * (nb * bs))
    srcs = _floats(src)
    wa = WriteArgs(ctypes.addressof(k8), ctypes.addressof(v8), ctypes.addressof(sk), ctypes.addressof(sv),
                   bs * d, d, d, bs, 1, 1, nb, bs, 1, d, ctypes.addressof(srcs), ctypes.addressof(srcs), d, d, d)
    slots = (ctypes.c_int64 * 2)(9, 22)
    if lib.kv_write(ctypes.byref(wa), slots, 2, 2) != 0:
        return "kv_write refused slots inside the pool"
    for t, slot in enumerate((9, 22)):
        row = src[t * d:(t + 1) * d]
        scale = struct.unpack("f", struct.pack("f", max(abs(v) for v in row) / 448))[0]
        if not _near(sk[slot], scale, scale):
            return "kv_write gave a wrong fp8 scale"
        for c in range(d):
            if abs(_e4m3(k8[slot * d + c]) * scale - row[c]) > abs(row[c]) / 16 + scale * 2 ** -9:
                return "kv_write gave a wrong fp8 byte"
    return None


def _decode_wrong(out, q, kc, vc, table, lens, g: int, d: int, bs: int) -> str | None:
    """None when out holds each sequence's attention (scale 0.25) over its cached rows."""
    for s in range(len(lens)):
        rows = [table[s][t // bs] * bs + t % bs for t in range(lens[s])]
        for j in range(g):
            qs = q[(s * g + j) * d:(s * g + j + 1) * d]
            sc = [0.25 * math.fsum(qs[c] * kc[r * d + c] for c in range(d)) for r in rows]
            m = max(sc)
            p = [math.exp(v - m) for v in sc]
            for c in range(d):
                want = math.fsum(pi * vc[r * d + c] for pi, r in zip(p, rows)) / math.fsum(p)
                if not _near(out[(s * g + j) * d + c], want, 1):
                    return "kv_decode gave a wrong value"
    return None


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _chunk_calls_wrong(lib: ctypes.CDLL, rng: random.Random, x: list[float], res: list[float], w: list[float],
                       gu: list[float], b: int, k: int) -> str | None:
    """A prompt chunk's calls: the add and norm with the residual in bf16 and the norm rounded
    to bf16; silu * up on bf16; two partial attentions merged by log-sum-exp. None, or what
    was wrong."""
    rb = [_bf16_bits(v) for v in res]
    xs, yh = _floats(x), (ctypes.c_uint16 * (b * k))()
    lib.kv_add_rms_norm_rows(xs, (ctypes.c_uint16 * len(rb))(*rb), 1, _floats(w[:k]), yh, 1, b, k, 1e-5, 2)
    for i in range(b):
        row = [x[i * k + c] + _bf16_float(rb[i * k + c]) for c in range(k)]
        inv = 1 / math.sqrt(math.fsum(v * v for v in row) / k + 1e-5)
        if any(not _near(xs[i * k + c], row[c], 1) or abs(_bf16_float(yh[i * k + c]) - row[c] * inv * w[c]) >
               2 ** -8 * abs(row[c] * inv * w[c]) + 1e-6 for c in range(k)):
            return "kv_add_rms_norm_rows gave a wrong value"
    gh = [_bf16_bits(v) for v in gu]
    sh = (ctypes.c_uint16 * (b * k))()
    lib.kv_silu_mul_rows((ctypes.c_uint16 * len(gh))(*gh), sh, b, k, 1, 2)
    for i in range(b):
        for c in range(k):
            gate, up = _bf16_float(gh[i * 2 * k + c]), _bf16_float(gh[i * 2 * k + k + c])
            want = gate / (1 + math.exp(-gate)) * up
            if abs(_bf16_float(sh[i * k + c]) - want) > 2 ** -7 * abs(want) + 1e-6:    # two roundings to bf16
                return "kv_silu_mul_rows gave a wrong value"
    # t 2 rows, 2 query heads of 1 KV head, d 3
    t, h, d = 2, 2, 3
    o1, o2 = [rng.uniform(-1, 1) for _ in range(h * t * d)], [rng.uniform(-1, 1) for _ in range(h * t * d)]
    l1, l2 = [rng.uniform(-3, 3) for _ in range(h * t)], [rng.uniform(-3, 3) for _ in range(h * t)]
    merged = _floats([0.0] * (t * h * d))
    st = (ctypes.c_int64 * 8)(h * t * d, d, h * t, 1, t * d, d, t, 1)
    lib.kv_merge_two(_floats(o1), _floats(l1), _floats(o2), _floats(l2), st, merged, t, h, h, d, 0, 2)
    for r in range(t):
        for q in range(h):
            e1, e2 = math.exp(l1[q * t + r]), math.exp(l2[q * t + r])
            for c in range(d):
                want = (e1 * o1[(q * t + r) * d + c] + e2 * o2[(q * t + r) * d + c]) / (e1 + e2)
                if not _near(merged[(r * h + q) * d + c], want, 1):
                    return "kv_merge_two gave a wrong value"
    return None


def _bf16_float(h: int) -> float:
    """bf16 bits h widened to a float, exactly"""
    return struct.unpack("<f", struct.pack("<I", h << 16))[0]


def _bf16_bits(x: float) -> int:
    """x (a float32) rounded to bf16 by Python's own float arithmetic: the nearer of the two
    bf16 values around it, the even one on a tie"""
    lo = _f32_bits(x) >> 16
    down, up = (_bf16_float(h) for h in (lo, lo + 1))
    if abs(x - down) != abs(up - x):
        return lo if abs(x - down) < abs(up - x) else lo + 1
    return lo if lo % 2 == 0 else lo + 1


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


if __name__ == "__main__":
    problem = check(sys.argv[1])
    if problem:
        print(problem)
    sys.exit(1 if problem else 0)
