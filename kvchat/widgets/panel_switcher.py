"""The telemetry column beside the chat: the four panels, arranged by the layout
(kvchat/widgets/layout.py decides which from the terminal's size, the app passes it on each resize).

- stacked / columns: all four at once, in one stack or two;
- tabs / compact: one at a time under a row of tabs; the cycle key (keys.py `next_panel`)
  or a click on a tab shows another.

It owns what is displayed: the layout, the panel in front, the panels /panel closed, and
F6's hide / show (the user's choice, which wins over the size once made). Hidden panels
only keep their telemetry (widgets/panel.py); this column has each one it shows draw what
it missed before the screen is laid out again.
"""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget

from kvchat.engine.telemetry import CacheSnapshot

from ..keys import PANELS as PANEL_NAMES
from .layout import ALL_AT_ONCE, CHAT, LAYOUTS, TABS
from .block_map import BlockMap
from .cache_panel import CachePanel
from .cap_gauge import CapGauge
from .crowd_panel import CrowdFigures, CrowdPanel
from .latency_panel import LatencyPanel

# each panel's widget id, by its name (keys.PANELS: the tabs' labels and /panel's names)
PANELS = dict(zip(PANEL_NAMES, ("cache-panel", "cap-gauge", "block-map", "latency-panel"), strict=True))
# panels offered only while what they show exists (the crowd panel while a crowd runs): a tab
# after the four, and the top of the first stack where all are shown
EXTRA = {"crowd": "crowd-panel"}


class PanelTabs(Widget):
    """One row: a label per panel, the one in front marked, closed ones struck through, and
    the cycle key at the right. A click on a label posts Selected."""

    DEFAULT_CSS = """
    PanelTabs { height: 1; }
    PanelTabs > .paneltabs--current { text-style: bold reverse; color: $accent; }
    PanelTabs > .paneltabs--closed { text-style: strike; color: $foreground 40%; }
    PanelTabs > .paneltabs--hint { color: $foreground 50%; }
    """
    COMPONENT_CLASSES = {"paneltabs--current", "paneltabs--closed", "paneltabs--hint"}

    class Selected(Message):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.current = "cache"
        self.closed: frozenset[str] = frozenset()
        self.hint = ""                        # the cycle key, e.g. "f10"
        self.names: tuple[str, ...] = tuple(PANELS)
        self._spans: list[tuple[int, int, str]] = []

    def show(self, current: str, closed: frozenset[str], hint: str, names: tuple[str, ...] = tuple(PANELS)) -> None:
        if (current, closed, hint, names) != (self.current, self.closed, self.hint, self.names):
            self.current, self.closed, self.hint, self.names = current, closed, hint, names
            self.refresh()

    def render(self) -> Text:
        """' cache │ cap │ blocks │ latency ' and the key; without the spaces where they and the key
        do not fit (the key matters more)."""
        width = self.content_size.width or 80
        key = 2 + cell_len(self.hint) if self.hint else 0
        spaced = sum(len(n) + 2 for n in self.names) + len(self.names) - 1 + key <= width
        out = Text(no_wrap=True, overflow="crop")
        self._spans = []
        for name in self.names:
            if out:
                out.append("│" if spaced else " ")
            style = ("paneltabs--current" if name == self.current else
                     "paneltabs--closed" if name in self.closed else None)
            start = out.cell_len
            out.append(f" {name} " if spaced else name, self.get_component_rich_style(style) if style else "")
            self._spans.append((start, out.cell_len, name))
        for hint in (f"{self.hint} next", self.hint) if self.hint else ():
            room = width - out.cell_len - cell_len(hint)
            if room >= 2:
                out.append(" " * room).append(hint, self.get_component_rich_style("paneltabs--hint"))
                break
        return out

    def on_click(self, event: events.Click) -> None:
        name = next((n for start, end, n in self._spans if start <= event.x < end), None)
        if name is not None:
            event.stop()
            self.post_message(self.Selected(name))


class PanelScroll(VerticalScroll):
    """Scrolls a panel taller than the screen; Tab can focus it for the arrows, a click does
    not take the keyboard from the input."""
    FOCUS_ON_CLICK = False


