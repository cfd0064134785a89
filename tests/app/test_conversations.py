"""Several conversations in one pool, on the scripted engine: open, switch, close, list;
each keeps its own transcript, latency, cap and log; the block map shows the others'
blocks; a preempted conversation says so and recomputes; a second conversation's turn
waits for the first's."""
from __future__ import annotations

import json

import pytest

from kvchat.engine.telemetry import OTHER
from kvchat.commands import Command, CommandError, parse
from kvchat.widgets import (BlockMap, CachePanel, CapGauge, ConversationBar, LatencyPanel, Notice, Reply, Transcript,
                            UserMessage)

from .conftest import screen_text, send, wait_until
from .fake_backend import FakeBackend, FakeConfig


async def command(pilot, text: str) -> None:
    pilot.app.query_one("#input").load_text(text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: pilot.app.chat_screen.jobs.busy is None and not pilot.app.chat_screen.jobs, what=f"{text} to finish")


async def open_second(pilot) -> None:
    app = pilot.app
    n = len(app.chat_screen.conversations.views)
    await pilot.press("ctrl+n")
    await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == n + 1 and app.chat_screen.jobs.busy is None, what="the new conversation")


def notices(app) -> list[str]:
    return [n.text for n in app.chat_screen.view.query(Notice)]


@pytest.mark.parametrize("text, expected", [
    ("/switch 2", Command("switch", 2)), ("/close", Command("close", None)), ("/close 3", Command("close", 3)),
    ("/list", Command("list")), ("/new", Command("new")), ("/policy sink-window", Command("policy", "sink-window")),
])
def test_conversation_commands_parse(text, expected):
    assert parse(text) == expected


@pytest.mark.parametrize("text, message", [
    ("/switch", "usage: /switch N"), ("/switch two", "needs a conversation's number"),
    ("/close 0", "from 1 up"), ("/list all", "/list takes no argument"),
])
def test_malformed_conversation_commands_say_what_is_accepted(text, message):
    with pytest.raises(CommandError, match=message):
        parse(text)


async def test_a_second_conversation_shares_the_pool_and_the_block_map_shows_the_first_as_other_chats(running_app):
    async with running_app() as (app, pilot):
        assert not app.query_one(ConversationBar).display          # one conversation: no bar
        await send(pilot, "first conversation here")
        first = app.chat_screen.view
        await open_second(pilot)
        assert app.query_one(ConversationBar).display
        await send(pilot, "second one")
        snap = app.query_one(BlockMap).snapshot
        assert snap.block_map.count(OTHER) == len(first.session.chat.block_table) > 0
        assert "other chats" in app.query_one(BlockMap).render().plain
        assert snap.tokens_held == app.chat_screen.session.chat.state().tokens_held    # the panels show the focused one
        assert "chat 2 · 2 open" in app.query_one("StatusBar").info


async def test_switching_shows_each_conversations_own_transcript_latency_and_cap(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "alpha")
        one = app.chat_screen.view
        await open_second(pilot)
        await command(pilot, "/cap 512")
        await send(pilot, "beta")
        await send(pilot, "gamma")
        two = app.chat_screen.view
        assert [u.text for u in app.chat_screen.view.query(UserMessage)] == ["beta", "gamma"]
        assert app.query_one(LatencyPanel).point_count == sum(t.generated_tokens for t in two.session.turns)

        await pilot.press("alt+left")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, what="the fresh snapshot")
        assert app.chat_screen.view is one and [u.text for u in app.chat_screen.view.query(UserMessage)] == ["alpha"]
        assert app.query_one(LatencyPanel).point_count == one.session.turns[0].generated_tokens
        assert app.query_one(CapGauge).cap is None and app.query_one(CachePanel).snapshot.tokens_held == \
            one.session.chat.state().tokens_held
        assert app.query_one(BlockMap).snapshot.block_map.count(OTHER) == len(two.session.chat.block_table)

        await pilot.press("alt+right")
        assert app.chat_screen.view is two and app.query_one(CapGauge).cap == 512
        await pilot.press("alt+right")                            # wraps around
        assert app.chat_screen.view is one


async def test_clicking_a_conversation_in_the_bar_switches_to_it(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        one = app.chat_screen.view
        await open_second(pilot)
        await pilot.click(ConversationBar, offset=(3, 0))              # on " 1 hello "
        assert app.chat_screen.view is one
        assert app.chat_screen.query_one("#transcripts").current == one.id


async def test_switch_close_and_list_commands(fake, running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "the first")
        one = app.chat_screen.view
        await open_second(pilot)
        await send(pilot, "the second")
        two = app.chat_screen.view
        await command(pilot, "/list")
        listing = notices(app)[-1]
        assert "2 conversations share the pool" in listing and "● 2 the second" in listing and "  1 the first" in listing
        await command(pilot, "/switch 9")
        assert notices(app)[-1] == "no conversation 9; open: 1, 2"
        await command(pilot, "/switch 1")
        assert app.chat_screen.view is one
        await command(pilot, "/close 2")
        assert app.chat_screen.conversations.views == [one] and fake.chats == [one.session.chat] and app.chat_screen.view is one
        assert list(app.query(Transcript)) == [one] and not app.query_one(ConversationBar).display
        assert any("closed conversation 2" in n for n in notices(app))
        records = [json.loads(x) for x in two.session.log.path.read_text().splitlines()]
        assert records[-1]["event"] == "closed" and {"type": "message", "role": "user", "content": "the second"} \
            in records


async def test_closing_the_focused_conversation_shows_its_neighbour_and_closing_the_last_opens_a_new_one(fake, running_app):
    async with running_app() as (app, pilot):
        one = app.chat_screen.view
        await open_second(pilot)
        await pilot.press("alt+left")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None)
        await pilot.press("f9")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 1 and app.chat_screen.jobs.busy is None, what="the close")
        assert app.chat_screen.view.number == 2 and one.session.chat not in fake.chats
        await pilot.press("f9")
        await wait_until(pilot, lambda: app.chat_screen.view.number == 3 and app.chat_screen.jobs.busy is None, what="a fresh conversation")
        assert len(app.chat_screen.conversations.views) == 1 and len(fake.chats) == 1


