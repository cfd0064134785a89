"""SIGINT, SIGTERM, SIGHUP and a terminal that went away, seen without the app's event loop.

The loop can be blocked for good: when the terminal goes away, Textual's writer thread ends on
its first failed write, and the loop then waits in `queue.put` for room that never comes (the
input thread meanwhile spins on the dead terminal). A handler the loop runs
(`loop.add_signal_handler`) then never runs, and a parent that keeps SIGHUP to itself (make
waits for its children) leaves the process no signal at all. So the handlers here are
signal.signal's, which Python runs in the main thread even while it waits on a lock, and they
only write the signal's number to a pipe; a daemon thread reads it and calls the app back. The
same thread watches the terminal: a hung-up terminal polls as POLLHUP or POLLERR, and is taken
for a SIGHUP.
"""
from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType


def terminal_fds() -> list[int]:
    """stdin, stdout and stderr, those that are a terminal."""
    return [fd for fd in (0, 1, 2) if os.isatty(fd)]


class SignalWatch:
    """Handlers for `signals` until close(), the previous ones then back; `on_signal(sig)` is
    called in the watch's thread, once for each signal and once (SIGHUP) when the terminal on
    `fds` hangs up."""

    def __init__(self, signals: Iterable[int], fds: Iterable[int], on_signal: Callable[[int], None]) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._fds = list(fds)
        self._on_signal = on_signal
        threading.Thread(target=self._watch, daemon=True, name="kvchat-signals").start()
        self._previous = {sig: signal.signal(sig, self._handler) for sig in signals}

    def _handler(self, sig: int, frame: FrameType | None) -> None:
        """In the main thread, between two bytecodes of whatever it was doing, which may hold a
        lock that starting a thread takes: one byte written, no lock taken."""
        try:
            os.write(self._write, bytes((sig,)))
        except OSError:         # the pipe full (hundreds of signals): those already there act
            pass

    def close(self) -> None:
        """The previous handlers back; the thread ends (its pipe closed)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        os.close(self._write)

    def _watch(self) -> None:
        poll = select.poll()
        poll.register(self._read, select.POLLIN)
        for fd in self._fds:
            poll.register(fd, 0)        # no events asked: POLLHUP, POLLERR and POLLNVAL come anyway
        try:
            while True:
                for fd, events in poll.poll():
                    if fd == self._read:
                        got = os.read(self._read, 64)
                        if not got:     # close(): the app ended
                            return
                        for sig in got:
                            self._on_signal(sig)
                    elif events & select.POLLNVAL:      # a terminal poll cannot watch (macOS)
                        poll.unregister(fd)
                        self._fds.remove(fd)
                    elif fd in self._fds:               # POLLHUP, POLLERR: the terminal went away
                        for each in self._fds:
                            poll.unregister(each)
                        self._fds = []
                        self._on_signal(signal.SIGHUP)
        finally:
            os.close(self._read)
