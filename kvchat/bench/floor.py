"""The memory floor of a decode step, measured in the bench's own run.

A batch-1 decode step must read every weight once and the sequence's whole KV cache once;
on a CPU (and on a GPU) it can go no faster than those bytes over the machine's read
bandwidth. The bandwidth is measured here, in the same process and with the same thread
count as the engine, by a timed sum over a buffer larger than what any measured step reads,
so that it streams from memory rather than from cache (BandwidthProbe says which sum).

Torch is used here; `report.py` turns the figures into tables without it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

MIN_BUFFER = 512 * 2**20   # bytes: well past any last-level cache


def probe_bytes(step_bytes: int, available: int) -> int:
    """The probe buffer's size: 1.5x what a measured step reads, so that no step can find its
    bytes in a cache the probe's sums miss; but at most half the memory still available with
    the model loaded (Llama 3.1 8B in bf16 reads 15 GB a step, and 1.5x of it beside the 16 GB
    of weights had the bench killed for memory on a 24 GB machine). Any size from MIN_BUFFER
    up is far past the last-level cache, so the cap does not change what is measured."""
    return max(MIN_BUFFER, min(int(1.5 * step_bytes), available // 2))


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Read bandwidth from timed sums over one buffer, taken before, between and after the
    measured contexts. The floor uses their median: on a shared host the bandwidth drifts
    within a run (measured here: 29 GB/s at the start of one run, 53 GB/s in its last
    minute), and the median stands for the conditions the timed steps ran in; the fastest
    and slowest are reported beside it."""
    buffer_bytes: int
    samples_ms: tuple[float, ...]
    reader: str = "torch.sum"

    def _gb_s(self, ms: float) -> float:
        return self.buffer_bytes / (ms / 1000) / 1e9

    @property
    def gb_s(self) -> float:
        ms = sorted(self.samples_ms)
        return self._gb_s(ms[len(ms) // 2])

    def to_dict(self) -> dict:
        return {"gb_s": round(self.gb_s, 2), "buffer_bytes": self.buffer_bytes, "estimator": "median",
                "reader": self.reader,
                "fastest_gb_s": round(self._gb_s(min(self.samples_ms)), 2),
                "slowest_gb_s": round(self._gb_s(max(self.samples_ms)), 2),
                "samples_ms": [round(x, 3) for x in self.samples_ms]}


def device_sync(device):
    """What makes a host clock read after a device's queued work: the GPU's synchronize, or
    nothing on a CPU."""
    import torch
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class BandwidthProbe:
    """A float32 buffer of about buffer_bytes (at least MIN_BUFFER), summed on demand: the
    bench samples it between contexts so that the floor follows the run's conditions. On a
    GPU the buffer is in the device's memory, each sum timed between synchronizations.

    On a CPU the buffer sits where the weights do, in an engine Arena (2 MiB pages where the
    kernel grants them), and the C kernels' streaming read sums it (native.read_sum), on the
    products' threads. torch.sum over a torch tensor measured its reduction and the TLB rather
    than memory: 28-30 GB/s on 2 Zen 4 cores, where the products of a decode step, once their
    weights were in huge pages, read 41 GB/s. Without the C kernels, torch.sum serves."""

    def __init__(self, buffer_bytes: int, device=None) -> None:
        import torch

        from kvchat.engine import native
        from kvchat.engine.arena import Arena
        self.device = torch.device(device or "cpu")
        n = max(buffer_bytes, MIN_BUFFER) // 4
        if self.device.type == "cpu" and native.lib() is not None:
            self.buf = Arena(4 * n).take((n,), torch.float32).fill_(1.0)    # every page resident
            self._sum = native.read_sum
            self.reader = "C streaming read, 2 MiB pages where granted"
        else:
            self.buf = torch.ones(n, dtype=torch.float32, device=self.device)
            self._sum = torch.sum
            self.reader = "torch.sum"
        self._sum(self.buf)                         # warm: threads started, code paged in
        self.samples: list[float] = []

    def sample(self, repeats: int = 3) -> None:
        sync = device_sync(self.device)
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            self._sum(self.buf)
            sync()
            self.samples.append((time.perf_counter() - t0) * 1000)

    def result(self) -> Bandwidth:
        return Bandwidth(self.buf.nbytes, tuple(self.samples), self.reader)


def step_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads (Llama.step_weight_bytes: every matrix and norm,
    of an embedding table not shared with the output head only the row it looks up)."""
    return model.step_weight_bytes
