"""A trace run for real: every user of a trace is a thread that chats with a backend (kvchat's
engine, or a vLLM server) through the Backend protocol, sending each turn after its think
time, and the client's clock times every request the way `vllm bench serve` does.

What comes back is measured per request (arrival, first token, each token, the end, the
prompt and cached tokens the backend reported) and the trace as it really ran: the turns'
true token counts (the chat template's tokens included) and the replies' true lengths, so the
simulator can replay exactly what the backend was given.

Timing. A request arrives when its thread calls `send`; a token exists when the backend has
sampled it. kvchat's engine yields each TokenEvent after the next decode step (the event
carries that step's time), so there the first token is the PrefillEvent and token k + 1 is
TokenEvent k, for the TokenEvents that followed a decode step; a vLLM stream's TokenEvents
are the tokens as they arrive.
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

from .request import RequestRecord, SimResult
from .workload import Trace, Turn, UserTrace

WORDS = ("harbour", "lantern", "copper", "morning", "station", "river", "paper", "window", "garden", "signal",
         "winter", "letter", "market", "bridge", "island", "thunder", "orchard", "compass", "meadow", "violin")


@dataclass(slots=True)
class Measured:
    user: int
    turn: int
    long: bool
    arrival: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output: int = 0
    error: str | None = None
    # the backend's own figures, where it reports them (kvchat's engine does): the time from the
    # turn's start to its prefill's end, and each decode step's time and position
    prefill_ms: float | None = None
    step_ms: tuple[float, ...] = ()
    step_pos: tuple[int, ...] = ()
    stop_reason: str = ""         # the backend's (eos, max_tokens, cap, cancelled); "" before the end

    def record(self) -> RequestRecord | None:
        if self.error or not self.token_times:
            return None
        return RequestRecord(self.user, self.turn, self.long, self.arrival, self.prompt_tokens, self.cached_tokens,
                             len(self.token_times), self.token_times[0] - self.arrival,
                             self.token_times[-1] - self.arrival, 0, 0)


@dataclass(slots=True)
class TraceRun:
    measured: list[Measured]
    replayed: Trace                   # the trace with the true token counts and think times
    wall_s: float
    t0: float = 0.0                   # the clock's origin (perf_counter): arrivals and token times are after it

    def result(self) -> SimResult:
        """The measured run in the simulator's shapes, for metrics.summarize."""
        res = SimResult()
        for m in self.measured:
            rec = m.record()
            if rec is None:
                continue
            res.records.append(rec)
            res.itl.extend((b - a, 1) for a, b in zip(m.token_times, m.token_times[1:]))
        res.end = max((r.arrival + r.e2e for r in res.records), default=0.0)
        return res


