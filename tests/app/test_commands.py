"""Slash commands: parsing (unit) and their effect in the app (scripted engine)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.commands import Command, CommandError, parse, read_message_file
from kvchat.widgets import CachePanel, CapGauge, Notice, UserMessage

from .conftest import send, wait_until

THEMES = ("dark", "high-contrast", "light")


@pytest.mark.parametrize("text, expected", [
    ("/reset", Command("reset")),
    ("/cap 2048", Command("cap", 2048)),
    ("/cap 1_024", Command("cap", 1024)),
    ("/cap off", Command("cap", None)),
    ("/policy drop-oldest", Command("policy", "drop-oldest")),
    ("/load 'my notes.txt'", Command("load", Path("my notes.txt"))),
    ("/save", Command("save", None)),
    ("/save out/chat", Command("save", Path("out/chat"))),
    ("/theme light", Command("theme", "light")),
    ("/cache OFF", Command("cache", "off")),
    ("/kv fp8", Command("kv", "fp8")),
    ("/HELP", Command("help")),
])
def test_commands_parse_to_their_arguments(text, expected):
    assert parse(text, THEMES) == expected


@pytest.mark.parametrize("text", ["hello", "  not /a command", "//etc/hosts is a file"])
def test_text_that_is_not_a_command_is_a_message(text):
    assert parse(text, THEMES) is None


@pytest.mark.parametrize("text, message", [
    ("/bogus", "unknown command /bogus; accepted: /help"),
    ("/", "empty command"),
    ("/cap", "usage: /cap N"),
    ("/cap lots", "whole number of tokens or 'off', got 'lots'"),
    ("/cap -5", "positive number of tokens, got -5"),
    ("/cap 1 2", "usage: /cap N"),
    ("/policy forever", "unknown policy 'forever'; accepted: stop, drop-oldest"),
    ("/theme pink", "unknown theme 'pink'; accepted: dark, high-contrast, light"),
    ("/reset now", "/reset takes no argument"),
    ("/kv int4", "unknown kv 'int4'; accepted: auto, fp32, bf16, fp16, fp8"),
    ("/load", "usage: /load FILE"),
    ("/load 'unclosed", "cannot read"),
])
def test_malformed_commands_raise_one_line_naming_what_is_accepted(text, message):
    with pytest.raises(CommandError) as err:
        parse(text, THEMES)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_load_reads_utf8_text_and_names_what_is_wrong_otherwise(tmp_path):
    good = tmp_path / "a.txt"
    good.write_text("context " * 10)
    assert read_message_file(good).startswith("context")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    for name, why in (("missing.txt", "no such file"), ("empty.txt", "empty"), ("bin.dat", "not UTF-8"),
                      (".", "is a directory")):
        with pytest.raises(CommandError, match=why):
            read_message_file(tmp_path / name)


def notices(app) -> list[Notice]:
    return list(app.query(Notice))


async def test_an_unknown_command_shows_one_error_line_and_the_app_goes_on(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/frobnicate")
        await pilot.press("enter")
        await pilot.pause()
        last = notices(app)[-1]
        assert last.has_class("error") and last.text.startswith("unknown command /frobnicate")
        await send(pilot, "still works")


async def test_cap_command_takes_effect_at_once_and_stop_refuses_an_over_cap_turn(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "one two three")
        app.query_one("#input").load_text("/cap 12")
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat_screen.session.chat.state().cap == 12 and app.query_one(CapGauge).cap == 12
        assert "tokens over, so the next turn is refused" in app.chat_screen.panels.notes[-1]     # the status line, not the transcript
        app.query_one("#input").load_text("this turn is too long for the cap")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and notices(app)[-1].has_class("error"), what="refusal")
        assert "over" in notices(app)[-1].text and "cap is 12" in notices(app)[-1].text
        assert app.query(UserMessage).last().has_class("refused")
        assert app.query_one("#input").text == "this turn is too long for the cap"   # back for editing
        assert len(app.chat_screen.session.turns) == 1 and app.chat_screen.session.chat.state().messages[-1]["role"] == "assistant"


async def test_drop_oldest_drops_whole_turns_to_fit_the_cap(running_app):
    async with running_app(policy="drop-oldest") as (app, pilot):
        await send(pilot, "first turn with some words")
        await send(pilot, "second turn")
        app.query_one("#input").load_text("/cap 40")
        await pilot.press("enter")
        await send(pilot, "third")
        last = app.chat_screen.session.turns[-1]
        assert last.dropped_messages >= 2 and "dropped" in app.query("Reply .stats").last().render().plain
        assert app.chat_screen.session.chat.state().messages[0]["content"] != "first turn with some words"


async def test_load_sends_the_files_content(running_app, tmp_path):
    (tmp_path / "notes.txt").write_text("alpha beta gamma")
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/load notes.txt")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.session.turns and app.chat_screen.jobs.busy is None, what="the reply")
        assert app.chat_screen.session.chat.state().messages[0] == {"role": "user", "content": "alpha beta gamma"}


async def test_save_writes_markdown_and_json_lines(fake, tmp_path, running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "save me")
        app.query_one("#input").load_text("/save out/chat.md")
        await pilot.press("enter")
        await pilot.pause()
    md = (tmp_path / "out" / "chat.md").read_text()
    assert "## You\n\nsave me" in md and "## Assistant" in md and "TTFT" in md
    records = [json.loads(x) for x in (tmp_path / "out" / "chat.jsonl").read_text().splitlines()]
    assert records[0]["prompt_tokens"] > 0 and records[0]["kv_bytes_per_token"] == fake.bytes_per_token


async def test_cache_off_and_kv_dtype_commands_change_the_panels(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        before = app.query_one(CachePanel).snapshot.bytes_per_token
        app.query_one("#input").load_text("/kv bf16")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query_one(CachePanel).snapshot.kv_dtype == "bf16", what="bf16 pool")
        assert app.query_one(CachePanel).snapshot.bytes_per_token * 2 == before
        app.query_one("#input").load_text("/cache off")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.query_one(CachePanel).snapshot.mode == "off", what="cache off")
        assert "cache off" in app.query_one(CachePanel).border_title
        await send(pilot, "no cache now")
        assert app.chat_screen.session.turns[-1].mode == "off" and app.query_one(CachePanel).snapshot.bytes_used == 0
        assert app.query_one(CapGauge).tokens > 0     # the context still counts without a cache
