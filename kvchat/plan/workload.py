"""Who the simulated users are and what they send: length and time distributions, the
workload they describe, and the trace (the concrete users, one JSON line each) that the
simulator and the trace runner both replay.

A user is one conversation: it starts at `start` with `history` tokens already in it (kept
as segments, so that drop-oldest can drop the oldest ones whole), then sends its turns in
order; each turn adds `new` tokens (the message and the chat template around it) and asks
for `reply` tokens, after `think` seconds counted from the end of the previous reply. Every
user's prompt begins with the same shared system prompt of `system_tokens` tokens. Users
arrive as a Poisson process (`rate` users/s) or, given only their number, spread uniformly
over a ramp.
"""
from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..cli.args import UsageError

TRACE_FORMAT = "kvchat-plan-trace/1"
HISTORY_SEGMENT = 1000    # tokens per segment of an initial history (drop-oldest drops whole segments)
MAX_TOKENS = 10_000_000
MAX_SECONDS = 86_400.0


@dataclass(frozen=True, slots=True)
class Dist:
    """A length or a time: `fixed` N, `uniform` A-B, `exp` with mean A, or `lognormal` with
    median A and shape B (sigma of the log)."""
    kind: str
    a: float
    b: float = 0.0
    text: str = ""

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "exp":
            return rng.expovariate(1.0 / self.a) if self.a > 0 else 0.0
        return self.a * math.exp(rng.gauss(0.0, self.b))

    def tokens(self, rng: random.Random, lo: int = 1) -> int:
        return max(lo, min(MAX_TOKENS, round(self.sample(rng))))

    @property
    def mean(self) -> float:
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "lognormal":
            return self.a * math.exp(self.b**2 / 2)
        return self.a


_NUM = r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)"
_UNIT = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


def _number(flag: str, text: str, seconds: bool, example: str) -> float:
    m = re.fullmatch(_NUM + (r"\s*(ms|s|min|m|h)?" if seconds else ""), text.strip().lower())
    if m is None:
        raise UsageError(f"{flag} {text!r}: expected {'a duration' if seconds else 'a number'} such as {example}")
    value = float(m.group(1)) * (_UNIT[m.group(2) or ""] if seconds else 1.0)
    if not math.isfinite(value):
        raise UsageError(f"{flag} {text!r} is not a finite number; e.g. {example}")
    return value


def parse_dist(flag: str, text: str, seconds: bool = False, zero_ok: bool = False) -> Dist:
    """`N`, `A-B`, `exp:MEAN` or `lognormal:MEDIAN,SIGMA`; durations may carry ms, s or min."""
    example = "5s, 2-10s, exp:5s" if seconds else "2000, 1000-3000, exp:2000, lognormal:1500,0.6"
    accepted = (f"{flag} takes N, A-B, exp:MEAN or lognormal:MEDIAN,SIGMA (e.g. {example}); "
                f"{'zero or more' if zero_ok else 'positive'}")
    s = text.strip().lower()
    hi = MAX_SECONDS if seconds else MAX_TOKENS
    if s.startswith("-"):
        raise UsageError(f"{flag} {text!r} is negative; {accepted}")
    try:
        if s.startswith("exp:"):
            d = Dist("exp", _number(flag, s[4:], seconds, example), text=text)
        elif s.startswith("lognormal:"):
            parts = s[10:].split(",")
            if len(parts) != 2:
                raise UsageError(f"{flag} {text!r}: lognormal needs a median and a sigma; {accepted}")
            d = Dist("lognormal", _number(flag, parts[0], seconds, example), _number(flag, parts[1], False, "0.6"),
                     text=text)
            if not 0 < d.b <= 3:
                raise UsageError(f"{flag} {text!r}: sigma must be in (0, 3]; e.g. lognormal:1500,0.6")
        elif re.fullmatch(r"[^-]+-[^-]+", s):
            lo, hi_text = s.split("-")
            d = Dist("uniform", _number(flag, lo, seconds, example), _number(flag, hi_text, seconds, example),
                     text=text)
            if d.b < d.a:
                raise UsageError(f"{flag} {text!r}: the range runs backwards; e.g. {example.split(', ')[1]}")
        else:
            d = Dist("fixed", _number(flag, s, seconds, example), text=text)
    except UsageError as err:
        if accepted in str(err):
            raise
        raise UsageError(f"{err}; {accepted}") from None
    top = max(d.a, d.b)
    if top > hi:
        raise UsageError(f"{flag} {text!r} is past {hi:,.0f}{' s' if seconds else ' tokens'}; {accepted}")
    if d.a <= 0 and not (zero_ok and d.kind in ("fixed", "uniform", "exp")):
        raise UsageError(f"{flag} {text!r} must be positive; {accepted}")
    return d


@dataclass(slots=True)
class Workload:
    users: int
    rate: float | None              # users/s, Poisson; None: spread over `ramp`
    ramp: float                     # seconds over which the users' first messages are spread
    turns: Dist
    think: Dist                     # seconds
    context: Dist                   # tokens of history a user starts with (0 allowed)
    message: Dist                   # tokens each turn adds: the message and its template
    reply: Dist
    system_tokens: int = 0
    long_tokens: int | None = None  # one more user, starting at t = 0 with this much history
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 0 or (self.users == 0 and not self.long_tokens):
            raise UsageError(f"--users {self.users}: give at least one user (or --long TOKENS)")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise UsageError(f"--rate {self.rate}: users per second must be a positive number")
        if not (math.isfinite(self.ramp) and 0 <= self.ramp <= MAX_SECONDS):
            raise UsageError(f"--ramp {self.ramp}: seconds must be in [0, {MAX_SECONDS:,.0f}]")
        if not 0 <= self.system_tokens <= MAX_TOKENS:
            raise UsageError(f"--system-prompt {self.system_tokens}: tokens must be in [0, {MAX_TOKENS:,}]")

    def describe(self) -> str:
        arrive = (f"arriving at {self.rate:g}/s (Poisson)" if self.rate else
                  f"starting over the first {self.ramp:g} s" if self.ramp else "all starting at once")
        long = f" + 1 long user at {self.long_tokens:,} tokens from t=0" if self.long_tokens else ""
        return (f"{self.users} users{long}, {arrive}; turns {self.turns.text}, history {self.context.text}, "
                f"message {self.message.text}, reply {self.reply.text} tokens, think {self.think.text}; shared "
                f"system prompt {self.system_tokens:,} tokens; seed {self.seed}")


