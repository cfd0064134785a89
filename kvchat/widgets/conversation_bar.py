"""The conversation bar: one clickable label per open conversation, the focused one
highlighted, with what each is doing (replying, preempted). Hidden while only one is open."""
from __future__ import annotations

from dataclasses import dataclass

from textual.content import Content
from textual.markup import escape
from textual.widgets import Static

from ..text import inert


@dataclass(frozen=True, slots=True)
class Entry:
    number: int
    title: str
    turns: int
    state: str = ""        # "replying", "preempted", or ""


class ConversationBar(Static):
    """`show(entries, focused)`; a click on a label runs the screen's switch_conversation(N)."""

    DEFAULT_CSS = """
    ConversationBar { height: 1; background: $panel; padding: 0 1; }
    ConversationBar.single { display: none; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entries: tuple[Entry, ...] = ()
        self.focused = 0
        self._hint = ""

    def show(self, entries: list[Entry], focused: int, hint: str = "") -> None:
        entries_t = tuple(entries)
        if (entries_t, focused, hint) == (self.entries, self.focused, self._hint):
            return
        self.entries, self.focused, self._hint = entries_t, focused, hint
        self.set_class(len(entries_t) < 2, "single")
        self._draw()

    def on_resize(self) -> None:
        self._draw()

    def _draw(self) -> None:
        parts = []
        for e in self.entries:
            label = f" {e.number} {escape(inert(e.title))} "
            if e.state:
                label += f"[i]{e.state}[/i] "
            style = "reverse b" if e.number == self.focused else ("$warning" if e.state == "preempted" else "")
            style = f"{style} @click=screen.switch_conversation({e.number})".strip()
            parts.append(Content.from_markup(f"[{style}]{label}[/]"))
        content = self._around_focus(parts)
        hint = f"   {self._hint}"
        if self._hint and content.cell_length + len(hint) <= (self.content_region.width or 10**6):
            content = content + Content.styled(hint, "dim")   # only when it fits
        self.update(content)

    def _around_focus(self, parts: list[Content]) -> Content:
        """The labels that fit the bar's width, the focused one's always: with too many for
        one line, those far from it give way, counted at each end ("‹2", "3›"), where the
        line's end cut off whatever was there (the newest conversation, often the focused
        one: issue 26)."""
        width = self.content_region.width or 10**6
        i = next((k for k, e in enumerate(self.entries) if e.number == self.focused), 0)

        def line(lo: int, hi: int) -> Content:
            out = Content("│").join(parts[lo:hi])
            if lo > 0:
                out = Content.styled(f"‹{lo} ", "dim") + out
            if hi < len(parts):
                out = out + Content.styled(f" {len(parts) - hi}›", "dim")
            return out
        lo, hi = i, i + 1
        while True:      # widen one label at a time, the newer side first
            wider = [(a, b) for a, b in ((lo, hi + 1), (lo - 1, hi))
                     if a >= 0 and b <= len(parts) and line(a, b).cell_length <= width]
            if not wider:
                return line(lo, hi)
            lo, hi = wider[0]
