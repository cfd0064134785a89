"""A Llama decoder in plain torch, reading and writing its K/V through the paged pool.

References: Touvron et al., "LLaMA" (2023) and "Llama 2" (2023) for RMSNorm, SwiGLU and
RoPE; Ainslie et al., "GQA" (2023); Meta's Llama 3.1 release for the "llama3" RoPE
frequency scaling. The layout follows transformers' LlamaForCausalLM weights (rotate-half
RoPE), so the same safetensors load into both and their logits can be compared.

Q, K and V share one fused projection and gate/up another: fewer, larger matmuls per
layer, which is what a batch-1 decode step on a CPU is bound by.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native
from .attention import causal_attention, paged_decode, paged_prefill, write_kv
from .geometry import Geometry
from .kv_cache import KVPool


@dataclass(slots=True)
class Step:
    """Where one forward pass reads and writes the cache (one sequence)."""
    block_table: torch.Tensor  # (max_blocks,) int32 on the model's device
    slots: torch.Tensor        # (T,) int64: flat pool slots of the new tokens
    prefix_len: int            # tokens already cached before this pass
    decode: bool               # one new token against the cache
    # (1,) int32/int64 on the device: prefix_len + 1 for a decode step. Given, the step
    # reads its length from the device (a CUDA graph replays it with new values); left
    # None, forward makes it from prefix_len, and the CPU path reads that int directly.
    context_lens: torch.Tensor | None = None
    # The table as runs of consecutive block ids, ((first id, blocks), ...), when the caller
    # knows them (Sequence.runs): the CPU path reads each run as a view without reading the table.
    runs: tuple[tuple[int, int], ...] | None = None


def rope_inv_freq(geom: Geometry) -> torch.Tensor:
    """(head_dim/2,) inverse frequencies, with Llama 3.1's "llama3" scaling when configured."""
    d = geom.head_dim
    inv = 1.0 / (geom.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = geom.rope_scaling
    if sc and sc.get("rope_type", sc.get("type")) == "llama3":
        factor = sc["factor"]
        low, high = sc["low_freq_factor"], sc["high_freq_factor"]
        old_ctx = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif sc and sc.get("rope_type", sc.get("type")) not in (None, "default"):
        raise ValueError(f"unsupported rope scaling {sc!r}; supported: default, llama3")
    return inv.float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if native.gemv_serves(x, w):  # a decode step's rows (1 to 16) in fp32 on CPU: one C call, not torch's eight ops
        return native.rms_norm(x, w, eps)
    if x.dtype == torch.float32 and _FUSED_RMS_NORM:
        return F.rms_norm(x, w.shape, w, eps)  # one op instead of eight: decode is op-bound on CPU
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


_FUSED_RMS_NORM = hasattr(F, "rms_norm")


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T. A decode step's fp32 CPU rows (1 to native.GEMV_MAX_ROWS, one per sequence)
    take the C kernel (engine/native.py) where it compiled: each weight row read once for all.
    Otherwise one row splits w's rows across a batched matmul: a single-row product runs on
    one thread in MKL, a batch of S runs on S threads (the same dot products, so the same
    numbers; a decode step's weight reads went 45 ms -> 25 ms on 2 cores)."""
    if native.gemv_serves(x, w):
        return native.gemv(x, w)
    if w.dtype != x.dtype:     # bf16 weights, fp32 rows (Llama.act_dtype): a prefill's GEMM in bf16 (AMX where present)
        return (x.to(w.dtype) @ w.T).to(x.dtype)
    s = torch.get_num_threads()
    if x.shape[0] != 1 or s < 2 or x.device.type != "cpu" or w.shape[0] % s:
        return x @ w.T
    n, k = w.shape
    return torch.bmm(x.expand(s, 1, k), w.view(s, n // s, k).transpose(1, 2)).reshape(1, n)  # (1, n)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, H, d); cos, sin: (T, 1, d). Rotate-half RoPE, x cos + (-x2, x1) sin, computed
    half by half into one output (no negated copy, no concatenation): the same roundings, so
    the same bits as the plain formula and as the Triton rope_write kernel."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].sub_(x2 * sin[..., :half])
    out[..., half:].add_(x1 * sin[..., half:])
    return out


class Layer:
    __slots__ = ("wqkv", "wo", "w_gate_up", "w_down", "attn_norm", "mlp_norm")

    def __init__(self, wqkv, wo, w_gate_up, w_down, attn_norm, mlp_norm):
        self.wqkv, self.wo = wqkv, wo                 # (q+2kv, hidden), (hidden, q)
        self.w_gate_up, self.w_down = w_gate_up, w_down  # (2*inter, hidden), (hidden, inter)
        self.attn_norm, self.mlp_norm = attn_norm, mlp_norm


class Llama:
    """Weights plus a forward pass; the engine decides which blocks it uses."""

    def __init__(self, geom: Geometry, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor) -> None:
        self.geom = geom
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.device, self.dtype = embed.device, embed.dtype
        self.act_dtype = self.dtype     # the rows' dtype: see fp32_rows()
        self.scale = geom.head_dim ** -0.5
        self.inv_freq = rope_inv_freq(geom).to(self.device)
        self._cos = self._sin = torch.empty(0)
        self._extend_rope(min(geom.max_position, 8192))

    def fp32_rows(self) -> None:
        """bf16 weights on a CPU with the C kernels (the engine asks for this): only the
        matrices stay bf16 (half the bytes a decode step reads, native.gemv's bf16 path); the
        rows, norms, RoPE and K/V are fp32, so the fp32 cache kernels serve and nothing is
        rounded to bf16 between the products. A prefill's GEMM runs in bf16 (AMX where present)."""
        self.act_dtype = torch.float32
        self.norm = self.norm.float()
        for layer in self.layers:
            layer.attn_norm, layer.mlp_norm = layer.attn_norm.float(), layer.mlp_norm.float()
        self._extend_rope(self._cos.shape[0])

    # ---- rotary tables -----------------------------------------------------------------------
    def _extend_rope(self, n: int) -> None:
        t = torch.arange(n, device=self.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)                      # (n, d/2)
        emb = torch.cat((freqs, freqs), dim=-1)                    # (n, d)
        self._cos = emb.cos().to(self.act_dtype)[:, None, :]        # (n, 1, d)
        self._sin = emb.sin().to(self.act_dtype)[:, None, :]

    def rope_tables(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (cos, sin) tables, (positions, 1, head_dim) each, extended to n positions
        first if they cover fewer. A CUDA graph keeps reading the tensors it captured."""
        if n > self._cos.shape[0]:
            self._extend_rope(n)
        return self._cos, self._sin

    def rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if max_pos >= self._cos.shape[0]:
            self._extend_rope(max(2 * self._cos.shape[0], max_pos + 1))
        return self._cos[positions], self._sin[positions]

    # ---- forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: Step, pool: KVPool,
                last_only: bool = True) -> torch.Tensor:
        """ids, positions: (T,). Writes the T new K/V rows, returns logits (T or 1, vocab) in fp32."""
        g = self.geom
        t = ids.shape[0]
        hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
        cos, sin = self.rope(positions, step.prefix_len + t)
        context = step.prefix_len + t
        context_lens, max_context = step.context_lens, None
        if step.decode and context_lens is None:
            context_lens = torch.tensor([context], dtype=torch.int32, device=self.device)
            max_context = context
        x = self.embed[ids].to(self.act_dtype)                            # (T, hidden)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            k_cache, v_cache, k_scale, v_scale = pool.layer(i)
            h = rms_norm(x, layer.attn_norm, g.norm_eps)
            qkv = linear(h, layer.wqkv)                                   # (T, (hq+2hk)*d)
            qk = apply_rope(qkv[:, :(hq + hk) * d].view(t, hq + hk, d), cos, sin)  # (T, hq+hk, d)
            q, k = qk[:, :hq], qk[:, hq:]                                 # (T, hq, d), (T, hk, d)
            v = qkv[:, (hq + hk) * d:].view(t, hk, d)                     # (T, hk, d)
            write_kv(k_cache, v_cache, k, v, step.slots, k_scale, v_scale)
            if step.decode:
                o = paged_decode(q, k_cache, v_cache, step.block_table[None], context_lens, self.scale,
                                 k_scale, v_scale, max_context=max_context,
                                 runs=step.runs)           # (1, hq, d)
            elif i == last and last_only and t > 1:
                # the last layer's K/V are written; only the last row's output reaches the logits
                x, q = x[-1:], q[-1:]                                     # (1, hidden), (1, hq, d)
                o = paged_prefill(q, k_cache, v_cache, step.block_table, step.prefix_len + t - 1, self.scale,
                                  k_scale, v_scale, runs=step.runs)  # (1, hq, d)
            else:
                o = paged_prefill(q, k_cache, v_cache, step.block_table, step.prefix_len, self.scale,
                                  k_scale, v_scale, runs=step.runs)  # (T, hq, d)
            x = x + linear(o.reshape(x.shape[0], hq * d), layer.wo)
            x = x + self._mlp(x, layer)
        return self._logits(x[-1:] if last_only else x)

    @torch.inference_mode()
    def forward_dense(self, ids: torch.Tensor, last_only: bool = True) -> torch.Tensor:
        """The whole sequence from scratch, no cache read or kept: what every decode step
        costs without a KV cache. ids: (T,) -> logits (T or 1, vocab) fp32."""
        g = self.geom
        t = ids.shape[0]
        hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
        positions = torch.arange(t, device=self.device)
        cos, sin = self.rope(positions, t)
        x = self.embed[ids].to(self.act_dtype)
        for layer in self.layers:
            h = rms_norm(x, layer.attn_norm, g.norm_eps)
            q, k, v = linear(h, layer.wqkv).split((hq * d, hk * d, hk * d), dim=-1)
            q = apply_rope(q.view(t, hq, d), cos, sin).transpose(0, 1)    # (hq, T, d)
            k = apply_rope(k.view(t, hk, d), cos, sin).transpose(0, 1)    # (hk, T, d)
            v = v.view(t, hk, d).transpose(0, 1)
            o = causal_attention(q, k, v, 0, self.scale).transpose(0, 1)  # (T, hq, d)
            x = x + linear(o.reshape(t, hq * d), layer.wo)
            x = x + self._mlp(x, layer)
        return self._logits(x[-1:] if last_only else x)

    def _mlp(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        h = rms_norm(x, layer.mlp_norm, self.geom.norm_eps)
        gate, up = linear(h, layer.w_gate_up).chunk(2, dim=-1)            # (T, inter) each
        return linear(F.silu(gate) * up, layer.w_down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(rms_norm(x, self.norm, self.geom.norm_eps), self.lm_head).float()  # (T, vocab)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down, layer.attn_norm, layer.mlp_norm]
        return sum(t.nbytes for t in tensors)
