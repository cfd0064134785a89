"""The latency panel: per-token decode latency against context position (a plotext chart),
one series per (cache mode, KV dtype) with its own fitted growth in ms per 1k tokens, or
why it has none; and per turn the TTFT, how much of the prompt was reused from the cache
versus computed, and the KV dtype it ran with ("off": no cache)."""
from __future__ import annotations

import math
import time

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plotext import PlotextPlot

from ..latency import MODES, Fit, Key, LatencyData, Turn, fit_series, series_key, series_label, turn_field
from ..text import duration, plural
from .panel import Panel

__all__ = ["LatencyPanel", "nice_ticks"]

MAX_PLOTTED = 600      # points drawn; the fit uses all of them
OUTLIER = "▲"          # a point above the chart's robust top, drawn on its top row
REDRAW_S = 1.0         # during a turn the plot is redrawn at most this often
TURNS_SHOWN = 4
BAR_WIDTH = 12         # the reused / computed bar of each turn, where the panel is wide enough
KV_ORDER = ("fp32", "bf16", "fp16", "fp8")
# the chart's title and x label, longest first: plotext leaves out a label wider than its room
# (a title centred over the canvas, which starts after the y ticks), so the longest that fits
TITLES = ("decode ms per token vs context position", "ms per token vs context position", "ms per token vs position")
STEP_TITLES = ("your ms per token vs cached tokens in the whole step", "your ms per token vs the step's cached tokens",
               "ms per token vs step tokens")
XLABELS = ("context position",)
STEP_XLABELS = ("cached tokens the step read, every conversation's", "cached tokens the step read", "step tokens")
Y_UNIT = "ms"          # the y label: plotext writes it under the y ticks, left of the x label
# plotext colour, rich colour: one per series, the same in the plot and in the fit lines under it
SERIES_COLOURS = {"fp32": ("cyan", "cyan"), "bf16": ("green", "green"), "fp16": ("blue", "blue"),
                  "fp8": ("magenta", "magenta"), "off": ("orange", "dark_orange"), "": ("white", "default")}


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """At most `most` ticks at a round step (1, 2, 2.5 or 5 x 10^k) within [lo, hi]: evenly spaced
    values with short labels, instead of plotext's 13.0, 19.8, 26.5, ..."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(most - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks: list[float] = []
    while first + len(ticks) * step <= hi + 1e-9 * step:
        ticks.append(first + len(ticks) * step)
    return ticks


def robust_top(values: list[float]) -> float:
    """The chart's top: the largest value short of far outliers (Tukey's fences, Q3 + 3 x
    IQR), so one slow step (a page fault, a redraw) does not flatten every real point onto
    the bottom row. Fewer than 8 values: their largest."""
    if len(values) < 8:
        return max(values)
    s = sorted(values)
    q1, q3 = s[len(s) // 4], s[(3 * len(s)) // 4]
    fence = q3 + 3 * (q3 - q1)
    return max((v for v in s if v <= fence), default=s[-1])


def row_ticks(lo: float, hi: float, rows: int, most: int = 4) -> tuple[float, float, list[float]]:
    """Y limits and ticks that land exactly on character rows, evenly: plotext maps the
    limits to the first and last of `rows` rows, so a tick every r rows means limits
    (base, base + (rows - 1) x step / r). Returns (lower, upper, ticks)."""
    if hi - lo < 1e-9 * max(abs(lo), 1.0):       # one point, or a flat line: give it room
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    if rows < 2:
        return lo, hi, [lo, hi]
    mag = 10 ** math.floor(math.log10((hi - lo) / (rows - 1)))
    want = min(3, rows, most)
    for k in range(6):
        for m in (1, 2, 2.5, 5):
            step = m * mag * 10 ** k
            base = math.floor(lo / step + 1e-9) * step
            for r in range(rows - 1, 0, -1):
                count = (rows - 1) // r + 1
                top = base + (rows - 1) * step / r
                if want <= count <= most and top >= hi:
                    return base, top, [base + j * step for j in range(count)]
    return lo, hi, nice_ticks(lo, hi, most)


def tick_labels(ticks: list[float]) -> list[str]:
    """The fewest decimals that tell the ticks apart."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else (1 if step % 1 else 0)
    return [f"{t:,.{decimals}f}" for t in ticks]


