"""The decode step's fused C calls (engine/csrc/step.c and write.c's kv_rope_write).

Between the products and the attention, a decode step in torch ran about 1,800 small ops and
240 ctypes calls a step for the bundled model (RoPE, residual adds, SiLU, slicing; profile in
issue 25's note), a fifth of a step on a busy 2-core machine. Two levels replace them:
- `add_rms_norm_rows`, `silu_mul_rows`, `rope_write`: one C call each for the rows of any
  batch Llama.forward runs layer by layer (a few decode rows beside prompt chunks, or a
  chunk's hundreds), threads over the rows, with a bf16 prefill's rows in bf16 where its
  products take and give them;
- `add_rms_norm`, `silu_mul`: the single-thread row calls kv_decode_step itself makes
  (kv_add_rms_norm, kv_silu_mul), with the signatures of `cuda_graph.TorchOps`: the tests'
  handle on them;
- `decode_step`: a batch of decode rows only (one per sequence, 1 to native.max_rows())
  through every layer and the logits in one C call (kv_decode_step), which runs those same
  kernels with the products and the attention in between. Its per-layer arguments (weight
  and cache addresses) are built once per model and pool, not once per step.
Each returns None (or the caller checks `*_serves` first) where the C kernels do not serve,
and the torch path in engine/model.py runs instead.
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from . import native, threads
from .attention import triton_kernels
from .native import CACHE_DTYPES, lib, max_rows
from .native_abi import LayerArgs, StepArgs


def rows_serve(x: torch.Tensor) -> bool:
    """Whether the fused ops take rows like x: 1 to native.max_rows() contiguous fp32 CPU rows (a
    decode step's; a prompt chunk's take the *_rows calls below), and the kernels loaded."""
    return (x.dim() == 2 and 0 < x.shape[0] <= max_rows() and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous())


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (B, k) fp32, set to x + residual (B, k) in place when residual is given; returns
    RMSNorm(x) * w (B, k). Callers check native.gemv_serves(x, w); residual must be contiguous fp32."""
    y = torch.empty_like(x)
    lib().kv_add_rms_norm(x.data_ptr(), residual.data_ptr() if residual is not None else None, w.data_ptr(),
                          y.data_ptr(), x.shape[0], x.shape[1], eps)
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: (B, 2 n) fp32 contiguous, gate then up -> silu(gate) * up (B, n). Callers check
    rows_serve(gate_up)."""
    b, n2 = gate_up.shape
    out = torch.empty(b, n2 // 2)
    lib().kv_silu_mul(gate_up.data_ptr(), out.data_ptr(), b, n2 // 2)
    return out


def chunk_serves(x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
    """Whether add_rms_norm_rows and silu_mul_rows take rows like x: any number of contiguous
    fp32 or bf16 CPU rows (a prompt chunk's; a decode step's take the calls above too), fp32
    contiguous norm weights w where given, and the kernels loaded."""
    return (x.dim() == 2 and x.shape[0] > 0 and x.dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu" and x.is_contiguous() and lib() is not None
            and (w is None or (w.dtype == torch.float32 and w.is_contiguous() and w.device.type == "cpu")))


def add_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor | None, w: torch.Tensor, eps: float,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """add_rms_norm over any number of rows, threads over them: x (T, k) fp32, set to x +
    residual in place (residual: (T, k) fp32 or bf16, widened exactly); returns RMSNorm(x) * w
    in dtype (fp32, or bf16 rounded to nearest even: a bf16 product's input). Callers check
    chunk_serves(x, w) and chunk_serves(residual)."""
    y = torch.empty(x.shape, dtype=dtype)
    lib().kv_add_rms_norm_rows(x.data_ptr(), residual.data_ptr() if residual is not None else None,
                               residual is not None and residual.dtype == torch.bfloat16, w.data_ptr(), y.data_ptr(),
                               dtype == torch.bfloat16, x.shape[0], x.shape[1], eps, threads.count())
    return y


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul over any number of rows, threads over them: (T, 2 n) fp32 or bf16 -> (T, n)
    in the same dtype (bf16: torch's two roundings, after the SiLU and after the product).
    Callers check chunk_serves(gate_up)."""
    b, n2 = gate_up.shape
    out = torch.empty(b, n2 // 2, dtype=gate_up.dtype)
    lib().kv_silu_mul_rows(gate_up.data_ptr(), out.data_ptr(), b, n2 // 2, gate_up.dtype == torch.bfloat16,
                           threads.count())
    return out


def rope_serves(qkv: torch.Tensor, cos: torch.Tensor, k_cache: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor) -> bool:
    """Whether rope_write takes these: fp32 CPU qkv rows with unit stride, contiguous fp32
    tables, an fp32 or e4m3 cache with unit-stride rows, an even head_dim up to 1024."""
    d = k_cache.shape[-1]
    return (qkv.device.type == "cpu" and qkv.dtype == torch.float32 and qkv.dim() == 2 and qkv.stride(1) == 1
            and cos.dtype == torch.float32 and cos.is_contiguous() and k_cache.device.type == "cpu"
            and k_cache.dtype in CACHE_DTYPES and k_cache.stride(-1) == 1 and d % 2 == 0 and d <= 1024
            and positions.device.type == "cpu" and slots.device.type == "cpu" and lib() is not None
            and triton_kernels(k_cache) is None)     # tests that force the Triton kernels onto CPU tensors


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None, n_heads: int) -> torch.Tensor:
    """qkv: (T, (hq + 2 hk) d); cos, sin: (max_pos, 1, d); positions, slots: (T,). Writes
    RoPE(k) and v to the slots (bf16: rounded, fp8: quantized, as native.write does) and returns RoPE(q)
    (T, hq, d). A slot or position out of range raises IndexError before anything is written.
    Callers check rope_serves."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    pos, slots = positions.to(torch.int64).contiguous(), slots.to(torch.int64).contiguous()
    q = torch.empty(t, n_heads, d)                                          # (T, hq, d)
    a = native.write_args(k_cache, v_cache, k_scale, v_scale)
    if lib().kv_rope_write(ctypes.byref(a), qkv.data_ptr(), qkv.stride(0), n_heads, cos.data_ptr(), sin.data_ptr(),
                           cos.shape[0], pos.data_ptr(), slots.data_ptr(), q.data_ptr(), t, threads.count()) != 0:
        raise IndexError(f"a slot or position is outside the pool's {a.num_blocks * a.block_size} slots "
                         f"or the RoPE table's {cos.shape[0]} positions")
    return q


# ---- the whole step ---------------------------------------------------------------------------
_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (its tensors' weakrefs, LayerArgs array or None)


def _weights_serve(model) -> bool:
    mats = [model.lm_head] + [w for ly in model.layers for w in (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down)]
    norms = [model.norm] + [w for ly in model.layers for w in (ly.attn_norm, ly.mlp_norm)]
    dtype = mats[0].dtype
    return (dtype in (torch.float32, torch.bfloat16) and all(m.dtype == dtype and m.is_contiguous() for m in mats)
            and all(n.dtype == torch.float32 and n.is_contiguous() for n in norms)
            and all(t.device.type == "cpu" for t in mats + norms))


def _tensors(model, pool) -> list[torch.Tensor]:
    """Every tensor whose address the C step is given."""
    out = [pool.data, model.norm, model.lm_head] + ([pool.scales] if pool.scales is not None else [])
    for ly in model.layers:
        out += (ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down, ly.attn_norm, ly.mlp_norm)
    return out


def _layer_args(model, pool):
    """The LayerArgs array for this model and pool, or None where they do not serve: made once,
    and again when any of their tensors is another object (a new pool, weights replaced). Held
    by weak references, so a dropped pool or weight is freed at once and never read again."""
    tensors = _tensors(model, pool)
    held = _LAYERS.get(model)
    if held is not None and len(held[0]) == len(tensors) and all(r() is t for r, t in zip(held[0], tensors)):
        return held[1]
    arr = None
    k0 = pool.layer(0)[0] if model.layers else None
    if k0 is not None and k0.dtype in CACHE_DTYPES and k0.stride(-1) == 1 and _weights_serve(model):
        arr = (LayerArgs * len(model.layers))()
        for i, ly in enumerate(model.layers):
            k, v, ks, vs = pool.layer(i)
            arr[i] = LayerArgs(ly.wqkv.data_ptr(), ly.wo.data_ptr(), ly.w_gate_up.data_ptr(), ly.w_down.data_ptr(),
                               ly.attn_norm.data_ptr(), ly.mlp_norm.data_ptr(), k.data_ptr(), v.data_ptr(),
                               ks.data_ptr() if ks is not None else None, vs.data_ptr() if vs is not None else None)
    _LAYERS[model] = ([weakref.ref(t) for t in tensors], arr)
    return arr


def step_serves(x: torch.Tensor, batch) -> bool:
    """Whether decode_step may take this batch: decode rows only, 1 to native.max_rows() fp32 CPU
    rows, their tables and lengths int32 on the CPU, the kernels loaded and the Triton ones
    not forced onto CPU tensors."""
    b = batch.decode
    return (not batch.prefills and 0 < b <= max_rows() and x.shape[0] == b and x.dtype == torch.float32
            and x.device.type == "cpu" and batch.block_tables is not None and batch.context_lens is not None
            and batch.block_tables.dtype == torch.int32 and batch.context_lens.dtype == torch.int32
            and batch.block_tables.device.type == "cpu"
            and triton_kernels(x) is None)           # tests that force the Triton kernels onto CPU tensors


def decode_step(model, x: torch.Tensor, positions: torch.Tensor, batch, pool) -> torch.Tensor | None:
    """x: (B, hidden) fp32, the rows' embeddings (overwritten); positions: (B,). Writes the
    rows' K/V and returns logits (B, vocab) fp32, or None where the C step does not serve
    this model, pool or batch (a length, block id, slot or position out of range included:
    nothing is written then, and the torch path says what is wrong). Callers check step_serves."""
    g = model.geom
    hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
    if d % 16 or d > 256 or hq % hk or hq // hk > 16:       # native.decode_serves' geometry
        return None
    layers = _layer_args(model, pool)
    if layers is None:
        return None
    b = x.shape[0]
    x = x if x.is_contiguous() else x.contiguous()
    tables = batch.block_tables if batch.block_tables.stride(-1) == 1 else batch.block_tables.contiguous()
    lens = batch.context_lens.contiguous()
    pos = positions.to(torch.int64).contiguous()
    slots = batch.slots.to(torch.int64).contiguous()
    cos, sin = model.rope_cover(batch.max_position)                        # (n_pos, 1, d) each
    if cos.dtype != torch.float32:
        return None
    k, v, ks, vs = pool.layer(0)
    s = StepArgs(native.decode_args((b, hq, d), hq * d, k, v, tables, tables.stride(0), lens.data_ptr(), 0, b,
                                    model.scale, ks, vs),
                 native.write_args(k, v, ks, vs), ctypes.addressof(layers), model.norm.data_ptr(), model.lm_head.data_ptr(),
                 cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), slots.data_ptr(),
                 len(model.layers), g.hidden, hq, g.intermediate, model.lm_head.shape[0], cos.shape[0],
                 int(model.lm_head.dtype == torch.bfloat16), g.norm_eps)
    work = torch.empty(b * (2 * g.hidden + (hq + 2 * hk) * d + 2 * hq * d + 3 * g.intermediate))
    logits = torch.empty(b, model.lm_head.shape[0])                         # (B, vocab)
    rc = lib().kv_decode_step(ctypes.byref(s), x.data_ptr(), work.data_ptr(), logits.data_ptr(),
                              native.splits(hk), threads.count())
    if rc == -2:
        raise MemoryError("the C decode step ran out of memory")
    return logits if rc == 0 else None
