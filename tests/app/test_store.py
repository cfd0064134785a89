"""Conversations on disk: written as they happen, read back by --resume, exported by /save;
and the settings file."""
from __future__ import annotations

import json

import pytest

from kvchat.store import settings as settings_mod
from kvchat.store.history import History
from kvchat.store.records import TurnRecord
from kvchat.store.settings import Settings, SettingsError
from kvchat.store.export import export
from kvchat.store.log import ConversationLog, last_conversation, restore
from kvchat.widgets import ChatInput, LatencyPanel, Reply, UserMessage

from .conftest import send, wait_until

SUMMARY = {"turn": 1, "reply": "hi there", "prompt_tokens": 12, "reused_tokens": 0, "computed_tokens": 12,
           "generated_tokens": 2, "ttft_ms": 30.0, "decode_ms": [10.0, 11.0], "positions": [12, 13],
           "stop_reason": "eos", "mode": "cache", "kv_bytes_per_token": 46080}


def test_appends_are_logged_message_by_message_and_other_changes_as_the_whole_list(tmp_path):
    log = ConversationLog.create(tmp_path, model="m", system="sys", cap=None, policy="stop", mode="cache")
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "a"}]
    log.sync(msgs)
    log.sync(msgs + [{"role": "assistant", "content": "b"}])
    log.sync([{"role": "system", "content": "sys"}])          # e.g. drop-oldest or regenerate
    kinds = [json.loads(x)["type"] for x in log.path.read_text().splitlines()]
    assert kinds == ["start", "message", "message", "messages"]


def test_restore_replays_messages_turns_and_settings_and_returns_an_unanswered_message(tmp_path):
    log = ConversationLog.create(tmp_path, model="m", system=None, cap=None, policy="stop", mode="cache")
    log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}])
    log.turn(TurnRecord.from_dict(SUMMARY))
    log.event("cap", value=512)
    log.event("policy", value="drop-oldest")
    log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
              {"role": "user", "content": "are you there?"}])
    with open(log.path, "a") as fh:
        fh.write('{"type": "turn", "tor')                       # a crash mid-write
    r = restore(last_conversation(tmp_path))
    assert r.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
    assert r.unanswered == "are you there?" and r.cap == 512 and r.policy == "drop-oldest"
    assert r.turns[0].reply == "hi there"


def test_a_turn_record_writes_back_the_json_it_was_read_from():
    """Old files resume: summary() keys round-trip in order, missing keys take defaults, and
    keys TurnRecord does not know are written back as found."""
    from kvchat.engine.telemetry import CacheSnapshot, TurnStats
    snap = CacheSnapshot("m", "fp32", 16, 8, 4, 512, 3, 12, 64, 1, 13, 7, 1, 0, 0, bytes(8), None, "stop",
                         "cache", 0, 0)
    stats = TurnStats(1, 5, 0, 5, 2, 3.0, 2.0, (1.0, 2.0), (5, 6), "eos", "hi", "cache", "fp32", "stop", 0, 0,
                      0, 0, snap)
    assert TurnRecord.from_stats(stats).to_dict() == stats.summary()
    assert list(TurnRecord.from_stats(stats).to_dict()) == list(stats.summary())
    old = dict(SUMMARY, future_key=1)
    record = TurnRecord.from_dict({"type": "turn", **old})
    assert record.generated_tokens == 2 and record.decode_ms == (10.0, 11.0) and record.prefill_ms == 0.0
    assert record.to_dict()["future_key"] == 1 and "type" not in record.to_dict()


def test_export_writes_the_transcript_with_stats_lines_and_the_telemetry(tmp_path):
    record = TurnRecord.from_dict(SUMMARY)
    history = History([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}],
                      replies={1: record})
    md, jl = export(tmp_path / "chat", history, [record], "m")
    assert md.name == "chat.md" and jl.name == "chat.jsonl"
    assert "## You\n\nhello" in md.read_text() and "2 tokens · TTFT 30 ms" in md.read_text()
    assert json.loads(jl.read_text())["positions"] == [12, 13]