ROOMY_HEIGHT = 30      # terminal rows from which the latency panel's notes may take two lines each


def fitting(options: tuple[str, ...], room: int) -> str:
    """The longest of `options` (longest first) that fits in `room` columns, else the shortest."""
    return next((o for o in options if len(o) <= room), options[-1])


def centred_room(width: int, ticks: int) -> int:
    """The longest label plotext draws centred over the canvas of a `width`-column plot whose y
    ticks are `ticks` wide: the canvas starts after them and their "┤" and ends before the
    right border, and a label must end inside the plot with a blank column beside it."""
    start = ticks + 1
    centre = start + (width - start - 1) // 2
    return max(2 * (width - 1 - centre) - 1, 0)


def _tokens(n: int | None) -> str:
    """A token count for the turn table; a dash where the backend did not report it."""
    return f"{n:,}" if n is not None else "—"


def _series_order(key: Key) -> tuple[int, int, str]:
    mode, kv = key
    return (MODES.index(mode), KV_ORDER.index(kv) if kv in KV_ORDER else len(KV_ORDER), kv)


def _colours(key: Key) -> tuple[str, str]:
    return SERIES_COLOURS["off" if key[0] == "off" else key[1] if key[1] in SERIES_COLOURS else ""]


class LatencyPanel(Panel, Vertical):
    """Draws one conversation's LatencyData (`attach` switches to another conversation's);
    whoever changes the data says so (`changed`). While hidden it only owes the draw: the
    plot is the costliest thing on the screen to draw."""

    DEFAULT_CSS = """
    LatencyPanel { height: auto; border: round $primary 50%; padding: 0 1; }
    LatencyPanel > PlotextPlot { height: 11; }
    LatencyPanel > #latency-fits { height: auto; }
    LatencyPanel > #latency-turns { height: auto; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "latency"
        self.data = LatencyData()
        self._drawn_at = 0.0
        self._width = 60
        self.by_step = False     # x: the cached tokens of the whole step (a crowd runs), not the own context
        self.show_host = False   # the host's load under the fits: a local engine's (its steps share these cores)
        self.outliers: list[tuple[int, float]] = []    # points above the chart's robust top, last drawn
        self.y_range: tuple[float, float] | None = None   # the y limits last drawn

    def plot_against_step(self, on: bool) -> None:
        """While a crowd runs: each finished turn's ms/token against the cached tokens its
        steps read over every sequence in them (TurnSummary.step_tokens), so the others'
        contexts show on the user's own curve; off: against its own context position."""
        if on != self.by_step:
            self.by_step = on
            self._redraw()

    def drawn_series(self) -> dict[Key, list[tuple[int, float]]]:
        """The points the plot draws, by series: (the context the step read, or the step's
        tokens, ms); under sink-window the context stops at the window (LatencyData.drawn)."""
        if not self.by_step:
            return {k: self.data.drawn(k) for k in sorted(self.data.series, key=_series_order)}
        out: dict[Key, list[tuple[int, float]]] = {}
        for t in self.data.turns:
            steps, ms = turn_field(t, "step_tokens", ()), turn_field(t, "decode_ms", ())
            if steps and len(steps) == len(ms):
                key = series_key(turn_field(t, "mode", "cache"), turn_field(t, "kv_dtype"))
                out.setdefault(key, []).extend(zip(steps, ms))
        return {k: out[k] for k in sorted(out, key=_series_order)}

    def compose(self) -> ComposeResult:
        yield PlotextPlot(id="latency-plot")
        yield Static(id="latency-fits")
        yield Static(id="latency-turns")

    def on_mount(self) -> None:
        self._redraw()

    @property
    def points(self) -> dict[str, list[tuple[int, float]]]:
        return self.data.points

    @property
    def turns(self) -> list[Turn]:
        return self.data.turns

    @property
    def point_count(self) -> int:
        return self.data.point_count

    def slope(self, mode: str = "cache", kv_dtype: str | None = None) -> float | None:
        """The fitted ms per 1k tokens of the `mode` series in `kv_dtype` (default: the one the
        latest turn of that mode used), None where no fit is meaningful."""
        key = self.data.latest_key(mode) if kv_dtype is None else (mode, "" if mode == "off" else kv_dtype)
        return self.data.fit(key).slope if key is not None else None

    def fits(self) -> dict[Key, Fit]:
        """Each series' fit, in drawing order."""
        return {k: self.data.fit(k) for k in sorted(self.data.series, key=_series_order)}

    def attach(self, data: LatencyData) -> None:
        """Show another conversation's history."""
        if data is not self.data:
            self.data = data
            self._redraw()

    def changed(self, live: bool = False) -> None:
        """The data changed: a turn's live points redraw the plot at most every REDRAW_S (the
        turn table waits for the turn's end); anything else redraws it all."""
        if live and time.monotonic() - self._drawn_at < REDRAW_S:
            return
        self._redraw(table=not live)

    def draw(self) -> None:
        self._redraw()

    def _redraw(self, table: bool = True) -> None:
        if not self.drawing():
            return
        self._drawn_at = time.monotonic()
        plot = self.query_one(PlotextPlot)
        plt = plot.plt
        plt.clear_data()
        plt.clear_figure()
        series = self.drawn_series()
        fits = self.fits() if not self.by_step else {k: fit_series(p) for k, p in series.items()}
        xs: list[int] = []
        ys: list[float] = []
        # each series' own top (a cache-off series sits far above the cached ones, rightly)
        top = max((robust_top([m for _, m in series[key]]) for key in fits if series[key]), default=0.0)
        lines = [y for fit in fits.values() if fit.line is not None for _, y in fit.line]
        top = max([top, *lines])                  # the fits are drawn whole
        self.outliers = [(p, m) for key in fits for p, m in series[key] if m > top]
        for key, fit in fits.items():
            pts = [(p, m) for p, m in series[key] if m <= top]
            colour = _colours(key)[0]
            if pts:
                step = max(1, len(pts) // MAX_PLOTTED)
                shown = pts[::step]
                plt.scatter([p for p, _ in shown], [m for _, m in shown], marker="dot", color=colour,
                            label=series_label(key))
                xs += (min(p for p, _ in shown), max(p for p, _ in shown))
                ys += (min(m for _, m in shown), max(m for _, m in shown))
            if fit.line is not None:
                (x0, y0), (x1, y1) = fit.line
                plt.plot([x0, x1], [y0, y1], marker="braille", color=colour)
        if self.outliers:
            xs += (min(p for p, _ in self.outliers), max(p for p, _ in self.outliers))
            ys.append(top)
        y_labels: list[str] = []
        if xs:
            xt = nice_ticks(min(xs), max(xs))
            lower, upper, yt = row_ticks(min(ys, default=top), max(ys, default=top), self._plot_rows(plot))
            y_labels = tick_labels(yt)
            plt.ylim(lower, upper)
            self.y_range = (lower, upper)
            if self.outliers:      # on the top row, where they would leave the chart
                plt.scatter([p for p, _ in self.outliers], [upper] * len(self.outliers), marker=OUTLIER,
                            color="red")
            plt.xticks(xt, tick_labels(xt))
            plt.yticks(yt, y_labels)
        width = self.content_region.width or self._width      # the plot's: it fills the panel
        ticks = max((len(t) for t in y_labels), default=0)
        plt.title(fitting(STEP_TITLES if self.by_step else TITLES, centred_room(width, ticks)))
        plt.xlabel(fitting(STEP_XLABELS if self.by_step else XLABELS, centred_room(width, max(ticks, len(Y_UNIT) + 1))))
        plt.ylabel(Y_UNIT)
        plot.refresh()
        self.query_one("#latency-fits", Static).update(self._fit_lines(fits))
        if table:
            self.query_one("#latency-turns", Static).update(self._turn_table())

    @staticmethod
    def _plot_rows(plot: PlotextPlot) -> int:
        """The plot's data rows: its height less the title, two borders, tick labels and x label."""
        return max((plot.size.height or 11) - 5, 2)

    def _wrapped(self, options: tuple[str, ...], room: int, lines: int = 2) -> str:
        """The longest of `options` (longest first) that wraps into at most `lines` lines of
        `room` columns, else the shortest: on a small terminal a long note would push the
        panel past the screen's bottom."""
        console = self.app.console
        return next((o for o in options if len(Text(o).wrap(console, max(room, 1))) <= lines), options[-1])

    def _fit_lines(self, fits: dict[Key, Fit]) -> Text:
        """One line per series: its growth per 1k tokens, or why it has no fit; then the notes
        (slow steps above the chart, the host's load), each in the longest form that takes at
        most two lines of the panel's width, one on a terminal under ROOMY_HEIGHT rows (at 80x24
        the panel has 21 rows for the chart, the turn table and these)."""
        if not fits:
            return Text("growth per 1k tokens: no points yet", style="dim")
        room = self.content_region.width or self._width
        notes = 2 if self.app.size.height >= ROOMY_HEIGHT else 1     # lines a note may take
        out = Text()
        if self.outliers:
            n, worst = len(self.outliers), max(m for _, m in self.outliers)
            steps = plural(n, "slow step")
            out.append(self._wrapped((f"{OUTLIER} {steps} above the chart (up to {duration(worst)}), "
                                      "marked on its top row; the fits use every point",
                                      f"{OUTLIER} {steps} above the chart (up to {duration(worst)}), on its top row",
                                      f"{OUTLIER} {steps}, up to {duration(worst)}, top row",
                                      f"{OUTLIER} {n:,} slow, ≤{duration(worst)}"), room, notes), style="red")
        for key, fit in fits.items():
            if out:
                out.append("\n")
            label = f"• {series_label(key)}: "
            text = self._wrapped((label + fit.describe(), label + fit.describe(short=True)), room)[len(label):]
            out.append("• ", style=_colours(key)[1])
            out.append(f"{series_label(key)}: ", style="bold")
            out.append(text, style="" if fit.slope is not None else "dim")
        host = self.data.host
        if self.show_host and host is not None:
            out.append("\n" + self._wrapped(host.lines(), room, notes), style="yellow" if host.noticeable else "dim")
        return out

    def on_resize(self) -> None:
        """The turn table is laid out for the panel's width, and the chart's labels chosen for it."""
        self._width = self.content_region.width or self._width
        self._redraw()

    def _turn_table(self) -> Table | Text:
        """The last turns, fitted to the panel's width: the reused / computed bar narrows,
        then goes, then the KV column, then the turn numbers (a narrow switcher column)."""
        if not self.data.turns:
            return Text("no turns yet", style="dim")
        heads = ["turn", "TTFT", "reused", "computed", "KV"]
        rows: list[list[str]] = []
        shares: list[float | None] = []
        for s in self.data.turns[-TURNS_SHOWN:]:
            f = lambda name, default=0: turn_field(s, name, default)  # noqa: E731
            reused, computed = f("reused_tokens"), f("computed_tokens")     # None: the backend cannot tell
            rows.append([str(f("turn")), duration(f("ttft_ms")), _tokens(reused), _tokens(computed),
                         "off" if f("mode") == "off" else f("kv_dtype", "")])
            shares.append(reused / max(f("prompt_tokens"), 1) if reused is not None else None)
        width = self.content_region.width or self._width     # hidden: the width it had
        cols = [0, 1, 2, 3, 4]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
        need = lambda: sum(widths[i] for i in cols) + 2 * (len(cols) - 1)  # noqa: E731  (one space each side)
        bar_w = min(BAR_WIDTH, width - need() - 2)
        if bar_w < 4:
            bar_w = 0
            for drop in (4, 0):      # then the KV column, then the turn numbers (the rows keep their order)
                if need() > width:
                    cols.remove(drop)
        t = Table(box=None, padding=(0, 1), show_edge=False, pad_edge=False, header_style="bold")
        styles = (None, None, "green", "yellow", None)
        for i in cols:
            t.add_column(heads[i], justify="left" if i == 4 else "right", style=styles[i], no_wrap=True)
        if bar_w:
            t.add_column("", no_wrap=True)
        for row, share in zip(rows, shares):
            if not bar_w:
                bar = []
            elif share is None:
                bar = [Text("░" * bar_w, style="dim")]
            else:
                r = round(bar_w * share)
                # two glyphs as well as two colours: reused █, computed ▒ (a monochrome terminal too)
                bar = [Text("█" * r, style="green") + Text("▒" * (bar_w - r), style="yellow")]
            t.add_row(*(row[i] for i in cols), *bar)
        return t
