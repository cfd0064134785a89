"""The message input: multi-line, Enter sends, ctrl+j adds a line, up/down walk the history."""
from __future__ import annotations

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

SEND_KEYS = ("enter",)
PAGE_KEYS = {"pageup": False, "pagedown": True}         # the transcript's, not the draft's (chat/input_keys.py)
INTERRUPT_KEY = "ctrl+c"                                # with nothing selected: stop the reply
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")   # ctrl+j works in every terminal


class ChatInput(TextArea):
    """Posts Submitted(text) on Enter; keeps the sent texts for up/down recall."""

    DEFAULT_CSS = """
    ChatInput { height: auto; min-height: 3; max-height: 10; border: round $primary 60%; }
    ChatInput:focus { border: round $primary; }
    """
    BINDINGS = [
        Binding("enter", "send", "send", show=False),
        Binding("ctrl+j", "newline", "newline", show=False),
    ]

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class Interrupt(Message):
        """ctrl+c with nothing selected (it would copy nothing): the screen stops the reply."""

    class Page(Message):
        """PageUp or PageDown while typing: the screen pages the transcript."""
        def __init__(self, down: bool) -> None:
            super().__init__()
            self.down = down

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.sent: list[str] = []
        self._index = 0          # len(history) means "the draft", not a history entry
        self._draft = ""
        self.border_subtitle = "enter send · ctrl+j new line · ↑↓ history"

    async def _on_key(self, event: events.Key) -> None:
        # TextArea inserts a newline on Enter before bindings run, so intercept here.
        if event.key in SEND_KEYS:
            event.stop()
            event.prevent_default()
            self.action_send()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.action_newline()
            return
        if event.key == INTERRUPT_KEY and self.selection.is_empty:
            event.stop()
            event.prevent_default()
            self.post_message(self.Interrupt())
            return
        if event.key in PAGE_KEYS:
            event.stop()
            event.prevent_default()
            self.post_message(self.Page(PAGE_KEYS[event.key]))
            return
        await super()._on_key(event)

    def action_send(self) -> None:
        text = self.text
        if not text.strip():
            return
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._index = len(self.sent)
        self._draft = ""
        self.clear()
        self.post_message(self.Submitted(text))

    def action_newline(self) -> None:
        self.insert("\n")

    def restore(self, text: str) -> None:
        """Put text back (a refused message) for editing."""
        self.load_text(text)
        self.move_cursor(self.document.end)

    def action_cursor_up(self, select: bool = False) -> None:
        if select or self.cursor_location[0] > 0 or not self.sent or self._index == 0:
            super().action_cursor_up(select)
            return
        if self._index == len(self.sent):
            self._draft = self.text
        self._index -= 1
        self.restore(self.sent[self._index])

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.document.line_count - 1
        if select or self.cursor_location[0] < last_row or self._index >= len(self.sent):
            super().action_cursor_down(select)
            return
        self._index += 1
        self.restore(self._draft if self._index == len(self.sent) else self.sent[self._index])
