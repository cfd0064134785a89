"""The message input: Enter sends, ctrl+j adds a line, up/down recall sent messages; and
settings typed while a reply streams take effect at once."""
from __future__ import annotations

from kvchat.widgets import ChatInput, UserMessage

from .conftest import send, wait_until


async def test_ctrl_j_adds_a_line_and_enter_sends_both_lines(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("o", "n", "e", "ctrl+j", "t", "w", "o")
        assert app.query_one(ChatInput).text == "one\ntwo"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.session.turns and app.chat_screen.jobs.busy is None, what="the reply")
        assert app.query_one(UserMessage).text == "one\ntwo" and app.query_one(ChatInput).text == ""


async def test_up_and_down_walk_the_sent_messages_and_come_back_to_the_draft(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "first")
        await send(pilot, "second")
        box = app.query_one(ChatInput)
        await pilot.press("d", "r", "a", "f", "t")
        await pilot.press("up")
        assert box.text == "second"
        await pilot.press("up")
        assert box.text == "first"
        await pilot.press("down", "down")
        assert box.text == "draft"


async def test_a_cap_set_while_a_reply_streams_stops_it_at_the_cap(slow_fake, running_app):
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("a long one please")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy == "reply", what="the reply to start")
        app.query_one("#input").load_text("/cap 30")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.chat_screen.session.turns, what="the reply to stop")
        turn = app.chat_screen.session.turns[-1]
        assert turn.stop_reason == "cap" and turn.prompt_tokens + turn.generated_tokens <= 30
        assert "stopped at the cap" in app.query("Reply .stats").last().render().plain
