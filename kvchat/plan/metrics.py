"""The figures `vllm bench serve` reports, from a simulation's (or a measured run's) records:
TTFT, TPOT, ITL and end-to-end latency as mean, p50, p90 and p99; request and token
throughput; goodput under a service-level objective; and the pool's own story (preemptions,
recomputed tokens, prefix-cache hits, occupancy over time).

The definitions follow vllm bench serve: TTFT from a request's arrival to its first token;
TPOT = (end-to-end - TTFT) / (output tokens - 1), for requests of more than one token; ITL
every gap between two tokens of one request, pooled over all requests; goodput the requests
per second that meet every objective given. Percentiles interpolate linearly between ranks
(numpy's default); the ITL, held as (gap, count) pairs, takes the first gap whose cumulative
count reaches the rank.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..cli.args import UsageError
from .request import RequestRecord, SimResult

PERCENTILES = (50, 90, 99)
SLO_KEYS = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}


def percentile(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def weighted_percentile(pairs: list[tuple[float, int]], p: float) -> float | None:
    total = sum(w for _, w in pairs)
    if not total:
        return None
    rank = max(1.0, p / 100 * total)
    acc = 0
    for v, w in sorted(pairs):
        acc += w
        if acc >= rank:
            return v
    return max(v for v, _ in pairs)


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=2s,tpot=100ms` (or vLLM's `ttft:2000 tpot:100`, in ms) -> seconds per metric."""
    accepted = "e.g. --slo ttft=2s,tpot=100ms; metrics ttft, tpot, e2el; values in ms (the default) or s"
    out: dict[str, float] = {}
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise UsageError(f"--slo {text!r} is empty; {accepted}")
    for part in parts:
        m = re.fullmatch(r"([a-z0-9]+)\s*[=:]\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(ms|s)?", part.lower())
        if m is None:
            raise UsageError(f"--slo {part!r}: expected METRIC=VALUE; {accepted}")
        key = SLO_KEYS.get(m.group(1))
        if key is None:
            raise UsageError(f"--slo: unknown metric {m.group(1)!r}; {accepted}")
        value = float(m.group(2)) * (1.0 if m.group(3) == "s" else 1e-3)
        if not math.isfinite(value) or value <= 0:
            raise UsageError(f"--slo {part!r}: the objective must be a positive duration; {accepted}")
        if key in out:
            raise UsageError(f"--slo names {key} twice; {accepted}")
        out[key] = value
    return out


def tpot(r: RequestRecord) -> float | None:
    return (r.e2e - r.ttft) / (r.output - 1) if r.output > 1 else None


@dataclass(frozen=True, slots=True)
class Stat:
    mean: float | None
    p: dict[int, float | None]

    @classmethod
    def of(cls, xs: list[float]) -> Stat:
        return cls(sum(xs) / len(xs) if xs else None, {q: percentile(xs, q) for q in PERCENTILES})

    @classmethod
    def weighted(cls, pairs: list[tuple[float, int]]) -> Stat:
        n = sum(w for _, w in pairs)
        mean = sum(v * w for v, w in pairs) / n if n else None
        return cls(mean, {q: weighted_percentile(pairs, q) for q in PERCENTILES})

    def ms(self) -> dict[str, float | None]:
        out = {"mean": _ms(self.mean)}
        out.update({f"p{q}": _ms(v) for q, v in self.p.items()})
        return out


def _ms(s: float | None) -> float | None:
    return round(s * 1000, 3) if s is not None else None


def summarize(res: SimResult, slo: dict[str, float], start: float = 0.0, which: str = "all") -> dict:
    """The report's figures for the records `which` selects: "all", "others" (every user but
    the long one) or "long"."""
    recs = [r for r in res.records if which == "all" or (r.long == (which == "long"))]
    duration = max(res.end - start, 1e-9)
    tpots = [t for t in map(tpot, recs) if t is not None]
    good = sum(1 for r in recs if _meets(r, slo))
    out_tokens = sum(r.output for r in recs)
    in_tokens = sum(r.prompt for r in recs)
    out = {
        "requests": len(recs), "duration_s": round(duration, 3),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached for r in recs),
        "request_throughput": round(len(recs) / duration, 4),
        "output_throughput": round(out_tokens / duration, 2),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 2),
        "ttft_ms": Stat.of([r.ttft for r in recs]).ms(),
        "tpot_ms": Stat.of(tpots).ms(),
        "e2el_ms": Stat.of([r.e2e for r in recs]).ms(),
        "preempted_requests": sum(1 for r in recs if r.preemptions),
        "preemptions": sum(r.preemptions for r in recs),
        "recomputed_tokens": sum(r.recomputed for r in recs),
    }
    if which == "all":
        out["itl_ms"] = Stat.weighted(res.itl).ms()
    if slo:
        out["slo_ms"] = {k: round(v * 1000, 3) for k, v in slo.items()}
        out["good_requests"] = good
        out["goodput"] = round(good / duration, 4)
    return out


def _meets(r: RequestRecord, slo: dict[str, float]) -> bool:
    t = tpot(r) or 0.0
    return all(v >= {"ttft": r.ttft, "tpot": t, "e2el": r.e2e}[k] for k, v in slo.items())


def pool_story(res: SimResult, num_blocks: int, start: float = 0.0) -> dict:
    """Occupancy over time (time-weighted between samples), the long user's share, and the
    scheduler's counters."""
    samples = res.samples
    used_area = cached_area = long_area = 0.0
    peak_used = peak_long = peak_running = peak_waiting = 0
    for (t0, used, cached, running, waiting, long), (t1, *_) in zip(samples, samples[1:]):
        dt = t1 - t0
        used_area += used * dt
        cached_area += cached * dt
        long_area += long * dt
    for _, used, _, running, waiting, long in samples:
        peak_used, peak_long = max(peak_used, used), max(peak_long, long)
        peak_running, peak_waiting = max(peak_running, running), max(peak_waiting, waiting)
    span = max((samples[-1][0] - samples[0][0]) if samples else 0.0, 1e-9)
    prompt = sum(r.prompt for r in res.records)
    return {
        "num_blocks": num_blocks,
        "mean_in_use": round(used_area / span / num_blocks, 4),
        "peak_in_use": round(peak_used / num_blocks, 4),
        "mean_cached_evictable": round(cached_area / span / num_blocks, 4),
        "long_user_peak_share": round(peak_long / num_blocks, 4),
        "long_user_mean_share": round(long_area / span / num_blocks, 4),
        "peak_running": peak_running, "peak_waiting": peak_waiting,
        "preemptions": res.preemptions, "recomputed_tokens": res.recomputed, "evictions": res.evictions,
        "prefix_hit_rate": round(sum(r.cached for r in res.records) / prompt, 4) if prompt else None,
        "steps": res.steps, "decode_stretches": res.stretches, "mean_tokens_per_step": round(res.tokens_scheduled / res.steps, 1) if res.steps else None,
        "refused_turns": len(res.refused), "unfinished_requests": res.unfinished,
    }
