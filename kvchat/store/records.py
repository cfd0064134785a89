"""One saved turn: TurnRecord, the engine's flat `TurnSummary` as kvchat keeps it on disk.

The conversation log, `--resume`, `/save`, the stats line under a reply and the latency
panel all read turns through this class. Its fields are `TurnSummary`'s (the engine defines
them once; `TurnStats.summarized()` fills them), so a turn stays on disk the flat JSON object
`TurnStats.summary()` gives, in the same order. Files written before a field existed still
resume: a missing key takes its default, and a key this class does not know is kept in
`extra` and written back as found.

A turn read back is checked field by field (`from_dict` raises RecordError naming the field):
a log may have been edited by hand or by someone else, and a string where a latency belongs,
NaN, 1e999 or a dict for a stop reason must not reach a panel's arithmetic. A figure a
backend could not give is None, as TurnSummary has it; a field TurnSummary always has may
not be null.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvchat.engine.telemetry import TurnStats, TurnSummary

MAX_COUNT = 2**53           # tokens, bytes, blocks: past any machine, still exact in a float
MAX_MS = 1e12               # 30 years
MAX_WORD = 64               # a stop reason, a dtype, a policy name


class RecordError(ValueError):
    """A saved record kvchat would not have written; str() names the field and what is accepted."""


def _shown(v: Any) -> str:
    return repr(v)[:40] if isinstance(v, (int, float, str)) else type(v).__name__


@dataclass(frozen=True, slots=True)
class TurnRecord(TurnSummary):
    extra: tuple[tuple[str, Any], ...] = ()  # keys this class does not know, kept for the file

    @classmethod
    def from_stats(cls, stats: TurnStats) -> TurnRecord:
        s = stats.summarized()
        return cls(**{f: getattr(s, f) for f in _FIELDS})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnRecord:
        """From a summary or a log's turn record (its "type" key is not part of the turn);
        RecordError if a field holds what no backend writes."""
        known = {k: _check(k, v) for k, v in d.items() if k in _FIELDS}
        if "unavailable" in known:
            known["unavailable"] = _words("unavailable", known["unavailable"])
        if known.get("positions") and len(known["positions"]) != len(known.get("decode_ms", ())):
            raise RecordError(f"positions has {len(known['positions'])} entries for {len(known.get('decode_ms', ()))} "
                              "decode_ms; expected one position per decoded token")
        extra = tuple((k, v) for k, v in d.items() if k not in _FIELDS and k not in ("type", "extra"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to disk: TurnStats.summary()'s keys, in its order, then `extra`."""
        out = TurnSummary.to_dict(self)
        out.update(self.extra)
        return out


_FIELDS = tuple(f.name for f in fields(TurnSummary))
_OPTIONAL = frozenset(f.name for f in fields(TurnSummary) if "None" in str(f.type))
_COUNTS = ("turn", "prompt_tokens", "reused_tokens", "computed_tokens", "generated_tokens", "kv_bytes_per_token",
           "kv_bytes_used", "kv_bytes_allocated", "kv_capacity_bytes", "block_size", "blocks_used", "tokens_held",
           "dropped_messages", "evicted_blocks", "preempted", "recomputed_tokens", "reclaimed_blocks")
_WORDS = ("stop_reason", "kv_dtype", "policy")


def _count(k: str, v: Any) -> int | None:
    if v is None and k not in _OPTIONAL:
        raise RecordError(f"{k} is null; expected a whole number from 0 to {MAX_COUNT:,}")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_COUNT):
        raise RecordError(f"{k} is {_shown(v)}; expected a whole number from 0 to {MAX_COUNT:,}")
    return v


def _ms(k: str, v: Any) -> float | None:
    if v is None and k not in _OPTIONAL:
        raise RecordError(f"{k} is null; expected milliseconds, a finite number >= 0")
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))    # an int is finite; an int
                          or not (isinstance(v, int) or math.isfinite(v))   # past a float fails the range
                          or not 0 <= v <= MAX_MS):
        raise RecordError(f"{k} is {_shown(v)}; expected milliseconds, a finite number >= 0")
    return v


_MS_TYPES, _INT_TYPES = frozenset((float, int)), frozenset((int,))


def _fast_check(v: list, types: frozenset, most: float) -> bool:
    """The fast test first, at C speed (a long reply has tens of thousands of these; a
    Python loop over them made a 97 MB log take minutes to reopen): every item of `types`
    (a bool is not an int here), all finite (NaN and inf make the sum so) and within 0..most.
    False sends the list to the slow test, which names the bad item."""
    if not v:
        return True
    if not types.issuperset(map(type, v)):
        return False
    try:
        return math.isfinite(sum(v)) and min(v) >= 0 and max(v) <= most
    except OverflowError:          # an int past any float: the slow test names it
        return False


def _check(k: str, v: Any) -> Any:
    """One field of a saved turn, as TurnRecord holds it."""
    if k in _COUNTS:
        return _count(k, v)
    if k in ("ttft_ms", "prefill_ms"):
        return _ms(k, v)
    if k in ("step_sequences", "step_tokens"):      # per decoded token: how many sequences / tokens its step held
        if v is None:
            return ()
        if not (isinstance(v, list) and all(type(x) is int and 0 <= x <= MAX_COUNT for x in v)):
            raise RecordError(f"{k} is {_shown(v)}; expected a list of whole numbers, one per decoded token")
        return tuple(v)
    if k in ("decode_ms", "positions"):
        if v is None:
            return ()
        if not isinstance(v, list):
            raise RecordError(f"{k} is {_shown(v)}; expected a list")
        if _fast_check(v, _MS_TYPES if k == "decode_ms" else _INT_TYPES, MAX_MS if k == "decode_ms" else MAX_COUNT):
            return tuple(v)
        one = _ms if k == "decode_ms" else _count
        if any(x is None for x in v):
            raise RecordError(f"{k} holds null; expected a number for every token")
        return tuple(one(f"{k}[{i}]", x) for i, x in enumerate(v))
    if k in _WORDS:
        if (v is not None or k not in _OPTIONAL) and not (isinstance(v, str) and len(v) <= MAX_WORD):
            raise RecordError(f"{k} is {_shown(v)}; expected a word of at most {MAX_WORD} characters")
        return v
    if k == "mode":
        if v not in ("cache", "off"):
            raise RecordError(f"mode is {_shown(v)}; accepted: cache, off")
        return v
    if k == "cap":
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= MAX_COUNT):
            raise RecordError(f"cap is {_shown(v)}; expected a positive number of tokens or null")
        return v
    if k == "reply":
        if v is not None and not isinstance(v, str):
            raise RecordError(f"reply is {_shown(v)}; expected text")
        return v
    return v


def _words(k: str, v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) > len(_FIELDS) or not all(
            isinstance(x, str) and len(x) <= MAX_WORD for x in v):
        raise RecordError(f"{k} is {_shown(v)}; expected a list of field names")
    return tuple(v)
