"""The attention interface over the paged KV pool.

Three operations, each with one signature whatever the device:
- `write_kv`: store a step's (or a prefill's) K and V rows into their pool slots;
- `paged_decode`: one query per sequence against its cached K/V through its block table;
- `paged_prefill`: a turn's new tokens against the reused cached prefix plus themselves.

CPU tensors take the vectorised torch paths below, which are also the references the
Triton kernels are tested against; CUDA tensors take the Triton kernels in
`engine/kernels/` when they import. fp8 caches carry one float32 scale per (slot, KV head):
x ~= q * scale, with q in float8_e4m3fn.

Layout: k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim);
scales: (num_blocks, block_size, n_kv_heads); slot = block_id * block_size + offset.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
import math
import threading
from functools import cache

import torch
import torch.nn.functional as F

from .sequence import block_runs

FP8 = getattr(torch, "float8_e4m3fn", None)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa
FP8_MAX = 448.0


_FORCE_TRITON = False  # tests only: see force_triton


@cache  # one import attempt, not one per call on the hot path
def _kernels():
    try:
        from . import kernels  # noqa: PLC0415  (optional: needs triton)
    except ImportError:
        return None
    return kernels


def _use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda or _FORCE_TRITON) and _kernels() is not None


def triton_kernels(t: torch.Tensor):
    """The Triton kernels (engine.kernels) when they serve tensors like t, else None."""
    return _kernels() if _use_triton(t) else None


@contextmanager
def force_triton() -> Iterator[None]:
    """Route CPU tensors through the Triton kernels too, for tests that run them under
    TRITON_INTERPRET=1 (set before engine.kernels is first imported). Not thread-safe;
    raises RuntimeError when the kernels cannot be imported, so a test never silently
    checks the torch path against itself."""
    global _FORCE_TRITON
    if _kernels() is None:
        raise RuntimeError("force_triton: engine.kernels does not import (is triton installed?)")
    previous, _FORCE_TRITON = _FORCE_TRITON, True
    try:
        yield
    finally:
        _FORCE_TRITON = previous


# ---- fp8 helpers -----------------------------------------------------------------------
def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) absmax scaling. x: (T, H, D) -> (q (T, H, D) fp8, scale (T, H) fp32)."""
    amax = x.abs().amax(dim=-1).float().clamp_min(1e-12)  # (T, H)
    scale = amax / FP8_MAX
    q = (x.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x: (..., D) in the cache dtype; scale: (...) fp32 for an fp8 cache, else None."""
    if scale is None:
        return x if x.dtype == dtype else x.to(dtype)
    if x.device.type == "cpu" and x.dtype == FP8:
        return dequantize_rows(x, scale, dtype)
    return (x.to(torch.float32) * scale.unsqueeze(-1)).to(dtype)


# ---- cache write ---------------------------------------------------------------------------
def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: (T, n_kv_heads, head_dim); slots: (T,) int64 flat slot ids."""
    if _use_triton(k_cache):
        return _kernels().write_kv(k_cache, v_cache, k, v, slots, k_scale, v_scale)
    return write_kv_ref(k_cache, v_cache, k, v, slots, k_scale, v_scale)


def write_kv_ref(k_cache, v_cache, k, v, slots, k_scale=None, v_scale=None) -> None:
    nb, bs, hk, d = k_cache.shape
    if k_scale is not None:
        k, ks = quantize_fp8(k)
        v, vs = quantize_fp8(v)
        k_scale.view(nb * bs, hk).index_copy_(0, slots, ks)
        v_scale.view(nb * bs, hk).index_copy_(0, slots, vs)
    bits(k_cache).view(nb * bs, hk, d).index_copy_(0, slots, bits(k.to(k_cache.dtype)))
    bits(v_cache).view(nb * bs, hk, d).index_copy_(0, slots, bits(v.to(v_cache.dtype)))


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8: CPU torch has no index_copy_/index_select for float8 types."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


# ---- gathering a sequence's K/V ---------------------------------------------------------
Runs = tuple[tuple[int, int], ...]   # ((first block id, blocks), ...): a table cut into ascending runs
MAX_RUNS = 16  # a table cut into more runs is gathered into one copy instead of read run by run


def row_pieces(cache: torch.Tensor, block_table: torch.Tensor, length: int,
               runs: Runs | None = None) -> list[torch.Tensor]:
    """The first `length` rows of one sequence, in the cache's own dtype, as a list of pieces
    (rows_i, *cache.shape[2:]) in order: one view per run of consecutive block ids, or a
    single gathered copy when the table has more than MAX_RUNS runs. `runs`, when the
    caller has them, spare reading the table."""
    bs, rest = cache.shape[1], cache.shape[2:]
    n = -(-length // bs)
    if runs is None:
        runs = block_runs(block_table[:n].tolist())
    if len(runs) > MAX_RUNS:
        rows = bits(cache).index_select(0, block_table[:n]).view(cache.dtype)
        return [rows.reshape(n * bs, *rest)[:length]]
    pieces, left = [], length
    for first, count in runs:
        if left <= 0:
            break
        # (count, bs, ...) -> (count * bs, ...): a view in either pool layout (kv_cache.py)
        pieces.append(cache[first:first + count].flatten(0, 1)[:left])
        left -= count * bs
    return pieces


def cached_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                runs: Runs | None = None) -> torch.Tensor:
    """The first `length` rows of one sequence in the cache's own dtype: (length, *rest);
    a view when the table is one run, else a copy."""
    pieces = row_pieces(cache, block_table, length, runs)
    return pieces[0] if len(pieces) == 1 else torch.cat([bits(p) for p in pieces]).view(cache.dtype)


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
              length: int, dtype: torch.dtype, runs: Runs | None = None) -> torch.Tensor:
    """The first `length` cached rows of one sequence in dtype: (length, n_kv_heads, head_dim)."""
    rows = cached_rows(cache, block_table, length, runs)
    srows = cached_rows(scale, block_table, length, runs) if scale is not None else None
    return dequantize(rows, srows, dtype)


