"""`kvchat bench --busy N`: decode beside N busy processes, against decode alone.

A laptop always has other work running. Each round decodes the same history alone, then
beside N processes that spin on a CPU each (a Python loop: what `yes > /dev/null` does,
without needing `yes`), the rounds taken in turn so that a changing load touches both
alike. Reported: median and p90 ms/token of each, and the slowdown (busy over alone). The
targets (issue 25): with one busy process on 2 cores, median at most 2.2x and p90 at most
3x the time alone (a fair share of the cores is 2x).
"""
from __future__ import annotations

import subprocess
import sys
import time

from .report import Series, percentile

SPIN = "while True: pass"
SETTLE_S = 0.5           # the busy processes reach their cores before the first timed step
TARGETS = {"median": 2.2, "p90": 3.0}


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(n)]


def stop_busy(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def measure(bench, ctx: int, busy: int) -> dict[str, Series]:
    """Alone and beside `busy` spinning processes, bench.cfg.runs rounds of one turn each."""
    cfg = bench.cfg
    row = {"alone": Series(), "busy": Series()}
    for run in range(cfg.runs):
        text, _ = bench.history_of(ctx, run)
        bench.say(f"context {ctx}, round {run + 1}/{cfg.runs}: alone")
        bench.ours(text, cfg.new_tokens, row["alone"], "none")
        bench.say(f"context {ctx}, round {run + 1}/{cfg.runs}: beside {busy} busy process(es)")
        procs = start_busy(busy)
        try:
            time.sleep(SETTLE_S)
            bench.ours(text, cfg.new_tokens, row["busy"], "none")
        finally:
            stop_busy(procs)
    return row


def summary(row: dict[str, Series]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, s in row.items():
        out[f"{name}_median_ms"] = percentile(s.decode_ms, 50)
        out[f"{name}_p90_ms"] = percentile(s.decode_ms, 90)
    alone = out["alone_median_ms"]
    for stat in ("median", "p90"):
        busy = out[f"busy_{stat}_ms"]
        out[f"slowdown_{stat}"] = busy / alone if alone and busy is not None else None
    return out


def markdown(ctx: int, busy: int, s: dict[str, float | None], threads: str, cores: int) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    def ratio(stat: str) -> str:
        x = s[f"slowdown_{stat}"]
        if x is None:
            return "-"
        return f"{x:.2f}x ({'meets' if x <= TARGETS[stat] else 'misses'} <= {TARGETS[stat]}x)"

    return "\n".join([
        f"Decode beside {busy} busy process(es), context {ctx}, {cores} usable CPU(s); threads: {threads}",
        "",
        "| | median ms/token | p90 ms/token |",
        "|---|---:|---:|",
        f"| alone | {ms(s['alone_median_ms'])} | {ms(s['alone_p90_ms'])} |",
        f"| beside {busy} busy | {ms(s['busy_median_ms'])} | {ms(s['busy_p90_ms'])} |",
        "",
        f"Slowdown (busy over alone's median): median {ratio('median')}, p90 {ratio('p90')}",
    ])
