"""Writing a step's (or a prefill's) K and V rows into their slots of the paged pool.

One program per token writes every KV head of that token, K and V together, to
slot = block_id * block_size + offset (the PagedAttention layout of vLLM, Kwon et al. 2023).
An fp8 cache quantizes on the way in, per (token, KV head), by absmax / 448 exactly as
`engine.attention.quantize_fp8` does (round-to-nearest divisions, so the stored bytes match).
Reference: `engine.attention.write_kv_ref`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (ACT_DTYPES, INDEX_DTYPES, check_caches, check_devices, check_dim, check_dtype,
                     check_last_dim_dense, check_scales, check_shape)
from .rounding import cast, quantize_fp8


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slots_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot,
                     HK: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    heads = (offs_h < HK) & (offs_h * 0 + slot >= 0)                      # (BLOCK_H,); slot -1: a padded row
    mask = heads[:, None]                                                  # (BLOCK_H, 1)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)  # (BLOCK_H, D)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)  # (BLOCK_H, D)
    dst = slot * (HK * D) + offs_h[:, None] * D + offs_d[None, :]          # (BLOCK_H, D) flat cache offsets
    if FP8:
        k, k_scale = quantize_fp8(k)
        v, v_scale = quantize_fp8(v)
        tl.store(k_scale_ptr + slot * HK + offs_h, k_scale, mask=heads)
        tl.store(v_scale_ptr + slot * HK + offs_h, v_scale, mask=heads)
    tl.store(k_cache_ptr + dst, cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store k, v: (T, n_kv_heads, head_dim) at flat slots (T,) of the caches
    (num_blocks, block_size, n_kv_heads, head_dim); fp8 caches also fill k_scale, v_scale
    (num_blocks, block_size, n_kv_heads). A negative slot writes nothing (the padded rows of
    a CUDA graph captured for a larger batch, as in vLLM). Slot ids are not range-checked
    (that would read them back to the host); an out-of-range slot is the caller's bug."""
    check_caches(k_cache, v_cache)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    _, _, hk, d = k_cache.shape
    layout = "(T, n_kv_heads, head_dim)"
    check_dim("k", k, 3, layout)
    check_dim("v", v, 3, layout)
    t = k.shape[0]
    check_shape("k", k, (t, hk, d), layout)
    check_shape("v", v, (t, hk, d), layout)
    check_dtype("k", k, ACT_DTYPES)
    check_dtype("v", v, ACT_DTYPES)
    check_last_dim_dense("k", k)
    check_last_dim_dense("v", v)
    check_dim("slots", slots, 1, "(T,) flat slot ids")
    check_shape("slots", slots, (t,), "(T,) flat slot ids, one per row of k")
    check_dtype("slots", slots, INDEX_DTYPES)
    check_devices(k_cache=k_cache, v_cache=v_cache, k=k, v=v, slots=slots, k_scale=k_scale, v_scale=v_scale)
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), slots.stride(0),
        HK=hk, BLOCK_H=triton.next_power_of_2(hk), D=d, FP8=fp8, num_warps=4 if hk * d >= 1024 else 1)
