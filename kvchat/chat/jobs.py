"""The job queue: backend work runs in thread workers one job at a time, in order.

Jobs are turns (a RunningTurn) and operations (an Op: reset, cache mode, KV dtype, opening
and closing conversations, a fresh snapshot); the model load runs before any. A turn holds
the backend from its prefill to its last token, so running jobs in order means the UI
thread never waits on it. The queue only orders and counts: its owner (the chat screen)
takes the next job when the queue is free (`next()`), runs it in a worker
(kvchat/chat/worker.py), and says when it is `done()`.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Union

from ..widgets.transcript import Reply, UserMessage
from .session import Session

if TYPE_CHECKING:
    from .view import ChatView

Then = Callable[[], Union[Awaitable[None], None]]     # an op's follow-up on the UI thread


class Busy(str, Enum):
    """What the backend is doing; None when idle. (A str, so `busy == "reply"` reads plainly.)"""
    LOAD = "load"
    REPLY = "reply"
    OP = "op"


@dataclass(slots=True)
class Op:
    label: str                                          # "reset the cache": shown while it runs
    run: Callable[[], str | None]                       # in a worker; returns a note to show
    then: Then | None = None                            # on the UI thread, after run
    focus: Callable[[], Session] | None = None          # whose snapshot to take (default: the focused)


@dataclass(slots=True, eq=False)
class RunningTurn:
    """A turn from the moment it is asked for (it may wait in the job queue) to its end."""
    view: ChatView                      # the conversation it belongs to (its Session once the model loaded)
    text: str | None                    # the message to send; None regenerates the last reply
    shown: str | None = None            # what the transcript shows instead (a /load preview)
    typed: str | None = None            # what goes back into the input if the turn is refused
    user: UserMessage | None = None     # the message's widget, once shown
    reply: Reply | None = None          # the reply's widget, once the turn starts
    cancel: threading.Event = field(default_factory=threading.Event)
    prefilled: bool = False             # the backend accepted the turn (its PrefillEvent came)
    quitting: bool = False              # stopped because the app quits: a message never answered stays
                                        # in the log, so --resume puts it back in the input
    saved: threading.Event = field(default_factory=threading.Event)   # the worker wrote the turn's end
    unsent: list[str] = field(default_factory=list)   # messages typed behind it when the app quit
    ended: bool = False                 # its worker has written its end (and took `unsent`)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def keep_after(self, texts: list[str]) -> bool:
        """Hand the worker messages to log after this turn's end (chat/unsent.py); False once
        that end is written, when the caller must log them itself."""
        with self.lock:
            if self.ended:
                return False
            self.unsent.extend(texts)
            return True

    def end(self) -> list[str]:
        """The worker is done with the log: what it must still write behind the turn."""
        with self.lock:
            self.ended = True
            return list(self.unsent)


Job = Union[RunningTurn, Op]


class JobQueue:
    """`submit` a job; `next()` hands out the first waiting one when none is running, and
    `done()` ends the running one. Starts busy loading: the first `done()` ends the load."""

    def __init__(self) -> None:
        self._waiting: deque[Job] = deque()
        self.busy: Busy | None = Busy.LOAD
        self.current: Job | None = None     # the running job (the last one, once idle)

    def __len__(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return len(self._waiting)

    def __iter__(self) -> Iterator[Job]:
        return iter(self._waiting)

    def submit(self, job: Job) -> None:
        self._waiting.append(job)

    def next(self) -> Job | None:
        """The job to start now, if the backend is free and one waits."""
        if self.busy is not None or not self._waiting:
            return None
        self.current = self._waiting.popleft()
        self.busy = Busy.OP if isinstance(self.current, Op) else Busy.REPLY
        return self.current

    def done(self) -> None:
        self.busy = None

    def clear(self) -> None:
        self._waiting.clear()

    @property
    def replying(self) -> RunningTurn | None:
        """The turn running now, if the backend is replying."""
        turn = self.current
        return turn if self.busy is Busy.REPLY and isinstance(turn, RunningTurn) else None

    def replying_in(self, view: ChatView) -> bool:
        turn = self.replying
        return turn is not None and turn.view is view

    def queued_in(self, view: ChatView) -> bool:
        return any(isinstance(job, RunningTurn) and job.view is view for job in self._waiting)
