"""Relaying one turn's engine events to the UI at a bounded cost.

The engine yields one event per token. Redrawing per token would cost more than the decode
step itself on a fast device, so `relay` (in the worker) batches the text and the latency
points and takes a cache snapshot at most every `interval()` seconds. Two costs are kept
bounded, each measured where it is paid:
- the snapshot walks every block of the pool (a large GPU pool has ~10^5), on the worker:
  the interval stretches to keep it under 1/SNAPSHOT_SHARE of the turn;
- the redraw, on the UI thread: `Governor` reads the UI thread's own CPU clock and sets the
  interval so that the UI uses at most `share` of the turn's time.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvchat.engine.telemetry import CacheSnapshot, PrefillEvent, PrefillProgress, TokenEvent, TurnStats

from ..backends.protocol import Event
from .prefill_eta import PrefillEta

INTERVAL_S = 0.125          # ~8 updates a second at most
MAX_INTERVAL_S = 1.0        # and at least one a second
SNAPSHOT_SHARE = 50         # snapshot time <= 2% of the turn
UI_SHARE = 0.03             # UI thread CPU time <= 3% of the turn


@dataclass(frozen=True, slots=True)
class Progress:
    """What happened since the last update."""
    text: str
    points: tuple[tuple[int, float], ...]     # (context position, decode ms)
    snapshot: CacheSnapshot | None
    prefill: PrefillEvent | None
    generated: int                            # tokens so far this turn
    prefill_progress: PrefillProgress | None = None   # the latest, while the prompt prefills
    prefill_eta_s: float | None = None                # its time left, from the recent chunks


class Governor:
    """Sets the update interval so the UI thread's CPU time stays under `share` of the wall
    time. `tick()` runs on the UI thread after each update; the worker reads `interval`."""

    def __init__(self, share: float = UI_SHARE, lo: float = INTERVAL_S, hi: float = MAX_INTERVAL_S,
                 cpu: Callable[[], float] = time.thread_time, wall: Callable[[], float] = time.perf_counter,
                 window: float = 0.5) -> None:
        self.share, self.lo, self.hi, self.window = share, lo, hi, window
        self._cpu, self._wall = cpu, wall
        self.interval = lo
        self.begin()

    def begin(self) -> None:
        """A turn starts: measure from here (the interval learnt so far is kept)."""
        self._cpu0, self._wall0 = self._cpu(), self._wall()

    def tick(self) -> None:
        cpu, now = self._cpu(), self._wall()
        elapsed = now - self._wall0
        if elapsed < self.window:
            return
        used = (cpu - self._cpu0) / elapsed              # the UI's share of this window
        # cost per update is ~used x interval; the interval that meets the share is that / share
        want = self.interval * used / self.share
        self.interval = min(self.hi, max(self.lo, (self.interval * want) ** 0.5))   # damped
        self._cpu0, self._wall0 = cpu, now


def relay(events: Iterable[Event], snapshot: Callable[[], CacheSnapshot], emit: Callable[[Progress], None],
          interval: Callable[[], float] = lambda: INTERVAL_S,
          clock: Callable[[], float] = time.perf_counter) -> TurnStats | None:
    """Consume a turn's events, emitting batched Progress; returns the TurnStats (None if
    the events ended without one)."""
    text: list[str] = []
    points: list[tuple[int, float]] = []
    prefill: PrefillEvent | None = None
    generated = 0
    cost = 0.0
    last = snapped = clock()       # the last update; the last snapshot
    eta = PrefillEta()

    def flush(take_snapshot: bool, progress: PrefillProgress | None = None) -> None:
        nonlocal text, points, prefill, cost, last, snapped
        snap = None
        if take_snapshot:
            t0 = clock()
            snap = snapshot()
            cost = clock() - t0
            snapped = t0
        emit(Progress("".join(text), tuple(points), snap, prefill, generated, progress,
                      eta.add(progress) if progress is not None else None))
        text, points, prefill = [], [], None
        last = clock()

    for ev in events:
        if isinstance(ev, TurnStats):
            if text or points:
                flush(take_snapshot=False)   # the stats carry the final snapshot
            return ev
        if isinstance(ev, PrefillProgress):
            # one per prefill chunk: few, each worth showing with the cache the chunks have
            # filled so far (the panels froze at the last turn's for a whole long prefill)
            # (timed from the last snapshot, not the last update: a chunk's update without one
            # must not put the next one off for good)
            flush(take_snapshot=clock() - snapped >= SNAPSHOT_SHARE * cost, progress=ev)
            continue
        if isinstance(ev, PrefillEvent):
            prefill = ev
            flush(take_snapshot=True)        # show prefix reuse before the first token
            continue
        if isinstance(ev, TokenEvent):
            text.append(ev.text)
            if ev.token_id is None or ev.token_id >= 0:     # -1: a text tail, not a token
                generated += 1
                points.append((ev.position, ev.latency_ms))
        if clock() - last >= max(interval(), SNAPSHOT_SHARE * cost):
            flush(take_snapshot=True)
    if text or points or prefill:
        flush(take_snapshot=True)
    return None