@dataclass(frozen=True, slots=True)
class Turn:
    new: int          # tokens this turn adds before the reply
    reply: int        # reply tokens asked for
    think: float      # seconds after the previous reply ends (the first turn: after `start`)


@dataclass(frozen=True, slots=True)
class UserTrace:
    uid: int
    start: float
    history: tuple[int, ...]
    turns: tuple[Turn, ...]
    long: bool = False


@dataclass(frozen=True, slots=True)
class Trace:
    system_tokens: int
    users: tuple[UserTrace, ...]

    @property
    def turns(self) -> int:
        return sum(len(u.turns) for u in self.users)


def segments(tokens: int) -> tuple[int, ...]:
    full, rest = divmod(tokens, HISTORY_SEGMENT)
    return (HISTORY_SEGMENT,) * full + ((rest,) if rest else ())


def make_trace(w: Workload) -> Trace:
    """The workload's users, drawn from one seeded generator: the same seed, the same users."""
    rng = random.Random(w.seed)
    users, t = [], 0.0
    if w.long_tokens:
        users.append(_user(rng, w, 0, 0.0, w.long_tokens, long=True))
    for i in range(w.users):
        if w.rate:
            t += rng.expovariate(w.rate)
            start = t
        else:
            start = rng.uniform(0.0, w.ramp) if w.ramp else 0.0
        users.append(_user(rng, w, len(users), start, w.context.tokens(rng, lo=0)))
    return Trace(w.system_tokens, tuple(users))


def _user(rng: random.Random, w: Workload, uid: int, start: float, history: int, long: bool = False) -> UserTrace:
    n = max(1, round(w.turns.sample(rng)))
    turns = tuple(Turn(w.message.tokens(rng), w.reply.tokens(rng), 0.0 if i == 0 else max(0.0, w.think.sample(rng)))
                  for i in range(n))
    return UserTrace(uid, start, segments(history), turns, long)


# ---- the trace file: a header line, then one user per line -----------------------------------
def write_trace(path: Path, trace: Trace, description: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"format": TRACE_FORMAT, "system_tokens": trace.system_tokens,
                             "description": description}) + "\n")
        for u in trace.users:
            fh.write(json.dumps({"user": u.uid, "start": u.start, "history": list(u.history),
                                 "turns": [[t.new, t.reply, t.think] for t in u.turns], "long": u.long}) + "\n")


def read_trace(path: str, max_bytes: int = 256 * 2**20) -> Trace:
    from ..store.files import FileRefused, read_text
    where = f"--trace {path!r}"
    try:
        lines = read_text(Path(path), max_bytes).splitlines()
    except FileRefused as err:
        raise UsageError(f"{where}: {err}; expected a kvchat plan trace (JSON Lines, --save-trace writes one)") \
            from None
    try:
        head = json.loads(lines[0]) if lines else None
    except ValueError:
        head = None
    if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT:
        raise UsageError(f"{where}: the first line is not a {TRACE_FORMAT} header; --save-trace FILE writes one")
    system = _whole(where, "system_tokens", head.get("system_tokens"), 0)
    users: list[UserTrace] = []
    for i, line in enumerate(lines[1:], start=2):
        if line.strip():
            users.append(_user_line(f"{where} line {i}", line, len(users)))
    if not users:
        raise UsageError(f"{where}: no users after the header; each line after it holds one user")
    return Trace(system, tuple(users))


def _user_line(where: str, line: str, uid: int) -> UserTrace:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError):
        raise UsageError(f"{where} is not valid JSON; expected {{\"start\": S, \"history\": [...], "
                         "\"turns\": [[new, reply, think], ...]}") from None
    if not isinstance(d, dict) or not isinstance(d.get("turns"), list) or not d["turns"]:
        raise UsageError(f"{where}: expected an object with a non-empty \"turns\" list of [new, reply, think]")
    start = _seconds(where, "start", d.get("start", 0.0))
    history = d.get("history", [])
    if not isinstance(history, list):
        raise UsageError(f"{where}: \"history\" must be a list of token counts")
    hist = tuple(_whole(where, "history", h, 1) for h in history)
    turns = []
    for t in d["turns"]:
        if not isinstance(t, list) or len(t) != 3:
            raise UsageError(f"{where}: each turn is [new tokens, reply tokens, think seconds], got {t!r}")
        turns.append(Turn(_whole(where, "new", t[0], 1), _whole(where, "reply", t[1], 1),
                          _seconds(where, "think", t[2])))
    return UserTrace(uid, start, hist, tuple(turns), bool(d.get("long", False)))


def _whole(where: str, name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_TOKENS:
        raise UsageError(f"{where}: {name} must be a whole number of tokens in [{lo}, {MAX_TOKENS:,}], got {v!r}")
    return v


def _seconds(where: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= MAX_SECONDS:
        raise UsageError(f"{where}: {name} must be seconds in [0, {MAX_SECONDS:,.0f}], got {v!r}")
    return float(v)
