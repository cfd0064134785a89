"""The top line: the model and its settings on the left, the last setting changed (a note)
in the middle, what kvchat is doing on the right; a warning (random weights) before all."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


class StatusBar(Widget):
    DEFAULT_CSS = "StatusBar { height: 1; background: $panel; padding: 0 1; }"

    info: reactive[str] = reactive("kvchat")
    """model · device · dtypes · cache mode"""
    state: reactive[str] = reactive("starting")
    """loading 1.2 s, ready, replying, ..."""
    note: reactive[str] = reactive("")
    """the last setting changed: "cap 2,048 tokens", "theme light", ..."""
    warning: reactive[str] = reactive("")
    """what the user must not miss: "random weights: gibberish by design\""""

    def render(self) -> Table:
        t = Table.grid(expand=True, padding=(0, 1))
        cells = []
        width = self.content_size.width
        state = fit_segments(self.state, width - 12) if width else self.state
        if self.warning:
            t.add_column(no_wrap=True)
            cells.append(Text(self.warning, style="bold reverse"))
        room = width - len(state) - 2 - (len(self.warning) + 1 if self.warning else 0)
        t.add_column(no_wrap=True, overflow="ellipsis", ratio=3)
        cells.append(Text(fit_segments(self.info, room) if width else self.info, style="bold"))
        if self.note:
            t.add_column(no_wrap=True, overflow="ellipsis", ratio=2, justify="right")
            cells.append(Text(self.note, style="italic"))
        t.add_column(justify="right", no_wrap=True)
        cells.append(Text(state))
        t.add_row(*cells)
        return t


def fit_segments(text: str, room: int, sep: str = " · ") -> str:
    """Drop whole trailing " · " segments until text fits in room columns, so a narrow
    terminal cuts the line between words, never inside one (the first segment stays)."""
    parts = text.split(sep)
    while len(parts) > 1 and len(sep.join(parts)) > room:
        parts.pop()
    return sep.join(parts)
