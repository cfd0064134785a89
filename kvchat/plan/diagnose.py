"""Where a validation's error comes from: the step-time model, or the scheduler model.

A simulated percentile can miss the measured one for two independent reasons, and each run
of `kvchat plan --validate` says which, per load level:

(a) the step-time model: the measured run's own steps (the engine's StepRecords of that run)
    against what the calibrated model predicts for each step's composition; the ratio
    measured / predicted at its median and p90, for the steps that only decoded and for those
    that held prompt chunks. Beside it the time between two steps while a request was in
    flight: the engine's loop, the lock handed from one user's thread to the next, the events
    delivered, which no step's own time holds and which the model lacks unless its per-step
    overhead took it in.
(b) the scheduler model: the simulated run's steps against the measured ones: how many, how
    many sequences each held (median, p90, mean), the prompt chunks and their tokens, the
    preemptions, and the busy time (the steps' time summed) on each side.
(c) the client's clock: the first token as the client saw it against the engine's own
    prefill end for the same turn (both from the turn's start): the delivery lag a TTFT holds;
    and the share of the client's token gaps under 1 ms: tokens read in bursts, several steps'
    worth at once. kvchat's engine has no thread of its own: whoever waits for a token runs the
    next step for everyone (Engine.drive), and a reader that keeps winning the engine's lock
    leaves the others' tokens queued; the simulator hands every token out at its step's end.

A run whose (a) ratios sit near 1 and whose (b) figures agree has its error elsewhere (the
client side, (c)); a run whose (b) agrees but (a) does not needs another calibration, and the
reverse, another scheduler model.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from .metrics import percentile
from .run_points import step_row


@contextmanager
def every_step(engine) -> Iterator[list]:
    """Keep every StepRecord the engine makes inside the block (its ring keeps only the last
    few hundred) in the list this yields; the ring is put back after."""
    sched = engine.scheduler
    kept, sched.recent = sched.recent, deque()
    got: list = []
    try:
        yield got
    finally:
        got.extend(sched.recent)
        sched.recent = kept


@dataclass(frozen=True, slots=True)
class StepStats:
    """One run's steps, the engine's or the simulator's."""
    steps: int
    decode_only: int          # steps with no prompt chunk
    batch_p50: float | None   # sequences per step
    batch_p90: float | None
    batch_mean: float | None
    chunks: int               # prompt chunks over every step
    prompt_tokens: int
    preemptions: int
    busy_s: float             # the steps' times summed


def _stats(rows: list[tuple[int, int, int, float]], preemptions: int) -> StepStats:
    """rows: (decode rows, prompt chunks, prompt tokens, seconds) per step."""
    batch = [float(d + c) for d, c, _, _ in rows]
    return StepStats(len(rows), sum(1 for _, c, _, _ in rows if not c), percentile(batch, 50), percentile(batch, 90),
                     sum(batch) / len(batch) if batch else None, sum(c for _, c, _, _ in rows),
                     sum(p for _, _, p, _ in rows), preemptions, sum(s for *_, s in rows))


def engine_stats(records) -> StepStats:
    return _stats([(r.decode_rows, r.prefill_chunks, r.prefill_tokens, r.step_ms / 1000) for r in records],
                  sum(r.preemptions for r in records))


def sim_stats(res) -> StepStats:
    return _stats(res.step_log or [], res.preemptions)


@dataclass(frozen=True, slots=True)
class TimeSplit:
    """(a): the measured steps against the model, and the time between busy steps."""
    steps: int
    ratio_p50: float | None        # measured / predicted step time, every step
    ratio_p90: float | None
    decode_p50: float | None       # steps that only decoded
    prompt_p50: float | None       # steps that held a prompt chunk
    gap_p50_ms: float | None       # between two steps while a request was in flight
    gap_p90_ms: float | None
    gap_share: float | None        # that time over the busy wall time (steps + gaps)


def time_split(records, timer, busy: list[tuple[float, float]]) -> TimeSplit:
    """`timer`: the calibrated StepTimer; `busy`: (start, end) on the records' clock of each
    request in flight (a gap between two steps inside one of them is the engine's loop, not
    idle time between turns)."""
    ratios: list[float] = []
    dec: list[float] = []
    pro: list[float] = []
    gaps: list[float] = []
    step_s = 0.0
    for r in records:
        if r.step_ms <= 0 or r.dense_rows:
            continue
        predicted = timer.seconds(*step_row(r)) * 1000
        ratio = r.step_ms / predicted
        ratios.append(ratio)
        (pro if r.prefill_chunks else dec).append(ratio)
    spans = sorted(busy)
    for prev, nxt in zip(records, records[1:]):
        start = nxt.time - nxt.step_ms / 1000
        if start <= prev.time or not _inside(spans, prev.time, start):
            continue
        gaps.append((start - prev.time) * 1000)
        step_s += nxt.step_ms / 1000
    gap_s = sum(gaps) / 1000
    return TimeSplit(len(ratios), percentile(ratios, 50), percentile(ratios, 90), percentile(dec, 50),
                     percentile(pro, 50), percentile(gaps, 50), percentile(gaps, 90),
                     gap_s / (gap_s + step_s) if gaps else None)


