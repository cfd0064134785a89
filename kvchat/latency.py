"""One conversation's latency history: decode ms per context position in one series per
(cache mode, KV dtype), each with its own fit, and the per-turn summaries. Plain data, so
each conversation keeps its own while the one LatencyPanel draws whichever is in focus.

Series are kept apart because a step's cost depends on what it reads: an fp8 cache reads a
quarter of fp32's bytes, and with the cache off a step recomputes the whole history. One
fit across them would measure the mix, not the growth.

The fit is least squares of decode ms against the context the step read. That is the
position, except under sink-window once the window is full: the cache then holds `cap`
tokens whatever the position (the model's maximum without a cap), so those points do not
grow the context and cannot show growth. The chart draws each point at that context too:
sink-window gives a token its index in the cache as its position, so the text's position
runs past the model's maximum while the model's never does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .host_load import HostLoad

MIN_FIT_POINTS = 8
MIN_FIT_SPAN = 256      # positions; a slope fitted over fewer is mostly timing noise scaled up to 1k tokens
MODES = ("cache", "off")

Key = tuple[str, str]   # (cache mode, KV dtype); the KV dtype is "" with the cache off (nothing is stored)
Turn = Any              # one turn's telemetry: a TurnStats.summary() dict or a typed record with those fields


def turn_field(turn: Turn, name: str, default: Any = None) -> Any:
    """A turn's field by its summary key, whether the turn is a dict or a typed record."""
    return turn.get(name, default) if isinstance(turn, dict) else getattr(turn, name, default)


def series_key(mode: str, kv_dtype: str | None) -> Key:
    mode = mode if mode in MODES else "cache"
    return (mode, "" if mode == "off" else (kv_dtype or ""))


def series_label(key: Key) -> str:
    mode, kv = key
    return "cache off" if mode == "off" else f"{kv} cache" if kv else "cache on"


@dataclass(frozen=True, slots=True)
class Fit:
    """One series' growth: `slope` ms per 1k tokens of context (± `stderr`), or None and
    `reason` saying why no slope is shown."""
    points: int
    slope: float | None = None
    stderr: float = 0.0
    reason: str = ""
    line: tuple[tuple[float, float], tuple[float, float]] | None = None   # the fitted line's ends (context, ms)

    def describe(self, short: bool = False) -> str:
        """The slope, its error and the points; `short` for a narrow panel."""
        if self.slope is None:
            return f"no fit: {self.reason}"
        digits = 0 if abs(self.slope) >= 100 else 1 if abs(self.slope) >= 1 else 2
        if short:
            return f"{self.slope:+,.{digits}f}±{self.stderr:,.{digits}f} ms/1k ({self.points:,} pts)"
        return f"{self.slope:+,.{digits}f} ± {self.stderr:,.{digits}f} ms per 1k tokens ({self.points:,} points)"


