"""PageUp and PageDown scroll the transcript while the message input has focus.

The input keeps focus while the user reads back (typing always reaches it), so its page keys,
which would only move the cursor through a few lines of draft, page the conversation above
instead: the input posts `ChatInput.Page`, and the chat screen, which has this mixin, pages
the transcript on show. The transcript itself keeps its own page keys when it has focus.
"""
from __future__ import annotations

from ..widgets.chat_input import ChatInput
from .view import ChatView


class TranscriptPaging:
    """Mixed into the chat screen, whose `view` is the conversation on show."""

    @property
    def view(self) -> ChatView:
        raise NotImplementedError

    def on_chat_input_page(self, message: ChatInput.Page) -> None:
        message.stop()
        if message.down:
            self.view.scroll_page_down(animate=False)
        else:
            self.view.scroll_page_up(animate=False)
