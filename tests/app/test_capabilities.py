"""A backend that lacks what a vLLM server lacks (the fake's SERVER_LIKE capabilities): each
key and command for it says why, in one line, and calls nothing; the policy picker and the
block map say so too; a model of unknown geometry leaves out what cannot be known."""
from __future__ import annotations

import pytest

from kvchat.backends.protocol import CACHE_TOGGLE, KV_DTYPE, RESET, SINK_WINDOW
from kvchat.widgets import BlockMap, CachePanel, CapGauge, Notice
from kvchat.screens import PolicyPicker

from .conftest import screen_text, send, wait_until
from .fake_backend import SERVER_LIKE, FakeBackend, FakeConfig


def server_like() -> FakeBackend:
    return FakeBackend(FakeConfig(capabilities=SERVER_LIKE))


def last_notice(app) -> Notice:
    return app.query(Notice).last()


async def test_keys_for_what_the_backend_lacks_say_why_in_one_line_and_change_nothing(running_app):
    async with running_app(server_like()) as (app, pilot):
        await send(pilot, "hello")
        held = app.query_one(CachePanel).snapshot.tokens_held
        for key, capability in (("ctrl+r", RESET), ("f7", CACHE_TOGGLE), ("f8", KV_DTYPE)):
            await pilot.press(key)
            await pilot.pause()
            notice = last_notice(app)
            assert notice.text == f"not with this backend: {SERVER_LIKE.why_not(capability)}"
            assert notice.has_class("error") and "\n" not in notice.text
        assert app.chat_screen.jobs.busy is None and not app.chat_screen.jobs
        state = app.chat_screen.session.chat.state()
        assert state.tokens_held == held > 0 and state.mode == "cache"


@pytest.mark.parametrize("text, capability", [
    ("/reset", RESET), ("/cache off", CACHE_TOGGLE), ("/kv fp8", KV_DTYPE), ("/policy sink-window", SINK_WINDOW)])
async def test_commands_for_what_the_backend_lacks_say_why(running_app, text, capability):
    async with running_app(server_like()) as (app, pilot):
        app.query_one("#input").load_text(text)
        await pilot.press("enter")
        await pilot.pause()
        assert last_notice(app).text == f"not with this backend: {SERVER_LIKE.why_not(capability)}"
        assert app.chat_screen.session.chat.state().policy == "stop" and app.chat_screen.jobs.busy is None


async def test_the_policy_picker_shows_what_the_backend_lacks_disabled_with_the_reason(running_app):
    async with running_app(server_like()) as (app, pilot):
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, PolicyPicker), what="the picker")
        await pilot.pause()
        assert "sink-window: not with this backend: the server cannot evict" in screen_text(app)
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, PolicyPicker), what="the picker to close")
        assert app.chat_screen.session.chat.state().policy == "drop-oldest"


async def test_without_a_block_level_map_the_block_map_says_why(running_app):
    async with running_app(server_like()) as (app, pilot):
        await send(pilot, "hello")
        assert app.query_one(BlockMap).why_not == SERVER_LIKE.why_not("block_map")
        assert "no block map: the server reports block counts" in screen_text(app)


async def test_an_unknown_geometry_leaves_out_the_formula_and_the_model_limit(running_app):
    async with running_app(FakeBackend(FakeConfig(knows_geometry=False))) as (app, pilot):
        await send(pilot, "hello")
        text = screen_text(app)
        assert "per token" in text and "2 × L × H_kv" not in text and "model max" not in text
        await pilot.press("f3")                  # caps still step, from the top of the range
        assert app.chat_screen.session.chat.state().cap == app.query_one(CapGauge).cap == 1 << 19


async def test_a_fixed_kv_dtype_says_so_when_the_backend_does_not_say_why(running_app):
    from kvchat.backends.protocol import Capabilities
    fixed = FakeBackend(FakeConfig(capabilities=Capabilities(kv_dtypes=())))
    async with running_app(fixed) as (app, pilot):
        await pilot.press("f8")
        await pilot.pause()
        assert last_notice(app).text == "not with this backend: its KV dtype is fixed (fp32)"
        app.query_one("#input").load_text("/kv bf16")
        await pilot.press("enter")
        await pilot.pause()
        assert last_notice(app).text == "not with this backend: its KV dtype is fixed, not bf16"
        assert app.query_one(CachePanel).snapshot.kv_dtype == "fp32"


async def test_turns_without_a_reuse_count_show_it_as_not_reported_and_the_app_goes_on(running_app):
    """A vLLM server without --enable-prompt-tokens-details reports no cached-token count:
    the turn's reused and computed tokens are None. The stats line, the latency panel's turn
    table and the saved record say so, and the next turn runs (issue 27 item 6: this crashed
    the turn table's number format)."""
    from kvchat.widgets import LatencyPanel, Reply
    async with running_app(FakeBackend(FakeConfig(reports_reuse=False))) as (app, pilot):
        await send(pilot, "hello")
        await send(pilot, "and again")
        turns = app.chat_screen.session.turns
        assert len(turns) == 2 and all(t.reused_tokens is None and t.computed_tokens is None for t in turns)
        assert "reused_tokens" in turns[-1].unavailable
        stats = app.query(Reply).last().query_one(".stats").render().plain
        assert "prompt " in stats and "reuse not reported" in stats and "None" not in stats
        table = str(app.query_one("#latency-turns").render())
        text = screen_text(app)
        assert "None" not in text and "None" not in table
        assert app.query_one(LatencyPanel).data.turns[-1].reused_tokens is None
