"""The CUDA decode step: B tokens (one per sequence) through the model, captured in a CUDA
graph per batch-size bucket and replayed with new inputs.

A decode step launches hundreds of small kernels; launched one by one from Python they cost
more host time than the GPU needs to run them. Captured in a graph, the whole step is one
launch (gpt-fast's `torch.compile(mode="reduce-overhead")` and vLLM's CUDA graphs do the
same). Inside the graph each small kernel still costs a few microseconds, so the step
captured here (`decode_step`) is `Llama.forward` over B decode rows with its norms,
rotations and activation fused (`engine/kernels/fused.py`): about 10 kernels per layer
instead of about 35. `decode_step` with `TorchOps` is the same step in plain torch,
operation for operation the arithmetic of `Llama.forward`, and the reference the fused
kernels are tested against.

A graph replays fixed addresses with fixed shapes, so everything a step varies lives in
static device buffers refilled before each replay: each row's token, position, slot and
context length, and its block table. Nothing inside the step reads a value back to the host:
the attention kernels take the context lengths from the device and their grid does not
depend on them (see `engine/kernels/decode.py`). One graph is captured per batch-size
bucket (1, 2, 4, 8, 16, 32, 64, as nano-vllm does) on first use; a batch of B rows replays
the smallest bucket that holds it, the rows past B padded: slot -1 (the write kernels skip
it), context length 1. The RoPE table is extended before capture, since a graph keeps
reading the table it was captured with.

On CPU (or with use_graph=False) the same buffers drive an eager step of exactly B rows,
which is how the tests exercise this file without a GPU.
"""
from __future__ import annotations

import gc
import os
import warnings
import weakref

import torch
import torch.nn.functional as F

from . import attention
from .attention import paged_decode, write_kv_ref
from .kv_cache import KVPool
from .model import Batch, Llama, Step, apply_rope, rms_norm

ROPE_MARGIN = 4096  # positions added beyond the one asked for when the RoPE table must grow
BUCKETS = (1, 2, 4, 8, 16, 32, 64)   # batch sizes with a graph each; a batch replays the next one up


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
def decode_step(model: Llama, pool: KVPool, ids: torch.Tensor, positions: torch.Tensor, step: Step | Batch,
                ops=None) -> torch.Tensor:
    """B decode tokens, one per sequence, with the arithmetic of `Llama.forward` and fused
    elementwise work. ids, positions: (B,); step: a Step (B = 1) or a decode-only Batch with
    context_lens on the device; the RoPE table must cover positions. Returns logits (B, vocab) fp32."""
    ops = ops or ops_for(ids)
    batch = step.batch(ids.shape[0]) if isinstance(step, Step) else step
    g = model.geom
    hq, d = g.n_heads, g.head_dim
    b = ids.shape[0]
    layers = model.layers
    cos, sin = model.rope_tables()                                             # (max_pos, 1, d) each
    x = model.embed[ids]                                                       # (B, hidden) residual stream
    h = ops.add_rms_norm(x, None, layers[0].attn_norm, g.norm_eps)
    for i, layer in enumerate(layers):
        k_cache, v_cache, k_scale, v_scale = pool.layer(i)
        q = ops.rope_write(h @ layer.wqkv.T, cos, sin, positions, k_cache, v_cache,
                           batch.slots, k_scale, v_scale, hq)                   # (B, hq, d)
        o = paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, model.scale,
                         k_scale, v_scale)                                      # (B, hq, d)
        h = ops.add_rms_norm(x, o.reshape(b, hq * d) @ layer.wo.T, layer.mlp_norm, g.norm_eps)
        after = layers[i + 1].attn_norm if i + 1 < len(layers) else model.norm
        h = ops.add_rms_norm(x, ops.silu_mul(h @ layer.w_gate_up.T) @ layer.w_down.T, after, g.norm_eps)
    return (h @ model.lm_head.T).float()                                       # (B, vocab)


