"""The conversation log's records, typed, and the one reader of a log file: `--resume`
(log.restore), the chat browser's listing (catalog.summarize) and reopening all read a log
through `read_log`, in one pass.

A log is kvchat's own file, but it sits in the user's folder where anything may have edited
it, so every record read back is checked before it is used. A line that fails (a torn write,
a hand edit, text that is not UTF-8, a string where a latency belongs) is skipped and named
in `problems` as "FILE line N: what is wrong"; the rest of the conversation opens. Only a
regular file is read, and at most MAX_LOG_BYTES of it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, Union

from kvchat.engine.policy import POLICIES

from .files import FileRefused, read_bytes
from .records import MAX_COUNT, RecordError, TurnRecord

MAX_LOG_BYTES = 256 * 2**20     # about 50,000 long turns; a log past it is refused, not read slowly
PROGRESS_BYTES = 4 * 2**20     # read_log tells its progress this often
MAX_NAME = 512                  # a model's name, a title
ROLES = ("system", "user", "assistant")


class StoreError(Exception):
    """A conversation file that cannot be read back; str() is one line."""


@dataclass(frozen=True, slots=True)
class Start:
    time: float
    model: str | None
    system: str | None
    cap: int | None
    policy: str
    mode: str


@dataclass(frozen=True, slots=True)
class Appended:
    """One message appended to the conversation."""
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Replaced:
    """The whole list of messages, after an edit, a drop or a system-prompt change."""
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True, slots=True)
class Event:
    """A setting changed (cap, policy, mode), a rename (title), a model change, or a mark
    (resumed, closed, reset_cache, ...) that restores nothing."""
    name: str
    value: Any = None
    previous: Any = None


Record = Union[Start, Appended, Replaced, TurnRecord, Event]
Progress = Callable[[int, int], None]       # bytes read so far, of the total


@dataclass(slots=True)
class LogRead:
    path: Path
    records: list[Record] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)    # "FILE line N: why", one per skipped line


def read_log(path: Path, progress: Progress | None = None) -> LogRead:
    """Every valid record of the log at `path`, in order; StoreError if it cannot be read.
    `progress(done, total)` hears the bytes parsed so far, every PROGRESS_BYTES (a 97 MB
    log takes seconds: the screen says how far it is)."""
    try:
        data = read_bytes(path, MAX_LOG_BYTES)
    except FileRefused as err:
        raise StoreError(f"cannot read saved conversation {path}: {err}") from None
    out = LogRead(path)
    done = told = 0
    for number, raw in enumerate(data.split(b"\n"), 1):
        if progress is not None and done - told >= PROGRESS_BYTES and done < len(data):
            progress(done, len(data))      # the lines before this one are parsed (the end: below, once)
            told = done
        done += len(raw) + 1
        if not raw.strip():
            continue
        try:
            out.records.append(parse_record(raw))
        except RecordError as err:
            out.problems.append(f"{path.name} line {number}: {err}")
    if progress is not None and told:
        progress(len(data), len(data))     # the end, for a log long enough to have told its progress
    return out


def parse_record(raw: bytes) -> Record:
    """One line of a log as its typed record; RecordError says what is wrong with it."""
    try:
        rec = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise RecordError(f"not UTF-8 text (byte {raw[err.start]:#04x} at offset {err.start})") from None
    except ValueError:
        raise RecordError("not a JSON record (a torn line?)") from None
    except RecursionError:
        raise RecordError("nested too deeply to be kvchat's") from None
    if not isinstance(rec, dict):
        raise RecordError(f"a JSON {type(rec).__name__}, not a record")
    kind = rec.get("type")
    if kind == "start":
        return _start(rec)
    if kind == "message":
        return Appended(**message(rec))
    if kind == "messages":
        if not isinstance(rec.get("messages"), list):
            raise RecordError("a messages record without a list of messages")
        return Replaced(tuple(message(m) for m in rec["messages"]))
    if kind == "turn":
        return TurnRecord.from_dict(rec)
    if kind == "event":
        return _event(rec)
    raise RecordError(f"unknown record type {str(kind)[:40]!r}")


def message(m: Any) -> dict[str, str]:
    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
        raise RecordError("a message needs a role (system, user, assistant) and a string content")
    return {"role": m["role"], "content": m["content"]}


# the settings a log restores, each with what a valid value is
SETTINGS = {
    "cap": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_COUNT),
    "policy": lambda v: v in POLICIES,
    "mode": lambda v: v in ("cache", "off"),
}


def _name(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_NAME


def _sampling(v: Any) -> bool:
    """/temperature, /top-p, /seed as the log writes them: numbers (a seed may be null)."""
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)   # noqa: E731
    return (isinstance(v, dict) and set(v) <= {"temperature", "top_p", "seed"}
            and all(number(x) or (k == "seed" and x is None) for k, x in v.items()))


def _start(rec: dict) -> Start:
    t = rec.get("time", 0.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e11:
        raise RecordError(f"start time {str(t)[:40]!r}; expected seconds since 1970")
    if rec.get("model") is not None and not _name(rec["model"]):
        raise RecordError(f"start model is not a name of 1 to {MAX_NAME} characters")
    if rec.get("system") is not None and not isinstance(rec["system"], str):
        raise RecordError("start system is not text")
    values: dict[str, Any] = {key: rec.get(key, default) for key, default in (("cap", None), ("policy", "stop"), ("mode", "cache"))}
    for key, value in values.items():
        if not SETTINGS[key](value):
            raise RecordError(f"start {key} {str(value)[:40]!r} is not one kvchat writes")
    return Start(float(t), rec.get("model"), rec.get("system") or None, **values)


def _event(rec: dict) -> Event:
    name, value = rec.get("event"), rec.get("value")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise RecordError("an event without a name")
    if name in SETTINGS and not SETTINGS[name](value):
        raise RecordError(f"{name} {str(value)[:40]!r} is not one kvchat writes")
    if name == "title" and not (isinstance(value, str) and _name(value) and value.strip()):
        raise RecordError(f"a title that is not text of 1 to {MAX_NAME} characters")
    if name == "model" and not _name(value):
        raise RecordError(f"a model that is not a name of 1 to {MAX_NAME} characters")
    if name == "system" and value is not None and not isinstance(value, str):
        raise RecordError("a system prompt that is not text")
    if name == "sampling" and not _sampling(value):
        raise RecordError("sampling that is not temperature, top_p and seed as numbers")
    return Event(name, value, rec.get("previous") if name == "model" else None)
