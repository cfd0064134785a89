"""One saved turn: TurnRecord, the engine's flat `TurnSummary` as kvchat keeps it on disk.

The conversation log, `--resume`, `/save`, the stats line under a reply and the latency
panel all read turns through this class. Its fields are `TurnSummary`'s (the engine defines
them once; `TurnStats.summarized()` fills them), so a turn stays on disk the flat JSON object
`TurnStats.summary()` gives, in the same order. Files written before a field existed still
resume: a missing key takes its default, and a key this class does not know is kept in
`extra` and written back as found.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvchat.engine.telemetry import TUPLE_FIELDS, TurnStats, TurnSummary


@dataclass(frozen=True, slots=True)
class TurnRecord(TurnSummary):
    extra: tuple[tuple[str, Any], ...] = ()  # keys this class does not know, kept for the file

    @classmethod
    def from_stats(cls, stats: TurnStats) -> TurnRecord:
        s = stats.summarized()
        return cls(**{f: getattr(s, f) for f in _FIELDS})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnRecord:
        """From a summary or a log's turn record (its "type" key is not part of the turn)."""
        known = {k: v for k, v in d.items() if k in _FIELDS}
        for k in TUPLE_FIELDS:
            if k in known:
                known[k] = tuple(known[k] or ())
        extra = tuple((k, v) for k, v in d.items() if k not in _FIELDS and k not in ("type", "extra"))
        return cls(**known, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to disk: TurnStats.summary()'s keys, in its order, then `extra`."""
        out = TurnSummary.to_dict(self)
        out.update(self.extra)
        return out


_FIELDS = tuple(f.name for f in fields(TurnSummary))
