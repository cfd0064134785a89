"""The CUDA decode step: one token through the model, captured once in a CUDA graph and
replayed with new inputs.

A batch-1 decode step launches hundreds of small kernels; launched one by one from Python
they cost more host time than the GPU needs to run them. Captured in a graph, the whole step
is one launch (gpt-fast's `torch.compile(mode="reduce-overhead")` and vLLM's CUDA graphs do
the same). Inside the graph each small kernel still costs a few microseconds, so the step
captured here (`decode_step`) is `Llama.forward` for one token with its norms, rotations and
activation fused (`engine/kernels/fused.py`): about 10 kernels per layer instead of about 35.
`decode_step` with `TorchOps` is the same step in plain torch, operation for operation the
arithmetic of `Llama.forward`, and the reference the fused kernels are tested against.

A graph replays fixed addresses with fixed shapes, so everything a step varies lives in
static device buffers refilled before each replay: the token, its position, its slot, the
context length, and the block table. Nothing inside the step reads a value back to the host:
the attention kernels take the context length from the device and their grid does not depend
on it (see `engine/kernels/decode.py`). The RoPE table is extended before capture, since the
graph keeps reading the table it was captured with.

On CPU (or with use_graph=False) the same buffers drive an eager step, which is how the tests
exercise this file without a GPU.
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F

from . import attention
from .attention import paged_decode, write_kv_ref
from .kv_cache import KVPool
from .model import Llama, Step, apply_rope, rms_norm

ROPE_MARGIN = 4096  # positions added beyond the one asked for when the RoPE table must grow


class TorchOps:
    """The fused kernels' references: the torch operations `Llama.forward` performs."""

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x: (T, H), set to x + residual in place; returns RMSNorm(x) * weight."""
        if residual is not None:
            x.copy_(x + residual)
        return rms_norm(x, weight, eps)

    @staticmethod
    def rope_write(qkv, cos, sin, positions, k_cache, v_cache, slots, k_scale, v_scale, n_heads: int) -> torch.Tensor:
        """qkv: (T, (hq + 2 hk) * d); cos, sin: (max_pos, 1, d). Writes RoPE(k), v to slots;
        returns RoPE(q) (T, hq, d)."""
        t = qkv.shape[0]
        hk, d = k_cache.shape[2], k_cache.shape[3]
        q, k, v = qkv.split((n_heads * d, hk * d, hk * d), dim=-1)
        c, s = cos[positions].view(t, 1, d), sin[positions].view(t, 1, d)     # (T, 1, d)
        q = apply_rope(q.view(t, n_heads, d), c, s)                            # (T, hq, d)
        k = apply_rope(k.view(t, hk, d), c, s)                                 # (T, hk, d)
        write_kv_ref(k_cache, v_cache, k, v.view(t, hk, d), slots, k_scale, v_scale)
        return q

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)                                    # (T, inter) each
        return F.silu(gate) * up


def ops_for(t: torch.Tensor):
    """The fused Triton kernels where attention would use Triton for t, else TorchOps."""
    return attention.triton_kernels(t) or TorchOps


@torch.inference_mode()
def decode_step(model: Llama, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, step: Step,
                ops=None) -> torch.Tensor:
    """One decode token, the arithmetic of `Llama.forward` with fused elementwise work.
    ids, positions: (1,); step.context_lens: (1,) on the device; the RoPE table must cover
    positions. Returns logits (1, vocab) fp32."""
    ops = ops or ops_for(ids)
    g = model.geom
    hq, d = g.n_heads, g.head_dim
    layers = model.layers
    cos, sin = model.rope_tables()                                             # (max_pos, 1, d) each
    x = model.embed[ids]                                                       # (1, hidden) residual stream
    h = ops.add_rms_norm(x, None, layers[0].attn_norm, g.norm_eps)
    for i, layer in enumerate(layers):
        k_cache, v_cache, k_scale, v_scale = pool.layer(i)
        q = ops.rope_write(h @ layer.wqkv.T, cos, sin, positions, k_cache, v_cache,
                           step.slots, k_scale, v_scale, hq)                    # (1, hq, d)
        o = paged_decode(q, k_cache, v_cache, step.block_table[None], step.context_lens, model.scale,
                         k_scale, v_scale)                                      # (1, hq, d)
        h = ops.add_rms_norm(x, o.reshape(1, hq * d) @ layer.wo.T, layer.mlp_norm, g.norm_eps)
        after = layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm
        h = ops.add_rms_norm(x, ops.silu_mul(h @ layer.w_gate_up.T) @ layer.w_down.T, after, g.norm_eps)
    return (h @ model.lm_head.T).float()                                       # (1, vocab)


class GraphDecoder:
    """Decode steps of one model over one pool, replayed from a CUDA graph.

    fused=True captures `decode_step`; fused=False captures `Llama.forward` itself. If the
    fused step fails to run (a kernel that does not compile on this GPU, say), the decoder
    warns and captures `Llama.forward` instead; `fallback` keeps the reason.

    Holds only weak references to the model and the pool, so an engine that rebuilds its
    pool frees the old one at once; `decoder_for` then makes a new decoder."""

    def __init__(self, model: Llama, pool: KVPool, use_graph: bool | None = None, fused: bool = True) -> None:
        self._model = weakref.ref(model)
        self._pool = weakref.ref(pool)
        dev = model.device
        self.inputs = torch.zeros(4, dtype=torch.int64, device=dev)  # token, position, slot, context length
        if use_graph is None:  # the torch paths read context lengths back to the host: no graph
            use_graph = dev.type == "cuda" and attention.triton_kernels(self.inputs) is not None
        self.use_graph = use_graph
        self.fused = fused
        self.fallback: str | None = None
        self._staging = torch.zeros(4, dtype=torch.int64, pin_memory=dev.type == "cuda")  # host side of inputs
        self._host = self._staging.numpy()
        self.table = torch.zeros(pool.spec.num_blocks, dtype=torch.int32, device=dev)  # (max_blocks,)
        self.step = Step(self.table, self.inputs[2:3], prefix_len=0, decode=True,
                         context_lens=self.inputs[3:4])  # prefix_len unused: the length comes from context_lens
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None  # (1, vocab) fp32, the graph's output buffer
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the tables the graph reads
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None

    def serves(self, model: Llama, pool: KVPool) -> bool:
        return self._model() is model and self._pool() is pool

    def __call__(self, token: int, pos: int, slot: int, block_table: torch.Tensor, n_blocks: int,
                 context_len: int | None = None) -> torch.Tensor:
        """Logits (vocab,) fp32 of `token` at RoPE position `pos`, whose K/V go to flat `slot`;
        block_table: (>= n_blocks,) int32 on the device, its first n_blocks entries in use;
        context_len: cached rows to attend to, this one included (pos + 1 unless given)."""
        model, pool = self._model(), self._pool()
        if model is None or pool is None:
            raise RuntimeError("GraphDecoder: its model or pool is gone; make a new one with decoder_for")
        if pos >= model.rope_tables()[0].shape[0]:
            model.rope_tables(pos + 1 + ROPE_MARGIN)
        if self._rope is not None and pos >= self._rope[0].shape[0]:
            self.graph = None  # captured with a table too short for this position
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of the staging buffer is done
        self._host[:] = (token, pos, slot, pos + 1 if context_len is None else context_len)
        self.inputs.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.table[:n_blocks].copy_(block_table[:n_blocks])
        if not self.use_graph:
            return self._forward(model, pool)[0]
        graph, logits = self.graph, self.logits
        if graph is None or logits is None:
            graph, logits = self._capture(model, pool)
        graph.replay()
        return logits[0].clone()  # the next replay overwrites the buffer

    def _forward(self, model: Llama, pool: KVPool) -> torch.Tensor:
        ids, positions = self.inputs[0:1], self.inputs[1:2]
        if self.fused:
            return decode_step(model, pool, ids, positions, self.step)        # (1, vocab)
        return model.forward(ids, positions, self.step, pool)                  # (1, vocab)

    def _capture(self, model: Llama, pool: KVPool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Every position the pool can hold, up to the model's trained context, so that a
        # conversation rarely outgrows the captured table (its tensors are kept alive in
        # self._rope: the graph reads their memory even after the model replaces them).
        model.rope_tables(min(model.geom.max_position, pool.spec.capacity_tokens))
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels and
        # workspace), as torch.cuda.graphs asks. The warm-up runs this very step: writing
        # the same K/V row twice is harmless.
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            try:
                self._forward(model, pool)
            except Exception as err:  # noqa: BLE001  (any kernel failure: fall back, loudly)
                if not self.fused:
                    raise
                self.fused = False
                self.fallback = f"{type(err).__name__}: {err}"
                warnings.warn(f"fused CUDA decode step failed ({self.fallback}); capturing Llama.forward instead",
                              RuntimeWarning, stacklevel=3)
                self._forward(model, pool)
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the app's UI thread may query the device (memory telemetry) meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.logits = logits = self._forward(model, pool)
        self.graph = graph
        self._rope = model.rope_tables()
        return graph, logits


_DECODERS: weakref.WeakKeyDictionary[Llama, GraphDecoder] = weakref.WeakKeyDictionary()


def decoder_for(model: Llama, pool: KVPool) -> GraphDecoder:
    """The model's decoder for this pool, made (and captured on first use) when the pool is new."""
    dec = _DECODERS.get(model)
    if dec is None or not dec.serves(model, pool):
        dec = _DECODERS[model] = GraphDecoder(model, pool)
    return dec
