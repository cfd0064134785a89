"""Paged decode attention: one new query per sequence against its cached K/V.

Split-K flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023):
the context is cut into `num_splits` ranges, one program per (sequence, KV head, range)
keeps an online softmax (FlashAttention, Dao et al. 2022) over its range and writes a
partial output and its log-sum-exp; a second small kernel merges the ranges. All query
heads of one KV group share a program, so each K/V row is read once for the group (GQA,
Ainslie et al. 2023). K/V rows are gathered through the block table one row per token, as
PagedAttention (vLLM, Kwon et al. 2023) lays them out, so any block size and any order of
block ids cost the same.

The grid depends on the batch, the KV heads and the configured splits only, never on the
context lengths (which stay on the device): the launch has static shapes and no host sync,
so it can be captured in a CUDA graph. Each program reads context_lens itself and sizes its
range (whole tiles of `block_n` rows, so short contexts use fewer ranges); ranges past the
end do nothing, and the merge reads only the ranges that hold rows.

fp8 caches fold their per-row scales into the scores (K) and the probabilities (V) instead
of dequantizing tiles, so the dot products run on exact fp8 values cast to bf16/fp16.
Reference: `engine.attention.paged_decode_ref`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .checks import (ACT_DTYPES, INDEX_DTYPES, check_caches, check_devices, check_dim, check_dtype,
                     check_last_dim_dense, check_pow2, check_scales, check_shape, interpreting)
from .rounding import cast

LOG2E = 1.4426950408889634
# Every buffer the wrapper allocates goes through this; the tests swap in a NaN-filling
# allocator to prove that each element of the output and of the partials is written.
_empty = torch.empty


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Launch parameters. `num_splits` None picks enough programs to fill the GPU
    (about `waves` programs per SM) from the batch and KV heads alone."""
    num_splits: int | None = None
    block_n: int = 64       # context rows per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 4

    def __post_init__(self) -> None:
        if self.num_splits is not None and not 1 <= self.num_splits <= 1024:
            raise ValueError(f"num_splits must be in [1, 1024] or None, got {self.num_splits}")
        check_pow2("block_n", self.block_n, 16, 256)
        check_pow2("num_warps", self.num_warps, 1, 16)
        if not 1 <= self.num_stages <= 6:
            raise ValueError(f"num_stages must be in [1, 6], got {self.num_stages}")
        if self.waves < 1:
            raise ValueError(f"waves must be >= 1, got {self.waves}")


DEFAULT = DecodeConfig()


@lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_splits(batch: int, n_kv_heads: int, max_tokens: int, device: torch.device,
                config: DecodeConfig = DEFAULT) -> int:
    """Static split count: enough (batch x KV head x split) programs for `waves` per SM, but
    never more splits than tiles in the widest possible context."""
    if config.num_splits is not None:
        return config.num_splits
    sms = 2  # the interpreter: a couple of ranges, so the tests see splits
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    want = -(-config.waves * sms // (batch * n_kv_heads))
    return max(1, min(want, -(-max_tokens // config.block_n), 256))


# How the two matmuls of a tile run: in q's 16-bit dtype with fp32 accumulation (tensor
# cores), in fp32 (IEEE, never TF32), or, under the interpreter, whose dot multiplies bf16's
# raw bits, as fp32 matmuls of the same bf16-rounded operands (the GPU path's numerics).
DOT_NATIVE: tl.constexpr = tl.constexpr(0)
DOT_FP32: tl.constexpr = tl.constexpr(1)
DOT_EMULATED: tl.constexpr = tl.constexpr(2)


@triton.jit
def _mm(a, b, DOT: tl.constexpr):
    """a @ b with fp32 accumulation; a, b already in the operand dtype."""
    if DOT == DOT_NATIVE:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, tables_ptr, lens_ptr,
                         o_part_ptr, lse_part_ptr, qk_scale,
                         stride_qb, stride_qh, stride_tb,
                         HK: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                         PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         FP8: tl.constexpr, DOT: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N), 1) * BLOCK_N  # whole tiles per range
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g                                               # (BLOCK_G,) query heads
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < G)[:, None], other=0.0)                     # (BLOCK_G, D)
    if DOT == DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)                   # running max (log2 units)
    l_i = tl.zeros((BLOCK_G,), tl.float32)                                 # running sum of exp2
    acc = tl.zeros((BLOCK_G, D), tl.float32)                               # (BLOCK_G, D)
    table = tables_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_t                                               # (BLOCK_N,) context rows
        valid = offs_n < end
        page = tl.load(table + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
        slot = page * PAGE + offs_n % PAGE                                 # (BLOCK_N,) flat slots
        rows = slot[:, None] * (HK * D) + kvh * D + offs_d[None, :]        # (BLOCK_N, D)
        k = tl.load(k_cache_ptr + rows, mask=valid[:, None], other=0.0)    # (BLOCK_N, D)
        v = tl.load(v_cache_ptr + rows, mask=valid[:, None], other=0.0)    # (BLOCK_N, D)
        s = _mm(q, tl.trans(k.to(q.dtype)), DOT)                           # (BLOCK_G, BLOCK_N)
        if FP8:
            k_sc = tl.load(k_scale_ptr + slot * HK + kvh, mask=valid, other=0.0)  # (BLOCK_N,)
            s = s * k_sc[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))                         # (BLOCK_G,)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])                                    # (BLOCK_G, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            v_sc = tl.load(v_scale_ptr + slot * HK + kvh, mask=valid, other=0.0)  # (BLOCK_N,)
            p = p * v_sc[None, :]
        acc = acc * alpha[:, None] + _mm(cast(p, q.dtype), v.to(q.dtype), DOT)  # (BLOCK_G, D)
        m_i = m_new

    # A range past the end of the context leaves l_i = 0 and stores a zero output with
    # lse = -inf: harmless values, though the merge never reads them.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]                      # (BLOCK_G, D)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = (b * (HK * G) + heads).to(tl.int64) * NUM_SPLITS + split         # (BLOCK_G,) in (B*HQ, S)
    tl.store(o_part_ptr + row[:, None] * D + offs_d[None, :], out, mask=(offs_g < G)[:, None])
    tl.store(lse_part_ptr + row, lse, mask=offs_g < G)