def _inside(spans: list[tuple[float, float]], a: float, b: float) -> bool:
    return any(s <= a and b <= e for s, e in spans)


def request_spans(run) -> list[tuple[float, float]]:
    """Each measured request's (arrival, last token) on the engine's clock (perf_counter and
    time.monotonic are both CLOCK_MONOTONIC on Linux)."""
    return [(run.t0 + m.arrival, run.t0 + m.token_times[-1]) for m in run.measured if m.token_times]


BURST_MS = 1.0


def burst_share(run) -> float | None:
    """(c): the share of the client's gaps between two tokens of one request under BURST_MS."""
    gaps = [b - a for m in run.measured for a, b in zip(m.token_times, m.token_times[1:])]
    return sum(1 for g in gaps if g * 1000 < BURST_MS) / len(gaps) if gaps else None


def delivery_lag_ms(run) -> float | None:
    """(c): the client's first token after the engine's own prefill end, median over turns."""
    lags = [(m.token_times[0] - m.arrival) * 1000 - m.prefill_ms for m in run.measured
            if m.token_times and m.prefill_ms]
    return percentile(lags, 50)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    level: str
    time: TimeSplit
    measured: StepStats
    simulated: StepStats
    lag_ms: float | None
    request_ms: float          # the model's request overhead
    speed: float | None = None  # the drift probes' step over the calibration's (drift.py), reported only
    bursts: float | None = None  # share of the client's token gaps under BURST_MS

    def lines(self) -> list[str]:
        t, m, s = self.time, self.measured, self.simulated
        out = [f"{self.level}: where the error comes from"
               + ("" if self.speed is None else f" (the speed probe's step around it: {self.speed:.2f}x the one "
                                                "after the calibration)")]
        out.append(f"  (a) step time: {t.steps} measured steps at {_x(t.ratio_p50)} the model's prediction (p50), "
                   f"{_x(t.ratio_p90)} (p90); decode-only {_x(t.decode_p50)}, with a prompt chunk {_x(t.prompt_p50)}")
        if t.gap_p50_ms is not None:
            out.append(f"      between steps while busy: {t.gap_p50_ms:.1f} ms (p50), {t.gap_p90_ms:.1f} ms (p90), "
                       f"{t.gap_share:.0%} of the busy time")
        out.append(f"  (b) scheduler, measured / simulated: {m.steps} / {s.steps} steps ({m.decode_only} / "
                   f"{s.decode_only} decode-only); sequences per step p50 {_n(m.batch_p50)} / {_n(s.batch_p50)}, "
                   f"p90 {_n(m.batch_p90)} / {_n(s.batch_p90)}, mean {_n(m.batch_mean, 2)} / {_n(s.batch_mean, 2)}")
        out.append(f"      prompt chunks {m.chunks} / {s.chunks} ({m.prompt_tokens:,} / {s.prompt_tokens:,} tokens); "
                   f"preemptions {m.preemptions} / {s.preemptions}; busy {m.busy_s:.1f} s / {s.busy_s:.1f} s")
        if self.lag_ms is not None:
            out.append(f"  (c) client: first token {self.lag_ms:.1f} ms after the engine's prefill end (p50); the "
                       f"model's request overhead {self.request_ms:.1f} ms"
                       + ("" if self.bursts is None else f"; {self.bursts:.0%} of the token gaps under "
                          f"{BURST_MS:g} ms (read in bursts)"))
        return out

    def to_dict(self) -> dict:
        return {"level": self.level, "step_time": asdict(self.time), "measured_steps": asdict(self.measured),
                "simulated_steps": asdict(self.simulated), "delivery_lag_ms": self.lag_ms,
                "request_overhead_ms": self.request_ms, "speed": self.speed, "burst_share": self.bursts}


def diagnose(level: str, run, records, sim, speed: float | None = None) -> Diagnosis:
    """`run`: the measured TraceRun; `records`: the engine's steps during it; `sim`: the
    PlanResult of its replay (run with log_steps); `speed`: the drift probes' factor."""
    timer = sim.model.timer()
    return Diagnosis(level, time_split(records, timer, request_spans(run)), engine_stats(records),
                     sim_stats(sim.result), delivery_lag_ms(run), timer.request * 1000, speed, burst_share(run))


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _n(v: float | None, digits: int = 0) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"
