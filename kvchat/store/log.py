"""Conversations on disk: one JSON Lines file per conversation, each record flushed and
fsynced as it happens, so a crash or a quit loses nothing.

<data dir>/conversations/<YYYYmmdd-HHMMSS>-<random>.jsonl holds, in order:
    {"type": "start", "time", "model", "system", "cap", "policy", "mode"}
    {"type": "message", "role", "content"}        a message appended to the conversation
    {"type": "messages", "messages": [...]}        the whole list, when it changed otherwise
    {"type": "turn", ...TurnStats.summary()}       one reply's telemetry
    {"type": "event", "event": "cap" | "policy" | "mode" | "reset_cache" | ..., ...}
    {"type": "event", "event": "dropped", "value": N}   drop-oldest: the N oldest messages (after
                                                    the system prompt) are out of the model's sight
`--resume` replays the newest file; `/save FILE` exports Markdown and telemetry. Reading a log
back is log_records.py's (one typed reader, every record checked); this file writes them, and
only ever to a regular file it created under its own folder (never through a link).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import cannot_write
from .history import History
from .log_records import SETTINGS, Appended, Event, Progress, Replaced, Start, read_log
from .log_records import StoreError  # noqa: F401  (the store's error, where callers have always found it)
from .records import TurnRecord

DATA_ENV = "KVCHAT_DATA_DIR"
MAX_NUMBER = 10**6       # a conversation number past this in a log is not one kvchat wrote
Messages = list[dict[str, str]]


class ConversationBusy(OSError):
    """The conversation file is open for writing in another process; str() is one line.
    An OSError, so the app's "cannot start the conversation" path shows it."""

    def __str__(self) -> str:
        return self.args[0]


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
    problems: list[str] = field(default_factory=list)   # "FILE line N: why" per damaged record left out
    title: str | None = None        # the name a rename gave it
    model: str | None = None        # the model it last ran with (None: not recorded)
    model_from: int = 0             # turns before this index ran under another model
    started: float = 0.0            # seconds since the epoch, from its start record
    dropped: int = 0                # the oldest messages after the system prompt that drop-oldest dropped
    replies: dict[int, TurnRecord] = field(default_factory=dict)   # index in messages -> its reply's turn
    sampling: dict[str, Any] | None = None   # the last /temperature, /top-p, /seed: {"temperature": ...}
    number: int | None = None       # the number the chat screen last gave it (kvchat/chat/numbering.py)

    @property
    def skipped(self) -> int:
        return len(self.problems)

    @property
    def history(self) -> History:
        return History(list(self.messages), self.dropped, dict(self.replies))

    @property
    def visible(self) -> Messages:
        """What the model saw: the messages less the ones drop-oldest dropped."""
        return self.history.visible


def lock_holder(path: Path) -> int | None:
    """The pid holding an flock on `path` (from /proc/locks; Linux), or None if none is
    found. Advisory: a process that never locks is not seen."""
    try:
        inode = path.stat().st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as fh:
            for line in fh:
                f = line.split()
                if len(f) > 5 and f[1] == "FLOCK" and f[5].rsplit(":", 1)[-1] == str(inode):
                    return int(f[4])
    except (OSError, ValueError):
        pass
    return None


def _busy(path: Path, then: str = "close it there first, or start a new conversation") -> ConversationBusy:
    pid = lock_holder(path)
    who = f"another kvchat (pid {pid})" if pid else "another kvchat"
    return ConversationBusy(f"conversation {path.name} is open in {who}; {then}")


def _repair_tail(fd: int) -> int:
    """Cut a torn last line (a crash mid-write) back to the last complete record, so the next
    record starts on a line of its own; a last line that is whole JSON only gets its newline.
    Returns the bytes cut."""
    size = os.fstat(fd).st_size
    pos, tail = size, b""
    while pos > 0:                               # read back to the last newline
        step = min(65536, pos)
        pos -= step
        tail = os.pread(fd, step, pos) + tail
        nl = tail.rfind(b"\n")
        if nl >= 0:
            pos, tail = pos + nl + 1, tail[nl + 1:]
            break
    if not tail:
        return 0
    try:
        json.loads(tail)
    except ValueError:
        os.ftruncate(fd, pos)
        os.fsync(fd)
        return len(tail)
    os.write(fd, b"\n")
    return 0


