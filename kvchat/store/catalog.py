"""The saved conversations as a list: what the chat browser shows and `--resume` opens.

Each conversation is its log (store/log.py). `summarize` reads one log into a `Summary`
(title, model, dates, turns, tokens, the text to search) through the same reader and fold as
`--resume` (log.restore), so a damaged line is skipped the same way. A rename and a model
change are log events, so the log stays the one record of a conversation:
    {"type": "event", "event": "title", "value": "my title"}      the browser's rename
    {"type": "event", "event": "model", "value": M, "previous": P}  resumed under model M
Which conversations were open when the app last quit is kept in <data dir>/open.json
(`remember_open`, `open_at_quit`); `--resume` reopens them all, if each is still one of
kvchat's own logs: a name there pointing elsewhere (notes.txt, a link, a FIFO) is left alone.
Each kvchat process keeps its own list there, so two on one data folder do not overwrite
each other's: `{"open": [every list's paths], "processes": [{"pid": N, "paths": [...]}]}`.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.sources import process_alive

from .files import FileRefused, cannot_write, read_text
from .history import replies
from .log import (ConversationLog, Restored, conversations_dir, data_dir, held, is_saved_log, last_conversation, restore,
                  saved_logs)
from .log_records import StoreError

TITLE_CHARS = 48
OPEN_FILE = "open.json"


@dataclass(frozen=True, slots=True)
class Summary:
    """One saved conversation as the browser lists it."""
    path: Path
    title: str                 # the name given by a rename, else the first thing the user said
    named: bool                # the title was given by a rename
    model: str | None          # the model it last ran with (None: a log from before models were kept)
    model_from: int            # turns before this index ran under another model
    started: float             # seconds since the epoch
    modified: float
    turns: int                 # replies in the conversation (a regenerated one is no other turn)
    tokens: int                # the context of its last turn: prompt + generated tokens
    messages: int              # user and assistant messages in the history now
    text: str                  # every message and the title, lowercased, for search

    def when(self) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(self.modified))

    def matches(self, query: str) -> bool:
        """Every word of the query is somewhere in the conversation or its title."""
        return all(word in self.text for word in query.lower().split())


_READ: dict[Path, tuple[tuple[int, ...], Summary]] = {}   # path: (its stat when read, its summary)


def summarize(path: Path) -> Summary:
    """Read a log; StoreError if it cannot be read. Damaged lines are skipped. A log unchanged
    since this process last read it (the same size and modification time) is not read again:
    the browser's second opening costs a stat per log, however long the logs are."""
    st = path.stat()
    key = (st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_ino)
    known = _READ.get(path)
    if known is not None and known[0] == key:
        return known[1]
    summary = summary_of(restore(path))
    _READ[path] = (key, summary)
    return summary


def summary_of(r: Restored) -> Summary:
    """A restored conversation as the browser lists it."""
    messages = r.messages + ([{"role": "user", "content": r.unanswered}] if r.unanswered is not None else [])
    first = next((m["content"] for m in messages if m["role"] == "user"), "")
    words = " ".join(first.split())
    title = r.title or (words[:TITLE_CHARS - 1] + "…" if len(words) > TITLE_CHARS else words) or "(no message yet)"
    text = "\n".join([title] + [m["content"] for m in messages]).lower()
    last = r.turns[-1] if r.turns else None
    tokens = (last.prompt_tokens or 0) + (last.generated_tokens or 0) if last is not None else 0
    modified = r.path.stat().st_mtime
    return Summary(r.path, title, r.title is not None, r.model, r.model_from, r.started or modified, modified,
                   replies(r.messages), tokens, sum(m["role"] != "system" for m in messages), text)


def list_conversations(root: Path | None = None,
                       progress: Callable[[int, int], None] | None = None) -> list[Summary]:
    """Every saved conversation, the most recently used first; unreadable files left out.
    `progress(read, total)` is called after each log (the browser reads in a thread and says
    how far it is)."""
    out = []
    paths = list(saved_logs(root))
    for i, path in enumerate(paths):
        try:
            out.append(summarize(path))
        except (StoreError, OSError):
            pass
        if progress is not None:
            progress(i + 1, len(paths))
    for gone in set(_READ) - set(paths):
        if gone.parent == conversations_dir(root):     # deleted or moved away: its text is not kept
            _READ.pop(gone, None)
    return sorted(out, key=lambda s: s.modified, reverse=True)


