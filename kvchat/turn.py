"""Relaying one turn's engine events to the UI at a bounded rate.

The engine yields one event per token. Redrawing per token would cost more than the decode
step itself on a fast device, so `relay` batches the text and the latency points, and
takes a cache snapshot at most every `interval` seconds. A snapshot walks every block of
the pool (a large GPU pool has ~10^5), so the interval also stretches to keep snapshots
under 1/SNAPSHOT_SHARE of the turn's time: the UI's cost stays bounded on any pool.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.telemetry import CacheSnapshot, PrefillEvent, TokenEvent, TurnStats

INTERVAL_S = 0.125          # ~8 updates a second
SNAPSHOT_SHARE = 50         # snapshot time <= 2% of the turn


@dataclass(frozen=True, slots=True)
class Progress:
    """What happened since the last update."""
    text: str
    points: tuple[tuple[int, float], ...]     # (context position, decode ms)
    snapshot: CacheSnapshot | None
    prefill: PrefillEvent | None
    generated: int                            # tokens so far this turn


def relay(events: Iterable, snapshot: Callable[[], CacheSnapshot], emit: Callable[[Progress], None],
          interval: float = INTERVAL_S, clock: Callable[[], float] = time.perf_counter) -> TurnStats | None:
    """Consume a turn's events, emitting batched Progress; returns the TurnStats (None if
    the events ended without one)."""
    text: list[str] = []
    points: list[tuple[int, float]] = []
    prefill: PrefillEvent | None = None
    generated = 0
    cost = 0.0
    last = clock()

    def flush(take_snapshot: bool) -> None:
        nonlocal text, points, prefill, cost, last
        snap = None
        if take_snapshot:
            t0 = clock()
            snap = snapshot()
            cost = clock() - t0
        emit(Progress("".join(text), tuple(points), snap, prefill, generated))
        text, points, prefill = [], [], None
        last = clock()

    for ev in events:
        if isinstance(ev, TurnStats):
            if text or points:
                flush(take_snapshot=False)   # the stats carry the final snapshot
            return ev
        if isinstance(ev, PrefillEvent):
            prefill = ev
            flush(take_snapshot=True)        # show prefix reuse before the first token
            continue
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
            if ev.token_id >= 0:
                generated += 1
                points.append((ev.position, ev.latency_ms))
        if clock() - last >= max(interval, SNAPSHOT_SHARE * cost):
            flush(take_snapshot=True)
    if text or points or prefill:
        flush(take_snapshot=True)
    return None
