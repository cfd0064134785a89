"""Messages from the worker threads to the UI: the only way workers talk to widgets.

Turn messages go to the turn's ChatView, which draws its own transcript, and bubble up to
the app, which draws the shared panels; the others go to the app."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from textual.message import Message

from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from .backends.protocol import Backend
from .records import TurnRecord

if TYPE_CHECKING:
    from .chat_view import ChatView
    from .turn import Progress, RunningTurn


class BackendReady(Message):
    def __init__(self, backend: Backend, seconds: float) -> None:
        super().__init__()
        self.backend, self.seconds = backend, seconds


class BackendFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class TurnProgress(Message):
    """A batch of the turn's tokens and latency points, and (usually) a cache snapshot of
    `focus`, the conversation in focus when it was taken."""

    def __init__(self, turn: RunningTurn, progress: Progress, focus: ChatView) -> None:
        super().__init__()
        self.turn, self.progress, self.focus = turn, progress, focus


class TurnEnded(Message):
    """The turn is over: stats and its record when it produced a reply, error when it
    failed; accepted is False when nothing of it entered the conversation (a refused turn).
    The snapshot is of `focus`, the conversation in focus when it was taken."""

    def __init__(self, turn: RunningTurn, stats: TurnStats | None, record: TurnRecord | None,
                 error: str | None = None, accepted: bool = True, snapshot: CacheSnapshot | None = None,
                 focus: ChatView | None = None) -> None:
        super().__init__()
        self.turn, self.stats, self.record, self.error, self.accepted = turn, stats, record, error, accepted
        self.snapshot, self.focus = snapshot, focus


class OpEnded(Message):
    """An operation ran between turns: a note to show, a fresh snapshot of `focus`, and an
    optional follow-up to run on the UI thread."""

    def __init__(self, note: str | None, snapshot: CacheSnapshot | None, focus: ChatView | None,
                 error: str | None = None, then: Callable[[], Awaitable[None] | None] | None = None) -> None:
        super().__init__()
        self.note, self.snapshot, self.focus, self.error, self.then = note, snapshot, focus, error, then
