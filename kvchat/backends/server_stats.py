"""A serving engine's own figures (its /metrics and its KV-event stream), and the cache snapshot
that carries them.

They belong to the server backend, not to the engine's telemetry: kvchat's own engine has no
server, and a `ServerSnapshot` is a `CacheSnapshot` with them added, so every reader of a
snapshot reads it unchanged and the ones that show the server's figures ask for the type.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvchat.engine.telemetry import CacheSnapshot


@dataclass(frozen=True, slots=True)
class ServerStats:
    """None where the server exports nothing. Server-wide: every client's requests, not only
    this conversation's."""
    url: str
    usage: float | None              # fraction of the pool's blocks referenced by running requests
    prefix_hit_rate: float | None    # prefix-cache hits / queries, in tokens, since the server started
    preemptions: int | None
    running: int | None
    waiting: int | None
    inter_token_ms: float | None     # the server's inter-token latency histogram, mean
    ttft_ms: float | None            # the server's time-to-first-token histogram, mean
    resident_blocks: int | None      # full prefix blocks resident per the KV events (None: no stream)
    event_batches: int | None
    event_gaps: int | None           # sequence numbers skipped: events lost, the map may be stale
    notes: tuple[str, ...] = ()      # what the panels cannot show in this mode, and why
    event_replayed: int | None = None  # batches the replay endpoint sent (None: no --kv-replay)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSnapshot(CacheSnapshot):
    """The cache as a serving engine reports it, with the server's own figures."""
    server: ServerStats
