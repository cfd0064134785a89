"""One saved turn: TurnRecord, the typed form of `TurnStats.summary()`.

The conversation log, `--resume`, `/save`, the stats line under a reply and the latency
panel all read turns through this class. On disk a turn stays the flat JSON object
`TurnStats.summary()` gives (`to_dict()` writes the same keys in the same order), so files
written before this class still resume: a missing key takes its default, and a key this
class does not know is kept in `extra` and written back as found.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvchat.engine.telemetry import TurnStats

@dataclass(frozen=True, slots=True)
class TurnRecord:
    turn: int = 0
    reply: str | None = None
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: tuple[float, ...] = ()        # one per generated token
    positions: tuple[int, ...] = ()          # the context position each token was fed at
    stop_reason: str | None = None           # eos, max_tokens, cap, cancelled
    kv_bytes_per_token: int = 0
    kv_bytes_used: int = 0
    kv_bytes_allocated: int = 0
    kv_capacity_bytes: int = 0
    block_size: int = 0
    blocks_used: int = 0
    tokens_held: int = 0
    mode: str = "cache"                      # "cache" or "off"
    kv_dtype: str = ""
    policy: str = ""
    cap: int | None = None
    dropped_messages: int = 0
    evicted_blocks: int = 0
    preempted: int = 0
    recomputed_tokens: int = 0
    extra: tuple[tuple[str, Any], ...] = ()  # keys this class does not know, kept for the file

    @classmethod
    def from_stats(cls, stats: TurnStats) -> TurnRecord:
        return cls.from_dict(stats.summary())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnRecord:
        """From a summary or a log's turn record (its "type" key is not part of the turn)."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        for k in ("decode_ms", "positions"):
            if k in known:
                known[k] = tuple(known[k] or ())
        extra = tuple((k, v) for k, v in d.items() if k not in _FIELDS and k not in ("type", "extra"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to disk: TurnStats.summary()'s keys, in its order."""
        out = {f: getattr(self, f) for f in _FIELDS}
        out["decode_ms"], out["positions"] = list(self.decode_ms), list(self.positions)
        out.update(self.extra)
        return out

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.decode_ms)
        return 1000.0 * len(self.decode_ms) / total if total > 0 else 0.0

    @property
    def context_tokens(self) -> int:
        """The prompt plus the reply: what the conversation held at the turn's end."""
        return self.prompt_tokens + self.generated_tokens


_FIELDS = tuple(f.name for f in fields(TurnRecord) if f.name != "extra")
