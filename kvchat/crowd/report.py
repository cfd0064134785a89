"""A headless crowd run: the crowd for a while over one backend, the engine's steps collected
as they pass, and the run summed up (aggregate tokens/s, TTFT percentiles, ms/token, the
step's bytes, preemptions) for the table, the JSON file and the plot.

Aggregate tokens/s is every reply token the users received during the run over its wall
time (think times included, as a server's throughput is counted); TTFT is each turn's, on
the client's clock. The per-step totals are the engine's own StepRecords (a server shows no
steps: they are left empty and the summary says so).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvchat.engine.telemetry import StepRecord, to_dict

from .driver import Crowd, CrowdConfig, CrowdTurn


@dataclass(slots=True)
class CrowdRun:
    config: CrowdConfig
    wall_s: float
    turns: list[CrowdTurn]
    steps: list[StepRecord] = field(default_factory=list)
    preemptions: int | None = None          # during the run (None: the backend cannot tell)
    recomputed_tokens: int | None = None
    stopped_in_time: bool = True

    def summary(self) -> dict[str, Any]:
        done = [t for t in self.turns if t.error is None]
        ttft = sorted(t.ttft_ms for t in done if t.ttft_ms is not None)
        mpt = sorted(t.ms_per_token for t in done if t.ms_per_token is not None)
        tokens = sum(t.generated_tokens for t in done)
        out: dict[str, Any] = {
            "users": self.config.users, "long": self.config.long, "seconds": round(self.wall_s, 2),
            "turns": len(done), "refused": len(self.turns) - len(done), "reply_tokens": tokens,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s > 0 else 0.0,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p90_ms": percentile(ttft, 90),
            "ttft_p99_ms": percentile(ttft, 99), "ms_per_token_p50": percentile(mpt, 50),
            "preemptions": self.preemptions, "recomputed_tokens": self.recomputed_tokens,
            "max_context_tokens": max((t.context_tokens for t in done), default=0)}
        if self.steps:
            out.update(steps=len(self.steps), step_ms_mean=round(sum(s.step_ms for s in self.steps) / len(self.steps), 3),
                       max_sequences=max(s.sequences for s in self.steps),
                       max_step_context_tokens=max(s.context_tokens for s in self.steps),
                       caches_passed_weights=any(s.cache_bytes > s.weight_bytes for s in self.steps))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "turns": [t.to_dict() for t in self.turns],
                "steps": [to_dict(s) for s in self.steps]}


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile of sorted values (None for none)."""
    if not values:
        return None
    k = max(0, min(len(values) - 1, round(q / 100 * len(values) + 0.5) - 1))
    return round(values[k], 3)


class StepLog:
    """Collects the engine's steps while a crowd runs: the scheduler keeps only the last few
    hundred, so a thread reads them every `every_s` and keeps the new ones."""

    def __init__(self, backend, every_s: float = 0.2) -> None:
        self.backend, self.every_s = backend, every_s
        self.steps: list[StepRecord] = []
        first = backend.scheduler()
        self.first = first
        self._last = first.steps - 1 if first is not None else -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crowd-steps", daemon=True)

    def start(self) -> None:
        if self.first is not None:
            self._thread.start()

    def _take(self) -> None:
        snap = self.backend.scheduler()
        if snap is None:
            return
        new = [s for s in snap.recent if s.index > self._last]
        if new:
            self.steps += new
            self._last = new[-1].index

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._take()

    def finish(self):
        """Stop and take the last steps; returns the scheduler's snapshot at the end (or None)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._take()
        return self.backend.scheduler()


def run_crowd(backend, config: CrowdConfig, seconds: float, on_turn=None) -> CrowdRun:
    """The crowd for `seconds` over the backend, then stopped (a turn cut by the stop is not
    counted). `on_turn(turn)` is called for each turn as it ends (the progress line)."""
    log = StepLog(backend)
    served0 = _server_preemptions(backend) if log.first is None else None
    crowd = Crowd(backend, config)
    log.start()
    t0 = time.perf_counter()
    crowd.start()
    seen = 0
    deadline = t0 + seconds
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(min(0.2, left))
        if on_turn is not None:
            turns = crowd.turns()
            for t in turns[seen:]:
                on_turn(t)
            seen = len(turns)
    stopped = crowd.stop(wait_s=5.0)
    wall = time.perf_counter() - t0
    end = log.finish()
    first = log.first
    run = CrowdRun(config, wall, crowd.turns(), log.steps, stopped_in_time=stopped)
    if first is not None and end is not None:
        run.preemptions = end.preemptions - first.preemptions
        run.recomputed_tokens = end.recomputed_tokens - first.recomputed_tokens
    elif served0 is not None and (served1 := _server_preemptions(backend)) is not None:
        run.preemptions = served1 - served0          # the server's counter: every client's, not only ours
    return run


def _server_preemptions(backend) -> int | None:
    """A server's preemption counter from its /metrics (None where it exports none)."""
    stats = getattr(backend.snapshot(), "server", None)
    return stats.preemptions if stats is not None else None


def table(runs: list[CrowdRun]) -> str:
    """The runs side by side: one row per number of users."""
    head = ("users", "turns", "tok/s", "TTFT p50", "p90", "p99", "ms/tok p50", "preempt", "recomputed", "max ctx")
    rows: list[tuple[str, ...]] = [head]
    for r in runs:
        s = r.summary()
        rows.append((f"{s['users']}{' (long)' if s['long'] else ''}", str(s["turns"]), f"{s['tokens_per_s']:.1f}",
                     *(_ms(s[k]) for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "ms_per_token_p50")),
                     _n(s["preemptions"]), _n(s["recomputed_tokens"]), f"{s['max_context_tokens']:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _n(v: int | None) -> str:
    return "n/a" if v is None else f"{v:,}"