def rename(path: Path, title: str, log: ConversationLog | None = None) -> None:
    """Give a conversation a title (an event in its log; `log` if it is open here)."""
    if log is not None:
        log.mark("title", value=title)          # a rename is no use: "last used" stays
        return
    closed = ConversationLog(path)
    try:
        closed.mark("title", value=title)
    finally:
        closed.close()


def delete(path: Path) -> None:
    """Remove a conversation's log under its writer's lock: one open in another kvchat is
    refused (ConversationBusy), never unlinked while that process writes on into it."""
    with held(path, "close it there first, then delete it"):
        path.unlink()


# ---- the conversations open at quit -------------------------------------------------------------
def remember_open(paths: list[Path], root: Path | None = None, peers: set[int] | None = None) -> str | None:
    """Record the conversations this process has open now (written whenever one opens or
    closes, so a crash keeps the list too), beside the lists of the other kvchat processes on
    this data folder: those still running, and those `peers` saw running (each call adds the
    running ones to it), so a kvchat that quit while this one ran keeps its list for --resume.
    A list left by a process that had quit before this one first looked is replaced, as one
    list was before. Returns a line saying why it could not be written, or None: failing
    loses only which conversations --resume reopens, never a conversation."""
    target = (root or data_dir()) / OPEN_FILE
    peers = set() if peers is None else peers
    me = os.getpid()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(target.with_name(f".{OPEN_FILE}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)           # read, merge and replace as one step
            lists: list[tuple[int, list[str]]] = [(me, [str(p) for p in paths])]
            for pid, listed in _processes(target):
                if pid is not None and pid != me and (pid in peers or process_alive(pid)):
                    if process_alive(pid):
                        peers.add(pid)
                    lists.append((pid, listed))
            union = list(dict.fromkeys(p for _, listed in lists for p in listed))
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{OPEN_FILE}.", suffix=".tmp")   # a new file, 0600
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(json.dumps({"open": union, "processes": [{"pid": pid, "paths": listed}
                                                                  for pid, listed in lists]}))
            os.replace(tmp, target)
        finally:
            os.close(lock)
    except OSError as err:
        return (f"cannot record the open conversations: {cannot_write(target, err, 'KVCHAT_DATA_DIR')}; --resume "
                "reopens the last")
    return None


def resume_paths(root: Path | None = None) -> tuple[Path | None, list[Path]]:
    """What --resume opens: every conversation open at the last quit, the most recently used
    in focus; with none recorded (or none left), the last saved conversation alone."""
    still_open = open_at_quit(root)
    if not still_open:
        return last_conversation(root), []
    focus = max(still_open, key=lambda p: p.stat().st_mtime)
    return focus, [p for p in still_open if p != focus]


def _processes(target: Path) -> list[tuple[int | None, list[str]]]:
    """Each process's list in open.json; a file from before the lists were per process is one
    list of no process. Nothing readable: none."""
    try:
        data = json.loads(read_text(target, 2**20))
    except (FileRefused, ValueError, RecursionError):
        return []
    if not isinstance(data, dict):
        return []
    listed = data.get("processes")
    if not isinstance(listed, list):
        paths = data.get("open")
        return [(None, [p for p in paths if isinstance(p, str)])] if isinstance(paths, list) else []
    out: list[tuple[int | None, list[str]]] = []
    for e in listed:
        if isinstance(e, dict) and isinstance(e.get("pid"), int) and isinstance(e.get("paths"), list):
            out.append((e["pid"], [p for p in e["paths"] if isinstance(p, str)]))
    return out


def open_at_quit(root: Path | None = None) -> list[Path]:
    """The conversations that were open when the app last quit and are still on disk (a
    conversation never sent a message has no file), each one of kvchat's own logs."""
    try:
        paths = json.loads(read_text((root or data_dir()) / OPEN_FILE, 2**20))["open"]
    except (FileRefused, ValueError, KeyError, TypeError, RecursionError):
        return []
    if not isinstance(paths, list):
        return []
    return [Path(p) for p in paths if isinstance(p, str) and is_saved_log(Path(p), root)]
