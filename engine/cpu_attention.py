"""The CPU's own attention paths, behind engine/attention.py's interface.

- Split-K decode ("flash-decoding", Dao et al. 2023): one sequence's rows cut into windows
  run as one batch of torch's fused CPU kernel, merged by log-sum-exp (`merge_partials`).
- An fp8 cache dequantized piece by piece inside that loop (`decode_fp8`), by placing its
  bits in float32 rather than converting element by element.
- Prefill after a cached prefix as two fused calls merged the same way (`prefix_then_causal`).

Rows arrive as (T, n_kv_heads, head_dim) views of the pool (`attention.row_pieces`), any
strides with unit stride in head_dim: the CPU pool is head-major (kv_cache.py).
"""
from __future__ import annotations

from typing import Any

import math
import threading

import torch
import torch.nn.functional as F

from . import native, threads


def sdpa_decode(q, k, v, scale):
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


_FLASH_LSE: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def fused_lse(t: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel, with its log-sum-exp, serves tensors like t."""
    return t.device.type == "cpu" and _FLASH_LSE is not None and t.dtype in (torch.float32, torch.bfloat16)


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention within each window and its log-sum-exp. q: (n, hk, g, d); k, v: (n, hk, c, d);
    bias: (n, 1, 1, c) or None. Returns (out (n, hk, g, d), lse (n, hk, g) fp32).

    torch's fused CPU kernel returns the log-sum-exp beside its output but only through the
    aten op that scaled_dot_product_attention itself calls on CPU (no public op gives it);
    without that op, the same in plain torch."""
    if fused_lse(q):
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
    n = split_count(t, hk, threads.most()) if n is None else n
    kw, s = windows(k, n)                                                  # (n, c, hk, d)
    vw, _ = windows(v, n)
    qn = q.view(1, hk, g, d).expand(n, hk, g, d)                           # (n, hk, g, d)
    return partial_attention(qn, kw.transpose(1, 2), vw.transpose(1, 2), scale,
                             window_bias(n, kw.shape[1], s))


def decode_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 n: int | None = None) -> torch.Tensor:
    """Split-K decode over one sequence's rows. q: (H, d); k, v: (T, hk, d) -> (H, d)."""
    n = split_count(k.shape[0], k.shape[1], threads.most()) if n is None else n
    if n == 1:
        return sdpa_decode(q, k, v, scale)
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
    n_threads = threads.most()   # the cap, not the load's count: the same bits under any load
    outs, lses = [], []
    for kp, vp, ksp, vsp in zip(k, v, ks, vs):
        for a in range(0, kp.shape[0], piece):
            b = min(a + piece, kp.shape[0])
            kd = dequantize_rows(kp[a:b].transpose(0, 1), ksp[a:b].t(), q.dtype, kbuf, exact)  # (hk, rows, d)
            vd = dequantize_rows(vp[a:b].transpose(0, 1), vsp[a:b].t(), q.dtype, vbuf, exact)
            w = split_count(b - a, hk, n_threads)    # windows: w x hk work items for the threads
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
    merged = native.merge_two(o1[0], l1[0], o2[0], l2[0])                 # (T, H, d), one C pass
    if merged is not None:
        return merged.transpose(0, 1)
    out = torch.stack((o1.reshape(h, t, d), o2[0]))                       # (2, H, T, d)
    lse = torch.stack((l1.reshape(h, t), l2[0]))                          # (2, H, T)
    return merge_partials(out, lse)