class PanelSwitcher(Vertical):
    """The column (id "panels"): the tabs, then the panels in two stacks (KV cache and cap,
    blocks and latency), which the columns layout puts side by side and the others one
    under the other. Widths per layout are in its CSS; the thresholds in kvchat/widgets/layout.py.

    The scroll keeps its scrollbar's column whether or not the panels overflow it (scrollbar-
    gutter: stable; the widths one column more for it): the panels' heights depend on their
    width, so a bar that took a column only while they overflowed could change whether they
    overflow, and it came and went: every panel redrawn about 18 times a second while the chat
    sat idle (tests/app/test_layout_steady.py)."""

    DEFAULT_CSS = """
    PanelSwitcher { width: 45%; min-width: 46; max-width: 73; padding: 0 0 0 1; }
    PanelSwitcher.-columns { width: 55%; min-width: 91; max-width: 127; }
    PanelSwitcher.-compact, PanelSwitcher.-chat { width: 42%; min-width: 29; max-width: 41; }
    PanelSwitcher > PanelScroll { height: 1fr; scrollbar-size-vertical: 1; scrollbar-gutter: stable; }
    PanelSwitcher.-columns > PanelScroll { layout: horizontal; }
    PanelSwitcher .panel-stack { height: auto; }
    PanelSwitcher.-columns .panel-stack { width: 1fr; }
    PanelSwitcher.-compact LatencyPanel > PlotextPlot, PanelSwitcher.-chat LatencyPanel > PlotextPlot { height: 8; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.arrangement = TABS
        self.current = "cache"             # the panel in front when one is shown at a time
        self.closed: set[str] = set()      # closed by /panel, in every layout
        self.chosen: bool | None = None    # F6's show (True) / hide (False); None: the layout decides
        self.hint = ""
        self.offered: set[str] = set()     # the EXTRA panels shown now

    @property
    def names(self) -> tuple[str, ...]:
        """The panels in tab and cycle order: the four, then the extra ones offered now."""
        return (*PANELS, *(n for n in EXTRA if n in self.offered))

    def compose(self) -> ComposeResult:
        yield PanelTabs()
        with PanelScroll():
            with Vertical(classes="panel-stack"):
                yield CrowdPanel(id=EXTRA["crowd"])
                yield CachePanel(id=PANELS["cache"])
                yield CapGauge(id=PANELS["cap"])
            with Vertical(classes="panel-stack"):
                yield BlockMap(id=PANELS["blocks"])
                yield LatencyPanel(id=PANELS["latency"])

    class CrowdUpdate(Message):
        """A crowd's figures and the pool's cache, from the crowd's poller thread (post_message
        is thread-safe): the crowd panel's rows, and the block map coloured by user."""

        def __init__(self, figures: CrowdFigures | None, cache: CacheSnapshot | None) -> None:
            super().__init__()
            self.figures, self.cache = figures, cache

    def on_mount(self) -> None:
        self._apply()

    def on_panel_switcher_crowd_update(self, msg: CrowdUpdate) -> None:
        msg.stop()
        if "crowd" not in self.offered:     # the crowd left while this was on its way
            return
        self.query_one(CrowdPanel).show(msg.figures)
        if msg.cache is not None:
            self.query_one(BlockMap).show(msg.cache)

    def panel(self, name: str):
        return self.query_one(f"#{PANELS.get(name) or EXTRA[name]}")

    @property
    def one_at_a_time(self) -> bool:
        return self.arrangement not in ALL_AT_ONCE

    def laid_out(self) -> list[str]:
        """The panels the layout shows (while the column itself is displayed), in order."""
        return [n for n in self.names if n not in self.closed and (not self.one_at_a_time or n == self.current)]

    # ---- what the app and the keys change ----------------------------------------------------
    def use_layout(self, layout: str) -> None:
        """Take the layout for the terminal's new size (layout.layout_for)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}")
        if layout != self.arrangement:
            self.arrangement = layout
            self._apply()

    def cycle(self, step: int = 1) -> None:
        """The next open panel to the front; where all are shown, scroll it into view."""
        names = list(self.names)
        for i in range(1, len(names) + 1):
            name = names[(names.index(self.current) + step * i) % len(names)]
            if name not in self.closed:
                self.select(name)
                return

    def select(self, name: str) -> None:
        """Bring a panel to the front (opening it if /panel closed it)."""
        self.current = name
        self.closed.discard(name)
        self._apply()
        if not self.one_at_a_time:
            self.query_one(PanelScroll).scroll_to_widget(self.panel(name), animate=False, top=True)

    def toggle(self) -> None:
        """F6: hide or show the column; the choice then wins over the terminal's size."""
        self.chosen = not self.display
        self._apply()

    def toggle_panel(self, name: str) -> None:
        """/panel NAME: close or reopen one panel ("all": each of them)."""
        for n in PANELS if name == "all" else (name,):
            self.closed ^= {n}
        if self.current in self.closed:
            self.cycle()
        self._apply()

    def offer(self, name: str, on: bool) -> None:
        """Add an EXTRA panel (in front) or take it away (the cache panel in front again)."""
        if name == "crowd":
            self.query_one(BlockMap).colour_owners(on)
            self.query_one(LatencyPanel).plot_against_step(on)
        if on:
            self.offered.add(name)
            self.select(name)
            return
        self.offered.discard(name)
        if self.current == name:
            self.current = "cache"
        self._apply()

    def set_hint(self, key: str) -> None:
        self.hint = key
        self._apply()

    def on_panel_tabs_selected(self, event: PanelTabs.Selected) -> None:
        event.stop()
        self.select(event.name)

    # ---- drawing -----------------------------------------------------------------------------
    def _apply(self) -> None:
        for name in LAYOUTS:
            self.set_class(name == self.arrangement, f"-{name}")
        self.display = self.chosen if self.chosen is not None else self.arrangement != CHAT
        if not self.is_mounted:
            return
        showing = self.laid_out()
        for name in (*PANELS, *EXTRA):
            self.panel(name).display = name in showing
        tabs = self.query_one(PanelTabs)
        tabs.display = self.one_at_a_time
        tabs.show(self.current, frozenset(self.closed), self.hint, self.names)
        for name in showing:
            self.panel(name).catch_up()      # before the next layout: it shows current figures at once

