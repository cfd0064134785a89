"""The status line while a long prompt prefills: a bar, tokens done / total, the rate and
an estimate of the time left, from the engine's PrefillProgress events (one per chunk)."""
from __future__ import annotations

from kvchat.engine.telemetry import PrefillProgress

BAR = 20


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
