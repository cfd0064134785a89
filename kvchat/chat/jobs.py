"""The job queue: backend work runs in thread workers one job at a time, in order.

Jobs are turns (a RunningTurn, chat_view.py) and operations (an Op: reset, cache mode, KV
dtype, opening and closing conversations, a fresh snapshot); the model load runs before
any. A turn holds the backend from its prefill to its last token, so running jobs in order
means the UI thread never waits on it. The queue only orders and counts: whoever owns it
(the app) starts each job, in a worker running `run_turn` or `run_op`, and says when it
is done.
"""
from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Union

from textual.message import Message

from kvchat.engine.errors import KvchatError
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import CacheSnapshot

from ..backends.protocol import Backend
from .view import ChatView, RunningTurn, TurnEnded, TurnProgress
from ..store.records import TurnRecord
from ..store.log import append_error_log
from ..text import shown
from .relay import Progress, relay


# The worker waits for the UI to draw each batch before its next decode step: a redraw on
# the UI thread during a step takes the GIL from it and shows up as that step's latency (the
# plot measuring its own cost; scripts/redraw_cost.py measures both ways). The draw then
# costs wall time between steps, at most UI_SHARE of it (turn.Governor), never step time.
DRAW_BETWEEN_STEPS = True
DRAW_WAIT_S = 0.5           # a UI that does not answer never holds the engine up longer


class Busy(str, Enum):
    """What the backend is doing; None when idle. (A str, so `busy == "reply"` reads plainly.)"""
    LOAD = "load"
    REPLY = "reply"
    OP = "op"


@dataclass(slots=True)
class Op:
    label: str                                          # "reset the cache": shown while it runs
    run: Callable[[], str | None]                       # in a worker; returns a note to show
    then: Callable[[], Awaitable[None] | None] | None = None   # on the UI thread, after run
    focus: Callable[[], ChatView] | None = None         # whose snapshot to take (default: the focused)


Job = Union[RunningTurn, Op]


class OpEnded(Message):
    """From an op's worker: a note to show, a fresh snapshot of `focus`, and an optional
    follow-up to run on the UI thread."""

    def __init__(self, note: str | None, snapshot: CacheSnapshot | None, focus: ChatView | None,
                 error: str | None = None, then: Callable[[], Awaitable[None] | None] | None = None) -> None:
        super().__init__()
        self.note, self.snapshot, self.focus, self.error, self.then = note, snapshot, focus, error, then


class JobQueue:
    """`submit` a job; `start(job)` is called for each in order, when the one before is
    `done()`. Starts busy loading: the first `done()` ends the load."""

    def __init__(self, start: Callable[[Job], None]) -> None:
        self._start = start
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
        self._next()

    def done(self) -> None:
        self.busy = None
        self._next()

    def clear(self) -> None:
        self._waiting.clear()

    def _next(self) -> None:
        if self.busy is not None or not self._waiting:
            return
        self.current = self._waiting.popleft()
        self.busy = Busy.OP if isinstance(self.current, Op) else Busy.REPLY
        self._start(self.current)


def run_turn(turn: RunningTurn, backend: Backend, sampling: SamplingParams,
             focus: Callable[[], ChatView], interval: Callable[[], float]) -> None:
    """In a worker thread: run the turn, posting TurnProgress batches and then TurnEnded to
    the turn's ChatView. Snapshots are of the conversation in focus when each is taken (the
    user may switch mid-reply): `focus()` names it."""
    view = turn.view
    chat = view.chat
    try:
        events = (chat.send(turn.text, sampling, turn.cancel) if turn.text is not None
                  else chat.regenerate(sampling, turn.cancel))
    except Exception as err:
        view.post_message(TurnEnded(turn, None, None, one_line(err), accepted=False))
        return
    view.conversation_log.sync(list(chat.state().messages))
    shown = [focus()]

    def snapshot() -> CacheSnapshot:
        shown[0] = focus()
        return backend.snapshot(shown[0].chat)

    def emit(p: Progress) -> None:
        turn.prefilled = turn.prefilled or p.prefill is not None
        msg = TurnProgress(turn, p, shown[0])
        view.post_message(msg)
        if DRAW_BETWEEN_STEPS:
            msg.drawn.wait(DRAW_WAIT_S)
    stats, error = None, None
    try:
        stats = relay(events, snapshot, emit, interval=interval)
    except Exception as err:
        error = one_line(err)
    view.conversation_log.sync(list(chat.state().messages))
    record = TurnRecord.from_stats(stats) if stats is not None else None
    if record is not None:
        view.conversation_log.turn(record)
    viewer = focus()
    snap = stats.cache if stats is not None and viewer is view else backend.snapshot(viewer.chat)
    # failing before its first token, the backend restores the messages: as if never sent
    view.post_message(TurnEnded(turn, stats, record, error, accepted=record is not None or turn.prefilled,
                                snapshot=snap, focus=viewer))


def run_op(op: Op, backend: Backend, focus: Callable[[], ChatView], post: Callable[[OpEnded], object]) -> None:
    """In a worker thread: run the op, then post OpEnded with its note (or its error) and a
    fresh snapshot of op.focus() (default: the conversation in focus now)."""
    try:
        note = op.run()
    except Exception as err:
        view = focus()
        post(OpEnded(None, _safe_snapshot(backend, view), view, error=one_line(err)))
        return
    view = op.focus() if op.focus is not None else focus()
    post(OpEnded(note, backend.snapshot(view.chat), view, then=op.then))


def _safe_snapshot(backend: Backend, view: ChatView) -> CacheSnapshot | None:
    try:
        return backend.snapshot(view.chat)
    except Exception as err:  # the op's own error is what gets shown; this one is logged
        one_line(err)
        return None


def one_line(err: Exception) -> str:
    """KvchatError's message is already one line for the user. Anything else is a bug: its
    traceback goes to errors.log (stderr would tear the screen) and the line says where."""
    if isinstance(err, KvchatError):
        return str(err)
    where = append_error_log(shown("".join(traceback.format_exception(err))))
    return f"internal error ({type(err).__name__}: {err}); traceback in {where}"
