"""Telemetry: immutable snapshots and events, the only things the app and the CLI read.

Every object here is plain data (frozen dataclasses of ints, floats, strings and tuples),
serialisable with `to_dict` and written as JSON Lines by `JsonlWriter`.

A figure typed `int | None` (or `float | None`) is one a backend may be unable to tell: kvchat's
own engine fills every one, a serving engine seen from outside leaves some None (and names
them in `unavailable`). Readers show None as unknown, never as 0; the type checker holds
them to it (tests/test_types.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
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
    token_id: int | None        # -1: text with no token of its own (the detokenizer's held-back tail);
                                # None: a token whose id the backend cannot tell
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
    reused_tokens: int | None
    computed_tokens: int | None
    prefill_ms: float | None


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    model: str
    kv_dtype: str
    block_size: int
    num_blocks: int
    bytes_per_token: int | None     # 2 x L x H_kv x d_h x element bytes, + fp8's scales (scale_bytes_per_token)
    capacity_bytes: int | None      # the whole pool, scales included
    tokens_held: int | None         # this conversation's cached tokens
    bytes_used: int | None          # tokens_held x bytes_per_token (scales included)
    bytes_allocated: int | None     # blocks_used x block_size x bytes_per_token (scales included)
    blocks_used: int | None
    wasted_slots: int | None        # empty slots in this conversation's partial last block
    pool_free: int | None           # blocks by state, whole pool
    pool_active: int | None
    pool_cached: int | None
    pool_shared: int | None
    block_map: bytes                # one code per block: FREE, HELD, PARTIAL, REUSED, CACHED, SHARED, OTHER
    cap: int | None
    policy: str
    mode: str                       # "cache" or "off"
    evictions: int | None
    preemptions: int | None
    # a serving engine's cache seen from outside (kvchat/backends/vllm.py): where the figures
    # came from, and the fields it left None because the server cannot tell them
    source: str = "local"
    unavailable: tuple[str, ...] = ()
    scale_bytes_per_token: int | None = 0   # of bytes_per_token, fp8's scales: 2 x L x H_kv x 4 (0 otherwise)
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
    def occupancy(self) -> float | None:
        """The share of the pool's blocks not free (None: the free count is unknown)."""
        if self.pool_free is None:
            return None
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


# TurnSummary's fields that are tuples in Python and lists in JSON
TUPLE_FIELDS = ("decode_ms", "positions", "unavailable", "step_sequences", "step_tokens")


@dataclass(frozen=True, slots=True)
class TurnSummary:
    """One turn as a flat record: what `kvchat ask --json` prints and the JSON Lines log keeps
    (`to_dict`), in this field order. Every field has a default, so a record written before a
    field existed still reads (kvchat/store/records.py)."""
    turn: int = 0
    reply: str | None = None
    prompt_tokens: int = 0
    reused_tokens: int | None = 0
    computed_tokens: int | None = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float | None = 0.0
    decode_ms: tuple[float, ...] = ()        # one per generated token
    positions: tuple[int, ...] = ()          # the context position each token was fed at
    stop_reason: str | None = None           # eos, max_tokens, cap, cancelled
    kv_bytes_per_token: int | None = 0       # elements and (fp8) scales; the scales' share next
    kv_scale_bytes_per_token: int | None = 0
    kv_bytes_used: int | None = 0
    kv_bytes_allocated: int | None = 0
    kv_capacity_bytes: int | None = 0
    block_size: int = 0
    blocks_used: int | None = 0
    tokens_held: int | None = 0
    mode: str = "cache"                      # "cache" or "off"
    kv_dtype: str = ""
    policy: str = ""
    cap: int | None = None
    dropped_messages: int = 0
    evicted_blocks: int | None = 0
    preempted: int | None = 0
    recomputed_tokens: int | None = 0
    unavailable: tuple[str, ...] = ()        # the keys above the backend could not tell (they are None)
    # aligned with decode_ms, each token's step: the sequences in it (1 alone; more when
    # conversations shared it) and the cached tokens it read over all of them
    step_sequences: tuple[int, ...] = ()
    step_tokens: tuple[int, ...] = ()
    # cached blocks (a closed or idle conversation's prefix) the pool reclaimed for this turn's
    # new content; evicted_blocks counts only sink-window's evictions from this conversation
    reclaimed_blocks: int | None = 0

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the fields in order, the tuples as lists."""
        out = {f.name: getattr(self, f.name) for f in fields(TurnSummary)}
        for k in TUPLE_FIELDS:
            out[k] = list(out[k])
        return out

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / total if total > 0 else 0.0

    @property
    def context_tokens(self) -> int:
        """The prompt plus the reply: what the conversation held at the turn's end."""
        return self.prompt_tokens + self.generated_tokens


