"""What the crowd panel shows, as plain data: one row per conversation in the pool (the
user's own first, then each simulated user) and the pool's totals, built from the
scheduler's snapshot (SchedulerSnapshot), the cache's (CacheSnapshot) and the crowd's own
turn records. No Textual here: the widget (kvchat/widgets/crowd_panel.py) draws a
CrowdFigures, and a test can check every figure without a screen.

Where the backend cannot see its scheduler (a server), the rows come from the streams' own
timings and the figures it cannot tell are None (drawn as n/a).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

from kvchat.engine.telemetry import CacheSnapshot, SchedulerSnapshot
from kvchat.latency import turn_field

from .driver import CrowdTurn, CrowdUser

WINDOW_S = 10.0      # tokens/s over the steps of the last WINDOW_S seconds
RATE_S = 60.0        # preemptions and recomputed tokens per minute, over the last minute


@dataclass(frozen=True, slots=True)
class CrowdRow:
    name: str                      # "you", "user 2", "user 1 (long)"
    own: bool                      # the user's own conversation (highlighted)
    state: str                     # running, prefill, waiting, preempted, idle; a crowd user between turns:
                                   # thinking, or refused (its last turn did not fit the pool)
    context_tokens: int | None     # the conversation's tokens: its last prompt and reply (cached or not:
                                   # an idle one's blocks are cached, not held, and may be reclaimed)
    ttft_ms: float | None
    ms_per_token: float | None
    blocks_held: int | None
    pool_share: float | None       # blocks held / the pool's blocks
    turns: int | None = None
    preemptions: int | None = None
    conversation: int | None = None  # its id (the block map's owner), for its colour


@dataclass(frozen=True, slots=True)
class CrowdFigures:
    rows: tuple[CrowdRow, ...]
    users: int                     # simulated users running
    tokens_per_s: float | None     # every reply token the steps sampled, over the last WINDOW_S
    step_ms: float | None          # the last step's time
    step_tokens: int | None        # cached tokens the last step's attention read, over every sequence
    weight_bytes: int | None       # the last step's weights, read once for every sequence
    cache_bytes: int | None        # the last step's K/V reads, every sequence's cache summed
    crossover_tokens: int | None   # tokens in a step at which the caches read as much as the weights
    preemptions_per_min: float | None
    recomputed_per_min: float | None
    waiting: int | None
    running: int | None
    pool_used: float | None        # share of the pool's blocks in use
    source: str = "local"          # "local", or the server's name: what filled the figures
    # the user's own last turn: its mean decode ms/token, the mean cached tokens its steps read
    # over every sequence in them, and its own mean context: the crowd's cost on its own curve
    own_cost: tuple[float, float, float] | None = None

    @property
    def caches_pass_weights(self) -> bool:
        return self.cache_bytes is not None and self.weight_bytes is not None and self.cache_bytes > self.weight_bytes


def _tokens(v: Any) -> int:
    """A conversation's tokens: those its sequence holds while it runs, else its last request's
    prompt and reply (idle, waiting or preempted, the sequence holds none)."""
    return max(v.context_tokens, v.prompt_tokens + v.generated_tokens)


class Meter:
    """Builds CrowdFigures from successive snapshots; keeps what a rate needs (the pool-wide
    preemption and recomputation totals over the last minute)."""

    def __init__(self) -> None:
        self._marks: deque[tuple[float, int, int]] = deque()

    def figures(self, users: list[CrowdUser], sched: SchedulerSnapshot | None, cache: CacheSnapshot | None,
                own: int | None, now: float | None = None, turns: list[CrowdTurn] | None = None,
                clock: float | None = None, own_turn: Any = None) -> CrowdFigures:
        """`own_turn`: the user's own last turn record (its step_tokens). `turns` and `clock`
        (the crowd's records and its clock now): the client's own tokens/s where no scheduler
        reports steps."""
        return replace(self._figures(users, sched, cache, own, now, turns, clock), own_cost=own_cost(own_turn))

    def _figures(self, users: list[CrowdUser], sched: SchedulerSnapshot | None, cache: CacheSnapshot | None,
                 own: int | None, now: float | None, turns: list[CrowdTurn] | None,
                 clock: float | None) -> CrowdFigures:
        now = time.monotonic() if now is None else now
        blocks = cache.num_blocks if cache is not None and cache.num_blocks else None
        views = {v.conversation: v for v in sched.conversations} if sched is not None else {}
        rows = []
        mine = views.get(own) if own is not None else None
        if mine is not None:
            rows.append(CrowdRow("you", True, mine.state, _tokens(mine), mine.ttft_ms, mine.ms_per_token,
                                 mine.blocks_held, mine.blocks_held / blocks if blocks else None,
                                 preemptions=mine.preemptions, conversation=own))
        for u in users:
            v = views.get(u.conversation) if u.conversation is not None else None
            last = u.last
            if v is not None:
                state = v.state
                if v.state == "idle" and u.state == "thinking":   # between turns: refused last time, or thinking
                    state = "refused" if last is not None and last.error else "thinking"
                rows.append(CrowdRow(u.name, False, state, _tokens(v), v.ttft_ms, v.ms_per_token, v.blocks_held,
                                     v.blocks_held / blocks if blocks else None, u.turns, v.preemptions,
                                     u.conversation))
            else:       # no scheduler to ask: the client's own timings
                rows.append(CrowdRow(u.name, False, u.state, last.context_tokens if last else None,
                                     last.ttft_ms if last else None, last.ms_per_token if last else None,
                                     None, None, u.turns))
        active = sum(u.state in ("thinking", "sending", "joining") for u in users)
        if sched is None:
            return self._from_server(tuple(rows), active, cache, turns, clock, now)
        step = sched.last_step
        recent = [s for s in sched.recent if s.time >= now - WINDOW_S]
        tps = None
        if recent:
            span = recent[-1].time - recent[0].time + recent[0].step_ms / 1000
            tps = sum(s.tokens_out for s in recent) / span if span > 0 else None
        pre, rec = self._rate(now, sched.preemptions, sched.recomputed_tokens)
        bpt = cache.bytes_per_token if cache is not None else None
        cross = step.weight_bytes // bpt if step is not None and bpt else None
        return CrowdFigures(
            tuple(rows), active, tps, step.step_ms if step else None, step.context_tokens if step else None,
            step.weight_bytes if step else None, step.cache_bytes if step else None, cross,
            pre, rec, sched.waiting,
            sched.running, cache.occupancy if cache is not None else None)

    def _rate(self, now: float, preemptions: int, recomputed: int) -> tuple[float, float]:
        """Per minute over the last RATE_S, from the running totals."""
        self._marks.append((now, preemptions, recomputed))
        while self._marks and self._marks[0][0] < now - RATE_S:
            self._marks.popleft()
        t0, p0, r0 = self._marks[0]
        minutes = max(now - t0, 1.0) / 60
        return (preemptions - p0) / minutes, (recomputed - r0) / minutes

    def _from_server(self, rows: tuple[CrowdRow, ...], active: int, cache: CacheSnapshot | None,
                     turns: list[CrowdTurn] | None, clock: float | None, now: float) -> CrowdFigures:
        """A server seen from outside: its /metrics (running, waiting, preemptions, KV usage)
        and the streams' own tokens/s; no steps, so the step's time and bytes are n/a."""
        stats = getattr(cache, "server", None)
        tps = None
        if turns is not None and clock is not None:
            window = min(WINDOW_S, clock) or None
            tps = sum(t.generated_tokens for t in turns if t.end_s >= clock - WINDOW_S) / window if window else None
        pre = None
        if stats is not None and stats.preemptions is not None:
            pre = self._rate(now, stats.preemptions, 0)[0]
        return CrowdFigures(rows, active, tps, None, None, None, None, None, pre, None,
                            stats.waiting if stats is not None else None, stats.running if stats is not None else None,
                            stats.usage if stats is not None else cache.occupancy if cache is not None else None,
                            source=stats.url if stats is not None else cache.source if cache is not None else "unknown")


def own_cost(record: Any) -> tuple[float, float, float] | None:
    """(mean ms/token, mean cached tokens in its steps, mean own context) of a turn record."""
    if record is None:
        return None
    ms, pos = turn_field(record, "decode_ms", ()), turn_field(record, "positions", ())
    steps = turn_field(record, "step_tokens", ())
    if not ms or not steps or not pos:
        return None
    return sum(ms) / len(ms), sum(steps) / len(steps), sum(pos) / len(pos)
