"""Telemetry: immutable snapshots and events, the only things the app and the CLI read.

Every object here is plain data (frozen dataclasses of ints, floats, strings and tuples),
serialisable with `to_dict` and written as JSON Lines by `JsonlWriter`.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Block map codes, one byte per pool block in CacheSnapshot.block_map.
FREE, HELD, PARTIAL, REUSED, CACHED, SHARED, OTHER = range(7)
BLOCK_STATE_NAMES = ("free", "held", "partial", "reused", "cached", "shared", "other")


def to_dict(obj: Any) -> dict[str, Any]:
    d = asdict(obj)
    for k, v in list(d.items()):
        if isinstance(v, bytes):
            d[k] = list(v)
    return d


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One decoded token: its text delta, the position it was fed at, and the step time."""
    text: str
    token_id: int
    position: int
    latency_ms: float


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    """Between prefill chunks: `done` of `total` prompt tokens to compute are in the cache
    (reused ones not counted), `elapsed_ms` since the prefill started. The first has done=0."""
    done: int
    total: int
    elapsed_ms: float

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.done / self.elapsed_ms if self.elapsed_ms > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far (None before the first chunk ends)."""
        rate = self.tokens_per_s
        return (self.total - self.done) / rate if rate > 0 else None


@dataclass(frozen=True, slots=True)
class PrefillEvent:
    """The prompt has been prefilled (sent before the first TokenEvent)."""
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    prefill_ms: float


@dataclass(frozen=True, slots=True)
class ServerStats:
    """A serving engine's own figures (its /metrics and KV-event stream); None where it
    exports nothing. Server-wide: every client's requests, not only this conversation's."""
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


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    model: str
    kv_dtype: str
    block_size: int
    num_blocks: int
    bytes_per_token: int       # 2 x L x H_kv x d_h x element bytes
    capacity_bytes: int        # the whole pool, scales included
    tokens_held: int           # this conversation's cached tokens
    bytes_used: int            # tokens_held x bytes_per_token
    bytes_allocated: int       # blocks_used x block_size x bytes_per_token
    blocks_used: int
    wasted_slots: int          # empty slots in this conversation's partial last block
    pool_free: int             # blocks by state, whole pool
    pool_active: int
    pool_cached: int
    pool_shared: int
    block_map: bytes           # one code per block: FREE, HELD, PARTIAL, REUSED, CACHED, SHARED, OTHER
    cap: int | None
    policy: str
    mode: str                  # "cache" or "off"
    evictions: int
    preemptions: int
    # a serving engine's cache seen from outside (kvchat/backends/vllm.py): where the figures
    # came from, the fields it left None because the server cannot tell them, and its own figures
    source: str = "local"
    unavailable: tuple[str, ...] = ()
    server: ServerStats | None = None
    # who holds each block, for a map coloured by conversation: block_owner has one byte per
    # block, 0 for none (free or cached), else 1 + the index in `owners` of the conversation
    # id that holds it (the oldest holder of a shared block; 255: the 255th owner or later)
    owners: tuple[int, ...] = ()
    block_owner: bytes = b""

    def owner_of(self, block_id: int) -> int | None:
        """The id of the conversation holding this block (None: free, cached, or not known)."""
        code = self.block_owner[block_id] if block_id < len(self.block_owner) else 0
        return self.owners[code - 1] if code else None

    @property
    def occupancy(self) -> float:
        return (self.num_blocks - self.pool_free) / self.num_blocks if self.num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: which rows shared it and what it read. The scheduler keeps the last
    few hundred (`Engine.steps()`); the crowd panel and the bench read them."""
    index: int                 # steps since the engine started
    rows: int                  # forward rows: decode rows + prefill tokens (+ cache-off rows)
    decode_rows: int           # sequences that each decoded one token
    prefill_tokens: int        # prompt tokens computed, over every chunk in the step
    prefill_chunks: int
    dense_rows: int            # cache-off conversations, each recomputing its whole text
    sequences: int             # sequences in the step (decode rows + chunks + cache-off)
    context_tokens: int        # cached tokens read by attention, over every sequence
    tokens_out: int            # tokens sampled (each decode row, each finished prefill)
    step_ms: float             # wall time from scheduling to sampled tokens
    weight_bytes: int          # weights read (once per forward pass)
    cache_bytes: int           # K/V (and fp8 scale) bytes attention read
    preemptions: int           # requests preempted while scheduling this step
    time: float                # time.monotonic() at the step's end

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.tokens_out / self.step_ms if self.step_ms > 0 else 0.0


