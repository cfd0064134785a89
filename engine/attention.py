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
def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
              length: int, dtype: torch.dtype, first_block: int | None = None) -> torch.Tensor:
    """The first `length` cached rows of one sequence in dtype: (length, n_kv_heads, head_dim).
    A block table that is one ascending run of ids becomes a view, not a copy; a caller that
    knows the run's first block passes `first_block` and spares the check."""
    if first_block is None:
        first_block = run_start(block_table, -(-length // cache.shape[1]))
    rows = cached_rows(cache, block_table, length, first_block)
    srows = cached_rows(scale, block_table, length, first_block) if scale is not None else None
    return dequantize(rows, srows, dtype)


def run_start(block_table: torch.Tensor, n: int) -> int | None:
    """The first id when the table's first n entries are one ascending run of ids, else None."""
    if not n:
        return None
    table = block_table[:n]
    first = int(table[0])
    if int(table[-1]) - first == n - 1 and bool((table[1:] - table[:-1] == 1).all()):
        return first
    return None


def cached_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                first_block: int | None = None) -> torch.Tensor:
    """The first `length` rows of one sequence in the cache's own dtype, not dequantized:
    (length, *cache.shape[2:]). A view when first_block names the table's ascending run."""
    bs, rest = cache.shape[1], cache.shape[2:]
    n = -(-length // bs)
    if first_block is not None:
        return cache[first_block:first_block + n].reshape(n * bs, *rest)[:length]
    return bits(cache).index_select(0, block_table[:n]).view(cache.dtype).reshape(n * bs, *rest)[:length]


# ---- decode ---------------------------------------------------------------------------------
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 max_context: int | None = None, first_block: int | None = None) -> torch.Tensor:
    """q: (B, n_heads, head_dim); block_tables: (B, max_blocks) int32; context_lens: (B,)
    int32 (rows to read, the new one included). Returns (B, n_heads, head_dim).
    `max_context` and `first_block` (B = 1, a table that is one ascending run), when the
    caller knows them, spare device-to-host reads on the CPU path."""
    if _use_triton(q):
        return _kernels().paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scale, v_scale)
    if q.shape[0] == 1:
        length = int(context_lens[0]) if max_context is None else max_context
        return decode_one(q[0], k_cache, v_cache, block_tables[0], length, scale, k_scale, v_scale,
                          first_block)[None]
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def decode_one(q, k_cache, v_cache, block_table, length, scale, k_scale=None, v_scale=None, first_block=None):
    """The CPU hot path for one sequence. q: (n_heads, head_dim) -> (n_heads, head_dim).

    Split-K ("flash-decoding", Dao et al. 2023): the context is cut into a few windows run as
    one batch, and their partial results are merged by log-sum-exp (`merge_partials`). One
    query per head gives torch's fused CPU kernel only n_kv_heads work items (3 for the
    bundled model, on 2 threads: one thread does two); windows x heads divide evenly.
    An fp8 cache is dequantized one piece at a time inside the loop (`decode_fp8`), so a step
    reads the fp8 bytes and never holds the whole sequence in fp32."""
    if q.device.type != "cpu":
        k = gather_kv(k_cache, k_scale, block_table, length, q.dtype, first_block)  # (T, hk, d)
        v = gather_kv(v_cache, v_scale, block_table, length, q.dtype, first_block)
        return _sdpa_decode(q, k, v, scale)
    if first_block is None:
        first_block = run_start(block_table, -(-length // k_cache.shape[1]))
    k = cached_rows(k_cache, block_table, length, first_block)                      # (T, hk, d) storage dtype
    v = cached_rows(v_cache, block_table, length, first_block)
    if k_scale is not None:
        ks = cached_rows(k_scale, block_table, length, first_block)                 # (T, hk)
        vs = cached_rows(v_scale, block_table, length, first_block)
        return decode_fp8(q, k, v, ks, vs, scale)
    return decode_split(q, k.to(q.dtype), v.to(q.dtype), scale)


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


def decode_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 n: int | None = None) -> torch.Tensor:
    """Split-K decode over one sequence's rows. q: (H, d); k, v: (T, hk, d) -> (H, d)."""
    h, d = q.shape
    t, hk, _ = k.shape
    g = h // hk
    n = split_count(t, hk, torch.get_num_threads()) if n is None else n
    if n == 1:
        return _sdpa_decode(q, k, v, scale)
    kw, s = windows(k, n)                                                  # (n, c, hk, d)
    vw, _ = windows(v, n)
    qn = q.view(1, hk, g, d).expand(n, hk, g, d)                           # (n, hk, g, d)
    out, lse = partial_attention(qn, kw.transpose(1, 2), vw.transpose(1, 2), scale,
                                 window_bias(n, kw.shape[1], s))
    return merge_partials(out, lse).reshape(h, d)


# ---- fp8 ----------------------------------------------------------------------------------------
@cache
def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """(256,) the value of every e4m3 byte: CPU torch converts float8 one element at a time
    (about 3 ns each, measured), a table lookup by byte is about 5x faster."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).to(dtype)


def dequantize_rows(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """rows: (..., d) float8 e4m3 on the CPU; scale: (...) fp32 -> (..., d) in dtype, written
    into `out` (a flat buffer of at least rows.numel() elements) when given."""
    n = rows.numel()
    idx = _scratch("index", n, torch.int32).copy_(rows.reshape(-1).view(torch.uint8))
    out = torch.empty(n, dtype=dtype) if out is None else out[:n]
    torch.index_select(_fp8_table(dtype), 0, idx, out=out)
    return out.view(rows.shape).mul_(scale[..., None])


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


def decode_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor,
               scale: float, piece: int = FP8_PIECE_ROWS) -> torch.Tensor:
    """Decode over an fp8 sequence, dequantizing FP8_PIECE_ROWS rows at a time and merging
    the pieces by log-sum-exp. q: (H, d); k, v: (T, hk, d) e4m3; ks, vs: (T, hk) -> (H, d)."""
    h, d = q.shape
    t, hk, _ = k.shape
    g = h // hk
    qg = q.view(1, hk, g, d)
    kbuf = _scratch("k_piece", min(piece, t) * hk * d, q.dtype)
    vbuf = _scratch("v_piece", min(piece, t) * hk * d, q.dtype)
    outs, lses = [], []
    for a in range(0, t, piece):
        b = min(a + piece, t)
        kp = dequantize_rows(k[a:b], ks[a:b], q.dtype, kbuf).transpose(0, 1)[None]  # (1, hk, rows, d)
        vp = dequantize_rows(v[a:b], vs[a:b], q.dtype, vbuf).transpose(0, 1)[None]
        o, lse = partial_attention(qg, kp, vp, scale)                          # (1, hk, g, d), (1, hk, g)
        outs.append(o)
        lses.append(lse)
    return merge_partials(torch.cat(outs), torch.cat(lses)).reshape(h, d)


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
                  first_block: int | None = None) -> torch.Tensor:
    """q: (T, n_heads, head_dim) for positions prefix_len .. prefix_len+T-1, whose K/V are
    already written. Causal over prefix + new. Returns (T, n_heads, head_dim).

    Both devices gather the sequence's blocks and call torch's scaled_dot_product_attention
    (flash / memory-efficient kernels on CUDA); see the kernels issue note for the measurement."""
    t = q.shape[0]
    total = prefix_len + t
    k = gather_kv(k_cache, k_scale, block_table, total, q.dtype, first_block).transpose(0, 1)  # (hk, S, d)
    v = gather_kv(v_cache, v_scale, block_table, total, q.dtype, first_block).transpose(0, 1)  # (hk, S, d)
    return causal_attention(q.transpose(0, 1), k, v, prefix_len, scale).transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     scale: float) -> torch.Tensor:
    """q: (H, T, d); k, v: (Hk, S, d) with S = prefix_len + T. Query i sees keys j <= prefix_len + i."""
    h, t, _ = q.shape
    hk, s, _ = k.shape
    # 4-D inputs: 3-D ones miss torch's flash kernel on CPU (about 6x slower, measured)
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
