"""A long /load on the real engine and the bundled model, prefilled in small chunks: the
status line shows the prefill's progress as it moves, and Escape stops it between chunks
with the message back in the input and nothing of it in the conversation."""
from __future__ import annotations

import pytest

from kvchat.backends.local import LocalBackend
from kvchat.widgets import ChatInput, Notice

from .conftest import prefill_steps, record_status, wait_until

pytestmark = pytest.mark.slow

LONG = "\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(60))


async def load_in_small_chunks(app, pilot, path) -> list:
    """Send `/load path` with the conversation prefilling 64 tokens a chunk; returns the
    status lines recorded from then on."""
    app.chat_screen.session.chat.conv.prefill_chunk_size = 64
    seen = record_status(app)
    app.query_one("#input").load_text(f"/load {path}")
    await pilot.press("enter")
    return seen


async def test_a_long_load_shows_the_prefill_moving_to_its_total(engine, running_app, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(LONG)
    backend = LocalBackend(engine)
    async with running_app(factory=lambda: backend, max_tokens=2) as (app, pilot):
        try:
            seen = await load_in_small_chunks(app, pilot, path)
            await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 1 and app.chat_screen.jobs.busy is None, timeout=120,
                             what="the reply to the long text")
            steps = prefill_steps(seen)
            total = app.chat_screen.session.turns[-1].computed_tokens
            assert len(steps) >= 4 and steps[-1] == (total, total)
            assert [d for d, _ in steps] == sorted(d for d, _ in steps)
        finally:
            backend.close(app.chat_screen.session.chat)


async def test_escape_stops_the_prefill_between_chunks_and_puts_the_message_back(engine, running_app, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(LONG.replace("fox", "cat"))
    engine.blocks.evict_all_cached()      # no prefix left by another test: the whole text prefills
    backend = LocalBackend(engine)
    async with running_app(factory=lambda: backend, max_tokens=2) as (app, pilot):
        try:
            seen = await load_in_small_chunks(app, pilot, path)
            await wait_until(pilot, lambda: any(d >= 64 for d, _ in prefill_steps(seen)), timeout=120,
                             what="the first chunk")
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, timeout=120, what="the prefill to stop")
            assert app.query_one(ChatInput).text == f"/load {path}"
            assert not any(m["role"] == "user" for m in app.chat_screen.session.chat.state().messages)
            assert app.chat_screen.session.turns == [] and app.chat_screen.session.chat.conv.tokens_held == 0
            done, total = prefill_steps(seen)[-1]
            assert done < total
            notes = [n.text for n in app.chat_screen.view.query(Notice)]
            assert any(f"prefill stopped at {done:,} of {total:,} tokens" in n for n in notes)
        finally:
            backend.close(app.chat_screen.session.chat)
