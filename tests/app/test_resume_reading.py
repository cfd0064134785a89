"""`kvchat --resume` of a long log: before the UI starts, one line of stderr says how far the
reading is, rewritten in place, and ends at 100% with a newline; nothing when stderr is not a
terminal (a redirected stderr would fill with carriage returns)."""
from __future__ import annotations

import io
import json

from kvchat.cli import launch
from kvchat.store import log_records
from kvchat.store.log import conversations_dir, restore


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def long_log(n: int):
    folder = conversations_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "long.jsonl"
    lines = [{"type": "start", "time": 1.7e9, "model": "m", "system": None}]
    for i in range(n):
        lines.append({"type": "message", "role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_a_long_log_read_back_tells_its_progress_on_one_rewritten_line(monkeypatch):
    path = long_log(400)
    monkeypatch.setattr(log_records, "PROGRESS_BYTES", 8192)   # a small log stands for a 97 MB one
    err = Terminal()
    monkeypatch.setattr("sys.stderr", err)
    tell = launch._reading(path)
    assert tell is not None
    restored = restore(path, tell)
    assert len(restored.messages) == 400
    out = err.getvalue()
    updates = out.split("\r")[1:]
    assert len(updates) >= 5 and out.count("\n") == 1 and out.endswith("(100%)\n"), out[-300:]
    assert all(u.startswith("reading long.jsonl: ") for u in updates)
    percents = [int(u.rsplit("(", 1)[1].split("%")[0]) for u in updates]
    assert percents == sorted(percents) and percents[0] < 100


def test_nothing_is_written_when_stderr_is_not_a_terminal(monkeypatch):
    path = long_log(10)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    assert launch._reading(path) is None
    assert err.getvalue() == ""