def fit_series(points: list[tuple[int, float]], contexts: list[int] | None = None, why_flat: str = "") -> Fit:
    """The fit of decode ms against the context read (`contexts`, default the positions).
    No slope without MIN_FIT_POINTS points over MIN_FIT_SPAN of context, or when the latency
    fell as the context grew (that is timing noise or load, never the cache)."""
    n = len(points)
    if n < MIN_FIT_POINTS:
        return Fit(n, reason=f"{n} point{'' if n == 1 else 's'}, needs {MIN_FIT_POINTS}")
    xs = contexts if contexts is not None else [p for p, _ in points]
    ys = [m for _, m in points]
    span = max(xs) - min(xs)
    if span < MIN_FIT_SPAN:
        pos_span = max(p for p, _ in points) - min(p for p, _ in points)
        if pos_span >= MIN_FIT_SPAN:
            return Fit(n, reason=f"positions do not grow{f' ({why_flat})' if why_flat else ''}")
        return Fit(n, reason=f"positions span {span:,}, needs {MIN_FIT_SPAN:,}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx        # ms per position
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(resid / (n - 2) / sxx) if n > 2 else 0.0
    if b < 0:
        return Fit(n, reason="latency fell as the context grew (timing noise, not the cache)")
    x0, x1 = min(xs), max(xs)
    return Fit(n, 1000.0 * b, 1000.0 * se, line=((x0, my + b * (x0 - mx)), (x1, my + b * (x1 - mx))))


class LatencyData:
    """Points by (cache mode, KV dtype); `add_points` during a turn, `end_turn` replaces that
    turn's live points with the exact ones from its TurnStats summary."""

    def __init__(self, max_position: int | None = None) -> None:
        self.max_position = max_position              # sink-window's window when it has no cap
        self.series: dict[Key, list[tuple[int, float]]] = {}
        self.contexts: dict[Key, list[int]] = {}      # the context each point's step read (see the module doc)
        self.flat_by: dict[Key, str] = {}             # why a series' context stopped growing, e.g. "sink-window"
        self.turns: list[Turn] = []
        self._live: list[tuple[int, float]] = []
        self._live_key: Key = ("cache", "")
        self._live_cap: int | None = None
        self._fits: dict[Key, tuple[int, Fit]] = {}   # a redraw refits only the series that changed
        self.host: HostLoad | None = None             # what other processes took of the cores in the last turn

    @property
    def points(self) -> dict[str, list[tuple[int, float]]]:
        """Every point by cache mode, all KV dtypes together (read-only view)."""
        out: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
        for (mode, _), pts in self.series.items():
            out.setdefault(mode, []).extend(pts)
        return out

    def drawn(self, key: Key) -> list[tuple[int, float]]:
        """A series' points at the context each step read (see the module doc): where the
        chart draws them and the fit measures them."""
        return list(zip(self.contexts.get(key, []), (m for _, m in self.series.get(key, []))))

    @property
    def point_count(self) -> int:
        return sum(len(v) for v in self.series.values())

    def fit(self, key: Key) -> Fit:
        pts = self.series.get(key, [])
        known = self._fits.get(key)
        if known is None or known[0] != len(pts):
            known = self._fits[key] = (len(pts), fit_series(pts, self.contexts.get(key), self.flat_by.get(key, "")))
        return known[1]

    def latest_key(self, mode: str | None = None) -> Key | None:
        """The series the most recent turn (or the live one) went to, of `mode` if given."""
        if self._live and (mode is None or self._live_key[0] == mode):
            return self._live_key
        for s in reversed(self.turns):
            key = series_key(turn_field(s, "mode", "cache"), turn_field(s, "kv_dtype"))
            if mode is None or key[0] == mode:
                return key
        return None

    def begin_turn(self, mode: str, kv_dtype: str | None = None, policy: str | None = None,
                   cap: int | None = None) -> None:
        """Live points go to (mode, kv_dtype); without kv_dtype, to the last turn's dtype."""
        if kv_dtype is None and mode != "off":
            last = next((s for s in reversed(self.turns) if turn_field(s, "mode", "cache") == "cache"), None)
            kv_dtype = turn_field(last, "kv_dtype") if last is not None else None
        self._live = []
        self._live_key = series_key(mode, kv_dtype)
        self._live_cap = (cap or self.max_position) if policy == "sink-window" and mode != "off" else None

    def add_points(self, points: tuple[tuple[int, float], ...]) -> None:
        self._live.extend(points)
        self._add(self._live_key, points, self._live_cap)

    def end_turn(self, summary: Turn | None) -> None:
        n = len(self._live)
        self._fits.pop(self._live_key, None)
        if n:
            for store in (self.series, self.contexts):
                del store[self._live_key][len(store[self._live_key]) - n:]
            if not self.series[self._live_key]:
                del self.series[self._live_key], self.contexts[self._live_key]
        self._live = []
        if summary is not None:
            self.add_turn(summary)

    def add_turn(self, summary: Turn) -> None:
        mode = turn_field(summary, "mode", "cache")
        key = series_key(mode, turn_field(summary, "kv_dtype"))
        sink = turn_field(summary, "policy") == "sink-window" and mode != "off"
        window = (turn_field(summary, "cap") or self.max_position) if sink else None
        self._add(key, tuple(zip(turn_field(summary, "positions", ()), turn_field(summary, "decode_ms", ()))), window)
        self.turns.append(summary)

    def _add(self, key: Key, points: tuple[tuple[int, float], ...], window: int | None) -> None:
        self._fits.pop(key, None)
        self.series.setdefault(key, []).extend(points)
        ctx = self.contexts.setdefault(key, [])
        if window is None:
            ctx.extend(p for p, _ in points)
            return
        ctx.extend(min(p, window) for p, _ in points)
        if any(p >= window for p, _ in points):
            self.flat_by[key] = "sink-window"
