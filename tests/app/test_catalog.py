"""catalog.py on hand-written logs (no app): summaries, search, rename, the model events,
and what --resume opens."""
from __future__ import annotations

import json
import os

from kvchat.store import catalog
from kvchat.store.log import conversations_dir


def write_log(name: str, *records: dict, mtime: float | None = None):
    folder = conversations_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


START = {"type": "start", "time": 1_700_000_000.0, "model": "model-a", "system": None}


def test_a_summary_reads_title_model_turns_tokens_and_skips_a_damaged_line():
    path = write_log("a", START, {"type": "message", "role": "user", "content": "Why is the sky blue?"},
                     {"type": "message", "role": "assistant", "content": "Rayleigh scattering."},
                     {"type": "turn", "prompt_tokens": 20, "generated_tokens": 5})
    with open(path, "a") as fh:
        fh.write('{"type": "message", "role": "us')          # a torn last line
    s = catalog.summarize(path)
    assert (s.title, s.model, s.turns, s.tokens, s.messages) == ("Why is the sky blue?", "model-a", 1, 25, 2)
    assert s.matches("rayleigh SKY") and not s.matches("rayleigh green")


def test_rename_and_model_events_are_read_back():
    path = write_log("b", START, {"type": "message", "role": "user", "content": "hi"},
                     {"type": "turn", "prompt_tokens": 3, "generated_tokens": 1},
                     {"type": "event", "event": "model", "value": "model-b", "previous": "model-a"})
    catalog.rename(path, "Greetings")
    s = catalog.summarize(path)
    assert (s.title, s.named, s.model, s.model_from) == ("Greetings", True, "model-b", 1)
    assert s.matches("greetings")


def test_resume_opens_the_conversations_open_at_quit_the_last_used_in_focus_else_the_last_saved():
    older = write_log("older", START, mtime=1_000)
    newer = write_log("newer", START, mtime=2_000)
    closed = write_log("closed", START, mtime=3_000)     # the last saved, but not open at quit
    assert catalog.resume_paths() == (closed, [])        # nothing recorded: the last saved alone
    gone = older.with_name("never-written.jsonl")
    assert catalog.remember_open([older, newer, gone]) is None
    assert catalog.resume_paths() == (newer, [older])   # a conversation with no file is left out
    assert [s.path for s in catalog.list_conversations()] == [closed, newer, older]