def text_of(tokens: int, count, seed: int) -> str:
    """Plain words that encode to about `tokens` tokens (`count`: the backend's counter, or
    None: about 0.75 words a token). Two seeds give texts that differ from their first words, so
    a server's prefix cache finds nothing shared between them (a fixed cycle of the words, as
    before, made every text a shift of one sequence and let a later probe hit an earlier one's
    blocks)."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(max(1, tokens))]
    if count is None:
        return " ".join(words[:max(1, round(tokens * 0.75))])
    lo, hi = 1, len(words)
    while lo < hi:                                   # the most words that stay within `tokens`
        mid = (lo + hi + 1) // 2
        if count(" ".join(words[:mid])) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def _history(segments: tuple[int, ...], count, seed: int) -> list[dict[str, str]]:
    msgs = []
    for i, n in enumerate(segments):
        half = max(1, n // 2)
        msgs += [{"role": "user", "content": text_of(half, count, seed + 2 * i)},
                 {"role": "assistant", "content": text_of(max(1, n - half), count, seed + 2 * i + 1)}]
    return msgs


def run_trace(trace: Trace, backend, timeout_s: float = 3600.0, salt: int = 0) -> TraceRun:
    """Every user in its own thread, all on one clock; returns when all are done (or the
    timeout passed: a user still waiting stops there). `salt`: a different number for each run
    on one backend, so that no run's texts begin with an earlier run's (the same user index
    and turn once drew the same words in every run, and a later level's prompts hit the
    engine's prefix cache of the calibration's and the earlier levels' conversations: 30
    prompt tokens computed where the simulator, starting empty, computed 526)."""
    from kvchat.engine.sampler import SamplingParams
    count = backend.count_tokens if backend.count_tokens("a b") is not None else None
    lagged = backend.info().kind == "local"
    system = text_of(trace.system_tokens, count, 0) if trace.system_tokens else None   # shared: the same each run
    base = 1_000_003 * salt
    out: list[list[Measured]] = [[] for _ in trace.users]
    stop = threading.Event()
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    def user(i: int, u: UserTrace) -> None:
        chat = backend.open(system=system)
        try:
            if u.history:
                chat.restore(([{"role": "system", "content": system}] if system else [])
                             + _history(u.history, count, base + 1000 * i))
            ready = u.start
            for k, turn in enumerate(u.turns):
                wait = ready + turn.think - clock()
                if wait > 0 and stop.wait(wait):
                    return
                m = Measured(u.uid, k, u.long, clock())
                out[i].append(m)
                try:
                    timed_turn(chat, text_of(turn.new, count, base + 7919 * i + k + 500),
                               SamplingParams(max_tokens=turn.reply),
                              m, clock, lagged, stop)
                except Exception as err:    # a refused or failed turn ends this user, and is reported
                    m.error = f"{type(err).__name__}: {err}"
                    return
                ready = m.token_times[-1] if m.token_times else clock()
        finally:
            backend.close(chat)

    threads = [threading.Thread(target=user, args=(i, u), daemon=True) for i, u in enumerate(trace.users)]
    for th in threads:
        th.start()
    deadline = time.perf_counter() + timeout_s
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    stop.set()
    return TraceRun([m for ms in out for m in ms], replayed_trace(trace, out), clock(), t0)


def replayed_trace(trace: Trace, measured: list[list[Measured]]) -> Trace:
    """The trace as it ran: each turn's new tokens from the prompts the backend counted
    (prompt k - prompt k-1 - reply k-1), the replies' true lengths, and the true gaps
    between a reply's end and the next message."""
    users = []
    for u, ms in zip(trace.users, measured):
        done = [m for m in ms if m.error is None and m.token_times]
        if not done:
            continue
        first = done[0].prompt_tokens - trace.system_tokens - sum(u.history)
        history = u.history if first >= 1 else ((done[0].prompt_tokens - trace.system_tokens - 1,)
                                                if done[0].prompt_tokens - trace.system_tokens > 1 else ())
        turns, prev = [], None
        for m in done:
            if prev is None:
                new, think = max(1, first), 0.0
            else:
                new = max(1, m.prompt_tokens - prev.prompt_tokens - prev.output)
                think = max(0.0, m.arrival - prev.token_times[-1])
            turns.append(Turn(new, max(1, m.output), think))
            prev = m
        users.append(UserTrace(u.uid, done[0].arrival, history, tuple(turns), u.long))
    return Trace(trace.system_tokens, tuple(users))


def timed_turn(chat, text: str, sp, m: Measured, clock, lagged: bool, stop: threading.Event) -> None:
    from kvchat.engine.telemetry import PrefillEvent, TokenEvent, TurnStats
    sampled: list[float] = []
    stats = None
    for ev in chat.send(text, sp, stop):
        now = clock()
        if isinstance(ev, PrefillEvent) and lagged:
            sampled.append(now)
        elif isinstance(ev, TokenEvent):
            sampled.append(now)
        elif isinstance(ev, TurnStats):
            stats = ev
    if stats is None:
        raise RuntimeError("the turn ended without its TurnStats")
    m.prompt_tokens, m.cached_tokens = stats.prompt_tokens, stats.reused_tokens or 0
    m.output, m.stop_reason = stats.generated_tokens, stats.stop_reason
    m.prefill_ms, m.step_ms, m.step_pos = stats.prefill_ms, tuple(stats.decode_ms), tuple(stats.positions)
    if lagged:       # token 1 at the PrefillEvent, then the TokenEvents that followed a decode step
        sampled = sampled[:1 + len(stats.decode_ms)]
    m.token_times = sampled[:max(1, m.output)]
