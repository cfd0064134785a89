"""The app on the real engine and the bundled model: one full turn, checked against the
engine's own arithmetic; and the cache experiments switched at runtime from the keyboard."""
from __future__ import annotations

import pytest

from kvchat.backends.local import LocalBackend
from kvchat.engine.telemetry import OTHER, SHARED
from kvchat.engine.units import human_bytes
from kvchat.widgets import BlockMap, CachePanel, ChatInput, LatencyPanel

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
            stats = app.chat_screen.session.turns[-1]
            after = app.query_one(CachePanel).snapshot
            new_tokens = after.tokens_held - before.tokens_held
            # the whole prompt (computed now, or reused from blocks an earlier test left cached in
            # the session's engine), plus one K/V row per decode step
            assert stats.computed_tokens == stats.prompt_tokens - stats.reused_tokens > 0
            assert new_tokens == stats.prompt_tokens + len(stats.decode_ms)
            assert after.bytes_used - before.bytes_used == engine.bytes_per_token * new_tokens
            text = screen_text(app)
            assert human_bytes(after.bytes_used) in text and f"= {after.bytes_used:,} B" in text

            assert after.block_map != before.block_map
            assert app.query_one(BlockMap).render().plain != map_before

            points = app.query_one(LatencyPanel).point_count
            assert points == len(stats.decode_ms) == len(stats.positions) > 0
        finally:
            backend.close(app.chat_screen.session.chat)


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
            await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="conversation 2")
            await send(pilot, "Name a fruit.")
            snap = blocks.snapshot
            assert snap.block_map.count(SHARED) >= 1 and snap.block_map.count(OTHER) >= 1
            legend = blocks.render().plain
            assert "shared" in legend and "other chats" in legend

            app.query_one("#input").load_text("/kv fp8")
            await pilot.press("enter")
            await wait_until(pilot, lambda: panel.snapshot.kv_dtype == "fp8" and app.chat_screen.jobs.busy is None, what="fp8 pool")
            # one convention for fp8 (issue 26 high 6): the one-byte elements and their fp32 scales,
            # in the notice, the panel's figures and the turn's record alike
            assert panel.snapshot.bytes_per_token == 12_240 == 46_080 // 4 + 2 * 30 * 3 * 4
            assert "fp8" in panel.border_title
            assert any("12,240 B (11,520 B data + 720 B scales) per token" in n.text
                       for n in app.chat_screen.view.query("Notice"))
            await send(pilot, "And a tree?")
            turn, snap = app.chat_screen.session.turns[-1], panel.snapshot
            assert turn.kv_dtype == "fp8" and snap.tokens_held > 0
            assert (turn.kv_bytes_per_token, turn.kv_scale_bytes_per_token) == (12_240, 720)
            assert snap.bytes_used == snap.tokens_held * 12_240
            assert f"= {snap.bytes_used:,} B" in screen_text(app)      # the formula's total is the used figure

            app.query_one("#input").load_text("/cache off")
            await pilot.press("enter")
            await wait_until(pilot, lambda: panel.snapshot.mode == "off" and app.chat_screen.jobs.busy is None, what="cache off")
            await send(pilot, "And a bird?")
            assert app.chat_screen.session.turns[-1].mode == "off" and panel.snapshot.tokens_held == 0
            assert "cache off" in panel.border_title
        finally:
            engine.set_kv_dtype("fp32")
            for view in app.chat_screen.conversations.views:
                backend.close(view.session.chat)


async def test_edit_and_resend_reuses_the_cache_up_to_the_block_holding_the_first_changed_token(engine, running_app):
    """/edit 2 on the real engine: the resent turn's reused tokens are the whole blocks before
    the first token where the new prompt differs from the old one, computed here from the
    model's own chat template, and no more (the prefix index matches whole blocks only)."""
    backend = LocalBackend(engine)
    async with running_app(factory=lambda: backend, max_tokens=4) as (app, pilot):
        try:
            await send(pilot, "Name three colours of the rainbow, please.")
            await send(pilot, "Now name three fruits that are red.")
            view, bs = app.chat_screen.view, engine.spec.block_size
            messages = list(view.session.state.messages)
            kept = messages[:max(i for i, m in enumerate(messages) if m["role"] == "user")]
            edited = "Now name three fruits that are yellow."
            old = view.session.chat.conv.render(kept + [messages[len(kept)]])
            new = view.session.chat.conv.render(kept + [{"role": "user", "content": edited}])
            differ = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
            assert differ >= bs            # the edit is past the first block, so some reuse is expected

            app.query_one(ChatInput).load_text("/edit 2")
            await pilot.press("enter")
            await pilot.pause()
            assert app.query_one(ChatInput).text == "Now name three fruits that are red."
            n = len(view.session.turns)
            app.query_one(ChatInput).load_text(edited)
            await pilot.press("enter")
            await wait_until(pilot, lambda: len(view.session.turns) > n and app.chat_screen.jobs.busy is None, timeout=60,
                             what="the resent turn")
            turn = view.session.turns[-1]
            assert turn.prompt_tokens == len(new)
            assert turn.reused_tokens == differ // bs * bs
            assert [m["content"] for m in view.session.state.messages if m["role"] == "user"][-1] == edited
            assert len(view.session.state.messages) == len(kept) + 2
        finally:
            for v in app.chat_screen.conversations.views:
                backend.close(v.session.chat)
