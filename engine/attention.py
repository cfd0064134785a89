"""The attention interface over the paged KV pool.

Three operations, each with one signature whatever the device:
- `write_kv`: store a step's (or a prefill's) K and V rows into their pool slots;
- `paged_decode`: one query per sequence against its cached K/V through its block table;
- `paged_prefill`: a turn's new tokens against the reused cached prefix plus themselves.

CPU tensors take the C kernels of `native.py` for the cache write and decode where they
compiled, and otherwise the vectorised torch paths below and in `cpu_attention.py` (split-K
decode, fp8 pieces, prefill after a prefix; prefill always); the plain-torch `*_ref` functions here are the
references the Triton kernels are tested against; CUDA tensors take the Triton kernels in
`engine/kernels/` when they import. fp8 caches carry one float32 scale per (slot, KV head):
x ~= q * scale, with q in float8_e4m3fn.

Layout: k_cache, v_cache: (num_blocks, block_size, n_kv_heads, head_dim);
scales: (num_blocks, block_size, n_kv_heads); slot = block_id * block_size + offset.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import contextlib

import torch
import torch.nn.functional as F

from . import native
from .cpu_attention import (decode_fp8, decode_split, dequantize_rows, fused_lse, merge_partials,
                            prefix_then_causal, sdpa_decode, split_partials)
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
    if native.write_serves(k_cache, k, v, slots):
        return native.write(k_cache, v_cache, k, v, slots, k_scale, v_scale)
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
    knows them, spare device-to-host reads on the CPU path.

    On the CPU, B > 1 takes the C kernel's batch (native.decode_batch: threads over sequence,
    KV head and split, each table read in place); without it, each sequence takes decode_one's
    torch path in turn. Either way a sequence gets the bits it gets alone."""
    if _use_triton(q):
        return _kernels().paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       k_scale, v_scale)
    if q.shape[0] == 1:
        length = int(context_lens[0]) if max_context is None else max_context
        return decode_one(q[0], k_cache, v_cache, block_tables[0], length, scale, k_scale, v_scale,
                          runs)[None]
    if q.device.type == "cpu" and native.decode_serves(q, k_cache):
        out = native.decode_batch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
        if out is not None:
            return out
    if q.device.type == "cpu":
        lens = context_lens.tolist()
        return torch.stack([decode_one(q[b], k_cache, v_cache, block_tables[b], lens[b], scale, k_scale, v_scale)
                            for b in range(q.shape[0])])                 # (B, n_heads, head_dim)
    return paged_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)


def decode_one(q, k_cache, v_cache, block_table, length, scale, k_scale=None, v_scale=None, runs=None):
    """The CPU hot path for one sequence. q: (n_heads, head_dim) -> (n_heads, head_dim).

    The C kernel (native.decode) takes it where it compiled: the table read in place, fp8
    dequantized in registers. Otherwise, torch: the sequence's rows are read run by run (`row_pieces`: views, no copy), each run through
    split-K ("flash-decoding", Dao et al. 2023): cut into a few windows run as one batch, the
    partial results of every window of every run merged by log-sum-exp (`merge_partials`).
    One query per head gives torch's fused CPU kernel only n_kv_heads work items (3 for the
    bundled model, on 2 threads: one thread does two); windows x heads divide evenly.
    An fp8 cache is dequantized one piece at a time inside the loop (`decode_fp8`), so a step
    reads the fp8 bytes and never holds the whole sequence in fp32."""
    if q.device.type != "cpu":
        k = gather_kv(k_cache, k_scale, block_table, length, q.dtype, runs)  # (T, hk, d)
        v = gather_kv(v_cache, v_scale, block_table, length, q.dtype, runs)
        return sdpa_decode(q, k, v, scale)
    if native.decode_serves(q, k_cache):
        out = native.decode(q, k_cache, v_cache, block_table, length, scale, k_scale, v_scale)
        if out is not None:
            return out
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


# A new turn's rows over its cached prefix are a (rows, prefix + rows) shape never seen before,
# and cuDNN's attention builds a plan for each new shape: on the H200 a turn after 1k tokens took
# 97 ms against 21 ms with the shape seen before, and 26-51 ms with cuDNN set aside. Full prefill
# chunks repeat their shapes (8,192 rows over 16k, 24k, ... on CUDA) and keep cuDNN, which took a
# first chunk of 8,192 in 246 ms against 271-279 without it.
CUDNN_MIN_ROWS = 512
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _NOT_CUDNN: list | None = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # torch before 2.3: no cuDNN attention to avoid either
    _NOT_CUDNN = None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int,
                     scale: float) -> torch.Tensor:
    """q: (H, T, d); k, v: (Hk, S, d) with S = prefix_len + T. Query i sees keys j <= prefix_len + i."""
    h, t, _ = q.shape
    hk, s, _ = k.shape
    # 4-D inputs: 3-D ones miss torch's flash kernel on CPU (about 6x slower, measured)
    if prefix_len and fused_lse(q):
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
    short_cuda = q.device.type == "cuda" and t < CUDNN_MIN_ROWS and _NOT_CUDNN is not None
    with sdpa_kernel(_NOT_CUDNN) if short_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **kw)[0]