async def test_a_preempted_conversation_says_so_and_its_next_turn_recomputes_its_tokens(running_app):
    # 8 blocks of 16: each long conversation needs 5, so the second preempts the first
    long = "word " * 60
    async with running_app(FakeBackend(FakeConfig(num_blocks=8))) as (app, pilot):
        await send(pilot, "first " + long)
        one = app.chat_screen.view
        held = one.session.chat.state().tokens_held
        await open_second(pilot)
        await send(pilot, "second " + long)
        assert app.chat_screen.session.turns[-1].preempted == 1 and one.session.chat.state().preempted_pending == held
        assert "preempted 1 other conversation" in app.chat_screen.view.query(Reply).last().query_one(".stats").render().plain
        assert app.query_one(CachePanel).snapshot.preemptions == 1
        assert "1 conversations, pool-wide" in screen_text(app)
        assert [e.state for e in app.query_one(ConversationBar).entries] == ["preempted", ""]

        await pilot.press("alt+left")
        assert f"its next turn recomputes {held:,} tokens" in notices(app)[-1]
        await send(pilot, "and again")
        assert one.session.turns[-1].recomputed_tokens == held and one.session.turns[-1].reused_tokens == 0
        assert f"recomputed {held:,} tokens" in app.chat_screen.view.query(Reply).last().query_one(".stats").render().plain
        assert app.query_one(ConversationBar).entries[0].state == "" and app.chat_screen.session.chat.state().preempted_pending == 0


async def test_a_message_sent_while_another_conversation_replies_waits_its_turn(slow_fake, running_app):
    async with running_app(slow_fake, max_tokens=40) as (app, pilot):
        app.query_one("#input").load_text("a long story")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy == "reply", what="the first reply")
        one = app.chat_screen.view
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2, what="a conversation opened mid-reply")
        assert app.chat_screen.jobs.busy == "reply" and app.chat_screen.jobs.replying.view is one
        app.query_one("#input").load_text("me too")
        await pilot.press("enter")
        assert notices(app)[-1].startswith("queued: conversation 1 is replying")
        await wait_until(pilot, lambda: app.chat_screen.session.turns and app.chat_screen.jobs.busy is None, timeout=20, what="both replies")
        assert len(one.session.turns) == 1 and app.chat_screen.session.chat.state().messages[0] == {"role": "user", "content": "me too"}


async def test_each_conversation_is_saved_to_its_own_log_as_it_goes(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "one says hi")
        one = app.chat_screen.view
        await open_second(pilot)
        await send(pilot, "two says hi")
        await pilot.press("alt+left")
        await send(pilot, "one again")
        logs = {s.number: [json.loads(x) for x in s.session.log.path.read_text().splitlines()] for s in app.chat_screen.conversations.views}
    said = {n: [r["content"] for r in recs if r["type"] == "message" and r["role"] == "user"] for n, recs in logs.items()}
    assert said == {1: ["one says hi", "one again"], 2: ["two says hi"]}
    assert sum(r["type"] == "turn" for r in logs[1]) == 2 == len(one.session.turns)


async def test_sink_window_is_offered_accepted_and_its_evictions_show_in_the_gauge_and_stats(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f2")
        await pilot.pause()
        assert "sink-window: keep the first tokens" in screen_text(app)
        await pilot.press("escape")
        await command(pilot, "/cap 32")
        await command(pilot, "/policy sink-window")
        assert "sink-window needs a cap of at least 48 tokens" in notices(app)[-1]
        assert app.chat_screen.session.chat.state().policy == "stop"
        await command(pilot, "/cap 64")
        await command(pilot, "/policy sink-window")
        assert app.chat_screen.session.chat.state().policy == "sink-window" and app.query_one(CapGauge).policy == "sink-window"
        await send(pilot, "word " * 80)
        gauge = app.query_one(CapGauge)
        evicted = app.chat_screen.session.chat.state().evicted_tokens
        assert evicted > 0 and gauge.evicted == evicted and gauge.tokens <= 64
        assert f"evicted {evicted:,} tokens" in gauge.render().plain
        blocks = app.chat_screen.session.turns[-1].evicted_blocks
        assert blocks == evicted // 16 and f"evicted {blocks} block" in screen_text(app)


async def test_after_a_close_and_a_new_conversation_the_status_counts_the_open_ones(running_app):
    """Numbers stay with their conversations (/switch N), so the status line says how many
    are open rather than 'chat 4 of 3'."""
    async with running_app() as (app, pilot):
        await open_second(pilot)
        await open_second(pilot)                       # conversations 1, 2, 3
        await pilot.press("f9")                        # close 3
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="the close")
        await pilot.press("ctrl+n")                    # opens 4
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 3 and app.chat_screen.jobs.busy is None, what="conversation 4")
        info = app.query_one("StatusBar").info
        assert app.chat_screen.view.number == 4 and "chat 4 · 3 open" in info and " of " not in info
