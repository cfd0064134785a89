"""The job queue: engine work runs in thread workers one job at a time, in order.

Jobs are the model load, turns, and cache operations (reset, cache mode, KV dtype, new and
closed conversations, a fresh snapshot). A mixin of KvChatApp. An operation asked for
during a reply stops the reply first (unless it can wait for it), then runs: a turn holds
engine.lock from prefill to its last token, and running jobs in order means the UI thread
never waits on that lock.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from textual import work

from kvchat.engine.errors import KvchatError
from kvchat.engine.telemetry import CacheSnapshot

from .messages import OpEnded
from .store import data_dir


@dataclass(slots=True)
class Op:
    label: str
    run: Callable[[], str | None]               # in a worker; returns a note to show
    then: Callable[[], Any] | None = None       # on the UI thread, after run
    focus: Callable[[], Any] | None = None      # the session whose snapshot to take (default: focused)


class Jobs:
    # ---- the job queue ------------------------------------------------------------------------
    def submit(self, label: str, start: Callable[[], Any]) -> None:
        self.jobs.append((label, start))
        self._next_job()

    def _next_job(self) -> None:
        if self.busy is not None or not self.jobs:
            return
        self.busy, start = self.jobs.popleft()
        if self.busy != "reply":
            self.status(f"{self.busy}…")
        self.call_later(start)

    def _job_done(self) -> None:
        self.busy = None
        if not self.jobs:
            self.status("quitting" if self.quitting else "ready")
        if self.quitting and not self.jobs:
            self.exit()
            return
        self._next_job()

    def quit_when_idle(self) -> None:
        """Let the reply in progress end (so it is saved), then exit."""
        self.quitting = True
        self.jobs.clear()
        if self.busy in (None, "load"):    # a load cannot be interrupted; the process ends after it
            self.exit()
            return
        self.cancel.set()
        self.status("quitting…")
        self.set_timer(10, lambda: self.exit())   # a stuck job must not keep the app open

    # ---- cache operations ---------------------------------------------------------------------------
    def run_op(self, label: str, run: Callable[[], str | None], then: Callable[[], Any] | None = None,
               focus: Callable[[], Any] | None = None, interrupt: bool = True) -> None:
        """Run an engine operation in a worker, after the current job; stops a reply first
        unless interrupt is False (then it waits for the reply to end)."""
        if self.busy == "reply" and interrupt:
            self.cancel.set()
            self.notice(f"stopping the reply to {label}")
        op = Op(label, run, then, focus)
        self.submit(label, lambda: self._op_worker(op))

    @work(thread=True, group="op", exit_on_error=False)
    def _op_worker(self, op: Op) -> None:
        try:
            note = op.run()
        except Exception as err:
            focus = self.session
            self.post_message(OpEnded(None, self._safe_snapshot(focus), error=one_line(err), focus=focus))
            return
        focus = op.focus() if op.focus is not None else self.session
        self.post_message(OpEnded(note, self.engine.snapshot(focus.conv), then=op.then, focus=focus))

    def _safe_snapshot(self, session) -> CacheSnapshot | None:
        try:
            return self.engine.snapshot(session.conv)
        except Exception as err:  # the op's own error is what gets shown; this one is logged
            one_line(err)
            return None

    async def on_op_ended(self, msg: OpEnded) -> None:
        if self.exiting:
            return
        if msg.then is not None:
            result = msg.then()
            if hasattr(result, "__await__"):
                await result
        if msg.snapshot is not None:
            self.take_snapshot(msg.focus, msg.snapshot)
        self.update_status()
        if msg.error:
            self.notice(msg.error, error=True)
        elif msg.note:
            self.notice(msg.note)
        self._job_done()


def one_line(err: Exception) -> str:
    """KvchatError's message is already one line for the user. Anything else is a bug: its
    traceback goes to errors.log (stderr would tear the screen) and the line says where."""
    if isinstance(err, KvchatError):
        return str(err)
    where = "errors.log"
    try:
        path = data_dir() / "errors.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            traceback.print_exception(err, file=fh)
        where = str(path)
    except OSError as log_err:
        where = f"nowhere: cannot write the log ({log_err.strerror})"
    return f"internal error ({type(err).__name__}: {err}); traceback in {where}"
