"""A turn through the UI on the scripted engine: streaming, stats line, panels, stopping."""
from __future__ import annotations

from kvchat.widgets import BlockMap, CachePanel, CapGauge, LatencyPanel, Reply, UserMessage

from .conftest import send, wait_until
from .fake_backend import FakeBackend, FakeConfig


async def test_a_reply_streams_into_the_transcript_with_a_stats_line(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello kv cache")
        reply = app.query_one(Reply)
        assert reply.text.startswith("Hello there!")
        stats = str(reply.query_one(".stats").render())
        assert "tokens · TTFT" in stats and "reused" in stats and "computed" in stats
        assert app.query_one(UserMessage).text == "hello kv cache"


async def test_panels_show_the_turns_bytes_blocks_and_latency(fake, running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello kv cache")
        snap = app.query_one(CachePanel).snapshot
        assert snap.bytes_used == snap.tokens_held * fake.bytes_per_token > 0
        assert app.query_one(BlockMap).snapshot.blocks_used == -(-snap.tokens_held // 16)
        assert app.query_one(LatencyPanel).point_count == app.chat_screen.session.turns[-1].generated_tokens
        assert app.query_one(CapGauge).tokens == snap.tokens_held


async def test_a_reply_keeps_streaming_while_the_help_screen_is_open(running_app):
    # 2,000 words at 50 ms each: on a loaded machine the help screen can take seconds, and the
    # reply must still be running when it closes (slow_fake's 200 words ended first at load 5)
    endless = FakeBackend(FakeConfig(token_delay_s=0.05, replies=(" ".join(f"w{i}" for i in range(2000)),)))
    async with running_app(endless) as (app, pilot):
        app.query_one("#input").load_text("go on")
        await pilot.press("enter")
        await pilot.press("f1")
        n = len(app.screen_stack[0].query_one(Reply).text)
        await wait_until(pilot, lambda: len(app.screen_stack[0].query_one(Reply).text) > n + 20, what="more text")
        await pilot.press("escape")            # closes help; the reply goes on
        assert app.chat_screen.jobs.busy == "reply"
        await pilot.press("escape")            # stops the reply
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, what="the stop")
        assert app.chat_screen.session.turns[-1].stop_reason == "cancelled"
