"""Saved state that is not what kvchat wrote (issue 27, high 5 and medium): turn records of the
wrong types, a log that is a FIFO, a link or too large, open.json naming a file outside the
conversations folder, a log that is not UTF-8, a settings file nested too deeply. Each record
that fails is skipped with a line naming the file and line, the rest of the conversation
opens, nothing outside kvchat's folders is written, and nothing waits for ever."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kvchat.chat.session import ChatOptions, Session
from kvchat.cli.command import main
from kvchat.store import catalog
from kvchat.store.history import replies
from kvchat.store.log import StoreError, conversations_dir, data_dir, restore
from kvchat.store.settings import config_path
from kvchat.widgets import LatencyPanel, Notice, Reply, UserMessage
from kvchat.screens.chat_browser import ChatBrowser

from .conftest import screen_text, send, wait_until
from .fake_backend import FakeBackend

pytestmark = pytest.mark.timeout(60)


def turn(n: int, reply: str, **changes) -> dict:
    """A turn record as kvchat writes it (the keys of TurnStats.summary())."""
    rec = {"type": "turn", "turn": n, "reply": reply, "prompt_tokens": 20 * n, "reused_tokens": 0,
           "computed_tokens": 20 * n, "generated_tokens": 3, "ttft_ms": 12.5, "prefill_ms": 10.0,
           "decode_ms": [4.0, 4.5], "positions": [20 * n + 1, 20 * n + 2], "stop_reason": "eos",
           "kv_bytes_per_token": 46080, "kv_bytes_used": 100, "kv_bytes_allocated": 100, "kv_capacity_bytes": 1000,
           "block_size": 16, "blocks_used": 2, "tokens_held": 23, "mode": "cache", "kv_dtype": "fp32",
           "policy": "stop", "cap": None, "dropped_messages": 0, "evicted_blocks": 0, "preempted": 0,
           "recomputed_tokens": 0}
    rec.update(changes)
    return rec


def write_log(lines: list[str | dict], name: str = "20250101-000000-aaaaaaaa.jsonl") -> Path:
    folder = conversations_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def conversation(bad_turn: dict | str) -> list:
    """Two turns; the second turn's record replaced by `bad_turn`."""
    return [{"type": "start", "time": 1.7e9, "model": "fake-smollm2", "system": None, "cap": None,
             "policy": "stop", "mode": "cache"},
            {"type": "message", "role": "user", "content": "first question"},
            {"type": "message", "role": "assistant", "content": "first answer"}, turn(1, "first answer"),
            {"type": "message", "role": "user", "content": "second question"},
            {"type": "message", "role": "assistant", "content": "second answer"}, bad_turn]


BAD_TURNS = {
    "decode-ms-a-string": turn(2, "second answer", decode_ms="4.0, 4.5"),
    "ttft-a-string": turn(2, "second answer", ttft_ms="fast"),
    "prompt-tokens-1e999": json.dumps(turn(2, "second answer")).replace('"prompt_tokens": 40', '"prompt_tokens": 1e999'),
    "nan-latency": json.dumps(turn(2, "second answer")).replace("4.5]", "NaN]"),
    "stop-reason-a-dict": turn(2, "second answer", stop_reason={"why": "eos"}),
    "mode-a-number": turn(2, "second answer", mode=3),
    "deep-nesting": '{"type": "turn", "reply": ' + "[" * 100_000 + "]" * 100_000 + "}",
    "positions-not-ints": turn(2, "second answer", positions=["a", "b"]),
}


@pytest.mark.parametrize("name", sorted(BAD_TURNS))
async def test_a_bad_turn_record_is_skipped_by_name_and_the_rest_opens(running_app, name):
    path = write_log(conversation(BAD_TURNS[name]))
    async with running_app(restored=restore(path)) as (app, pilot):
        await wait_until(pilot, lambda: len(app.chat_screen.view.query(Reply)) == 2, what="the restored replies")
        app.query_one(LatencyPanel)                   # the panels drew the restored turn
        await send(pilot, "a third question")          # and the conversation goes on
        lines = [n.text for n in app.chat_screen.view.query(Notice) if n.has_class("error")]
        assert any(f"{path.name} line 7" in line for line in lines), lines
        assert len(app.chat_screen.session.turns) == 2
    restored = restore(path)                          # the bad record stays on file, skipped again
    assert len(restored.turns) == 2 and len(restored.problems) == 1 and "line 7" in restored.problems[0]