REQUEST_STATES = ("running", "prefill", "waiting", "preempted", "idle")


@dataclass(frozen=True, slots=True)
class RequestView:
    """One conversation as the scheduler sees it: its request's state (idle between turns)
    and its figures."""
    conversation: int          # Conversation.id
    request: int | None        # the current request's id (None: idle)
    state: str                 # one of REQUEST_STATES: running decodes, prefill computes its
                               # prompt, waiting has not started, preempted waits to recompute
    context_tokens: int        # tokens its cache holds now
    blocks_held: int
    prompt_tokens: int         # the current (or last) request's prompt
    generated_tokens: int      # tokens of the current (or last) reply so far
    ttft_ms: float | None      # time to first token of the latest request that got one
    ms_per_token: float | None # mean decode step time over its latest request's steps
    preemptions: int           # times its requests were preempted, since start
    recomputed_tokens: int     # tokens it had to compute again after preemptions, since start


@dataclass(frozen=True, slots=True)
class SchedulerSnapshot:
    """The scheduler at one moment between steps: every conversation, the queues, the
    pool-wide preemption totals, and the recent steps."""
    conversations: tuple[RequestView, ...]
    running: int               # requests in the running set (decoding or prefilling)
    waiting: int               # requests not yet started or waiting after a preemption
    preemptions: int           # since start, pool-wide
    recomputed_tokens: int     # tokens computed again after preemptions, since start
    steps: int                 # steps since start
    token_budget: int          # most prompt and decode tokens one step takes
    recent: tuple[StepRecord, ...]   # the latest steps, oldest first

    @property
    def last_step(self) -> StepRecord | None:
        return self.recent[-1] if self.recent else None


@dataclass(frozen=True, slots=True)
class TurnStats:
    turn: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    generated_tokens: int
    ttft_ms: float
    prefill_ms: float
    decode_ms: tuple[float, ...]
    positions: tuple[int, ...]
    stop_reason: str           # eos, max_tokens, cap, cancelled
    reply: str
    mode: str
    kv_dtype: str
    policy: str
    dropped_messages: int
    evicted_blocks: int
    preempted: int
    recomputed_tokens: int
    cache: CacheSnapshot
    unavailable: tuple[str, ...] = ()   # summary() keys the backend cannot tell (they are None)
    # aligned with decode_ms, each token's step: the sequences in it (1 alone; more when
    # conversations shared it) and the cached tokens it read over all of them
    step_sequences: tuple[int, ...] = ()
    step_tokens: tuple[int, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / total if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The flat record `kvchat ask --json` prints and the JSON Lines log keeps."""
        c = self.cache
        return {
            "turn": self.turn, "reply": self.reply, "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens, "computed_tokens": self.computed_tokens,
            "generated_tokens": self.generated_tokens, "ttft_ms": _round(self.ttft_ms),
            "prefill_ms": _round(self.prefill_ms), "decode_ms": [round(x, 3) for x in self.decode_ms],
            "positions": list(self.positions), "stop_reason": self.stop_reason,
            "kv_bytes_per_token": c.bytes_per_token, "kv_bytes_used": c.bytes_used,
            "kv_bytes_allocated": c.bytes_allocated, "kv_capacity_bytes": c.capacity_bytes,
            "block_size": c.block_size, "blocks_used": c.blocks_used, "tokens_held": c.tokens_held,
            "mode": self.mode, "kv_dtype": self.kv_dtype, "policy": self.policy, "cap": c.cap,
            "dropped_messages": self.dropped_messages, "evicted_blocks": self.evicted_blocks,
            "preempted": self.preempted, "recomputed_tokens": self.recomputed_tokens,
            "unavailable": sorted(set(self.unavailable) | {_SUMMARY_KEYS.get(k, k) for k in c.unavailable}),
            "step_sequences": list(self.step_sequences), "step_tokens": list(self.step_tokens),
        }


def _round(ms: float | None) -> float | None:
    return round(ms, 3) if ms is not None else None


# CacheSnapshot field -> the summary() key that carries it
_SUMMARY_KEYS = {"bytes_per_token": "kv_bytes_per_token", "bytes_used": "kv_bytes_used",
                 "bytes_allocated": "kv_bytes_allocated", "capacity_bytes": "kv_capacity_bytes"}


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a crash loses nothing."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()