async def test_resume_shows_the_saved_conversation_and_puts_an_unanswered_message_back(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "remember me")
        crashed = {"role": "user", "content": "lost in a crash"}
        app.chat_screen.session.log.sync([*app.chat_screen.session.chat.state().messages, crashed])
    app.chat_screen.session.log.close()    # what the process's exit does: --resume is always a new process
    restored = restore(last_conversation())
    async with running_app(restored=restored) as (app, pilot):
        assert app.query_one(UserMessage).text == "remember me" and app.query_one(Reply).text
        assert app.query_one(ChatInput).text == "lost in a crash"
        assert app.query_one(LatencyPanel).point_count == restored.turns[0].generated_tokens
        await send(pilot, "and now")
        assert app.chat_screen.session.turns[-1].reused_tokens == 0      # the cache started empty
        assert app.chat_screen.session.log.path == restored.path


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    ('["dark"]', "expected a JSON object"),
    ('{"colour": "red"}', "unknown setting 'colour'"),
    ('{"keys": {"reset": "ctrl+e"}}', "unknown key id 'reset'"),
    ('{"keys": {"reset_cache": "r"}}', "printable character"),
    ('{"theme": 3}', "'theme' must be a theme name"),
    ('{"keys": {"reset_cache": "ctrl+q"}}', "already 'quit'"),             # would take quit's key
    ('{"keys": {"reset_cache": "f5"}}', "already 'regenerate'"),
    ('{"keys": {"reset_cache": "ctrl+frobnicate"}}', "not a key name"),
    ('{"keys": {"reset_cache": "hyperctrl+e"}}', "not a key name"),
    ('{"keys": {"reset_cache": "ctrl+"}}', "not a key name"),
    ('{"keys": {"reset_cache": "enter"}}', "the message input's own key"),
    ('{"keys": {"reset_cache": "ctrl+c"}}', "the message input's own key"),
    ('{"keys": {"quit": ["ctrl+q"]}}', "must be a string"),
])
def test_a_bad_settings_file_is_one_line_naming_the_file_and_the_problem(tmp_path, content, problem):
    path = tmp_path / "settings.json"
    path.write_text(content)
    with pytest.raises(SettingsError) as err:
        settings_mod.load(path)
    assert problem in str(err.value) and str(path) in str(err.value)


def test_settings_round_trip_and_a_missing_file_gives_defaults(tmp_path):
    path = tmp_path / "cfg" / "settings.json"
    assert settings_mod.load(path) == Settings()
    settings_mod.save(Settings(theme="light", keys={"quit": "ctrl+x"}), path)
    assert settings_mod.load(path) == Settings(theme="light", keys={"quit": "ctrl+x"})


async def test_a_session_without_messages_leaves_nothing_to_resume(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f3")                    # a setting alone is not a conversation
        await pilot.press("ctrl+q")
    assert last_conversation() is None


# ---- damage, duplicates, locks and file modes (issue 11) -------------------------------------
def two_turns(tmp_path):
    log = ConversationLog.create(tmp_path, model="m", system=None, cap=None, policy="stop", mode="cache")
    log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}])
    log.turn(TurnRecord.from_dict(SUMMARY))
    log.close()
    return log.path