# ---- decode ---------------------------------------------------------------------------------
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 max_context: int | None = None, runs: Runs | None = None) -> torch.Tensor:
    """q: (B, n_heads, head_dim); block_tables: (B, max_blocks) int32; context_lens: (B,)
    int32 (rows to read, the new one included). Returns (B, n_heads, head_dim).
    `max_context` and `runs` (B = 1: the table as runs of consecutive ids), when the caller
    knows them, spare device-to-host reads on the CPU path."""
    if _use_triton(q):
        return _kernels().paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scale, v_scale)
    if q.shape[0] == 1:
        length = int(context_lens[0]) if max_context is None else max_context
        return decode_one(q[0], k_cache, v_cache, block_tables[0], length, scale, k_scale, v_scale,
                          runs)[None]
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def decode_one(q, k_cache, v_cache, block_table, length, scale, k_scale=None, v_scale=None, runs=None):
    """The CPU hot path for one sequence. q: (n_heads, head_dim) -> (n_heads, head_dim).

    The sequence's rows are read run by run (`row_pieces`: views, no copy), each run through
    split-K ("flash-decoding", Dao et al. 2023): cut into a few windows run as one batch, the
    partial results of every window of every run merged by log-sum-exp (`merge_partials`).
    One query per head gives torch's fused CPU kernel only n_kv_heads work items (3 for the
    bundled model, on 2 threads: one thread does two); windows x heads divide evenly.
    An fp8 cache is dequantized one piece at a time inside the loop (`decode_fp8`), so a step
    reads the fp8 bytes and never holds the whole sequence in fp32."""
    if q.device.type != "cpu":
        k = gather_kv(k_cache, k_scale, block_table, length, q.dtype, runs)  # (T, hk, d)
        v = gather_kv(v_cache, v_scale, block_table, length, q.dtype, runs)
        return _sdpa_decode(q, k, v, scale)
    if runs is None:
        runs = block_runs(block_table[:-(-length // k_cache.shape[1])].tolist())
    k = row_pieces(k_cache, block_table, length, runs)                  # [(T_i, hk, d)] storage dtype
    v = row_pieces(v_cache, block_table, length, runs)
    if k_scale is not None:
        return decode_fp8(q, k, v, row_pieces(k_scale, block_table, length, runs),
                          row_pieces(v_scale, block_table, length, runs), scale)
    if len(k) == 1:
        return decode_split(q, k[0].to(q.dtype), v[0].to(q.dtype), scale)
    parts = [split_partials(q, kp.to(q.dtype), vp.to(q.dtype), scale) for kp, vp in zip(k, v)]
    return merge_partials(torch.cat([o for o, _ in parts]), torch.cat([l for _, l in parts])).reshape(q.shape)


def _sdpa_decode(q, k, v, scale):
    """q: (H, d); k, v: (T, hk, d) -> (H, d), one fused SDPA call."""
    h, d = q.shape
    hk = k.shape[1]
    # the group's queries play SDPA's query-length role: 4-D inputs take its fused CPU kernel
    out = F.scaled_dot_product_attention(q.view(1, hk, h // hk, d), k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], scale=scale)  # (1, hk, g, d)
    return out.reshape(h, d)


# ---- split-K decode on the CPU ---------------------------------------------------------------
SPLIT_MIN_ROWS = 512  # shorter windows: the merge's few ops cost more than the balance gains
FP8_PIECE_ROWS = 1024  # rows dequantized at a time: fp32 K and V of one piece stay in L2


def split_count(length: int, n_kv_heads: int, threads: int) -> int:
    """Windows per sequence: the fewest that make windows x KV heads a multiple of the
    threads, or 1 when the context is too short for splitting to pay."""
    n = threads // math.gcd(n_kv_heads, threads)
    return n if n > 1 and length >= n * SPLIT_MIN_ROWS else 1


def windows(rows: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """n equal windows over rows (T, ...) as a view: (n, c, ...) at a stride of s = T // n
    rows, c = T - s (n - 1) >= s. Consecutive windows overlap by c - s rows, which belong to
    the later one: `window_bias` masks them out of the earlier. Returns (view, s)."""
    t = rows.shape[0]
    s = t // n
    c = t - s * (n - 1)
    st = rows.stride()
    return rows.as_strided((n, c, *rows.shape[1:]), (s * st[0], *st), rows.storage_offset()), s


def window_bias(n: int, c: int, s: int) -> torch.Tensor | None:
    """(n, 1, 1, c) additive mask: -inf on each window's rows past s, except the last's."""
    if c == s:
        return None
    bias = torch.zeros(n, 1, 1, c)
    bias[:-1, :, :, s:] = float("-inf")
    return bias


_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within each window and its log-sum-exp. q: (n, hk, g, d); k, v: (n, hk, c, d);
    bias: (n, 1, 1, c) or None. Returns (out (n, hk, g, d), lse (n, hk, g) fp32).

    torch's fused CPU kernel returns the log-sum-exp beside its output but only through the
    aten op that scaled_dot_product_attention itself calls on CPU (no public op gives it);
    without that op, the same in plain torch."""
    if _FLASH_LSE is not None and q.dtype in (torch.float32, torch.bfloat16):
        out, lse = _FLASH_LSE(q, k, v, attn_mask=bias, scale=scale)[:2]
        return out, lse
    return partial_attention_ref(q, k, v, scale, bias)


def partial_attention_ref(q, k, v, scale, bias=None):
    """Plain torch: scores in fp32, softmax within the window, and its log-sum-exp."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale      # (n, hk, g, c)
    if bias is not None:
        s = s + bias
    lse = torch.logsumexp(s, dim=-1)                                       # (n, hk, g)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.float())           # (n, hk, g, d)
    return out.to(q.dtype), lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine windows by their log-sum-exp: sum_i exp(lse_i - lse) out_i, with lse the
    log-sum-exp over all windows. out: (n, hk, g, d); lse: (n, hk, g) -> (hk, g, d)."""
    if out.shape[0] == 1:
        return out[0]
    w = torch.softmax(lse, dim=0)                                          # (n, hk, g)
    return (out.float() * w[..., None]).sum(0).to(out.dtype)


def split_partials(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial results over one stretch of rows. q: (H, d); k, v: (T, hk, d), any
    strides with unit stride in d. Returns (out (n, hk, g, d), lse (n, hk, g))."""
    h, d = q.shape
    t, hk, _ = k.shape
    g = h // hk
    n = split_count(t, hk, torch.get_num_threads()) if n is None else n
    kw, s = windows(k, n)                                                  # (n, c, hk, d)
    vw, _ = windows(v, n)
    qn = q.view(1, hk, g, d).expand(n, hk, g, d)                           # (n, hk, g, d)
    return partial_attention(qn, kw.transpose(1, 2), vw.transpose(1, 2), scale,
                             window_bias(n, kw.shape[1], s))


def decode_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 n: int | None = None) -> torch.Tensor:
    """Split-K decode over one sequence's rows. q: (H, d); k, v: (T, hk, d) -> (H, d)."""
    n = split_count(k.shape[0], k.shape[1], torch.get_num_threads()) if n is None else n
    if n == 1:
        return _sdpa_decode(q, k, v, scale)
    return merge_partials(*split_partials(q, k, v, scale, n)).reshape(q.shape)


# ---- fp8 ------------------------------------------------------------------------------------------
# An e4m3 byte s.eeee.mmm holds 2^(e-7) (1 + m/8), or 2^-6 m/8 when e = 0. Its bits placed at
# float32's sign and at the top of float32's exponent and mantissa, s.0000eeee.mmm0..0, read as
# float32 give 2^(e-127) (1 + m/8), or 2^-126 m/8 as a float32 subnormal: the same value
# times 2^-120, exactly, every byte (e4m3fn's NaN, 0x7f, becomes 480: our writes never make it).
# Three integer passes, sign-extend, shift, mask, do it: CPU torch converts float8 one element
# at a time (about 2.4 ns each, measured) and a 256-entry table lookup by index_select took
# 7.5 ns; these passes take 0.3 ns an element.
_FP8_MASK = 0x87F00000 - (1 << 32)    # keep the sign bit and bits 20-26, as a signed int32
_FP8_UNSCALE = 2.0 ** 120


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None, exact: bool = True) -> torch.Tensor:
    """rows: (..., d) float8 e4m3 on the CPU, any strides; scale: (...) fp32 -> (..., d) in
    dtype, contiguous, written into `out` (a flat buffer of at least rows.numel() elements)
    when given. exact=False skips the check for scales past 2^8 (values past 114,688, where
    scale x 2^120 overflows to inf): the decode loop checks its result once instead."""
    n = rows.numel()
    if dtype == torch.float32:
        f32 = out[:n] if out is not None else torch.empty(n)
    else:  # computed in float32, then converted into out
        f32 = _scratch("fp8", n, torch.float32)
    i32 = f32.view(torch.int32).view(rows.shape)
    i32.copy_(rows.view(torch.int8))                   # sign-extends: the sign lands on bit 31
    i32.bitwise_left_shift_(20).bitwise_and_(_FP8_MASK)
    x = i32.view(torch.float32)
    factor = scale * _FP8_UNSCALE                     # exact: a power of two
    if exact and not bool(torch.isfinite(factor).all()):  # a scale past 2^8 (|x| > 114,688)
        x.mul_(_FP8_UNSCALE)
        factor = scale
    x.mul_(factor[..., None])
    if dtype == torch.float32:
        return x
    dst = torch.empty(rows.shape, dtype=dtype) if out is None else out[:n].view(rows.shape)
    return dst.copy_(x)


_SCRATCH = threading.local()


def _scratch(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU buffer of n elements kept per thread between decode steps: pieces of an
    L2's size, allocated anew each time, cost page faults that showed as system time."""
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        with torch.inference_mode(False):   # a normal tensor: writable inside and outside inference mode
            buf = torch.empty(n, dtype=dtype)
        setattr(_SCRATCH, name, buf)
    return buf[:n]


def decode_fp8(q: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor], ks: list[torch.Tensor],
               vs: list[torch.Tensor], scale: float, piece: int = FP8_PIECE_ROWS,
               exact: bool = False) -> torch.Tensor:
    """Decode over an fp8 sequence given as pieces (`row_pieces`), dequantizing at most
    `piece` rows at a time, head-major, and merging every part by log-sum-exp.
    q: (H, d); k[i], v[i]: (T_i, hk, d) e4m3; ks[i], vs[i]: (T_i, hk) -> (H, d).
    The pieces skip dequantize_rows' per-piece overflow check (about 5 ms a step at 4k,
    measured); a result that is not finite is recomputed with it."""
    h, d = q.shape
    hk = k[0].shape[1]
    g = h // hk
    longest = min(piece, max(x.shape[0] for x in k))
    kbuf = _scratch("k_piece", longest * hk * d, q.dtype)
    vbuf = _scratch("v_piece", longest * hk * d, q.dtype)
    threads = torch.get_num_threads()
    outs, lses = [], []
    for kp, vp, ksp, vsp in zip(k, v, ks, vs):
        for a in range(0, kp.shape[0], piece):
            b = min(a + piece, kp.shape[0])
            kd = dequantize_rows(kp[a:b].transpose(0, 1), ksp[a:b].t(), q.dtype, kbuf, exact)  # (hk, rows, d)
            vd = dequantize_rows(vp[a:b].transpose(0, 1), vsp[a:b].t(), q.dtype, vbuf, exact)
            w = split_count(b - a, hk, threads)    # windows: w x hk work items for the threads
            w = w if (b - a) % w == 0 else 1
            kw = kd.view(hk, w, (b - a) // w, d).transpose(0, 1)                       # (w, hk, c, d)
            vw = vd.view(hk, w, (b - a) // w, d).transpose(0, 1)
            o, lse = partial_attention(q.view(1, hk, g, d).expand(w, hk, g, d), kw, vw, scale)
            outs.append(o)
            lses.append(lse)
    out = merge_partials(torch.cat(outs), torch.cat(lses)).reshape(h, d)
    if not exact and not bool(torch.isfinite(out).all()):
        return decode_fp8(q, k, v, ks, vs, scale, piece, exact=True)
    return out


def paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None, v_scale=None):
    """Plain-torch reference for a batch: gather every table, mask the tail, softmax in fp32."""
    b, h, d = q.shape
    nb, bs, hk, _ = k_cache.shape
    mb = block_tables.shape[1]
    tables = block_tables.long()
    k_rows = bits(k_cache)[tables].view(k_cache.dtype).reshape(b, mb * bs, hk, d)  # (B, T, hk, d)
    v_rows = bits(v_cache)[tables].view(v_cache.dtype).reshape(b, mb * bs, hk, d)
    k = dequantize(k_rows, k_scale[tables].reshape(b, mb * bs, hk) if k_scale is not None else None, torch.float32)
    v = dequantize(v_rows, v_scale[tables].reshape(b, mb * bs, hk) if v_scale is not None else None, torch.float32)
    qg = q.float().view(b, hk, h // hk, d)                          # (B, hk, g, d)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale         # (B, hk, g, T)
    pos = torch.arange(mb * bs, device=q.device)
    mask = pos[None, :] < context_lens.long()[:, None]              # (B, T)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)
    return out.reshape(b, h, d).to(q.dtype)


# ---- prefill --------------------------------------------------------------------------------
def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, prefix_len: int, scale: float,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                  runs: Runs | None = None) -> torch.Tensor:
    """q: (T, n_heads, head_dim) for positions prefix_len .. prefix_len+T-1, whose K/V are
    already written. Causal over prefix + new. Returns (T, n_heads, head_dim).

    Both devices gather the sequence's blocks and call torch's scaled_dot_product_attention
    (flash / memory-efficient kernels on CUDA); see the kernels issue note for the measurement."""
    t = q.shape[0]
    total = prefix_len + t
    k = gather_kv(k_cache, k_scale, block_table, total, q.dtype, runs).transpose(0, 1)  # (hk, S, d)
    v = gather_kv(v_cache, v_scale, block_table, total, q.dtype, runs).transpose(0, 1)  # (hk, S, d)
    return causal_attention(q.transpose(0, 1), k, v, prefix_len, scale).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     scale: float) -> torch.Tensor:
    """q: (H, T, d); k, v: (Hk, S, d) with S = prefix_len + T. Query i sees keys j <= prefix_len + i."""
    h, t, _ = q.shape
    hk, s, _ = k.shape
    # 4-D inputs: 3-D ones miss torch's flash kernel on CPU (about 6x slower, measured)
    if prefix_len and q.device.type == "cpu" and _FLASH_LSE is not None and q.dtype in (torch.float32, torch.bfloat16):
        return prefix_then_causal(q, k, v, prefix_len, scale)
    q, k, v = q[None], k[None], v[None]                                   # (1, H, T, d), (1, Hk, S, d)
    if hk != h and _SDPA_GQA:
        kw = {"enable_gqa": True}
    else:
        kw = {}
        if hk != h:
            k = k.repeat_interleave(h // hk, dim=1)                       # (1, H, S, d)
            v = v.repeat_interleave(h // hk, dim=1)
    if prefix_len == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **kw)[0]
    mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=prefix_len)  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **kw)[0]


def prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                       scale: float) -> torch.Tensor:
    """causal_attention for a chunk after a cached prefix, on the CPU, with no mask: the
    new rows against the prefix (every pair allowed) and against themselves (causal) as two
    calls of the fused kernel, merged by their log-sum-exp. A (T, S) boolean mask costs its
    construction and keeps the kernel from skipping the blocks above the diagonal.
    q: (H, T, d); k, v: (Hk, prefix_len + T, d) -> (H, T, d)."""
    h, t, d = q.shape
    hk = k.shape[0]
    g = h // hk
    # a KV head's g query heads read the same prefix: fold them into the query length
    o1, l1 = _FLASH_LSE(q.reshape(1, hk, g * t, d), k[None, :, :prefix_len], v[None, :, :prefix_len],
                        scale=scale)[:2]                                   # (1, hk, g*T, d), (1, hk, g*T)
    kn, vn = k[:, prefix_len:], v[:, prefix_len:]                          # (Hk, T, d)
    if g > 1:
        kn, vn = kn.repeat_interleave(g, dim=0), vn.repeat_interleave(g, dim=0)  # (H, T, d): T rows, cheap
    o2, l2 = _FLASH_LSE(q[None], kn[None], vn[None], is_causal=True, scale=scale)[:2]  # (1, H, T, d), (1, H, T)
    out = torch.stack((o1.reshape(h, t, d), o2[0]))                       # (2, H, T, d)
    lse = torch.stack((l1.reshape(h, t), l2[0]))                          # (2, H, T)
    return merge_partials(out, lse)
