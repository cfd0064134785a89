"""The small fused kernels of the CUDA decode step (see `engine/cuda_graph.py`).

A batch-1 decode step moves little data outside the matmuls, and in torch every norm,
rotation and activation is several kernels of a few microseconds each: about 25 per layer,
800 for Llama 3.1 8B, over a millisecond per token even replayed from a CUDA graph. Fused,
each is one kernel (what vLLM's fused_add_rms_norm, rotary embedding + reshape_and_cache,
and silu_and_mul kernels do):

- `add_rms_norm`: x += residual (in place), then RMSNorm(x) * w;
- `rope_write`: RoPE on the q and k heads of a fused qkv row, q out, rotated k and v into
  their cache slots (fp8 quantized on the way in, as `write_kv` does);
- `silu_mul`: silu(gate) * up of a fused gate_up row.

Each rounds where the torch composition it replaces rounds (every torch op on bf16 rounds
its result to bf16), so the results match the references in `engine.cuda_graph.TorchOps`
up to the last bit of a few elements (reduction order, exp and rsqrt approximations).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import (ACT_DTYPES, INDEX_DTYPES, check_caches, check_contiguous, check_devices, check_dim,
                     check_dtype, check_last_dim_dense, check_scales, check_shape)
from .rounding import cast, quantize_fp8_row


# ---- add + RMSNorm ---------------------------------------------------------------------------
@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, n, eps,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)      # (BLOCK,)
    dt = x.dtype
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        x = cast(x.to(tl.float32) + r.to(tl.float32), dt)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = cast(xf * inv, dt)                                                 # rms_norm rounds here, then * w
    tl.store(out_ptr + row * stride_out + offs, cast(y.to(tl.float32) * w.to(tl.float32), dt), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (T, H), updated in place to x + residual when residual (T, H) is given; returns
    RMSNorm(x) * weight (T, H) in x's dtype."""
    check_dim("x", x, 2, "(T, hidden)")
    t, n = x.shape
    check_dtype("x", x, ACT_DTYPES)
    check_last_dim_dense("x", x)
    check_shape("weight", weight, (n,), "(hidden,)")
    check_contiguous("weight", weight)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype}, x has {x.dtype}; they must match")
    if residual is not None:
        check_shape("residual", residual, (t, n), "(T, hidden)")
        check_last_dim_dense("residual", residual)
        if residual.dtype != x.dtype:
            raise ValueError(f"residual has dtype {residual.dtype}, x has {x.dtype}; they must match")
    device = check_devices(x=x, residual=residual, weight=weight)
    out = torch.empty((t, n), dtype=x.dtype, device=device)                # (T, H)
    if t == 0:
        return out
    block = triton.next_power_of_2(n)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, float(eps),
                               HAS_RES=residual is not None, BLOCK=block,
                               num_warps=min(16, max(1, block // 256)))
    return out


# ---- RoPE + cache write ----------------------------------------------------------------------------
@triton.jit
def _rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                       v_scale_ptr, slots_ptr, stride_qkv, stride_qo_t, stride_pos, stride_slot,
                       HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)                                                   # q heads, then k heads
    offs = tl.arange(0, D)
    rot = (offs + D // 2) % D                                              # rotate_half's source lanes
    row = qkv_ptr + t * stride_qkv
    x = tl.load(row + h * D + offs)                                        # (D,)
    dt = x.dtype
    x_rot = tl.load(row + h * D + rot).to(tl.float32)
    x_rot = tl.where(offs < D // 2, -x_rot, x_rot)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    cos = tl.load(cos_ptr + pos * D + offs).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + offs).to(tl.float32)
    # x * cos + rotated * sin, rounding each product and the sum to x's dtype as torch does. The
    # launch turns off multiply-add fusion: on the H200 the compiler narrowed these fp32 products
    # to bf16 ones and fused one into the add, skipping its rounding (3,875 of 5,120 values of q
    # off by up to 6 bf16 steps where the two terms nearly cancel)
    y = cast(cast(x.to(tl.float32) * cos, dt).to(tl.float32) + cast(x_rot * sin, dt).to(tl.float32), dt)
    if h < HQ:
        tl.store(q_out_ptr + t * stride_qo_t + h * D + offs, y)
    else:
        j = h - HQ
        slot = tl.load(slots_ptr + t * stride_slot).to(tl.int64)
        keep = offs * 0 + slot >= 0                                        # (D,); slot -1: a padded row writes nothing
        dst = slot * (HK * D) + j * D + offs
        v = tl.load(row + (HQ + HK + j) * D + offs)                        # (D,)
        if FP8:
            k_q, k_sc = quantize_fp8_row(y)
            v_q, v_sc = quantize_fp8_row(v)
            tl.store(k_scale_ptr + slot * HK + j, k_sc, mask=slot >= 0)
            tl.store(v_scale_ptr + slot * HK + j, v_sc, mask=slot >= 0)
            tl.store(k_cache_ptr + dst, k_q.to(k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(v_cache_ptr + dst, v_q.to(v_cache_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(k_cache_ptr + dst, cast(y, k_cache_ptr.dtype.element_ty), mask=keep)
            tl.store(v_cache_ptr + dst, cast(v, v_cache_ptr.dtype.element_ty), mask=keep)


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
               k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """qkv: (T, (n_heads + 2 n_kv_heads) * head_dim), q then k then v heads; cos, sin: RoPE
    tables (max_pos, 1, head_dim) or (max_pos, head_dim) in qkv's dtype, read at positions
    (T,), which must be < max_pos (not checked: that would read them back). Writes RoPE(k)
    and v to `slots` (T,) of the caches (a negative slot: nothing, a padded row); returns
    RoPE(q) (T, n_heads, head_dim)."""
    check_caches(k_cache, v_cache)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    _, _, hk, d = k_cache.shape
    check_dim("qkv", qkv, 2, "(T, (n_heads + 2 n_kv_heads) * head_dim)")
    t = qkv.shape[0]
    if not isinstance(n_heads, int) or n_heads <= 0 or n_heads % hk:
        raise ValueError(f"n_heads must be a positive multiple of the cache's {hk} KV heads, got {n_heads!r}")
    check_shape("qkv", qkv, (t, (n_heads + 2 * hk) * d), "(T, (n_heads + 2 n_kv_heads) * head_dim)")
    check_dtype("qkv", qkv, ACT_DTYPES)
    check_last_dim_dense("qkv", qkv)
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() not in (2, 3) or table.shape[-1] != d or table.numel() != table.shape[0] * d:
            raise ValueError(f"{name} must be (max_pos, 1, {d}) or (max_pos, {d}), got {tuple(table.shape)}")
        check_contiguous(name, table)
        if table.dtype != qkv.dtype:
            raise ValueError(f"{name} has dtype {table.dtype}, qkv has {qkv.dtype}; they must match")
    check_shape("positions", positions, (t,), "(T,)")
    check_dtype("positions", positions, INDEX_DTYPES)
    check_shape("slots", slots, (t,), "(T,)")
    check_dtype("slots", slots, INDEX_DTYPES)
    device = check_devices(qkv=qkv, cos=cos, sin=sin, positions=positions, k_cache=k_cache, v_cache=v_cache,
                           slots=slots, k_scale=k_scale, v_scale=v_scale)
    q = torch.empty((t, n_heads, d), dtype=qkv.dtype, device=device)      # (T, hq, d)
    if t == 0:
        return q
    _rope_write_kernel[(t, n_heads + hk)](
        qkv, cos, sin, positions, q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        slots, qkv.stride(0), q.stride(0), positions.stride(0), slots.stride(0),
        HQ=n_heads, HK=hk, D=d, FP8=fp8, num_warps=1 if d <= 128 else 2,
        enable_fp_fusion=False)   # each product rounded as torch rounds it (see the kernel)
    return q


# ---- silu(gate) * up ----------------------------------------------------------------------------
@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + t * stride_gu + n + offs, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    act = cast(g / (1.0 + tl.exp(-g)), dt)                                 # F.silu, rounded as torch rounds
    tl.store(out_ptr + t * stride_out + offs, cast(act.to(tl.float32) * up.to(tl.float32), dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (T, 2 * inter), gate then up -> silu(gate) * up (T, inter)."""
    check_dim("gate_up", gate_up, 2, "(T, 2 * intermediate)")
    t, n2 = gate_up.shape
    if n2 % 2:
        raise ValueError(f"gate_up must have an even last dimension (gate then up), got {n2}")
    check_dtype("gate_up", gate_up, ACT_DTYPES)
    check_last_dim_dense("gate_up", gate_up)
    device = check_devices(gate_up=gate_up)
    n = n2 // 2
    out = torch.empty((t, n), dtype=gate_up.dtype, device=device)         # (T, inter)
    if t == 0:
        return out
    block = min(2048, triton.next_power_of_2(n))
    _silu_mul_kernel[(t, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block,
                                                  num_warps=4)
    return out
