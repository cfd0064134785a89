"""The app on the real engine and the bundled model: one full turn, checked against the
engine's own arithmetic."""
from __future__ import annotations

import pytest

from engine.units import human_bytes
from kvchat.widgets import BlockMap, CachePanel, LatencyPanel

from .conftest import SIZE, make_app, ready, screen_text, send

pytestmark = pytest.mark.slow


async def test_a_real_turn_grows_the_cache_panel_by_bytes_per_token_per_new_token(engine):
    """`engine` is the session's real Engine (tests/conftest.py: bundled model, 64 MiB pool)."""
    app = make_app(factory=lambda: engine, max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        try:
            before = app.query_one(CachePanel).snapshot
            map_before = app.query_one(BlockMap).render().plain
            assert before.tokens_held == 0 and app.query_one(LatencyPanel).point_count == 0

            await send(pilot, "Name three colours.")
            await pilot.pause()
            stats = app.session.conv.history[-1]
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
            engine.close_conversation(app.session.conv)