@contextlib.contextmanager
def held(path: Path, then: str) -> Iterator[None]:
    """The lock a conversation's writer holds, taken for a change made from outside it (a
    delete from the chat browser): ConversationBusy, naming the holder's pid, while another
    kvchat has the conversation open, so it never writes on into an unlinked file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(path, then) from None
        yield
    finally:
        os.close(fd)      # releases the lock


class _LogFile:
    """One conversation file open for appending: created with mode 0600, never through a
    symlink, held under an advisory lock (flock) while open, its torn last line repaired."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):          # a FIFO named *.jsonl: never written to
            os.close(fd)
            raise OSError(errno.EINVAL, "is not a regular file; kvchat writes its logs to regular files only",
                          str(path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(path) from None
        try:
            self.repaired = _repair_tail(fd)
        except OSError:
            os.close(fd)
            raise
        self.fd = fd

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        start = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except OSError:
            os.ftruncate(self.fd, start)   # no half record left behind (disk full mid-write)
            raise

    def close(self) -> None:
        os.close(self.fd)   # releases the lock


class ConversationLog:
    """Appends one conversation's records; safe to call from the UI and worker threads.

    The file is created with the first message: until then the start and settings records
    wait in memory, so opening kvchat and quitting leaves no empty conversation to resume.

    A record that cannot be written (read-only or full disk) never raises into the caller:
    it stays in `unsaved`, `error` holds one line saying why, `on_error` (if set) is called
    with that line once, and every later write tries the file again, oldest record first.
    Only a file locked by another process raises (ConversationBusy), when it is opened."""

    def __init__(self, path: Path, messages: Messages | None = None, restored: Restored | None = None) -> None:
        self.path = path
        self.history = History([dict(m) for m in messages or []])   # what the log says so far
        self._file: _LogFile | None = None
        self._held: list[dict[str, Any]] = []
        self.unsaved: list[dict[str, Any]] = []
        self.error: str | None = None
        self.on_error: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        if os.path.lexists(path):
            # the file's own view: a restored unanswered message is in it (restore() popped it
            # for the input), so sending that message again appends nothing twice
            on_file = restored if restored is not None and restored.path == path else restore(path)
            orphan = [{"role": "user", "content": on_file.unanswered}] if on_file.unanswered else []
            self.history = History(on_file.messages + orphan, on_file.dropped, dict(on_file.replies))
            try:
                self._file = _LogFile(path)
            except ConversationBusy:
                raise
            except OSError as err:   # read-only now: keep going in memory, as a failed write does
                self.error = self._failure(err)

    def _put(self, record: dict[str, Any]) -> None:
        """Write (the caller holds the lock); start and event records wait for a message."""
        if self._file is None and not self.unsaved and record["type"] in ("start", "event"):
            self._held.append(record)
            return
        self.unsaved.extend(self._held + [record])
        self._held = []
        try:
            if self._file is None:
                self._file = _LogFile(self.path)
            while self.unsaved:
                self._file.write(self.unsaved[0])
                self.unsaved.pop(0)
        except OSError as err:
            line = self._failure(err)
            first = self.error is None
            self.error = line
            if first and self.on_error is not None:
                self.on_error(line)
            return
        self.error = None

    def _failure(self, err: OSError) -> str:
        if isinstance(err, ConversationBusy):
            return str(err)
        return (f"cannot write the conversation log {self.path.name}: {cannot_write(self.path, err, DATA_ENV)}; "
                "the conversation is kept in memory: /save FILE elsewhere to keep it")

    @classmethod
    def create(cls, root: Path | None = None, **start: Any) -> ConversationLog:
        folder = conversations_dir(root)
        path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}.jsonl"
        log = cls(path)
        log.write({"type": "start", "time": time.time(), **start})
        system = start.get("system")
        if system:
            log.history.append({"role": "system", "content": system})
        return log

    @property
    def messages(self) -> Messages:
        """Every message the log holds, the ones drop-oldest dropped included."""
        return self.history.messages

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._put(record)

    def sync(self, visible: Messages, dropped: int | None = None) -> None:
        """Record the conversation as the model now sees it (`visible`), with `dropped` of
        its oldest messages out of its sight (None: as many as before), the dropped ones
        kept: a change in that count as a "dropped" event, appended messages one by one,
        anything else as the whole list."""
        with self._lock:
            h = self.history
            dropped = h.dropped if dropped is None else dropped
            messages = h.with_visible(visible, dropped)
            if dropped != h.dropped:
                self._put({"type": "event", "event": "dropped", "value": dropped, "time": time.time()})
            n = len(h.messages)
            if messages[:n] == h.messages:
                for m in messages[n:]:
                    self._put({"type": "message", "role": m["role"], "content": m["content"]})
                    h.append(m)
            else:
                self._put({"type": "messages", "messages": messages})
                h.replace(messages)
            h.dropped = dropped

    def keep_unsent(self, texts: list[str]) -> None:
        """Messages typed but never sent (they waited behind a reply when the app quit): kept as
        the conversation's unanswered last message, joined by blank lines (to one already
        unanswered too), so --resume puts them back in the input, as it does a message whose
        reply a kill cut off before its first token."""
        if not texts:
            return
        h = self.history
        visible = [dict(m) for m in h.visible]
        last = len(h.messages) - 1
        if visible and visible[-1]["role"] == "user" and not h.is_dropped(last):
            texts = [visible.pop()["content"], *texts]
        self.sync(visible + [{"role": "user", "content": "\n\n".join(texts)}], h.dropped)

    def turn(self, record: TurnRecord) -> None:
        with self._lock:
            self._put({"type": "turn", **record.to_dict()})
            self.history.link(record)

    def event(self, name: str, **fields: Any) -> None:
        self.write({"type": "event", "event": name, "time": time.time(), **fields})

    def mark(self, name: str, **fields: Any) -> None:
        """An event that is no use of the conversation (reopening it, a rename): the file's
        modification time, which the chat browser lists as "last used", stays as it was."""
        try:
            before = os.stat(self.path, follow_symlinks=False).st_mtime_ns
        except OSError:
            before = None
        self.event(name, **fields)
        if before is not None:
            with contextlib.suppress(OSError):
                os.utime(self.path, ns=(time.time_ns(), before), follow_symlinks=False)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def saved_logs(root: Path | None = None) -> list[Path]:
    """The conversation logs in kvchat's own folder: regular *.jsonl files there, never a link
    (which could point anywhere) nor a FIFO (which would hang the reader)."""
    folder = conversations_dir(root)
    if not folder.is_dir():
        return []
    out = []
    for p in folder.glob("*.jsonl"):
        try:
            if stat.S_ISREG(p.lstat().st_mode):
                out.append(p)
        except OSError:
            continue
    return out


def is_saved_log(path: Path, root: Path | None = None) -> bool:
    """Whether `path` names one of kvchat's own logs (what --resume may reopen and append to)."""
    try:
        return (path.suffix == ".jsonl" and path.parent.resolve() == conversations_dir(root).resolve()
                and stat.S_ISREG(path.lstat().st_mode))
    except OSError:
        return False


def last_conversation(root: Path | None = None) -> Path | None:
    files = sorted(saved_logs(root), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def restore(path: Path, progress: Progress | None = None) -> Restored:
    """Replay a conversation log (read once, by log_records.read_log). A damaged record (a
    torn line after a crash, a hand edit) is skipped and named in `problems`; the rest of the
    conversation is kept. The messages fold through a History, so drop-oldest's dropped
    messages stay (dimmed, out of the model's sight) and each turn record is tied to its reply."""
    log = read_log(path, progress)
    out = Restored(path, problems=log.problems)
    history = History()
    for number, rec in enumerate(log.records):
        if isinstance(rec, Start):
            history = History([{"role": "system", "content": rec.system}] if rec.system else [])
            out.cap, out.policy, out.mode = rec.cap, rec.policy, rec.mode
            out.model, out.started = rec.model, rec.time
        elif isinstance(rec, Appended):
            history.append({"role": rec.role, "content": rec.content})
        elif isinstance(rec, Replaced):
            history.replace([dict(m) for m in rec.messages])
        elif isinstance(rec, TurnRecord):
            out.turns.append(rec)
            history.link(rec)
        elif isinstance(rec, Event) and rec.name == "dropped":
            value = rec.value
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= len(history.chat):
                out.problems.append(f"{path.name}: a dropped count {str(value)[:40]!r} past the conversation's "
                                    f"{len(history.chat)} messages (record {number + 1})")
                continue
            history.dropped = value
        elif isinstance(rec, Event) and rec.name in SETTINGS:
            setattr(out, rec.name, rec.value)
        elif isinstance(rec, Event) and rec.name == "sampling":
            out.sampling = dict(rec.value)
        elif isinstance(rec, Event) and rec.name == "title":
            out.title = rec.value.strip()
        elif isinstance(rec, Event) and rec.name == "model":
            out.model, out.model_from = rec.value, len(out.turns)
        elif isinstance(rec, Event) and rec.name == "number":
            value = rec.value       # one kvchat would not have written is left out, not a problem
            if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_NUMBER:
                out.number = value
    out.messages, out.dropped, out.replies = history.messages, history.dropped, history.replies
    if out.messages and out.messages[-1]["role"] == "user" and not history.is_dropped(len(out.messages) - 1):
        out.unanswered = out.messages.pop()["content"]
    return out
