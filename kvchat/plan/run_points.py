"""Calibration points from a trace run on kvchat's batched engine: its own step records.

Each step of the batched engine can hold several sequences, decode rows and prompt chunks
together, so a turn's step times (TurnStats.decode_ms) say little on their own. The engine's
StepRecords say what each step held (decode rows, prompt tokens and chunks, sequences, the
cached tokens read) and how long it took; the run keeps every one of them (the scheduler's
ring holds only the last few hundred) and the steps of one composition, binned, give one
point at their median time, which rides out a busy machine's slow steps better than a mean.

A step's attention pairs are approximated: each decode row attends to its context and itself;
a chunk of n tokens to itself, n(n + 1) / 2, the step's prompt tokens split evenly over its
chunks, and its cached prefix is counted once, not n times (the record does not split the
cached tokens per sequence): an undercount for a chunk after a long history. At the short contexts a validation runs, attention is a small share of a step.

The first tokens measure the per-request overhead (rendering the chat, tokenising: time the
steps do not hold): a turn whose wait for its first token held only steps of its own gives a
point of its prefill's chunks and one request.
"""
from __future__ import annotations

from collections import defaultdict
from statistics import median

from .bench_points import prefill_steps
from .fitter import Point, StepRow

CONTEXT_BIN = 128           # cached tokens read per step, binned this coarsely
PROMPT_BIN = 32


def step_row(r) -> StepRow:
    """One StepRecord as the fitter's step composition."""
    tokens = r.decode_rows + r.prefill_tokens + r.dense_rows
    pairs = float(r.context_tokens + r.decode_rows)
    if r.prefill_chunks:
        n = r.prefill_tokens / r.prefill_chunks
        pairs += r.prefill_chunks * n * (n + 1) / 2
    return (tokens, r.decode_rows + r.prefill_chunks + r.dense_rows, r.sequences, float(r.context_tokens), pairs,
            r.prefill_chunks)


def step_points(records, kv_dtype: str, least: int = 3) -> list[Point]:
    """The steps binned by composition (decode rows, chunks, prompt tokens, cached tokens
    read), a point per bin of at least `least` steps: their mean composition, median time. A
    step with a prompt chunk is a point even alone: a run holds few of them, each of a
    different size, and without them the fit would extrapolate from decode steps to the
    steps that set every TTFT."""
    bins: dict[tuple, list] = defaultdict(list)
    for r in records:
        if r.step_ms <= 0 or r.dense_rows or r.preemptions:
            continue
        bins[(r.decode_rows, r.prefill_chunks, r.prefill_tokens // PROMPT_BIN,
              r.context_tokens // CONTEXT_BIN)].append(r)
    points = []
    for (dec, chunks, _, _), rs in sorted(bins.items()):
        if len(rs) < (1 if chunks else least):
            continue
        rows = [step_row(r) for r in rs]
        mean = tuple(sum(x[i] for x in rows) / len(rows) for i in range(5))
        step: StepRow = (round(mean[0]), round(mean[1]), round(mean[2]), mean[3], mean[4], chunks)
        what = f"{len(rs)} steps: {dec} decode rows" + (f", {chunks} chunks of {round(mean[0]) - dec}" if chunks else "")
        points.append(Point(f"{what}, {mean[3]:,.0f} cached", kv_dtype, (step,), median(r.step_ms for r in rs),
                            weight=len(rs)))
    return points


def first_token_points(run, records, t0: float, kv_dtype: str, chunk: int) -> list[Point]:
    """Turns that waited for their first token alone: every step between the turn's arrival
    and its first token held one sequence (its own). `t0`: the run's clock origin
    (perf_counter), on the same clock as StepRecord.time (both CLOCK_MONOTONIC)."""
    points = []
    for m in run.measured:
        if m.error or not m.token_times:
            continue
        start, first = t0 + m.arrival, t0 + m.token_times[0]
        during = [r for r in records if start <= r.time <= first + 1e-4]
        computed = m.prompt_tokens - m.cached_tokens
        if not during or computed <= 0 or any(r.sequences != 1 for r in during):
            continue
        points.append(Point(f"user {m.user} turn {m.turn}: first token after {computed} computed alone", kv_dtype,
                            prefill_steps(computed, m.cached_tokens, chunk), (first - start) * 1000, requests=1))
    return points


def request_overhead_ms(run, records) -> tuple[float, int] | None:
    """What a first token costs beyond its steps (rendering the chat, tokenising, the event
    handed to the client's thread), measured, not fitted: over the turns that waited alone
    (every step from the turn's arrival to its first token held only its own sequence, the
    first of them starting after the arrival), the TTFT less those steps' own times; the
    median and how many turns gave it. Fitting it beside the steps instead let a few noisy
    prefills set it (112 ms fitted where the turns spent 5-15 ms outside their steps)."""
    out = []
    for m in run.measured:
        if m.error or not m.token_times:
            continue
        start, first = run.t0 + m.arrival, run.t0 + m.token_times[0]
        during = [r for r in records if start < r.time <= first + 1e-4]
        if not during or any(r.sequences != 1 for r in during) or during[0].time - during[0].step_ms / 1000 < start:
            continue
        out.append((first - start) * 1000 - sum(r.step_ms for r in during))
    return (median(out), len(out)) if out else None
