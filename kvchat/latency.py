"""One conversation's latency history: decode ms per context position by cache mode, and
the per-turn records. Plain data, so each conversation keeps its own while the one
LatencyPanel draws whichever is in focus."""
from __future__ import annotations

from .records import TurnRecord

MIN_FIT_POINTS = 8
MIN_FIT_SPAN = 256      # positions; a slope fitted over fewer is mostly timing noise scaled up to 1k tokens
MODES = ("cache", "off")


def fit_slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope in ms per 1,000 positions, or None without enough points or spread."""
    n = len(points)
    if n < MIN_FIT_POINTS or max(p for p, _ in points) - min(p for p, _ in points) < MIN_FIT_SPAN:
        return None
    mx = sum(p for p, _ in points) / n
    my = sum(m for _, m in points) / n
    sxx = sum((p - mx) ** 2 for p, _ in points)
    if sxx == 0:
        return None
    sxy = sum((p - mx) * (m - my) for p, m in points)
    return 1000.0 * sxy / sxx


class LatencyData:
    """Points by cache mode; `add_points` during a turn, `end_turn` replaces that turn's live
    points with the exact ones from its TurnRecord."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {m: [] for m in MODES}
        self.turns: list[TurnRecord] = []
        self._live: list[tuple[int, float]] = []
        self._live_mode = "cache"

    @property
    def point_count(self) -> int:
        return sum(len(v) for v in self.points.values())

    def begin_turn(self, mode: str) -> None:
        self._live = []
        self._live_mode = mode if mode in self.points else "cache"

    def add_points(self, points: tuple[tuple[int, float], ...]) -> None:
        self._live.extend(points)
        self.points[self._live_mode].extend(points)

    def end_turn(self, record: TurnRecord | None) -> None:
        series = self.points[self._live_mode]
        del series[len(series) - len(self._live):]
        self._live = []
        if record is not None:
            self.add_turn(record)

    def add_turn(self, record: TurnRecord) -> None:
        self.points.setdefault(record.mode, []).extend(zip(record.positions, record.decode_ms))
        self.turns.append(record)
