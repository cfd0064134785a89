"""The CUDA decode step: one token of `Llama.forward`, captured once in a CUDA graph and
replayed with new inputs.

A batch-1 decode step launches a few hundred small kernels (matmuls, norms, RoPE, the
cache write and paged attention per layer); launched one by one from Python they cost more
host time than the GPU needs to run them. Captured in a graph, the whole step is one launch
(the approach of gpt-fast's `torch.compile(mode="reduce-overhead")` and vLLM's CUDA graphs).

A graph replays fixed addresses with fixed shapes, so everything a step varies lives in
static device buffers that are refilled before each replay: the token, its position, its
slot, the context length, and the block table. Nothing inside the step reads a value back to
the host: the attention kernels take the context length from the device and their grid does
not depend on it (see `engine/kernels/paged_decode.py`). The RoPE table is extended before
capture, since the graph keeps reading the table it was captured with.

On CPU (or with use_graph=False) the same buffers drive an eager forward, which is how the
tests exercise this file without a GPU.
"""
from __future__ import annotations

import weakref

import torch

from .kv_cache import KVPool
from .model import Llama, Step

ROPE_MARGIN = 4096  # positions added beyond the one asked for when the RoPE table must grow


class GraphDecoder:
    """Decode steps of one model over one pool, replayed from a CUDA graph.

    Holds only weak references to the model and the pool, so an engine that rebuilds its
    pool frees the old one at once; `decoder_for` then makes a new decoder."""

    def __init__(self, model: Llama, pool: KVPool, use_graph: bool | None = None) -> None:
        self._model = weakref.ref(model)
        self._pool = weakref.ref(pool)
        dev = model.device
        self.use_graph = dev.type == "cuda" if use_graph is None else use_graph
        self.inputs = torch.zeros(4, dtype=torch.int64, device=dev)  # token, position, slot, context length
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

    def __call__(self, token: int, pos: int, slot: int, block_table: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Logits (vocab,) fp32 of `token` at position `pos`, whose K/V go to flat `slot`;
        block_table: (>= n_blocks,) int32 on the device, its first n_blocks entries in use."""
        model, pool = self._model(), self._pool()
        if model is None or pool is None:
            raise RuntimeError("GraphDecoder: its model or pool is gone; make a new one with decoder_for")
        if pos >= model._cos.shape[0]:
            model._extend_rope(pos + 1 + ROPE_MARGIN)
        if self._rope is not None and pos >= self._rope[0].shape[0]:
            self.graph = None  # captured with a table too short for this position
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy out of the staging buffer is done
        self._host[:] = (token, pos, slot, pos + 1)
        self.inputs.copy_(self._staging, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self.table[:n_blocks].copy_(block_table[:n_blocks])
        if not self.use_graph:
            return self._forward(model, pool)[0]
        if self.graph is None:
            self._capture(model, pool)
        self.graph.replay()
        return self.logits[0].clone()  # the next replay overwrites the buffer

    def _forward(self, model: Llama, pool: KVPool) -> torch.Tensor:
        return model.forward(self.inputs[0:1], self.inputs[1:2], self.step, pool)  # (1, vocab)

    def _capture(self, model: Llama, pool: KVPool) -> None:
        # Every position the pool can hold, up to the model's trained context, so that a
        # conversation rarely outgrows the captured table (its tensors are kept alive in
        # self._rope: the graph reads their memory even after the model replaces them).
        reach = min(model.geom.max_position, pool.spec.capacity_tokens)
        if reach > model._cos.shape[0]:
            model._extend_rope(reach)
        # Warm up on a side stream first (Triton compiles, cuBLAS picks its kernels and
        # workspace), as torch.cuda.graphs asks. The warm-up runs this very step: writing
        # the same K/V row twice is harmless.
        side = torch.cuda.Stream(device=model.device)
        side.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(side):
            self._forward(model, pool)
        torch.cuda.current_stream(model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.logits = self._forward(model, pool)
        self.graph = graph
        self._rope = (model._cos, model._sin)


_DECODERS: weakref.WeakKeyDictionary[Llama, GraphDecoder] = weakref.WeakKeyDictionary()


def decoder_for(model: Llama, pool: KVPool) -> GraphDecoder:
    """The model's decoder for this pool, made (and captured on first use) when the pool is new."""
    dec = _DECODERS.get(model)
    if dec is None or not dec.serves(model, pool):
        dec = _DECODERS[model] = GraphDecoder(model, pool)
    return dec
