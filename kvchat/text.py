"""Every wording helper in one place: numbers, durations and figures as the words kvchat shows.

The app, the CLI and the saved Markdown say the same thing the same way: a turn's stats line,
a duration, a plural, the prefill progress line, the sizing sentence of `kvchat info --tokens`
and `/whatif` (the arithmetic is kvchat/engine/sizing.py; this only words it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from rich.cells import cell_len

from kvchat.engine.sizing import WhatIf, what_if
from kvchat.engine.units import human_bytes, parse_bytes

if TYPE_CHECKING:
    from kvchat.engine.telemetry import PrefillProgress, TurnSummary

RANDOM_WEIGHTS = ("random weights (--random-weights): the text is gibberish by design; the cache, its blocks "
                  "and the latency are real")
SLOW_MS = 10_000.0      # durations from here on read in seconds
BAR = 20        # the prefill bar's cells
NO_BUDGET = "give --kv-budget to compare it with a budget"


def plural(n: int, word: str) -> str:
    """'1 turn', '2 turns', '1,024 tokens'."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def duration(ms: float) -> str:
    """212 ms, 9,870 ms, then 10.2 s and 212.2 s: no one reads '212234 ms'."""
    return f"{ms / 1000:,.1f} s" if ms >= SLOW_MS else f"{ms:,.0f} ms"


def fit_segments(text: str, room: int, sep: str = " · ") -> str:
    """Drop whole trailing " · " segments until text fits in room columns, so a narrow
    terminal cuts the line between words, never inside one (the first segment stays)."""
    parts = text.split(sep)
    while len(parts) > 1 and cell_len(sep.join(parts)) > room:
        parts.pop()
    return sep.join(parts)


# ---- the stats line under a reply --------------------------------------------------------------
STOP_WORDS = {None: "", "eos": "", "max_tokens": "max tokens reached", "cap": "stopped at the cap",
              "cancelled": "stopped", "max_position": "stopped at the model's maximum context"}


def stats_line(r: TurnSummary) -> str:
    """The line under a reply: tokens, TTFT, speed, prompt reuse."""
    line = (f"{plural(r.generated_tokens, 'token')} · TTFT {duration(r.ttft_ms)} · "
            f"{r.tokens_per_s:.1f} tok/s · prompt {r.prompt_tokens}: ")
    if r.reused_tokens is None or r.computed_tokens is None:     # a server that does not report it
        line += "reuse not reported"
    else:
        line += f"{r.reused_tokens} reused, {r.computed_tokens} computed"
    if r.mode == "off":
        line += " · cache off"
    if r.dropped_messages:
        line += f" · dropped {r.dropped_messages} old messages"
    if r.evicted_blocks:
        n = r.evicted_blocks
        line += f" · evicted {n:,} block{'s' if n > 1 else ''}"
    if r.preempted:
        n = r.preempted
        line += f" · preempted {n} other conversation{'s' if n > 1 else ''}"
    if r.recomputed_tokens:
        line += f" · recomputed {r.recomputed_tokens:,} tokens lost to preemption"
    reason = STOP_WORDS.get(r.stop_reason, r.stop_reason)
    if reason:
        line += f" · {reason}"
    return line


# ---- the prefill progress line -------------------------------------------------------------------


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "ETA …"
    if seconds < 60:
        return f"ETA {seconds:.0f} s"
    return f"ETA {int(seconds // 60)} min {int(seconds % 60):02d} s"


def prefill_line(ev: PrefillProgress, width: int = BAR) -> str:
    """'prefilling ████████░░░░ 1,024 / 8,073 tokens · 41 tok/s · ETA 2 min 52 s · esc stops'."""
    share = ev.done / ev.total if ev.total else 1.0
    full = round(share * width)
    bar = "█" * full + "░" * (width - full)
    rate = f"{ev.tokens_per_s:,.0f} tok/s" if ev.done else "… tok/s"
    return (f"prefilling {bar} {ev.done:,} / {ev.total:,} tokens · {rate} · {eta_text(ev.eta_s)} · "
            "esc stops")


# ---- sizing as sentences (`kvchat info --tokens`, /whatif) ----------------------------------------

def what_if_line(w: WhatIf, no_budget: str = NO_BUDGET) -> str:
    """One sentence: what `w.users` conversations of `w.tokens` tokens cost, and if they fit
    (without a budget, `no_budget` says how to give one)."""
    who = f"{w.users:,} conversations of {w.tokens:,} tokens" if w.users > 1 else f"{w.tokens:,} tokens"
    scales = f" + {w.scale_bytes_per_token:,} B of scales" if w.scale_bytes_per_token else ""
    line = (f"What if: {who} x {w.bytes_per_token:,} B{scales} per token = {w.bytes_needed / 1e9:,.2f} GB "
            f"({human_bytes(w.bytes_needed)}) in {w.kv_dtype}")
    if w.budget is None:
        return f"{line}; {no_budget}"
    fit = (f"{w.users_that_fit:,} such conversation{'s fit' if w.users_that_fit != 1 else ' fits'} at a time"
           if w.users_that_fit else "not even one such conversation fits")
    return line + f": {w.share:.0%} of the {w.budget / 1e9:,.2f} GB budget; {fit}"


def short_alias(model: str) -> str:
    """'70b' -> 'llama-3.1-70b', '7b' -> 'llama-2-7b': the one known alias ending in -MODEL
    (the text itself when it is an alias, a path, or ambiguous)."""
    from kvchat.engine.sources import KNOWN
    m = model.strip().lower()
    ends = [a for a in KNOWN if a.endswith("-" + m)]
    return ends[0] if m not in KNOWN and len(ends) == 1 else model


def what_if_command(model: str, tokens: int, budget: str | None = None, kv_dtype: str = "bf16") -> str:
    """The app's `/whatif MODEL TOKENS [BUDGET]`: the model's geometry from the known table
    (or a local folder; no weights read), each model in its serving dtype (bf16 unless
    given). Raises KvchatError naming a bad value."""
    from kvchat.engine.sources import resolve
    src = resolve(short_alias(model), random_weights=True)        # geometry only
    w = what_if(src.geometry, kv_dtype, tokens, 1, parse_bytes(budget) if budget else None)
    return f"{src.name}: " + what_if_line(w, f"add a budget to compare, e.g. /whatif {model} {tokens} 15GB")
