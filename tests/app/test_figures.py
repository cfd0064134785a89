"""Figures that must agree with what they describe (issue 26's medium items): the cap gauge
counts the conversation as the cap is checked, a cap past the model is refused as --cap is,
the panel says where sink-window evicts without a cap."""
from __future__ import annotations

from rich.console import Console

from kvchat.engine.telemetry import TurnSummary
from kvchat.store.log import last_conversation, restore
from kvchat.text import stats_line
from kvchat.widgets import CachePanel, CapGauge, Notice

from .conftest import SIZE, make_app, ready, screen_text, send, wait_until
from .fake_backend import FakeBackend, FakeConfig


async def test_the_cap_gauge_counts_the_conversation_after_a_reset_and_after_a_resume(running_app):
    async with running_app(cap=4096) as (app, pilot):
        await send(pilot, "tell me about caches")
        await send(pilot, "and about blocks")
        gauge, session = app.query_one(CapGauge), app.chat_screen.session
        context = session.turns[-1].context_tokens
        assert gauge.tokens == context > 0
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and session.snapshot.tokens_held == 0,
                         what="the reset")
        assert gauge.tokens == context           # the cache is empty; the conversation is not
        session.log.close()
    async with make_app(restored=restore(last_conversation())).run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert pilot.app.query_one(CapGauge).tokens == context
        pilot.app.chat_screen.session.log.close()


async def test_a_cap_past_the_models_context_is_refused_as_the_flag_is(running_app):
    async with running_app(FakeBackend(FakeConfig(random_weights=False))) as (app, pilot):
        app.chat_screen.input.load_text("/cap 99999")
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat_screen.session.cap is None
        errors = [n.text for n in app.chat_screen.view.query(Notice) if n.has_class("error")]
        assert errors[-1] == ("/cap 99,999 is past fake-smollm2's context window of 8,192 tokens; accepted: 1 to "
                              "8,192, or /cap off")
        app.chat_screen.input.load_text("/cap 8192")      # the window itself is accepted
        await pilot.press("enter")
        await pilot.pause()
        assert app.chat_screen.session.cap == 8192


async def test_sink_window_without_a_cap_says_it_evicts_at_the_models_maximum(running_app):
    async with running_app(policy="sink-window") as (app, pilot):
        text = app.query_one(CapGauge).render().plain
        assert "no cap: it evicts at the model's maximum of 8,192 tokens" in text
        assert "needs a cap" not in text


async def test_evicted_reclaimed_and_preempted_are_one_word_each(running_app):
    """Issue 26: "evicted" meant sink-window's evictions, the pool's reclaim of cached blocks and
    its pool-wide counter. Now sink-window evicts (the gauge, the stats line's "from the
    middle"), the pool reclaims (the panel's counter, the stats line), and preempts."""
    async with running_app() as (app, pilot):
        await send(pilot, "tell me about caches")
        panel = app.query_one(CachePanel)
        text = Console(width=80, record=True)
        text.print(panel.render_snapshot(panel.snapshot))
        rows = text.export_text()
        assert "reclaimed" in rows and "cached blocks given to new content" in rows and "evicted" not in rows
    summary = TurnSummary(evicted_blocks=2, reclaimed_blocks=3, generated_tokens=1)
    line = stats_line(summary)
    assert "evicted 2 blocks from the middle" in line and "reclaimed 3 cached blocks" in line


async def test_switching_to_sink_window_says_the_history_it_will_prefill_again(running_app):
    """Issue 26: switching to sink-window re-prefilled the whole history without a word (44 s
    at 8k); the note says so, with its tokens, before the turn that pays it. Issue 26 low: that
    line (over 200 columns) was cut from the one-line status bar at 160x48, there whole: the
    status line says the cost in a line that fits, the transcript keeps the whole sentence."""
    async with running_app(cap=4096, size=(160, 48)) as (app, pilot):
        await send(pilot, "tell me about caches")
        await send(pilot, "and about blocks")
        session, notes = app.chat_screen.session, app.chat_screen.panels.notes
        app.chat_screen.controls.set_policy("drop-oldest")
        await pilot.pause()
        assert notes[-1].startswith("policy drop-oldest") and "again" not in notes[-1]
        assert notes[-1] in screen_text(app).splitlines()[0]
        app.chat_screen.controls.set_policy("sink-window")
        await pilot.pause()
        tokens = session.context_tokens
        assert tokens > 0 and notes[-1] == (f"policy sink-window: the next turn prefills the whole history again "
                                            f"({tokens:,} tokens)")
        assert notes[-1] in screen_text(app).splitlines()[0]            # on screen, whole
        said = [n.text for n in app.chat_screen.view.query(Notice)][-1]
        assert said.startswith("policy sink-window: keep the first tokens") and (
            f"the next turn prefills the whole history again, {tokens:,} tokens, as sink-window's cache is no "
            "prefix of the text") in said


def test_the_stats_line_counts_with_separators_and_singulars():
    """Issue 26 low: '3423' and 'dropped 1 old messages'."""
    line = stats_line(TurnSummary(prompt_tokens=3423, reused_tokens=1024, computed_tokens=2399, generated_tokens=1,
                                  dropped_messages=1))
    assert "prompt 3,423: 1,024 reused, 2,399 computed" in line and "dropped 1 old message" in line
    assert "old messages" not in line
