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
        width = self.content_size.width
        state = fit_segments(self.state, width - 12) if width else self.state
        info = fit_segments(self.info, width - len(state) - 2) if width else self.info
        t.add_row(Text(info, style="bold"), Text(state))
        return t


def fit_segments(text: str, room: int, sep: str = " · ") -> str:
    """Drop whole trailing " · " segments until text fits in room columns, so a narrow
    terminal cuts the line between words, never inside one (the first segment stays)."""
    parts = text.split(sep)
    while len(parts) > 1 and len(sep.join(parts)) > room:
        parts.pop()
    return sep.join(parts)