@dataclass(frozen=True, slots=True)
class TurnStats:
    turn: int
    prompt_tokens: int
    reused_tokens: int | None
    computed_tokens: int | None
    generated_tokens: int
    ttft_ms: float
    prefill_ms: float | None
    decode_ms: tuple[float, ...]
    positions: tuple[int, ...]
    stop_reason: str           # eos, max_tokens, cap, cancelled
    reply: str
    mode: str
    kv_dtype: str
    policy: str
    dropped_messages: int
    evicted_blocks: int | None
    preempted: int | None
    recomputed_tokens: int | None
    cache: CacheSnapshot
    unavailable: tuple[str, ...] = ()   # summary() keys the backend cannot tell (they are None)
    # aligned with decode_ms, each token's step: the sequences in it (1 alone; more when
    # conversations shared it) and the cached tokens it read over all of them
    step_sequences: tuple[int, ...] = ()
    step_tokens: tuple[int, ...] = ()
    reclaimed_blocks: int | None = 0    # cached blocks reclaimed for this turn (evicted_blocks: sink-window's)

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / total if total > 0 else 0.0

    def summarized(self) -> TurnSummary:
        """The flat record (times rounded to the microsecond)."""
        c = self.cache
        return TurnSummary(
            turn=self.turn, reply=self.reply, prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens, computed_tokens=self.computed_tokens,
            generated_tokens=self.generated_tokens, ttft_ms=round(self.ttft_ms, 3),
            prefill_ms=_round(self.prefill_ms), decode_ms=tuple(round(x, 3) for x in self.decode_ms),
            positions=tuple(self.positions), stop_reason=self.stop_reason,
            kv_bytes_per_token=c.bytes_per_token, kv_scale_bytes_per_token=c.scale_bytes_per_token,
            kv_bytes_used=c.bytes_used,
            kv_bytes_allocated=c.bytes_allocated, kv_capacity_bytes=c.capacity_bytes,
            block_size=c.block_size, blocks_used=c.blocks_used, tokens_held=c.tokens_held,
            mode=self.mode, kv_dtype=self.kv_dtype, policy=self.policy, cap=c.cap,
            dropped_messages=self.dropped_messages, evicted_blocks=self.evicted_blocks,
            preempted=self.preempted, recomputed_tokens=self.recomputed_tokens,
            unavailable=tuple(sorted(set(self.unavailable) | {_SUMMARY_KEYS.get(k, k) for k in c.unavailable})),
            step_sequences=tuple(self.step_sequences), step_tokens=tuple(self.step_tokens),
            reclaimed_blocks=self.reclaimed_blocks)

    def summary(self) -> dict[str, Any]:
        """The flat record `kvchat ask --json` prints and the JSON Lines log keeps."""
        return self.summarized().to_dict()


def _round(ms: float | None) -> float | None:
    return round(ms, 3) if ms is not None else None


# CacheSnapshot field -> the summary() key that carries it
_SUMMARY_KEYS = {"bytes_per_token": "kv_bytes_per_token", "scale_bytes_per_token": "kv_scale_bytes_per_token",
                 "bytes_used": "kv_bytes_used",
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
