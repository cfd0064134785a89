"""Keys the message input hands to the chat screen: PageUp/PageDown and ctrl+c.

The input keeps focus while the user reads back or waits (typing always reaches it), so:
- its page keys, which would only move the cursor through a few lines of draft, page the
  conversation above instead (`ChatInput.Page`);
- ctrl+c with nothing selected, which would copy nothing, stops the reply in progress, as a
  terminal's ctrl+c stops a program, and otherwise says which keys stop and quit
  (`ChatInput.Interrupt`); with a selection it still copies it.
The chat screen has this mixin; the transcript keeps its own page keys when it has focus.
"""
from __future__ import annotations

from ..widgets.chat_input import ChatInput
from .controls import Controls
from .jobs import JobQueue
from .view import ChatView


class InputKeys:
    """Mixed into the chat screen, whose `view` is the conversation on show."""

    @property
    def view(self) -> ChatView:
        raise NotImplementedError

    jobs: JobQueue
    controls: Controls

    def notice(self, text: str, error: bool = False) -> None:
        raise NotImplementedError

    def on_chat_input_page(self, message: ChatInput.Page) -> None:
        message.stop()
        if message.down:
            self.view.scroll_page_down(animate=False)
        else:
            self.view.scroll_page_up(animate=False)

    def on_chat_input_interrupt(self, message: ChatInput.Interrupt) -> None:
        message.stop()
        if self.jobs.replying is not None:
            self.controls.stop()
            self.notice("stopping the reply (escape stops it too; ctrl+q quits)")
        else:
            self.notice("nothing to stop: ctrl+c copies a selection, escape stops a reply, ctrl+q quits")
