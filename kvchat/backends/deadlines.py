"""How long kvchat waits on a server: every network wait has an end (issue 27).

`--timeouts connect=3,answer=10,first-token=300,gap=60,total=1800` (any subset, seconds):
- connect: the TCP (and TLS) connection;
- answer: a plain request's whole answer (/v1/models, /metrics, /tokenize, the resets);
- first-token: a reply's first event (a cold 8k-token prefill on a CPU server takes tens of
  seconds, so this one is long);
- gap: between two events of a reply (comment lines and stray bytes do not count);
- total: a whole reply, however steadily it streams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from kvchat.engine.errors import KvchatError

LONGEST_S = 86_400.0     # a day: anything longer is a typo, not a deadline


@dataclass(slots=True)
class Deadlines:
    connect: float = 3.0
    answer: float = 10.0
    first_token: float = 300.0
    gap: float = 60.0
    total: float = 1800.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0 < value <= LONGEST_S:
                raise KvchatError(f"--timeouts {flag_name(f.name)}={value!r}: must be seconds in (0, {LONGEST_S:g}]")
            setattr(self, f.name, float(value))

    @classmethod
    def parse(cls, text: str | None) -> Deadlines:
        """`connect=3,gap=30` -> Deadlines with those two changed; KvchatError names a bad part."""
        if text is None:
            return cls()
        names = {flag_name(f.name): f.name for f in fields(cls)}
        given: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key.strip() not in names:
                raise KvchatError(f"--timeouts {text!r}: expected NAME=SECONDS joined by commas, NAME one of "
                                  f"{', '.join(names)} (e.g. --timeouts first-token=600,gap=120)")
            try:
                given[names[key.strip()]] = float(value)
            except ValueError:
                raise KvchatError(f"--timeouts {key.strip()}={value!r}: not a number of seconds") from None
        return cls(**given)


def flag_name(field: str) -> str:
    return field.replace("_", "-")