@triton.jit
def _merge_kernel(o_part_ptr, lse_part_ptr, lens_ptr, out_ptr, stride_ob, stride_oh, HQ: tl.constexpr,
                  D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """out = sum_s exp2(lse_s - m) o_s / sum_s exp2(lse_s - m) over the ranges that hold rows,
    CHUNK ranges at a time (registers stay bounded however many splits there are)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N), 1) * BLOCK_N  # as the split kernel does
    used = tl.cdiv(ctx, per_split)                                         # ranges holding rows
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    row = (b * HQ + h).to(tl.int64) * NUM_SPLITS
    m = tl.full((CHUNK,), float("-inf"), tl.float32)
    for s0 in range(0, used, CHUNK):
        m = tl.maximum(m, tl.load(lse_part_ptr + row + s0 + offs_c, mask=s0 + offs_c < used, other=float("-inf")))
    m_all = tl.max(m, axis=0)
    acc = tl.zeros((D,), tl.float32)
    denom = tl.zeros((CHUNK,), tl.float32)
    for s0 in range(0, used, CHUNK):
        in_range = s0 + offs_c < used
        w = tl.exp2(tl.load(lse_part_ptr + row + s0 + offs_c, mask=in_range, other=float("-inf")) - m_all)
        o = tl.load(o_part_ptr + (row + s0 + offs_c)[:, None] * D + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)                     # (CHUNK, D)
        acc += tl.sum(o * w[:, None], axis=0)
        denom += w
    out = acc / tl.sum(denom, axis=0)                                      # (D,)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, cast(out, out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 *, config: DecodeConfig | None = None) -> torch.Tensor:
    """q: (B, n_heads, head_dim); caches (num_blocks, block_size, n_kv_heads, head_dim);
    block_tables: (B, max_blocks) int32 (or int64); context_lens: (B,) int32 (or int64),
    each >= 1 (rows to read, the new one included; not checked, as that would read them
    back to the host). Returns (B, n_heads, head_dim) in q's dtype."""
    cfg = config or DEFAULT
    check_caches(k_cache, v_cache)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    _, page, hk, d = k_cache.shape
    check_dim("q", q, 3, "(B, n_heads, head_dim)")
    b, hq, qd = q.shape
    if qd != d:
        raise ValueError(f"q has head_dim {qd} but the cache has {d}")
    if hq % hk:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hk} KV heads")
    check_dtype("q", q, ACT_DTYPES)
    check_last_dim_dense("q", q)
    check_dim("block_tables", block_tables, 2, "(B, max_blocks)")
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for a batch of {b}")
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_last_dim_dense("block_tables", block_tables)
    check_dim("context_lens", context_lens, 1, "(B,)")
    check_shape("context_lens", context_lens, (b,), "(B,)")
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    device = check_devices(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                           context_lens=context_lens,
                           k_scale=k_scale, v_scale=v_scale)
    if context_lens.stride(0) != 1:
        raise ValueError(f"context_lens must be contiguous, got stride {context_lens.stride(0)}")

    out = _empty((b, hq, d), dtype=q.dtype, device=device)                # (B, HQ, D)
    if b == 0:
        return out
    g = hq // hk
    splits = pick_splits(b, hk, block_tables.shape[1] * page, device, cfg)
    o_part = _empty((b, hq, splits, d), dtype=torch.float32, device=device)  # (B, HQ, S, D)
    lse_part = _empty((b, hq, splits), dtype=torch.float32, device=device)    # (B, HQ, S)
    # fp32 anywhere, or two different 16-bit types, computes in fp32 (IEEE, not TF32);
    # otherwise the dots run in q's dtype, which fp8 values convert to exactly.
    if q.dtype == torch.float32 or (not fp8 and k_cache.dtype != q.dtype):
        dot = DOT_FP32
    elif q.dtype == torch.bfloat16 and interpreting():
        dot = DOT_EMULATED
    else:
        dot = DOT_NATIVE
    _decode_split_kernel[(b, hk, splits)](
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, block_tables,
        context_lens, o_part, lse_part, float(scale) * LOG2E,
        q.stride(0), q.stride(1), block_tables.stride(0),
        HK=hk, G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), D=d, PAGE=page, BLOCK_N=cfg.block_n,
        NUM_SPLITS=splits, FP8=fp8, DOT=dot.value, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _merge_kernel[(b, hq)](o_part, lse_part, context_lens, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                           NUM_SPLITS=splits, BLOCK_N=cfg.block_n, CHUNK=16, num_warps=2)
    return out


__all__ = ["paged_decode", "DecodeConfig", "pick_splits"]
