"""How long a long prefill has left, from its recent chunks.

A prompt chunk costs more the more tokens come before it (its attention reads every one of
them), so the average rate since the start overstates the rate to come: a long prompt's ETA
fell short (18 s shown, about 40 s taken). `PrefillEta` fits the time per token of the last
few chunks as a line in the position, t(x) = a + b·x, and integrates it over the tokens left;
with one chunk measured, that chunk's rate. It is never faster than the latest chunk.
"""
from __future__ import annotations

from kvchat.engine.telemetry import PrefillProgress

RECENT = 4      # chunks the fit reads: the recent ones, not the average since the start


class PrefillEta:
    """Fed each PrefillProgress of one prefill in order (a done=0 event starts a new one)."""

    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []      # (tokens done, ms since the request started)

    def add(self, ev: PrefillProgress) -> float | None:
        """Seconds left after this event; None before a chunk has been timed."""
        if not self.points or ev.done < self.points[-1][0] or ev.done == 0:
            self.points = []
        self.points.append((ev.done, ev.elapsed_ms))
        chunks = [((d0 + d1) / 2, (t1 - t0) / (d1 - d0))          # (mid position, ms per token)
                  for (d0, t0), (d1, t1) in zip(self.points, self.points[1:]) if d1 > d0][-RECENT:]
        if not chunks:
            return None
        left = ev.total - ev.done
        latest = left * chunks[-1][1]
        if len(chunks) == 1:
            return max(latest, 0.0) / 1000
        n = len(chunks)
        mx, my = sum(x for x, _ in chunks) / n, sum(y for _, y in chunks) / n
        sxx = sum((x - mx) ** 2 for x, _ in chunks)
        b = max(0.0, sum((x - mx) * (y - my) for x, y in chunks) / sxx) if sxx else 0.0
        a = my - b * mx
        ms = a * left + b * (ev.total ** 2 - ev.done ** 2) / 2      # the integral of a + b·x over what is left
        return max(ms, latest, 0.0) / 1000
