"""The app on the real engine and the bundled model: one full turn, checked against the
engine's own arithmetic; and the cache experiments switched at runtime from the keyboard."""
from __future__ import annotations

import pytest

from kvchat.backends.local import LocalBackend
from kvchat.engine.telemetry import OTHER, SHARED
from kvchat.engine.units import human_bytes
from kvchat.widgets import BlockMap, CachePanel, LatencyPanel

from .conftest import screen_text, send, wait_until

pytestmark = pytest.mark.slow


async def test_a_real_turn_grows_the_cache_panel_by_bytes_per_token_per_new_token(engine, running_app):
    """`engine` is the session's real Engine (tests/conftest.py: bundled model, 64 MiB pool)."""
    backend = LocalBackend(engine)
    async with running_app(factory=lambda: backend, max_tokens=16) as (app, pilot):
        try:
            before = app.query_one(CachePanel).snapshot
            map_before = app.query_one(BlockMap).render().plain
            assert before.tokens_held == 0 and app.query_one(LatencyPanel).point_count == 0

            await send(pilot, "Name three colours.")
            await pilot.pause()
            stats = app.view.turns[-1]
            after = app.query_one(CachePanel).snapshot
            new_tokens = after.tokens_held - before.tokens_held
            # the prompt's computed tokens, plus one K/V row per decode step
            assert new_tokens == stats.computed_tokens + len(stats.decode_ms) > 0
            assert after.bytes_used - before.bytes_used == engine.bytes_per_token * new_tokens
            text = screen_text(app)
            assert human_bytes(after.bytes_used) in text and f"= {after.bytes_used:,} B" in text

            assert after.block_map != before.block_map
            assert app.query_one(BlockMap).render().plain != map_before

            points = app.query_one(LatencyPanel).point_count
            assert points == len(stats.decode_ms) == len(stats.positions) > 0
        finally:
            backend.close(app.view.chat)


async def test_runtime_experiments_change_the_panels_two_conversations_fp8_and_cache_off(engine, running_app):
    """Two conversations in the session engine's one pool: the second shares the first's
    system-prompt block (the bundled model's template adds a default one) and sees the
    first's other blocks; /kv fp8 rebuilds the pool at a quarter of fp32's bytes per token;
    /cache off makes the next turn hold nothing. The engine is left as it was found."""
    backend = LocalBackend(engine)
    async with running_app(factory=lambda: backend, max_tokens=6) as (app, pilot):
        panel, blocks = app.query_one(CachePanel), app.query_one(BlockMap)
        try:
            await send(pilot, "Name a colour.")
            assert panel.snapshot.bytes_per_token == 46_080 and panel.snapshot.kv_dtype == "fp32"
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: len(app.views) == 2 and app.busy is None, what="conversation 2")
            await send(pilot, "Name a fruit.")
            snap = blocks.snapshot
            assert snap.block_map.count(SHARED) >= 1 and snap.block_map.count(OTHER) >= 1
            legend = blocks.render().plain
            assert "shared" in legend and "other chats" in legend

            app.query_one("#input").load_text("/kv fp8")
            await pilot.press("enter")
            await wait_until(pilot, lambda: panel.snapshot.kv_dtype == "fp8" and app.busy is None, what="fp8 pool")
            assert panel.snapshot.bytes_per_token == 11_520 == 46_080 // 4
            assert "fp8" in panel.border_title
            await send(pilot, "And a tree?")
            assert app.view.turns[-1].kv_dtype == "fp8" and panel.snapshot.tokens_held > 0

            app.query_one("#input").load_text("/cache off")
            await pilot.press("enter")
            await wait_until(pilot, lambda: panel.snapshot.mode == "off" and app.busy is None, what="cache off")
            await send(pilot, "And a bird?")
            assert app.view.turns[-1].mode == "off" and panel.snapshot.tokens_held == 0
            assert "cache off" in panel.border_title
        finally:
            engine.set_kv_dtype("fp32")
            for view in app.views:
                backend.close(view.chat)
