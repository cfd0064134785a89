"""catalog.py on hand-written logs (no app): summaries, search, rename, the model events,
and what --resume opens."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvchat.store import catalog
from kvchat.store.log import ConversationBusy, ConversationLog, conversations_dir, restore


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


def test_a_log_is_read_again_only_when_it_changed(monkeypatch):
    """The browser's second opening must not read every log again (a 97 MB log took 3 s), and
    must see a log that changed since, and forget one deleted."""
    path = write_log("a", START, {"type": "message", "role": "user", "content": "first words"})
    other = write_log("b", START, {"type": "message", "role": "user", "content": "other words"})
    reads = []
    real = catalog.restore
    monkeypatch.setattr(catalog, "restore", lambda p: reads.append(p.name) or real(p))
    seen = []
    assert len(catalog.list_conversations(progress=lambda done, total: seen.append((done, total)))) == 2
    assert sorted(reads) == ["a.jsonl", "b.jsonl"] and seen == [(1, 2), (2, 2)]
    reads.clear()
    catalog.list_conversations()
    assert reads == []                                   # unchanged: from what was read
    with open(path, "a") as fh:
        fh.write(json.dumps({"type": "message", "role": "assistant", "content": "a reply"}) + "\n")
    catalog.rename(other, "named")                       # an event appended: changed too
    by_path = {s.path: s for s in catalog.list_conversations()}
    assert sorted(reads) == ["a.jsonl", "b.jsonl"]
    assert by_path[path].messages == 2 and by_path[other].title == "named"
    other.unlink()
    assert [s.path for s in catalog.list_conversations()] == [path] and other not in catalog._READ


def test_a_regenerated_reply_is_no_other_turn_in_the_browsers_count():
    """Two replies generated for one message (F5 regenerates the first): one turn, two records."""
    user = {"role": "user", "content": "Name a colour."}
    path = write_log("r", START, {"type": "message", **user},
                     {"type": "message", "role": "assistant", "content": "Red."},
                     {"type": "turn", "prompt_tokens": 20, "generated_tokens": 2},
                     {"type": "messages", "messages": [user, {"role": "assistant", "content": "Blue."}]},
                     {"type": "turn", "prompt_tokens": 20, "generated_tokens": 2})
    s = catalog.summarize(path)
    assert len(restore(path).turns) == 2 and s.turns == 1


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


HOLDER = """
import sys
from pathlib import Path
from kvchat.store.log import ConversationLog
log = ConversationLog(Path(sys.argv[1]))
log.event("resumed")
print("holding", flush=True)
sys.stdin.readline()
log.sync(log.messages + [{"role": "user", "content": "written after the delete was asked"}])
log.close()
"""


def test_a_conversation_open_in_another_process_is_neither_deleted_nor_renamed_under_it():
    """Issue 26 high 1: the browser of a second kvchat deleted a conversation the first had
    open, which wrote on into the unlinked file; the delete takes the writer's lock now."""
    path = write_log("held", START, {"type": "message", "role": "user", "content": "keep me"})
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(ConversationBusy, match=rf"open in another kvchat \(pid {holder.pid}\); close it there "
                                                   "first, then delete it"):
            catalog.delete(path)
        with pytest.raises(ConversationBusy, match=rf"pid {holder.pid}"):
            catalog.rename(path, "a new name")
        assert path.exists()
        holder.communicate("go on\n", timeout=30)
    finally:
        holder.kill()
    r = restore(path)
    assert [m["content"] for m in r.messages] + [r.unanswered] == ["keep me", "written after the delete was asked"]
    catalog.delete(path)                     # closed there: now it goes
    assert not path.exists()


REMEMBERER = """
import sys
from pathlib import Path
from kvchat.store import catalog
print(catalog.remember_open([Path(sys.argv[1])]), flush=True)
sys.stdin.readline()
"""


def test_two_processes_keep_each_others_open_conversations_for_resume():
    """Issue 26: two kvchats on one data folder overwrote each other's list of open
    conversations, so --resume reopened only the last writer's. Each keeps its own list now,
    also after the other quits; a list left by a process that had quit before is replaced."""
    stale = write_log("stale", START, mtime=1_000)
    (conversations_dir().parent / catalog.OPEN_FILE).write_text(json.dumps({"open": [str(stale)]}))   # a quit kvchat's
    theirs = write_log("theirs", START, mtime=2_000)
    mine = write_log("mine", START, mtime=3_000)
    other = subprocess.Popen([sys.executable, "-c", REMEMBERER, str(theirs)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "None"   # the other kvchat recorded its list, replacing
        assert catalog.open_at_quit() == [theirs]          # the one left before it started
        peers: set[int] = set()
        assert catalog.remember_open([mine], peers=peers) is None
        assert set(catalog.open_at_quit()) == {mine, theirs} and peers == {other.pid}
        other.communicate("quit\n", timeout=30)
    finally:
        other.kill()
    assert catalog.remember_open([mine], peers=peers) is None   # it quit while we ran: its list stays
    assert catalog.resume_paths() == (mine, [theirs])


def test_a_rename_or_a_reopen_leaves_last_used_as_it_was():
    """Issue 26 low: the browser's "last used" was rewritten by a rename and by --resume."""
    path = write_log("used", START, {"type": "message", "role": "user", "content": "hi"}, mtime=1_000)
    catalog.rename(path, "a title")
    assert catalog.summarize(path).modified == 1_000 and catalog.summarize(path).title == "a title"
    log = ConversationLog(path)
    log.mark("resumed")
    assert catalog.summarize(path).modified == 1_000
    log.sync(log.messages + [{"role": "assistant", "content": "hello"}])     # a use: it moves
    log.close()
    assert catalog.summarize(path).modified > 1_000
