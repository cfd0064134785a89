"""A long prompt on the FakeBackend, which prefills in chunks with the engine's
PrefillProgress events: the status line's progress moves up to the total, and Escape
between chunks stops the turn with the message back in the input and nothing recorded.
(tests/app/test_long_prompt_real.py does the same on the real engine, slowly.)"""
from __future__ import annotations

from kvchat.engine.telemetry import PrefillProgress
from kvchat.widgets import BlockMap, CachePanel, ChatInput, Notice, StatusBar

from .conftest import prefill_steps, record_status, send, wait_until
from .fake_backend import FakeBackend, FakeConfig

LONG = " ".join(f"w{i}" for i in range(600))     # 600 words: 600 tokens to the fake


def test_the_fake_prefills_in_chunks_with_the_engines_progress_events():
    chat = FakeBackend(FakeConfig(prefill_chunk=256)).open()
    events = list(chat.send(LONG))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    total = progress[-1].total
    assert [p.done for p in progress] == [0, 256, 512, total] and total > 600
    assert all(e.total == total for e in progress)
    assert events.index(progress[-1]) < next(i for i, e in enumerate(events) if not isinstance(e, PrefillProgress))


async def test_a_long_prompt_shows_the_prefill_moving_to_its_total(running_app):
    backend = FakeBackend(FakeConfig(prefill_chunk=64, prefill_delay_s=0.02))
    async with running_app(backend, max_tokens=4) as (app, pilot):
        seen = record_status(app)
        shown: list[str] = []
        app.chat_screen.query_one(StatusBar).watch(app.chat_screen.query_one(StatusBar), "state", lambda s: shown.append(s), init=False)
        await send(pilot, LONG)
        steps = prefill_steps(seen)
        total = app.chat_screen.session.turns[-1].computed_tokens
        assert len(steps) >= 8 and steps[0] == (0, total) and steps[-1] == (total, total)
        assert [d for d, _ in steps] == sorted(d for d, _ in steps) and len({d for d, _ in steps}) == len(steps)
        assert len(prefill_steps(shown)) >= 4        # the status bar itself showed it moving


async def test_escape_during_the_prefill_stops_it_and_puts_the_message_back(running_app):
    backend = FakeBackend(FakeConfig(prefill_chunk=64, prefill_delay_s=0.1))
    async with running_app(backend, max_tokens=4) as (app, pilot):
        await send(pilot, "a short first turn")
        held = app.chat_screen.session.chat.state().tokens_held
        seen = record_status(app)
        app.query_one(ChatInput).load_text(LONG)
        await pilot.press("enter")
        await wait_until(pilot, lambda: any(d >= 64 for d, _ in prefill_steps(seen)), what="the first chunk")
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, what="the prefill to stop")
        assert app.query_one(ChatInput).text == LONG
        state = app.chat_screen.session.chat.state()
        assert [m["content"] for m in state.messages if m["role"] == "user"] == ["a short first turn"]
        assert len(app.chat_screen.session.turns) == 1 and state.turns == 1 and held > 0 and state.tokens_held == 0
        done, total = prefill_steps(seen)[-1]
        assert 0 < done < total
        notes = [n.text for n in app.chat_screen.view.query(Notice)]
        assert any(f"prefill stopped at {done:,} of {total:,} tokens" in n for n in notes)
        await send(pilot, "and the chat goes on")          # nothing is left stuck
        assert len(app.chat_screen.session.turns) == 2


async def test_the_cache_panels_follow_a_long_prefill_chunk_by_chunk_and_show_the_state_after_a_cancel(running_app):
    """Issue 26: the panels froze at the last turn's figures for a whole long prefill, and once
    showed the cache from before a cancelled one."""
    backend = FakeBackend(FakeConfig(prefill_chunk=64, prefill_delay_s=0.1))
    async with running_app(backend, max_tokens=4) as (app, pilot):
        await send(pilot, "a short first turn")
        cache, blocks = app.query_one(CachePanel), app.query_one(BlockMap)
        before = cache.snapshot.tokens_held
        drawn: list[tuple[int, int]] = []
        show = cache.show

        def recording(snap, *args, **kwargs):
            drawn.append((snap.tokens_held, snap.blocks_used))
            show(snap, *args, **kwargs)
        cache.show = recording
        seen = record_status(app)
        app.query_one(ChatInput).load_text(" ".join(f"w{i}" for i in range(1500)))   # 24 chunks, 2.4 s
        await pilot.press("enter")

        def moved() -> int:
            return len({held for held, _ in drawn if held > before})
        # the panel moves with the chunks, not only at the end (a chunk's snapshot is skipped when
        # snapshots cost more than 2% of the time: a slow one on a busy machine skips a few)
        await wait_until(pilot, lambda: moved() >= 3, what="the panel following three chunks")
        assert not prefill_steps(seen) or prefill_steps(seen)[-1][0] < prefill_steps(seen)[-1][1]   # still prefilling
        assert blocks.snapshot.blocks_used == drawn[-1][1] > 0
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, what="the prefill to stop")
        held = app.chat_screen.session.chat.state().tokens_held
        assert cache.snapshot.tokens_held == blocks.snapshot.tokens_held == held == 0   # the cache after the cancel
