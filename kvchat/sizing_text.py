"""Sizing figures as sentences, shared by `kvchat info --tokens` and the app's /whatif: the
same arithmetic (kvchat/engine/sizing.py) says the same thing in both."""
from __future__ import annotations

from kvchat.engine.sizing import WhatIf, what_if
from kvchat.engine.units import human_bytes, parse_bytes


NO_BUDGET = "give --kv-budget to compare it with a budget"


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
