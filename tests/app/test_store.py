"""Conversations on disk: written as they happen, read back by --resume, exported by /save;
and the settings file."""
from __future__ import annotations

import json

import pytest

from kvchat import settings as settings_mod
from kvchat.records import TurnRecord
from kvchat.settings import Settings, SettingsError
from kvchat.store import ConversationLog, export, last_conversation, restore
from kvchat.widgets import ChatInput, LatencyPanel, Reply, UserMessage

from .conftest import send

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
    md, jl = export(tmp_path / "chat", [{"role": "user", "content": "hello"},
                                        {"role": "assistant", "content": "hi there"}],
                    [TurnRecord.from_dict(SUMMARY)], "m")
    assert md.name == "chat.md" and jl.name == "chat.jsonl"
    assert "## You\n\nhello" in md.read_text() and "2 tokens · TTFT 30 ms" in md.read_text()
    assert json.loads(jl.read_text())["positions"] == [12, 13]


async def test_resume_shows_the_saved_conversation_and_puts_an_unanswered_message_back(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "remember me")
        crashed = {"role": "user", "content": "lost in a crash"}
        app.view.conversation_log.sync([*app.view.chat.state().messages, crashed])
    restored = restore(last_conversation())
    async with running_app(restored=restored) as (app, pilot):
        assert app.query_one(UserMessage).text == "remember me" and app.query_one(Reply).text
        assert app.query_one(ChatInput).text == "lost in a crash"
        assert app.query_one(LatencyPanel).point_count == restored.turns[0].generated_tokens
        await send(pilot, "and now")
        assert app.view.turns[-1].reused_tokens == 0      # the cache started empty
        assert app.view.conversation_log.path == restored.path


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    ('["dark"]', "expected a JSON object"),
    ('{"colour": "red"}', "unknown setting 'colour'"),
    ('{"keys": {"reset": "ctrl+e"}}', "unknown key id 'reset'"),
    ('{"keys": {"reset_cache": "r"}}', "printable character"),
    ('{"theme": 3}', "'theme' must be a theme name"),
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
