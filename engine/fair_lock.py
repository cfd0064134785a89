"""A re-entrant lock handed to its waiters in the order they came: the engine's lock.

Every reader of a request waits the same way, by taking the engine's lock and running the next
step for everyone (Engine.drive). threading.RLock does not queue its waiters: the thread that
releases it and asks again at once (a reader that took its token and wants the next) takes it
back ahead of threads that waited the whole step. With several readers, one ran step after step
while the others' tokens piled up and then arrived in a burst: in `kvchat plan --validate`'s
busier levels 23-57% of the gaps between a user's tokens were under 1 ms. Handed over in order,
each reader waiting when a step ends reads its token before the next step runs.
"""
from __future__ import annotations

import threading
from collections import deque


class FairLock:
    """Re-entrant; `release` hands the lock straight to the longest waiter (it does not become
    free in between, so the releasing thread cannot take it back first)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: deque[tuple[int, threading.Lock]] = deque()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None:
                self._owner, self._depth = me, 1
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiters.append((me, gate))
        try:
            gate.acquire()               # opened by the release that made this thread the owner
        except BaseException:            # interrupted (ctrl+c in the main thread): leave the queue
            with self._mutex:
                try:
                    self._waiters.remove((me, gate))
                except ValueError:       # handed over meanwhile: this thread owns it, so gives it on
                    pass
                else:
                    raise
            self.release()
            raise
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, gate = self._waiters.popleft()
                self._depth = 1
                gate.release()
            else:
                self._owner = None

    def waiting(self) -> int:
        """Threads queued for the lock now."""
        with self._mutex:
            return len(self._waiters)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
