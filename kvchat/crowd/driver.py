"""The crowd: N simulated users, each a thread chatting with the backend through the Backend
protocol beside the user's own conversation, so every one of them shares the scheduler's
steps and the KV pool with it.

Each user opens its own conversation (drop-oldest, so a history that outgrows the model's
context loses its oldest turns instead of being refused), waits a think time, sends the
next question of the prompt set (kvchat/crowd/prompts.py), reads the reply, and goes on
until the crowd is stopped; its history grows turn by turn. With `long`, user 0 is the long
user: it pastes a report of `long_words` words and adds another part every turn, so its
share of the pool grows until the others are preempted around it.

The turns are timed on the client's clock by plan/trace_runner.timed_turn, the one
measurement the trace runner of `kvchat plan` uses too. Their records (CrowdTurn) stay in
memory: the app's crowd panel reads them and `kvchat crowd --json` writes them. A crowd
user is never saved as one of the user's conversations (nothing goes to the store).

Stopping sets one event: a user thinking wakes and leaves, a user mid-turn has its turn
cancelled at the next step (the event is the turn's cancel), and each closes its
conversation on the way out, so its full blocks stay cached and the rest are freed.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvchat.engine.errors import KvchatError
from kvchat.plan.trace_runner import Measured, timed_turn

from .prompts import LONG_ASK, LONG_FOLLOW, long_text, question

MAX_USERS = 64
USER_STATES = ("joining", "thinking", "sending", "left", "failed")


@dataclass(slots=True)
class CrowdConfig:
    users: int
    long: bool = False            # user 0 loads a long text and adds to it every turn
    think_s: float = 2.0          # mean think time between a reply and the next message
    reply_tokens: int = 48        # most tokens per reply
    long_words: int = 1500        # the long user's first text; each later turn adds a quarter of it
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.users, int) or not 1 <= self.users <= MAX_USERS:
            raise KvchatError(f"a crowd has 1 to {MAX_USERS} users, got {self.users!r}")
        if not math.isfinite(self.think_s) or not 0 <= self.think_s <= 3600:
            raise KvchatError(f"the think time must be 0 to 3600 seconds, got {self.think_s!r}")
        if not isinstance(self.reply_tokens, int) or self.reply_tokens < 1:
            raise KvchatError(f"reply tokens must be a positive number, got {self.reply_tokens!r}")
        if not isinstance(self.long_words, int) or self.long_words < 1:
            raise KvchatError(f"the long text must be a positive number of words, got {self.long_words!r}")


@dataclass(frozen=True, slots=True)
class CrowdTurn:
    """One turn of one simulated user, timed on the client's clock (seconds since the crowd
    started); what `kvchat crowd --json` writes per user."""
    user: int
    turn: int
    long: bool
    conversation: int | None      # the backend's id for the user's conversation (the block map's owner)
    start_s: float
    end_s: float
    prompt_tokens: int
    reused_tokens: int
    generated_tokens: int
    ttft_ms: float | None         # the request's arrival to its first token
    ms_per_token: float | None    # mean gap between its tokens after the first
    error: str | None = None      # a refused turn (the pool full, say): the user goes on after it

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class CrowdUser:
    """One simulated user as the panel lists it (written by its thread, read by the UI)."""
    index: int
    long: bool
    conversation: int | None = None
    state: str = "joining"            # one of USER_STATES
    turns: int = 0
    errors: int = 0
    last: CrowdTurn | None = None

    @property
    def name(self) -> str:
        return f"user {self.index + 1}" + (" (long)" if self.long else "")


def message(user: int, turn: int, long: bool, long_words: int, seed: int = 0) -> str:
    """What the user sends on this turn."""
    if not long:
        return question(user, turn, seed)
    if turn == 0:
        return LONG_ASK + long_text(long_words)
    return LONG_FOLLOW[0] + long_text(max(1, long_words // 4), turn) + "\n\n" + LONG_FOLLOW[1]


class Crowd:
    """The simulated users over one backend. `start()` once, `stop()` once; `turns()` and
    `users` may be read from any thread while it runs."""

    def __init__(self, backend, config: CrowdConfig) -> None:
        self.backend = backend
        self.config = config
        self.users = [CrowdUser(i, config.long and i == 0) for i in range(config.users)]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._turns: list[CrowdTurn] = []
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0
        self.lagged = backend.info().kind == "local"   # the engine yields token k + 1 as TokenEvent k

    # ---- control -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            raise KvchatError("this crowd has already started")
        self._t0 = time.perf_counter()
        for u in self.users:
            th = threading.Thread(target=self._run, args=(u,), name=f"crowd-{u.index + 1}", daemon=True)
            self._threads.append(th)
            th.start()

    def stop(self, wait_s: float = 1.0) -> bool:
        """Stop every user; True when all of them left within `wait_s` (a thread still inside
        a step leaves at its end: the threads are daemons, so none holds up the exit)."""
        self._stop.set()
        deadline = time.perf_counter() + wait_s
        for th in self._threads:
            th.join(max(0.0, deadline - time.perf_counter()))
        return not any(th.is_alive() for th in self._threads)

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stop.is_set()

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    def turns(self) -> list[CrowdTurn]:
        with self._lock:
            return list(self._turns)

    def owners(self) -> dict[int, CrowdUser]:
        """The users by their conversation's id (the scheduler's and the block map's name)."""
        return {u.conversation: u for u in self.users if u.conversation is not None}

    # ---- one user ----------------------------------------------------------------------------------
    def _run(self, u: CrowdUser) -> None:
        from kvchat.engine.sampler import SamplingParams
        cfg = self.config
        rng = random.Random(cfg.seed * 1000 + u.index)
        try:
            chat = self.backend.open(policy="drop-oldest")
        except KvchatError:
            u.state = "failed"
            return
        u.conversation = chat.state().conversation
        sp = SamplingParams(max_tokens=cfg.reply_tokens)
        try:
            wait = rng.uniform(0.0, cfg.think_s)          # arrivals spread over one think time
            while True:
                u.state = "thinking"
                if self._stop.wait(wait):
                    return
                u.state = "sending"
                if not self._turn(u, chat, sp):
                    return
                wait = cfg.think_s * rng.uniform(0.5, 1.5)
        finally:
            u.state = "left" if u.state != "failed" else "failed"
            try:
                self.backend.close(chat)
            except KvchatError:
                pass      # the backend is going away (the app quitting): nothing left to free

    def _turn(self, u: CrowdUser, chat, sp) -> bool:
        """One turn; False when the user should leave (stopped, or a failure it cannot go on from)."""
        m = Measured(u.index, u.turns, u.long, self.clock())
        error = None
        try:
            text = message(u.index, u.turns, u.long, self.config.long_words, self.config.seed)
            timed_turn(chat, text, sp, m, self.clock, self.lagged, self._stop)
        except KvchatError as err:      # refused (the pool full, a cap): recorded, and the user goes on
            error = str(err)
        except Exception as err:        # the backend failed: recorded, and this user leaves
            error = f"{type(err).__name__}: {err}"
            u.state = "failed"
        cut = m.stop_reason == "cancelled" and m.output < sp.max_tokens
        if self._stop.is_set() and (error is not None or not m.token_times or cut):
            return False                # cut by the stop, before or mid-reply: not a turn of the run
        gaps = [b - a for a, b in zip(m.token_times, m.token_times[1:])]
        rec = CrowdTurn(
            user=u.index, turn=u.turns, long=u.long, conversation=u.conversation, start_s=round(m.arrival, 4),
            end_s=round(self.clock(), 4), prompt_tokens=m.prompt_tokens, reused_tokens=m.cached_tokens,
            generated_tokens=m.output,
            ttft_ms=round(1000 * (m.token_times[0] - m.arrival), 3) if m.token_times else None,
            ms_per_token=round(1000 * sum(gaps) / len(gaps), 3) if gaps else None, error=error)
        with self._lock:
            self._turns.append(rec)
        u.last, u.turns = rec, u.turns + 1
        u.errors += error is not None
        return u.state != "failed" and not self._stop.is_set()
