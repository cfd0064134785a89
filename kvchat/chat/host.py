"""The chat screen as its helpers see it (controls.py, conversations.py, browser.py,
editing.py, generation.py): a Protocol, so they import the screen's interface, not the
screen, which imports them. A helper acts on the conversation in focus, its transcript and
the job queue through this; it never reaches the App."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from textual.message import Message
from textual.screen import Screen
from textual.widgets import ContentSwitcher

from ..backends.protocol import Backend
from ..widgets.chat_input import ChatInput
from ..widgets.conversation_bar import ConversationBar
from .jobs import JobQueue, RunningTurn, Then
from .panels import Panels
from .session import Session
from .view import ChatView

R = TypeVar("R")


class Host(Protocol):
    jobs: JobQueue
    panels: Panels
    keymap: dict[str, str]                      # key id -> the keys bound to it

    @property
    def backend(self) -> Backend: ...           # loaded (the chat keys and commands wait for it)

    @property
    def view(self) -> ChatView: ...             # the conversation in focus (the first, while loading)

    @property
    def session(self) -> Session: ...           # its Session (the chat keys and commands wait for it)

    @property
    def transcripts(self) -> ContentSwitcher: ...   # the open conversations' ChatViews

    @property
    def bar(self) -> ConversationBar: ...

    @property
    def input(self) -> ChatInput: ...

    def key_display(self, key_id: str) -> str: ...   # the first key bound to key_id, as the footer shows it

    def notice(self, text: str, error: bool = False) -> None: ...   # a line in the focused transcript

    def show_settings(self) -> None: ...        # the status line, for the conversation in focus

    def settings_changed(self, note: str) -> None: ...   # a setting of the focused one changed: say so

    def dialog(self, screen: Screen[R], chosen: Callable[[R | None], None] | None) -> None: ...

    def copy(self, what: str) -> None: ...      # the last reply ("reply") or its last code block ("code")

    def send(self, text: str, shown: str | None = None, typed: str | None = None) -> None: ...

    def submit(self, turn: RunningTurn) -> None: ...

    def run_op(self, label: str, run: Callable[[], str | None], then: Then | None = None,
               focus: Callable[[], Session] | None = None, interrupt: bool = True) -> None: ...

    def post_message(self, message: Message) -> bool: ...

    def call_later(self, callback: Callable[..., object], *args: object) -> bool: ...
