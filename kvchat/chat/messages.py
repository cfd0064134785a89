"""What the workers tell the UI thread: every message a thread worker posts, in one place,
and the one the chat screen sends up to the App.

The model's load (the App's worker) ends in BackendReady or BackendFailed. A turn's worker
posts TurnProgress batches, then TurnEnded; an operation's worker posts OpEnded; a
conversation's log posts LogFailed from whichever thread failed to write it. The chat
screen handles the turn and op messages: it updates the turn's Session, has the
conversation's ChatView draw the text, then draws the panels. A command that is the App's
(/help, /theme, /quit) goes up to it as an AppCommand.
"""
from __future__ import annotations

import threading

from textual.message import Message

from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from ..backends.protocol import Backend
from ..commands import Command
from ..store.records import TurnRecord
from .jobs import RunningTurn, Then
from .relay import Progress
from .session import Session


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

    def __init__(self, turn: RunningTurn, session: Session, progress: Progress, focus: Session) -> None:
        super().__init__()
        self.turn, self.session, self.progress, self.focus = turn, session, progress, focus
        self.drawn = threading.Event()    # set once the screen has drawn it (the worker may wait on it)


class TurnEnded(Message):
    """Stats and its record when the turn produced a reply, error when it failed; accepted is
    False when nothing of it entered the conversation (a refused turn). The snapshot is of
    `focus`, the conversation in focus when it was taken."""

    def __init__(self, turn: RunningTurn, session: Session, stats: TurnStats | None, record: TurnRecord | None,
                 error: str | None = None, accepted: bool = True, snapshot: CacheSnapshot | None = None,
                 focus: Session | None = None) -> None:
        super().__init__()
        self.turn, self.session, self.stats, self.record = turn, session, stats, record
        self.error, self.accepted, self.snapshot, self.focus = error, accepted, snapshot, focus


class OpEnded(Message):
    """A note to show (or the op's error), a fresh snapshot of `focus`, and the op's
    follow-up to run on the UI thread."""

    def __init__(self, note: str | None, snapshot: CacheSnapshot | None, focus: Session | None,
                 error: str | None = None, then: Then | None = None) -> None:
        super().__init__()
        self.note, self.snapshot, self.focus, self.error, self.then = note, snapshot, focus, error, then


class LogFailed(Message):
    """A conversation's log could not be written (one line)."""

    def __init__(self, session: Session, line: str) -> None:
        super().__init__()
        self.session, self.line = session, line


class AppCommand(Message):
    """A slash command for the App (its help, themes and quitting), typed in the chat."""

    def __init__(self, command: Command) -> None:
        super().__init__()
        self.command = command