def test_the_browser_and_resume_read_the_same_records():
    path = write_log(conversation(BAD_TURNS["mode-a-number"]) + [{"type": "event", "event": "title",
                                                                   "value": "named here"}])
    summary = catalog.summarize(path)
    restored = restore(path)
    assert (summary.title, summary.turns, summary.model) == ("named here", replies(restored.messages), restored.model)


# ---- files that are not kvchat's --------------------------------------------------------------------
def fake_resume() -> Path:
    """What --resume does before the UI: pick the conversations, read the focused one, and
    open it for appending (Session.open writes a "resumed" event)."""
    last, _ = catalog.resume_paths()
    restored = restore(last)
    session = Session.open(FakeBackend(), 1, ChatOptions(), None, restored)
    session.log.close()
    return last


def test_open_json_naming_a_file_outside_the_conversations_folder_is_never_written(tmp_path):
    mine = write_log(conversation(turn(2, "second answer")))
    notes = tmp_path / "notes.txt"
    notes.write_text('{"type": "message", "role": "user", "content": "my own notes"}\n')
    (data_dir() / "open.json").write_text(json.dumps({"open": [str(notes)]}))
    before = notes.read_bytes()
    assert fake_resume() == mine
    assert notes.read_bytes() == before


def test_a_link_in_the_conversations_folder_is_not_a_conversation(tmp_path):
    mine = write_log(conversation(turn(2, "second answer")))
    notes = tmp_path / "notes.txt"
    notes.write_text('{"type": "message", "role": "user", "content": "my own notes"}\n')
    os.utime(mine, (1, 1))                                           # the link is the newest entry
    (conversations_dir() / "20990101-000000-bbbbbbbb.jsonl").symlink_to(notes)
    before = notes.read_bytes()
    assert fake_resume() == mine and [s.path for s in catalog.list_conversations()] == [mine]
    assert notes.read_bytes() == before


def test_a_fifo_named_like_a_log_hangs_neither_resume_nor_the_browser():
    mine = write_log(conversation(turn(2, "second answer")))
    os.utime(mine, (1, 1))
    os.mkfifo(conversations_dir() / "20990101-000000-cccccccc.jsonl")
    t0 = time.monotonic()
    assert [s.path for s in catalog.list_conversations()] == [mine]
    assert fake_resume() == mine and time.monotonic() - t0 < 5


def test_a_fifo_named_in_open_json_hangs_nothing():
    mine = write_log(conversation(turn(2, "second answer")))
    fifo = conversations_dir() / "20990101-000000-dddddddd.jsonl"
    os.mkfifo(fifo)
    (data_dir() / "open.json").write_text(json.dumps({"open": [str(fifo)]}))
    assert fake_resume() == mine


async def test_the_chat_browser_opens_and_quits_with_a_fifo_in_the_folder(running_app):
    write_log(conversation(turn(2, "second answer")))
    os.mkfifo(conversations_dir() / "20990101-000000-eeeeeeee.jsonl")
    async with running_app() as (app, pilot):
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser) and app.screen.loaded, what="the chat browser")
        assert [s.title for s in app.screen.shown] == ["first question"]
        await pilot.press("escape")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: app.return_code is not None or not app.is_running, what="quit")


def test_a_log_past_the_size_limit_is_one_line_not_a_slow_read():
    path = write_log(conversation(turn(2, "second answer")))
    with open(path, "r+b") as fh:
        fh.truncate(300 * 2**20)                       # sparse: 300 MB of NULs after the records
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="limit"):
        restore(path)
    assert time.monotonic() - t0 < 2


