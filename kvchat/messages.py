"""Messages from the worker threads to the UI: the only way workers talk to widgets."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.message import Message

from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from .turn import Progress


class EngineReady(Message):
    def __init__(self, engine: Any, seconds: float) -> None:
        super().__init__()
        self.engine, self.seconds = engine, seconds


class EngineFailed(Message):
    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error


class TurnProgress(Message):
    """A batch of tokens and latency points of the turn's session, and (usually) a cache
    snapshot taken for `focus`, the session in focus when it was taken."""

    def __init__(self, progress: Progress, focus: Any = None) -> None:
        super().__init__()
        self.progress, self.focus = progress, focus


class TurnEnded(Message):
    """The turn is over: stats when it produced a reply, error when it failed; accepted is
    False when nothing of it entered the conversation (a refused turn). The snapshot is of
    `focus`, the session in focus when it was taken."""

    def __init__(self, stats: TurnStats | None, error: str | None = None, accepted: bool = True,
                 snapshot: CacheSnapshot | None = None, focus: Any = None) -> None:
        super().__init__()
        self.stats, self.error, self.accepted, self.snapshot = stats, error, accepted, snapshot
        self.focus = focus


class OpEnded(Message):
    """A cache operation ran between turns: a note to show, a fresh snapshot, and an
    optional follow-up to run on the UI thread."""

    def __init__(self, note: str | None, snapshot: CacheSnapshot | None, error: str | None = None,
                 then: Callable[[], Any] | None = None, focus: Any = None) -> None:
        super().__init__()
        self.note, self.snapshot, self.error, self.then = note, snapshot, error, then
        self.focus = focus                      # the session the snapshot is of
