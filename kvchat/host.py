"""What the app gives the parts that act on it: `Host`, the app as conversations.py and
controls.py see it (a Protocol, so they import the app's interface, not the app)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from textual.binding import Binding
from textual.screen import Screen

from kvchat.engine.telemetry import CacheSnapshot

from .backends.protocol import Backend
from .chat_view import ChatView, RunningTurn
from .jobs import JobQueue
from .settings import Settings
from .theming import ThemeFile


class BrowserPart(Protocol):
    """browser.Browser as controls.py sees it (declared here: browser.py imports this module)."""
    def show(self) -> None: ...


class EditorPart(Protocol):
    """editing.Editor as controls.py sees it."""
    def start(self, number: int | None) -> None: ...
    def cancel(self) -> None: ...


@runtime_checkable
class Host(Protocol):
    backend: Backend | None
    jobs: JobQueue
    turn: RunningTurn | None                    # the running turn (the last one, once idle)
    settings: Settings
    settings_path: Path | None
    themes: dict[str, ThemeFile]
    theme_name: str
    panels_forced: bool
    browser: BrowserPart                        # saved conversations (browser.py)
    editor: EditorPart                          # edit and resend (editing.py)

    @property
    def view(self) -> ChatView | None: ...      # the conversation in focus

    @property
    def views(self) -> list[ChatView]: ...

    # the screen
    def part(self, selector): ...
    def notice(self, text: str, error: bool = False) -> None: ...
    def status(self, state: str) -> None: ...
    def update_status(self) -> None: ...
    def update_gauge(self) -> None: ...
    def show_snapshot(self, snap: CacheSnapshot) -> None: ...
    def apply_theme(self, name: str) -> None: ...
    def keymap(self) -> dict[str, str]: ...
    def get_key_display(self, binding: Binding) -> str: ...
    def push_screen(self, screen: Screen, callback: Callable | None = None): ...
    def call_later(self, callback: Callable, *args, **kwargs) -> bool: ...

    # turns and jobs
    def send(self, text: str, shown: str | None = None, typed: str | None = None) -> None: ...
    def submit(self, turn: RunningTurn) -> None: ...
    def replying(self, view: ChatView) -> bool: ...
    def queued(self, view: ChatView) -> bool: ...
    def run_op(self, label: str, run: Callable[[], str | None],
               then: Callable[[], Awaitable[None] | None] | None = None,
               focus: Callable[[], ChatView] | None = None, interrupt: bool = True) -> None: ...
    def quit_when_idle(self) -> None: ...
