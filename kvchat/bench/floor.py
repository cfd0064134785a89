"""The memory floor of a decode step, measured in the bench's own run.

A batch-1 decode step must read every weight once and the sequence's whole KV cache once;
on a CPU (and on a GPU) it can go no faster than those bytes over the machine's read
bandwidth. The bandwidth is measured here, in the same process and with the same torch
thread count as the engine, by a timed reduction (`torch.sum`) over a buffer larger than
what any measured step reads, so that it streams from memory rather than from cache.

Torch is used here; `report.py` turns the figures into tables without it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

MIN_BUFFER = 512 * 2**20   # bytes: well past any last-level cache


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Read bandwidth from `repeats` timed sums over one buffer; the floor uses the fastest."""
    buffer_bytes: int
    samples_ms: tuple[float, ...]

    @property
    def gb_s(self) -> float:
        return self.buffer_bytes / (min(self.samples_ms) / 1000) / 1e9

    def to_dict(self) -> dict:
        ms = sorted(self.samples_ms)
        return {"gb_s": round(self.gb_s, 2), "buffer_bytes": self.buffer_bytes,
                "median_gb_s": round(self.buffer_bytes / (ms[len(ms) // 2] / 1000) / 1e9, 2),
                "samples_ms": [round(x, 3) for x in self.samples_ms]}


def measure_bandwidth(buffer_bytes: int, repeats: int = 7) -> Bandwidth:
    """Time `repeats` sums over a float32 buffer of about buffer_bytes (at least MIN_BUFFER)."""
    import torch
    n = max(buffer_bytes, MIN_BUFFER) // 4
    buf = torch.ones(n, dtype=torch.float32)   # written once, so every page is resident
    buf.sum()                                   # warm: threads started, code paged in
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        samples.append((time.perf_counter() - t0) * 1000)
    return Bandwidth(buf.nbytes, tuple(samples))


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every matrix and norm, but of an embedding
    table not shared with the output head only the one row it looks up."""
    total = model.weight_bytes
    if model.lm_head is not model.embed:
        total -= model.embed.nbytes - model.embed[0].nbytes
    return total
