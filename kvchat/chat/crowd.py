"""/crowd N [long], /crowd off and the crowd key: simulated users (kvchat/crowd/driver.py) in
the same pool as the user's conversations, and the crowd panel fed while they run.

The crowd's threads go straight to the backend, beside the app's job queue: the user's own
turns still run one at a time through it, and Escape, ctrl+r, the cap and the policies act
on the user's conversation only. A poller thread reads the scheduler and the cache twice a
second (both take the engine's lock, which a step holds, so never on the UI thread) and
posts the figures to the panel. The crowd's turns stay in memory (`Crowd.turns()`); they
are never saved as the user's conversations. Quitting stops the crowd without waiting (the
app stays responsive): its threads are cancelled at their next step, and the process waits for
them after the app ends (`join`): a thread waiting for its step waits while the engine's
compute thread runs it in torch or the C kernels' OpenMP, and a step still running while the
interpreter shuts down can abort the process.
"""
from __future__ import annotations

import threading
import time

from kvchat.engine.errors import KvchatError

from ..crowd.driver import Crowd, CrowdConfig
from ..crowd.figures import Meter
from ..widgets.panel_switcher import PanelSwitcher
from .host import Host
from .session import Session

DEFAULT_USERS = 4
POLL_S = 0.5


def long_words(pool_tokens: int | None, max_position: int | None) -> int:
    """The long user's first text: a third of the pool (it grows by a quarter of that each
    turn, so it holds about two thirds after a few turns), within the model's context."""
    tokens = min(pool_tokens or 4096, (max_position or 8192) * 3 // 4) // 3
    return max(200, int(tokens / 1.3))


class CrowdControl:
    def __init__(self, host: Host) -> None:
        self.host = host
        self.crowd: Crowd | None = None
        self._poll_stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._ended: list[Crowd] = []      # stopped crowds whose threads may still be in a step

    @property
    def running(self) -> bool:
        return self.crowd is not None and self.crowd.running

    def toggle(self) -> None:
        """The key: a crowd of DEFAULT_USERS, or off."""
        if self.running:
            self.command("off")
        else:
            self.command((DEFAULT_USERS, False))

    def command(self, arg: str | tuple[int, bool]) -> None:
        if arg == "off":
            if not self.running:
                self.host.notice("no crowd is running; /crowd N adds N simulated users")
                return
            self.stop()
            self.host.notice("the crowd left: their conversations are closed, their full blocks stay cached")
            return
        if isinstance(arg, str):
            raise KvchatError(f"/crowd takes N [long] or off, got {arg!r}")
        users, long = arg
        backend = self.host.backend
        self.stop()
        snap = self.host.session.snapshot
        pool = snap.num_blocks * snap.block_size if snap is not None else None
        cfg = CrowdConfig(users=users, long=long, long_words=long_words(pool, backend.info().max_position))
        self.crowd = Crowd(backend, cfg)
        self.crowd.start()
        self._poll_stop = threading.Event()
        self.host.panels.switcher.offer("crowd", True)
        self._poller = threading.Thread(target=self._poll, args=(self.crowd, self._poll_stop),
                                        name="crowd-poll", daemon=True)
        self._poller.start()
        what = f" (user 1 pastes a report of about {cfg.long_words:,} words and adds to it)" if long else ""
        queue = "" if backend.capabilities.concurrent_turns else " (this backend takes one turn at a time: they queue)"
        self.host.notice(f"{users} simulated users joined this pool{what}{queue}; /crowd off ends them")

    def stop(self) -> None:
        """End the crowd without waiting for a step to finish (the app stays responsive)."""
        if self._end() is not None:
            try:
                self.host.panels.switcher.offer("crowd", False)
            except LookupError:      # the screen is being torn down (quitting)
                pass

    def _end(self) -> Crowd | None:
        """Tell the crowd and the poller to stop; the crowd ended, if one ran."""
        crowd, self.crowd = self.crowd, None
        self._poll_stop.set()
        if crowd is not None:
            crowd.stop(wait_s=0.0)
            self._ended.append(crowd)
        return crowd

    def join(self, wait_s: float) -> bool:
        """After the app ended: stop any crowd and wait up to `wait_s` for its users and the
        poller to leave the engine; True when all of them did."""
        self._end()
        deadline = time.perf_counter() + wait_s

        def left() -> float:
            return max(0.0, deadline - time.perf_counter())

        if self._poller is not None:
            self._poller.join(left())
        done = all(c.stop(wait_s=left()) for c in self._ended)
        return done and (self._poller is None or not self._poller.is_alive())

    def _poll(self, crowd: Crowd, stop: threading.Event) -> None:
        """Twice a second: the scheduler, the cache with the focused conversation's blocks
        marked, and the figures, posted to the panels' column."""
        meter, switcher = Meter(), self.host.panels.switcher
        backend = self.host.backend
        while not stop.wait(POLL_S):
            try:
                session: Session | None = self.host.session
            except RuntimeError:        # no conversation open (cannot happen once loaded; kept safe)
                session = None
            chat = session.chat if session is not None else None
            cache = backend.snapshot(chat)
            own = session.state.conversation if session is not None else None
            last = session.turns[-1] if session is not None and session.turns else None
            figures = meter.figures(crowd.users, backend.scheduler(), cache, own, turns=crowd.turns(),
                                    clock=crowd.clock(), own_turn=last)
            if stop.is_set():
                return
            switcher.post_message(PanelSwitcher.CrowdUpdate(figures, cache))
