"""The chat app on the vLLM backend (Pilot): the panels move as a real server's tokens arrive,
and a reset empties the block map. Helpers come from tests/app (the same app factory and
waits the app tests use)."""
from __future__ import annotations

import asyncio

from app.conftest import SIZE, make_app, screen_text, wait_until
from kvchat.widgets import BlockMap, CachePanel, LatencyPanel

from .test_vllm_server import fresh_system, notes


def test_the_panels_move_as_a_real_servers_tokens_arrive(vllm_server, tmp_path, monkeypatch):
    from kvchat.backends.vllm import VllmBackend
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    backend = VllmBackend(vllm_server.url, kv_events=vllm_server.kv_events)

    async def run() -> None:
        app = make_app(factory=lambda: backend, system=fresh_system(), max_tokens=48)
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.chat_screen.conversations.session is not None and app.chat_screen.jobs.busy is None
                     and app.chat_screen.conversations.session.snapshot is not None,
                             timeout=30, what="the backend")
            panel, blocks, latency = app.query_one(CachePanel), app.query_one(BlockMap), app.query_one(LatencyPanel)
            map_before = blocks.render().plain
            assert panel.snapshot.blocks_used == 0 and latency.point_count == 0
            app.query_one("#input").load_text(f"Remember these. {notes(1, 30)}")
            await pilot.press("enter")
            # while the reply streams: latency points arrive before the turn ends
            await wait_until(pilot, lambda: latency.point_count > 0, timeout=120, what="the first latency points")
            await wait_until(pilot, lambda: app.chat_screen.session.turns and app.chat_screen.jobs.busy is None, timeout=120, what="the reply")
            await pilot.pause()
            turn = app.chat_screen.session.turns[-1]
            snap = panel.snapshot
            assert snap.source == "vllm" and snap.blocks_used >= 3          # 400+ tokens: 3+ full blocks of 128
            # the conversation's own tokens (its prompt and reply, as the server counts them), in
            # the blocks they fill, the last one partial (issue 26: not full blocks only)
            assert snap.tokens_held == turn.context_tokens and -(-snap.tokens_held // 128) == snap.blocks_used
            assert latency.point_count == len(turn.decode_ms) > 0
            assert blocks.render().plain != map_before
            text = screen_text(app)
            assert f"server {vllm_server.url}" in text and "resident prefix blocks" in text
            await pilot.press("ctrl+r")                                      # POST /reset_prefix_cache
            # the note is in the transcript once the reset's job has ended, and on the screen
            # after the next layout: one fresh-clone CI run read the screen in between
            await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and panel.snapshot.blocks_used == 0
                             and "cache reset" in screen_text(app), timeout=30, what="the reset and its note on screen")

    try:
        asyncio.run(run())
    finally:
        backend.shutdown()