async def test_a_log_that_is_not_utf8_names_its_lines_and_opens_the_rest(running_app):
    good = conversation(turn(2, "second answer"))
    path = write_log(good)
    raw = path.read_bytes().replace(b'"second question"', '"deuxi\u00e8me"'.encode("latin-1"))
    path.write_bytes(raw)
    restored = restore(path)
    assert len(restored.problems) == 1
    assert restored.problems[0].startswith(f"{path.name} line 5: not UTF-8 text (byte 0xe8 at offset")
    async with running_app(restored=restored) as (app, pilot):
        await wait_until(pilot, lambda: len(app.chat_screen.view.query(Reply)) == 2, what="the restored replies")
        assert [w.text for w in app.chat_screen.view.query(UserMessage)] == ["first question"]
        assert any("line 5: not UTF-8" in n.text for n in app.chat_screen.view.query(Notice))


# ---- escape sequences in a saved conversation ---------------------------------------------------------
async def test_escape_sequences_in_a_resumed_log_and_its_title_reach_the_screen_inert(running_app):
    evil = "\x1b]0;PWNED\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J\x1b[?1049h"
    lines = conversation(turn(2, f"second{evil}answer"))
    lines[4]["content"] = f"question{evil}"
    lines[5]["content"] = f"second{evil}answer"
    path = write_log(lines + [{"type": "event", "event": "title", "value": f"title{evil}"}])
    async with running_app(restored=restore(path)) as (app, pilot):
        await wait_until(pilot, lambda: len(app.chat_screen.view.query(Reply)) == 2, what="the restored replies")
        await pilot.pause()
        text = screen_text(app)
        assert "\x1b" not in text and "\x07" not in text and "question\\x1b]0;PWNED" in text
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser) and app.screen.loaded, what="the chat browser")
        await pilot.pause()
        text = screen_text(app)
        assert "\x1b" not in text and "title\\x1b" in text


# ---- the settings file ----------------------------------------------------------------------------
def test_a_deeply_nested_settings_file_is_one_line(capsys):
    config_path().parent.mkdir(parents=True)
    config_path().write_text("[" * 100_000 + "]" * 100_000)
    code = main([])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "settings" in err and "nested too deeply" in err


def test_a_settings_file_that_is_a_fifo_is_one_line(capsys):
    config_path().parent.mkdir(parents=True)
    os.mkfifo(config_path())
    code = main([])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "not a regular file" in err


def test_an_error_log_that_is_a_fifo_does_not_hang_an_internal_error(capsys, monkeypatch):
    data_dir().mkdir(parents=True)
    os.mkfifo(data_dir() / "errors.log")
    from kvchat.cli import command

    def broken(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(command, "cmd_info", broken)
    parser = command.build_parser
    monkeypatch.setattr(command, "build_parser", lambda: _with_func(parser(), broken))
    code = main(["info"])
    err = capsys.readouterr().err
    assert code == 1 and "internal error" in err and "not a regular file" in err


def _with_func(parser, func):
    for action in parser._subparsers._group_actions:
        action.choices["info"].set_defaults(func=func)
    return parser


# ---- folders kvchat cannot write --------------------------------------------------------------------
async def test_unwritable_data_and_config_folders_are_named_with_how_to_move_them(running_app, private_dirs,
                                                                                  monkeypatch):
    """A file where each folder should be: as root, the one failure a test can make happen."""
    for env, name in (("KVCHAT_DATA_DIR", "data-file"), ("KVCHAT_CONFIG_DIR", "config-file")):
        (private_dirs / name).write_text("not a folder")
        monkeypatch.setenv(env, str(private_dirs / name))
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        await pilot.press("ctrl+t")
        await wait_until(pilot, lambda: len([n for n in app.query(Notice) if n.has_class("error")]) >= 3,
                         what="the three failures")
        lines = [n.text for n in app.query(Notice) if n.has_class("error")]
        log = next(x for x in lines if "conversation log" in x)
        theme = next(x for x in lines if "theme" in x)
        assert f"folder {private_dirs / 'data-file' / 'conversations'}" in log and "KVCHAT_DATA_DIR" in log
        assert f"folder {private_dirs / 'config-file'}" in theme and "KVCHAT_CONFIG_DIR" in theme
