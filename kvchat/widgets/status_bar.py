"""The top line: the model and its settings on the left, what kvchat is doing on the right."""
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

    def render(self) -> Table:
        t = Table.grid(expand=True)
        t.add_column(no_wrap=True, overflow="ellipsis")
        t.add_column(justify="right", no_wrap=True)
        t.add_row(Text(self.info, style="bold"), Text(self.state))
        return t