class GraphDecoder:
    """Decode steps of one model over one pool, replayed from one CUDA graph per bucket.

    fused=True captures `decode_step`; fused=False captures `Llama.forward` itself. If the
    fused step fails to run (a kernel that does not compile on this GPU, say), the decoder
    warns and captures `Llama.forward` instead; `fallback` keeps the reason.

    Holds only weak references to the model and the pool, so an engine that rebuilds its
    pool frees the old one at once; `decoder_for` then makes a new decoder."""

    def __init__(self, model: Llama, pool: KVPool, use_graph: bool | None = None, fused: bool = True,
                 max_batch: int = BUCKETS[-1], pad: bool | None = None) -> None:
        self._model = weakref.ref(model)
        self._pool = weakref.ref(pool)
        dev = model.device
        self.max_batch = max_batch
        # rows: token, position, slot, context length; one column per batch row
        self.inputs = torch.zeros(4, max_batch, dtype=torch.int64, device=dev)
        if use_graph is None:  # the torch paths read context lengths back to the host: no graph
            use_graph = dev.type == "cuda" and attention.triton_kernels(self.inputs) is not None
        self.use_graph = use_graph
        self.pad = use_graph if pad is None else pad   # run whole buckets (graphs must; eager tests may)
        self.fused = fused
        self.fallback: str | None = None
        self._staging = torch.zeros(4, max_batch, dtype=torch.int64, pin_memory=dev.type == "cuda")  # host side
        self._host = self._staging.numpy()
        self.tables = torch.zeros(max_batch, pool.spec.num_blocks, dtype=torch.int32, device=dev)  # (max_B, max_blocks)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> graph, its logits
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # the tables the graphs read
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None

    def serves(self, model: Llama, pool: KVPool) -> bool:
        return self._model() is model and self._pool() is pool

    def bucket(self, b: int) -> int:
        """The rows a step of b rows runs: its graph's bucket, or b itself when eager."""
        if not self.pad:
            return b
        return next(size for size in BUCKETS if size >= b)

    def __call__(self, token: int, pos: int, slot: int, block_table: torch.Tensor, n_blocks: int,
                 context_len: int | None = None) -> torch.Tensor:
        """One sequence's step: logits (vocab,) fp32 of `token` at RoPE position `pos`, whose
        K/V go to flat `slot`; block_table: (>= n_blocks,) int32 on the device, its first
        n_blocks entries in use; context_len: cached rows to attend to (pos + 1 unless given)."""
        return self.decode([token], [pos], [slot], [block_table[:n_blocks]],
                           [pos + 1 if context_len is None else context_len])[0]

    def decode(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[torch.Tensor],
               context_lens: list[int]) -> torch.Tensor:
        """B rows, one per sequence: logits (B, vocab) fp32. tables: B int32 device tensors,
        each the first blocks of its sequence's table (a graph row reads only its own length)."""
        model, pool = self._model(), self._pool()
        if model is None or pool is None:
            raise RuntimeError("GraphDecoder: its model or pool is gone; make a new one with decoder_for")
        b = len(tokens)
        if not 0 < b <= self.max_batch:
            raise ValueError(f"GraphDecoder takes 1 to {self.max_batch} rows, got {b}")
        top = max(positions)
        if top >= model.rope_tables()[0].shape[0]:
            model.rope_tables(top + 1 + ROPE_MARGIN)
        if self._rope is not None and top >= self._rope[0].shape[0]:
            self.graphs.clear()  # captured with a table too short for this position
        size = self.bucket(b)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of the staging buffer is done
        host = self._host
        host[:, :b] = (tokens, positions, slots, context_lens)
        host[:, b:size] = ((0,), (0,), (-1,), (1,))   # padded rows: no write, one row read
        self.inputs[:, :size].copy_(self._staging[:, :size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        width = max(t.shape[0] for t in tables)
        if b == 1:
            self.tables[0, :width].copy_(tables[0])
        else:
            self.tables[:b, :width].copy_(torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0]))
                                                       for t in tables]))
        if not self.use_graph:
            return self._forward(model, pool, size)[:b]
        entry = self.graphs.get(size)
        if entry is None:
            entry = self.graphs[size] = self._capture(model, pool, size)
        graph, logits = entry
        graph.replay()
        return logits[:b].clone()  # the next replay overwrites the buffer

    def capture_all(self) -> int:
        """Capture every bucket's graph now, each on padded rows (no K/V written, one row read),
        so that no step pays a capture later: the engine calls it when it builds a pool. A
        bucket's first use took 0.4-0.8 s on the H200 (its kernels compiled and the graph
        captured), and a new turn's chunk first takes a bucket mid-conversation: the bench's
        first next turn after 1k took 761 ms against 37. Returns the graphs captured."""
        model, pool = self._model(), self._pool()
        if not self.use_graph or model is None or pool is None:
            return 0
        if self._copied is not None:
            self._copied.synchronize()
        self._host[:, :] = ((0,), (0,), (-1,), (1,))        # every row padding: slot -1, length 1
        self.inputs.copy_(self._staging)
        done = 0
        for size in BUCKETS:
            if size <= self.max_batch and size not in self.graphs:
                self.graphs[size] = self._capture(model, pool, size)
                done += 1
        return done

    def _forward(self, model: Llama, pool: KVPool, size: int) -> torch.Tensor:
        ids, positions = self.inputs[0, :size], self.inputs[1, :size]
        batch = Batch(self.inputs[2, :size], model.rope_tables()[0].shape[0] - 1, decode=size,
                      block_tables=self.tables[:size], context_lens=self.inputs[3, :size])
        if self.fused:
            return decode_step(model, pool, ids, positions, batch)             # (size, vocab)
        return model.forward(ids, positions, batch, pool)                      # (size, vocab)

    def _capture(self, model: Llama, pool: KVPool, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Every position the pool can hold, up to the model's trained context, so that a
        # conversation rarely outgrows the captured table (its tensors are kept alive in
        # self._rope: the graph reads their memory even after the model replaces them).
        model.rope_tables(min(model.geom.max_position, pool.spec.capacity_tokens))
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels and
        # workspace), as torch.cuda.graphs asks. The warm-up runs this very step: writing
        # the same K/V rows twice is harmless.
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            try:
                self._forward(model, pool, size)
            except Exception as err:  # noqa: BLE001  (any kernel failure: fall back, loudly)
                if not self.fused:
                    raise
                self.fused = False
                self.graphs.clear()   # every bucket captures the same step
                self.fallback = f"{type(err).__name__}: {err}"
                warnings.warn(f"fused CUDA decode step failed ({self.fallback}); capturing Llama.forward instead",
                              RuntimeWarning, stacklevel=3)
                self._forward(model, pool, size)
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the app's UI thread may query the device (memory telemetry) meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            logits = self._forward(model, pool, size)
        self._rope = model.rope_tables()
        return graph, logits


_DECODERS: weakref.WeakKeyDictionary[Llama, GraphDecoder] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """False with KVCHAT_CUDA_GRAPH=0: a CUDA decode step then launches its kernels one by one,
    as a prefill does, so that a bench can measure what the graph saves."""
    return os.environ.get("KVCHAT_CUDA_GRAPH", "1") != "0"


def decoder_for(model: Llama, pool: KVPool) -> GraphDecoder:
    """The model's decoder for this pool, made (and captured on first use) when the pool is new."""
    dec = _DECODERS.get(model)
    if dec is None or not dec.serves(model, pool):
        dec = _DECODERS[model] = GraphDecoder(model, pool)
    return dec


def forget(model: Llama) -> None:
    """Drop the model's decoder, and with it the graphs and buffers captured on its pool (a
    rebuilt pool gets a decoder of its own). On a GPU the freed memory also goes back from
    torch's allocator cache, so that a pool of most of the device can be rebuilt in its place."""
    _DECODERS.pop(model, None)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
