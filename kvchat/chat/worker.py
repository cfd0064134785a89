"""What runs in a thread worker: one turn (`run_turn`) or one operation (`run_op`), reporting
back to the UI thread only through messages (kvchat/chat/messages.py).

A turn's snapshots are of the conversation in focus when each is taken (the user may switch
mid-reply): `focus()` names it.
"""
from __future__ import annotations

from collections.abc import Callable

from textual.message import Message

from kvchat.engine.errors import KvchatError
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import CacheSnapshot, TurnStats

from ..backends.protocol import Backend, ReplyLost
from ..store.errors import log_error
from ..store.records import TurnRecord
from .jobs import Op, RunningTurn
from .messages import OpEnded, TurnEnded, TurnProgress
from .relay import Progress, relay
from .session import Session, dropped_by

# The worker waits for the UI to draw each batch before its next decode step: a redraw on
# the UI thread during a step takes the GIL from it and shows up as that step's latency (the
# plot measuring its own cost; scripts/redraw_cost.py measures both ways). The draw then
# costs wall time between steps, at most UI_SHARE of it (relay.Governor), never step time.
DRAW_BETWEEN_STEPS = True
DRAW_WAIT_S = 0.5           # a UI that does not answer never holds the engine up longer

Post = Callable[[Message], object]


def run_turn(turn: RunningTurn, session: Session, backend: Backend, sampling: SamplingParams,
             focus: Callable[[], Session], interval: Callable[[], float], post: Post) -> None:
    """Run the turn, posting TurnProgress batches and then TurnEnded; `turn.saved` is set
    once its end is in the log (a signal's exit waits for it)."""
    try:
        _run_turn(turn, session, backend, sampling, focus, interval, post)
    finally:
        unsent = turn.end()
        if unsent:      # typed behind it when the app quit (chat/unsent.py)
            session.log.keep_unsent(unsent)
        turn.saved.set()


def _run_turn(turn: RunningTurn, session: Session, backend: Backend, sampling: SamplingParams,
              focus: Callable[[], Session], interval: Callable[[], float], post: Post) -> None:
    chat = session.chat
    before = list(chat.state().messages)
    try:
        events = (chat.send(turn.text, sampling, turn.cancel) if turn.text is not None
                  else chat.regenerate(sampling, turn.cancel))
    except Exception as err:
        post(TurnEnded(turn, session, None, None, one_line(err), accepted=False))
        return
    after = list(chat.state().messages)
    base, seen = session.log.history.dropped, dropped_by(before, after) if turn.text is not None else 0
    session.log.sync(after, base + seen)       # drop-oldest's dropped messages stay in the log
    shown = [focus()]

    def snapshot() -> CacheSnapshot:
        shown[0] = focus()
        return backend.snapshot(shown[0].chat)

    def emit(p: Progress) -> None:
        turn.prefilled = turn.prefilled or p.prefill is not None
        msg = TurnProgress(turn, session, p, shown[0])
        post(msg)
        if DRAW_BETWEEN_STEPS:
            msg.drawn.wait(DRAW_WAIT_S)
    stats: TurnStats | None = None
    error = None
    try:
        stats = relay(events, snapshot, emit, interval=interval)
    except ReplyLost as err:        # its line is every command's: here the conversation is kept
        error = f"{one_line(err)}; the conversation so far is kept"
    except Exception as err:
        error = one_line(err)
    record = TurnRecord.from_stats(stats) if stats is not None else None
    if record is not None or turn.prefilled or not turn.quitting:
        dropped = record.dropped_messages if record is not None else seen if turn.prefilled else 0
        session.log.sync(list(chat.state().messages), base + dropped)
    if record is not None:
        session.log.turn(record)
    viewer = focus()
    snap = stats.cache if stats is not None and viewer is session else backend.snapshot(viewer.chat)
    # failing before its first token, the backend restores the messages: as if never sent
    post(TurnEnded(turn, session, stats, record, error, accepted=record is not None or turn.prefilled,
                   snapshot=snap, focus=viewer))


def run_op(op: Op, backend: Backend, focus: Callable[[], Session], post: Post) -> None:
    """Run the op, then post OpEnded with its note (or its error) and a fresh snapshot of
    op.focus() (default: the conversation in focus now)."""
    try:
        note = op.run()
    except Exception as err:
        session = focus()
        post(OpEnded(None, _safe_snapshot(backend, session), session, error=one_line(err)))
        return
    session = op.focus() if op.focus is not None else focus()
    post(OpEnded(note, backend.snapshot(session.chat), session, then=op.then))


def _safe_snapshot(backend: Backend, session: Session) -> CacheSnapshot | None:
    try:
        return backend.snapshot(session.chat)
    except Exception as err:  # the op's own error is what gets shown; this one is logged
        one_line(err)
        return None


def one_line(err: Exception) -> str:
    """KvchatError's message is already one line for the user. Anything else is a bug: its
    traceback goes to errors.log (stderr would tear the screen) and the line says where."""
    if isinstance(err, KvchatError):
        return str(err)
    return f"internal error ({type(err).__name__}: {err}); traceback in {log_error(err)}"
