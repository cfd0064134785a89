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
    if scale is None:
        return x if x.dtype == dtype else x.to(dtype)
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
    """The first `length` cached rows of one sequence: (length, n_kv_heads, head_dim).
    A block table that is one ascending run of ids becomes a view, not a copy; a caller that
    knows the run's first block passes `first_block` and spares the check."""
    nb, bs, hk, d = cache.shape
    n = -(-length // bs)
    table = block_table[:n]
    if first_block is None and n:
        first = int(table[0])
        if int(table[-1]) - first == n - 1 and bool((table[1:] - table[:-1] == 1).all()):
            first_block = first
    if first_block is not None:
        first = first_block
        rows = cache[first:first + n].reshape(n * bs, hk, d)[:length]
        srows = scale[first:first + n].reshape(n * bs, hk)[:length] if scale is not None else None
    else:
        rows = bits(cache).index_select(0, table).view(cache.dtype).reshape(n * bs, hk, d)[:length]
        srows = scale.index_select(0, table).reshape(n * bs, hk)[:length] if scale is not None else None
    return dequantize(rows, srows, dtype)


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
    """The CPU hot path for one sequence. q: (n_heads, head_dim) -> (n_heads, head_dim)."""
    h, d = q.shape
    hk = k_cache.shape[2]
    k = gather_kv(k_cache, k_scale, block_table, length, q.dtype, first_block)  # (T, hk, d)
    v = gather_kv(v_cache, v_scale, block_table, length, q.dtype, first_block)  # (T, hk, d)
    # the group's queries play SDPA's query-length role: 4-D inputs take its fused CPU kernel
    out = F.scaled_dot_product_attention(q.view(1, hk, h // hk, d), k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], scale=scale)  # (1, hk, g, d)
    return out.reshape(h, d)


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
