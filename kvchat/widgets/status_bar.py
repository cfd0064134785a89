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
        if self.warning:
            t.add_column(no_wrap=True)
            cells.append(Text(self.warning, style="bold reverse"))
        t.add_column(no_wrap=True, overflow="ellipsis", ratio=3)
        cells.append(Text(self.info, style="bold"))
        if self.note:
            t.add_column(no_wrap=True, overflow="ellipsis", ratio=2, justify="right")
            cells.append(Text(self.note, style="italic"))
        t.add_column(justify="right", no_wrap=True)
        cells.append(Text(self.state))
        t.add_row(*cells)
        return t
