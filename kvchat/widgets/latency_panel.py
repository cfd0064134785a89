"""The latency panel: per-token decode latency against context position (a plotext chart)
with the fitted growth in ms per 1k tokens, and per turn the TTFT and how much of the
prompt was reused from the cache versus computed, and the KV dtype it ran with ("off": no cache)."""
from __future__ import annotations

import time
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plotext import PlotextPlot

from ..latency import LatencyData, fit_slope
from ..records import TurnRecord

__all__ = ["LatencyPanel", "fit_slope"]

MAX_PLOTTED = 600      # points drawn; the fit uses all of them
REDRAW_S = 1.0         # during a turn the plot is redrawn at most this often
TURNS_SHOWN = 4


class LatencyPanel(Vertical):
    """Draws one conversation's LatencyData (`attach` switches to another conversation's);
    `add_points` during a turn, `end_turn` swaps the live points for the exact ones."""

    DEFAULT_CSS = """
    LatencyPanel { height: auto; border: round $primary 50%; padding: 0 1; }
    LatencyPanel > PlotextPlot { height: 11; }
    LatencyPanel > #latency-turns { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "latency"
        self.data = LatencyData()
        self._drawn_at = 0.0

    def compose(self) -> ComposeResult:
        yield PlotextPlot(id="latency-plot")
        yield Static(id="latency-turns")

    def on_mount(self) -> None:
        self._redraw()

    @property
    def points(self) -> dict[str, list[tuple[int, float]]]:
        return self.data.points

    @property
    def turns(self) -> list[TurnRecord]:
        return self.data.turns

    @property
    def point_count(self) -> int:
        return self.data.point_count

    def slope(self, mode: str = "cache") -> float | None:
        return fit_slope(self.data.points[mode])

    def attach(self, data: LatencyData) -> None:
        """Show another conversation's history."""
        if data is not self.data:
            self.data = data
            self._redraw()

    def begin_turn(self, mode: str) -> None:
        self.data.begin_turn(mode)

    def add_points(self, points: tuple[tuple[int, float], ...]) -> None:
        if points:
            self.data.add_points(points)
            if time.monotonic() - self._drawn_at >= REDRAW_S:
                self._redraw(table=False)

    def end_turn(self, record: TurnRecord | None) -> None:
        self.data.end_turn(record)
        self._redraw()

    def add_turn(self, record: TurnRecord) -> None:
        self.data.add_turn(record)
        self._redraw()

    def _redraw(self, table: bool = True) -> None:
        if not self.is_mounted:
            return
        self._drawn_at = time.monotonic()
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        titles = []
        for mode, label, color in (("cache", "cache on", "cyan"), ("off", "cache off", "orange")):
            pts = self.data.points[mode]
            if not pts:
                continue
            step = max(1, len(pts) // MAX_PLOTTED)
            shown = pts[::step]
            plt.scatter([p for p, _ in shown], [m for _, m in shown], marker="dot", color=color, label=label)
            slope = fit_slope(pts)
            if slope is not None:
                x0, x1 = min(p for p, _ in pts), max(p for p, _ in pts)
                my = sum(m for _, m in pts) / len(pts)
                mx = sum(p for p, _ in pts) / len(pts)
                y = lambda x: my + slope / 1000.0 * (x - mx)  # noqa: E731
                plt.plot([x0, x1], [y(x0), y(x1)], marker="braille", color="red")
                titles.append(f"{label} {slope:+,.0f} ms" if abs(slope) >= 100 else f"{label} {slope:+.3g} ms")
        plt.title("fitted growth per 1k tokens: " + ", ".join(titles) if titles
                  else "decode ms per token vs context position")
        plt.xlabel("context position")
        plot.refresh()
        if table:
            self.query_one("#latency-turns", Static).update(self._turn_table())

    def _turn_table(self) -> Table | Text:
        if not self.data.turns:
            return Text("no turns yet", style="dim")
        t = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
        t.add_column("turn", justify="right")
        t.add_column("TTFT", justify="right")
        t.add_column("reused", justify="right", style="green")
        t.add_column("computed", justify="right", style="yellow")
        t.add_column("KV", no_wrap=True)
        t.add_column("", no_wrap=True)
        for s in self.data.turns[-TURNS_SHOWN:]:
            total = max(s.prompt_tokens, 1)
            bar_w = 12
            r = round(bar_w * s.reused_tokens / total)
            bar = Text("█" * r, style="green") + Text("█" * (bar_w - r), style="yellow")
            kv = "off" if s.mode == "off" else s.kv_dtype
            t.add_row(str(s.turn), f"{s.ttft_ms:.0f} ms", f"{s.reused_tokens:,}",
                      f"{s.computed_tokens:,}", kv, bar)
        return t
