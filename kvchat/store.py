"""Conversations on disk: one JSON Lines file per conversation, each record flushed and
fsynced as it happens, so a crash or a quit loses nothing.

<data dir>/conversations/<YYYYmmdd-HHMMSS>-<random>.jsonl holds, in order:
    {"type": "start", "time", "model", "system", "cap", "policy", "mode"}
    {"type": "message", "role", "content"}        a message appended to the conversation
    {"type": "messages", "messages": [...]}        the whole list, when it changed otherwise
    {"type": "turn", ...TurnStats.summary()}       one reply's telemetry
    {"type": "event", "event": "cap" | "policy" | "mode" | "reset_cache" | ..., ...}
`--resume` replays the newest file; `/save FILE` exports Markdown and telemetry.
"""
from __future__ import annotations

import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.engine.telemetry import JsonlWriter

from .records import TurnRecord, stats_line

DATA_ENV = "KVCHAT_DATA_DIR"
Messages = list[dict[str, str]]


class StoreError(Exception):
    """A conversation file that cannot be read back; str() is one line."""


def data_dir() -> Path:
    from platformdirs import user_data_dir
    return Path(os.environ.get(DATA_ENV) or user_data_dir("kvchat"))


def conversations_dir(root: Path | None = None) -> Path:
    return (root or data_dir()) / "conversations"


@dataclass(slots=True)
class Restored:
    """A conversation read back from its log."""
    path: Path
    messages: Messages = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    cap: int | None = None
    policy: str = "stop"
    mode: str = "cache"
    unanswered: str | None = None   # a last user message whose reply never finished


class ConversationLog:
    """Appends one conversation's records; safe to call from the UI and worker threads.

    The file is created with the first message: until then the start and settings records
    wait in memory, so opening kvchat and quitting leaves no empty conversation to resume."""

    def __init__(self, path: Path, messages: Messages | None = None) -> None:
        self.path = path
        self.messages: Messages = [dict(m) for m in messages or []]  # what the log says so far
        self._writer: JsonlWriter | None = JsonlWriter(path) if path.exists() else None
        self._held: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def _put(self, record: dict[str, Any]) -> None:
        """Write (the caller holds the lock); start and event records wait for a message."""
        if self._writer is None:
            if record["type"] in ("start", "event"):
                self._held.append(record)
                return
            self._writer = JsonlWriter(self.path)
            for held in self._held:
                self._writer.write(held)
            self._held = []
        self._writer.write(record)

    @classmethod
    def create(cls, root: Path | None = None, **start: Any) -> ConversationLog:
        folder = conversations_dir(root)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl"
        log = cls(path)
        log.write({"type": "start", "time": time.time(), **start})
        system = start.get("system")
        if system:
            log.messages.append({"role": "system", "content": system})
        return log

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._put(record)

    def sync(self, messages: Messages) -> None:
        """Record how `messages` differs from what the log holds: appended messages one by
        one, anything else as the whole list."""
        with self._lock:
            n = len(self.messages)
            if messages[:n] == self.messages:
                for m in messages[n:]:
                    self._put({"type": "message", "role": m["role"], "content": m["content"]})
            else:
                self._put({"type": "messages", "messages": messages})
            self.messages = [dict(m) for m in messages]

    def turn(self, record: TurnRecord) -> None:
        self.write({"type": "turn", **record.to_dict()})

    def event(self, name: str, **fields: Any) -> None:
        self.write({"type": "event", "event": name, "time": time.time(), **fields})

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()


def last_conversation(root: Path | None = None) -> Path | None:
    folder = conversations_dir(root)
    files = sorted(folder.glob("*.jsonl"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
    return files[-1] if files else None


def restore(path: Path) -> Restored:
    """Replay a conversation log. A torn last line (a crash mid-write) is ignored."""
    out = Restored(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise StoreError(f"cannot read saved conversation {path}: {err}") from None
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise StoreError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
        kind = rec.get("type")
        if kind == "start":
            out.messages = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
            out.cap, out.policy, out.mode = rec.get("cap"), rec.get("policy", "stop"), rec.get("mode", "cache")
        elif kind == "message":
            out.messages.append({"role": rec["role"], "content": rec["content"]})
        elif kind == "messages":
            out.messages = [dict(m) for m in rec["messages"]]
        elif kind == "turn":
            out.turns.append(TurnRecord.from_dict(rec))
        elif kind == "event" and rec.get("event") in ("cap", "policy", "mode"):
            setattr(out, rec["event"], rec.get("value"))
    if out.messages and out.messages[-1]["role"] == "user":
        out.unanswered = out.messages.pop()["content"]
    return out


# ---- export -------------------------------------------------------------------------------------
def export(base: Path, messages: Messages, turns: list[TurnRecord], model: str) -> tuple[Path, Path]:
    """Write base.md (the transcript) and base.jsonl (one telemetry record per turn)."""
    if base.suffix in (".md", ".jsonl"):
        base = base.with_suffix("")
    md, jl = base.with_name(base.name + ".md"), base.with_name(base.name + ".jsonl")
    md.parent.mkdir(parents=True, exist_ok=True)
    by_reply = {t.reply: t for t in turns}   # dropped or regenerated turns stay in the telemetry
    parts = [f"# kvchat conversation\n\nmodel: {model} · saved {time.strftime('%Y-%m-%d %H:%M')}\n"]
    for m in messages:
        title = {"system": "System", "user": "You", "assistant": "Assistant"}.get(m["role"], m["role"])
        parts.append(f"## {title}\n\n{m['content']}\n")
        if m["role"] == "assistant":
            s = by_reply.get(m["content"])
            if s is not None:
                parts.append(f"*{stats_line(s)}*\n")
    md.write_text("\n".join(parts), encoding="utf-8")
    with open(jl, "w", encoding="utf-8") as fh:
        for s in turns:
            fh.write(json.dumps(s.to_dict(), ensure_ascii=False) + "\n")
    return md, jl
