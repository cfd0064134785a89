"""The runner: one step's plan as tensors, through the model once.

It turns the scheduler's Plan into one `Batch` (each decode row's token, position, slot,
block table and context length; each prompt chunk's rows) and runs `Llama.forward` over it,
so every weight is read once for all the rows. On CUDA a step of at most 64 rows (decode
rows, and short prompt chunks as one row per token) replays a CUDA graph captured for the next
batch-size bucket (cuda_graph.py); a step with longer prompt chunks runs eagerly, as
nano-vllm's prefill steps do. Cache-off conversations recompute
their whole text with `forward_dense`, one pass each. Sink-window re-rotations the
scheduler planned run first, before any row reads or writes those blocks.
"""
from __future__ import annotations

import torch

from .cuda_graph import GraphDecoder, decoder_for, enabled as graphs_enabled
from .kv_cache import KVPool
from .model import Batch, Chunk, Llama
from .request import Request
from .scheduler import Plan
from .streaming import rerotate_keys


CHUNK_READS = 12   # a prompt chunk goes through the decode graph while its rows read at most this many weights' bytes


class Runner:
    def __init__(self, model: Llama, pool: KVPool) -> None:
        self.model, self.pool = model, pool
        self.device = model.device
        self.graphs = self.device.type == "cuda" and graphs_enabled()   # KVCHAT_CUDA_GRAPH, read once a pool

    @torch.inference_mode()
    def capture(self) -> int:
        """On CUDA with graphs: every batch-size bucket's graph captured now (the engine's load
        and pool rebuilds), not at a step. Returns the graphs captured (0 elsewhere)."""
        return decoder_for(self.model, self.pool).capture_all() if self.graphs else 0

    @torch.inference_mode()
    def run(self, plan: Plan) -> tuple[torch.Tensor, int, int]:
        """Logits (R, vocab) fp32 in the plan's row order (decode rows, one per chunk, one per
        cache-off request), the cached tokens attention read, and the forward passes run."""
        for _, (block_ids, delta) in plan.shifts:
            rerotate_keys(self.model, self.pool, block_ids, delta)
        out, context, forwards = [], 0, 0
        if plan.decode or plan.chunks:
            logits, context = self._paged(plan.decode, plan.chunks)
            out.append(logits)
            forwards += 1
        for req in plan.dense:
            ids = req.tokens if req.generated else req.prompt
            out.append(self.model.forward_dense(torch.tensor(ids, device=self.device)))  # (1, vocab)
            forwards += 1
        return (out[0] if len(out) == 1 else torch.cat(out)), context, forwards

    def _paged(self, decode: list[Request], chunks: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, int]:
        ids, positions, slots, lens = [], [], [], []
        for req in decode:
            seq = req.seq
            pos = len(seq)                     # its cache position (its text position unless a window evicted)
            ids.append(req.tokens[-1])
            positions.append(pos)
            slots.append(seq.slot(pos))
            lens.append(pos + 1)
        if self.graphs:
            dec = decoder_for(self.model, self.pool)
            if len(decode) + sum(n for _, _, n in chunks) <= dec.max_batch and (not chunks or self._rows_pay(chunks)):
                return self._graphed(dec, decode, chunks, ids, positions, slots, lens)
        parts, context = [], sum(lens)
        for req, start, n in chunks:
            seq = req.seq
            p0 = len(seq)
            ids.extend(req.tokens[start:start + n])
            positions.extend(range(p0, p0 + n))
            slots.extend(seq.slots(p0, p0 + n))
            parts.append(Chunk(n, seq.table, p0, seq.runs))
            context += p0 + n
        dev = self.device
        batch = Batch(torch.tensor(slots, device=dev), max(positions) + 1, prefills=tuple(parts))
        if decode:
            batch.decode = b = len(decode)
            batch.max_context = max(lens)
            if b == 1:
                seq = decode[0].seq
                batch.block_tables, batch.runs = seq.table[None], seq.runs              # (1, max_blocks)
            else:
                width = -(-batch.max_context // decode[0].seq.block_size)
                batch.block_tables = torch.stack([r.seq.table[:width] for r in decode])  # (B, width)
            batch.context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)      # (B,)
        logits = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), batch,
                                    self.pool)
        return logits, context

    def _rows_pay(self, chunks: list[tuple[Request, int, int]]) -> bool:
        """Whether the chunks' rows are cheaper as decode rows: each row reads its sequence's
        whole cache, so their reads grow as rows x context, while the eager prefill reads it
        once but costs ~50 ms of launches (H200). Within CHUNK_READS x the weights' bytes: on
        the H200, 40 rows after 32k tokens (172 GB read, just within that bound) took 60 ms as rows
        when that included a graph's capture, 24 ms once the graphs were captured at load; 23
        after 8k 11 ms; against 49-116 ms eagerly."""
        per_token = self.pool.spec.stored_bytes_per_token
        reads = sum(n * len(req.seq) + n * (n + 1) // 2 for req, _, n in chunks) * per_token
        return reads <= CHUNK_READS * self.model.step_weight_bytes

    def _graphed(self, dec: GraphDecoder, decode: list[Request], chunks: list[tuple[Request, int, int]],
                 ids: list[int], positions: list[int], slots: list[int], lens: list[int]) -> tuple[torch.Tensor, int]:
        """The decode rows and short prompt chunks through the decode graph: a chunk's n tokens
        as n rows of its sequence, row i attending to the chunk's rows up to itself (each layer
        writes every row's K/V before any row reads). A new turn's few tokens after a long
        history thus cost one replay, not an eager prefill's ~650 launches (50 ms on the H200).
        Logits: a row per decode request, then each chunk's last row, as the eager path's."""
        seqs = [r.seq for r in decode]
        context, last = sum(lens), []
        for req, start, n in chunks:
            seq, p0 = req.seq, len(req.seq)
            ids.extend(req.tokens[start:start + n])
            positions.extend(range(p0, p0 + n))
            slots.extend(seq.slots(p0, p0 + n))
            lens.extend(range(p0 + 1, p0 + n + 1))
            seqs.extend([seq] * n)
            context += p0 + n
            last.append(len(ids) - 1)
        width = -(-max(lens) // seqs[0].block_size)
        logits = dec.decode(ids, positions, slots, [s.table[:width] for s in seqs], lens)
        if not chunks:
            return logits, context
        keep = torch.tensor(list(range(len(decode))) + last, device=logits.device)
        return logits.index_select(0, keep), context