def test_a_torn_line_is_cut_on_reopen_so_the_conversation_survives_more_turns(tmp_path):
    path = two_turns(tmp_path)
    with open(path, "a") as fh:
        fh.write('{"type": "message", "role": "user", "cont')            # a crash mid-write
    r = restore(path)
    assert r.skipped == 1 and r.messages[-1]["content"] == "hi there"
    for turn in ("again", "and again"):                                  # resumed twice, a turn each
        log = ConversationLog(path, r.messages)
        log.sync(r.messages + [{"role": "user", "content": turn}, {"role": "assistant", "content": "ok"}])
        log.close()
        r = restore(path)
        assert r.skipped == 0
    assert [m["content"] for m in r.messages] == ["hello", "hi there", "again", "ok", "and again", "ok"]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_a_damaged_record_mid_file_is_skipped_and_counted_not_the_whole_conversation(tmp_path):
    path = two_turns(tmp_path)
    lines = path.read_text().splitlines()
    lines[1:1] = ["not json at all", '{"type": "message", "role": "user"}', "[" * 100000 + "]" * 100000,
                  '{"type": "event", "event": "cap", "value": "lots"}']
    path.write_text("\n".join(lines) + "\n")
    r = restore(path)
    assert r.skipped == 4 and r.cap is None
    assert r.messages == [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


def test_a_restored_unanswered_message_sent_again_is_stored_once(tmp_path):
    path = two_turns(tmp_path)
    log = ConversationLog(path)
    log.sync(restore(path).messages + [{"role": "user", "content": "lost in a crash"}])
    log.close()
    r = restore(path)
    assert r.unanswered == "lost in a crash"
    log = ConversationLog(path, r.messages)
    log.sync(r.messages + [{"role": "user", "content": r.unanswered}, {"role": "assistant", "content": "here"}])
    log.close()
    r = restore(path)
    assert [m["content"] for m in r.messages].count("lost in a crash") == 1
    assert r.messages[-2:] == [{"role": "user", "content": "lost in a crash"}, {"role": "assistant", "content": "here"}]


def test_logs_and_exports_are_private_to_their_owner(tmp_path):
    path = two_turns(tmp_path)
    md, jl = export(tmp_path / "chat", History([{"role": "user", "content": "hello"}]),
                    [TurnRecord.from_dict(SUMMARY)], "m")
    assert [f.stat().st_mode & 0o777 for f in (path, md, jl)] == [0o600, 0o600, 0o600]


def test_export_never_overwrites_without_asking_follows_no_symlink_and_refuses_a_directory(tmp_path):
    msgs = History([{"role": "user", "content": "hello"}])
    (tmp_path / "old.md").write_text("precious")
    with pytest.raises(FileExistsError, match="/save!"):
        export(tmp_path / "old", msgs, [], "m")
    assert (tmp_path / "old.md").read_text() == "precious" and not (tmp_path / "old.jsonl").exists()
    export(tmp_path / "old", msgs, [], "m", overwrite=True)
    assert "hello" in (tmp_path / "old.md").read_text()
    target = tmp_path / "target"
    target.write_text("not yours")
    (tmp_path / "link.md").symlink_to(target)
    for overwrite in (False, True):
        with pytest.raises(OSError, match="symbolic link"):
            export(tmp_path / "link", msgs, [], "m", overwrite=overwrite)
    assert target.read_text() == "not yours"
    (tmp_path / "etc").mkdir()
    with pytest.raises(IsADirectoryError):
        export(tmp_path / "etc", msgs, [], "m")
    assert not (tmp_path / "etc.md").exists()


def test_a_log_that_cannot_be_written_keeps_every_record_and_says_so_once(tmp_path):
    blocker = tmp_path / "data"
    blocker.write_text("a file where the data directory should be")     # every write fails, even as root
    said = []
    log = ConversationLog.create(blocker, model="m", system=None, cap=None, policy="stop", mode="cache")
    log.on_error = said.append
    log.sync([{"role": "user", "content": "hello"}])
    log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    assert len(said) == 1 and "kept in memory" in said[0] and "\n" not in said[0]
    assert [r["type"] for r in log.unsaved] == ["start", "message", "message"]
    blocker.unlink()                                                     # the disk comes back
    log.turn(TurnRecord.from_dict(SUMMARY))
    assert log.unsaved == [] and log.error is None
    assert restore(log.path).messages[-1] == {"role": "assistant", "content": "hi"}


def test_saving_the_theme_keeps_key_bindings_edited_in_the_file_meanwhile(tmp_path):
    path = tmp_path / "settings.json"
    running = settings_mod.load(path)                                        # the app starts
    path.write_text(json.dumps({"keys": {"reset_cache": "ctrl+e"}}))         # the user edits the file
    running.theme = "light"
    settings_mod.save(running, path)                                         # the app remembers a theme
    assert settings_mod.load(path) == Settings(theme="light", keys={"reset_cache": "ctrl+e"})
    path.write_text("{half an edit")
    with pytest.raises(OSError, match="not valid now"):
        settings_mod.save(running, path)
    assert path.read_text() == "{half an edit"


def test_two_processes_saving_at_once_never_leave_a_broken_file_or_a_temp_file(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    path = tmp_path / "settings.json"
    script = ("import sys\nfrom pathlib import Path\nfrom kvchat.store import settings as s\n"
              "for i in range(60):\n    s.save(s.Settings(theme=sys.argv[1]), Path(sys.argv[2]))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    procs = [subprocess.Popen([sys.executable, "-c", script, theme, str(path)], env=env) for theme in ("dark", "light")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert settings_mod.load(path).theme in ("dark", "light")
    assert [f.name for f in tmp_path.iterdir()] == ["settings.json"]


def test_the_log_keeps_dropped_messages_and_a_refused_turn_gives_them_back(tmp_path):
    """drop-oldest's messages stay in the log as history out of the model's sight; a turn the
    backend refuses after dropping (its messages restored) takes the drop back."""
    u = [{"role": "user", "content": f"u{i}"} for i in range(4)]
    a = [{"role": "assistant", "content": "same"} for _ in range(4)]
    log = ConversationLog.create(tmp_path, model="m", system=None, cap=None, policy="drop-oldest", mode="cache")
    log.sync([u[0], a[0], u[1], a[1]])
    log.sync([u[1], a[1], u[2]], dropped=2)           # u0, a0 dropped
    assert log.messages == [u[0], a[0], u[1], a[1], u[2]] and log.history.visible == [u[1], a[1], u[2]]
    log.sync([u[0], a[0], u[1], a[1]], dropped=0)     # refused: the backend gives them back
    log.sync([u[1], a[1], u[3]], dropped=2)
    log.sync([u[1], a[1], u[3], a[3]], dropped=2)
    log.turn(TurnRecord.from_dict({**SUMMARY, "reply": "same", "ttft_ms": 99.0}))
    log.close()
    r = restore(log.path)
    assert r.messages == [u[0], a[0], u[1], a[1], u[3], a[3]] and r.dropped == 2
    assert r.visible == [u[1], a[1], u[3], a[3]]
    assert list(r.replies) == [5] and r.replies[5].ttft_ms == 99.0     # the last "same", not the others


async def test_a_resumed_load_message_is_collapsed_as_it_was_live(running_app, tmp_path):
    """Issue 26: a resumed transcript showed a /load message in full (hundreds of lines) where
    the live one showed a preview; the model still gets all of it."""
    long_file = tmp_path / "report.txt"
    long_file.write_text("\n".join(f"line {i}: the quick brown fox" for i in range(40)))
    async with running_app() as (app, pilot):
        app.query_one(ChatInput).load_text(f"/load {long_file}")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 1, what="the reply")
        live = app.query_one(UserMessage).text
        await send(pilot, "a short one\nof two lines")
    app.chat_screen.session.log.close()
    restored = restore(last_conversation())
    async with running_app(restored=restored) as (app, pilot):
        shown = [w.text for w in app.query(UserMessage)]
        assert len(shown[0].splitlines()) == len(live.splitlines()) == 6 and "(36 more lines)" in shown[0]
        assert shown[0].splitlines()[1:] == live.splitlines()[1:]
        assert shown[1] == "a short one\nof two lines"
        assert app.chat_screen.session.chat.state().messages[0]["content"] == long_file.read_text()


async def test_ctrl_s_says_it_saved_in_the_folder_kvchat_started_in(running_app, tmp_path, monkeypatch):
    """Issue 26 low: ctrl+s wrote into the working directory and said only an absolute path."""
    monkeypatch.chdir(tmp_path)
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        await pilot.press("ctrl+s")
        await pilot.pause()
        note = app.chat_screen.view.query("Notice").last().text
        md = next(tmp_path.glob("kvchat-*.md"))
        assert f"saved the transcript {md.name} and the telemetry {md.stem}.jsonl in the folder kvchat was started " \
               f"in, {tmp_path}; /save FILE saves elsewhere" == note
        app.chat_screen.session.log.close()
