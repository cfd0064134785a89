"""A resumed conversation's older messages, not drawn until asked for.

Each message drawn is a widget (a reply several: its Markdown blocks, its fold, its stats
line), and Textual lays every one out: a log of thousands of turns took tens of seconds to
draw on --resume, or on reopening it from the chat browser, and the app was frozen meanwhile.
So a restored transcript mounts only its newest page (`page_start`: PAGE_MESSAGES messages,
fewer when they are long) under one line standing for the rest; a click or Enter on that
line draws the page before, in order, and the line goes once nothing is left above.
Nothing is lost: the conversation's history, its log, /save and the browser's search keep
every message; only the widgets wait.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Static

from ..store.records import TurnRecord
from ..text import earlier_line
from .fold import LIVE_CHARS

PAGE_MESSAGES = 60      # a few screens of ordinary turns
PAGE_CHARS = 100_000    # drawn characters per page (a long reply counts as its live part, fold.py)


@dataclass(slots=True)
class Entry:
    """One message of a restored transcript, as it will be drawn."""
    role: str                       # user or assistant
    content: str
    record: TurnRecord | None = None    # a reply's turn
    dropped: bool = False           # drop-oldest took it out of the model's sight (drawn dimmed)


def page_start(entries: list[Entry]) -> int:
    """Where the newest page of `entries` starts: at most PAGE_MESSAGES messages and about
    PAGE_CHARS drawn characters, never fewer than one message."""
    start, chars = len(entries), 0
    while start > 0 and len(entries) - start < PAGE_MESSAGES:
        chars += min(len(entries[start - 1].content), LIVE_CHARS)
        if chars > PAGE_CHARS and start < len(entries):
            break
        start -= 1
    return start


class Earlier(Static, can_focus=True):
    """The line standing for the messages above not drawn yet; a click or Enter asks for the
    page before (the transcript mounts it, `take_page` hands it over)."""

    DEFAULT_CSS = """
    Earlier { color: $text-muted; text-style: italic; padding: 0 1; margin: 0 0 1 0; }
    Earlier:hover, Earlier:focus { color: $accent; }
    """
    BINDINGS = [Binding("enter,space", "show_more", "show earlier messages", show=False)]

    class More(Message):
        """The user asked for the page before."""

    def __init__(self, entries: list[Entry]) -> None:
        super().__init__()
        self.entries = entries          # oldest first; what is left to draw
        self._tell()

    @property
    def hidden(self) -> int:
        return len(self.entries)

    def _tell(self) -> None:
        self.update(Text(earlier_line(len(self.entries), len(self.entries) - page_start(self.entries))))

    def take_page(self) -> list[Entry]:
        """The newest page of what is left, oldest first; the line then counts the rest."""
        start = page_start(self.entries)
        page, self.entries = self.entries[start:], self.entries[:start]
        self._tell()
        return page

    def keep(self, n: int) -> None:
        """Only the n oldest wait (an edit took the rest off the conversation)."""
        self.entries = self.entries[:n]
        self._tell()

    def on_click(self) -> None:
        self.action_show_more()

    def action_show_more(self) -> None:
        self.post_message(self.More())
