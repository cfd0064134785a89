"""/system, /temperature, /top-p and /seed from the input; F5 regenerates with them."""
from __future__ import annotations

import random

from kvchat.store.log import last_conversation, restore
from kvchat.widgets import Notice, Reply

from .conftest import send, wait_until
from .fake_backend import REPLIES


def notices(app) -> list[str]:
    return [n.text for n in app.query(Notice)]


async def command(pilot, text: str) -> None:
    pilot.app.query_one("#input").load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def test_system_sets_the_prompt_says_its_tokens_and_that_the_prefix_changes(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        assert app.chat_screen.session.chat.state().tokens_held > 0
        await command(pilot, "/system You're a terse pirate.")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and "system prompt set" in notices(app)[-1], what="the note")
        note = notices(app)[-1]
        assert "system prompt set: 4 tokens; every prompt +" in note and "shared prefix" in note and "prefills the whole history" in note
        messages = app.chat_screen.session.chat.state().messages
        assert messages[0] == {"role": "system", "content": "You're a terse pirate."}
        assert [m["role"] for m in messages] == ["system", "user", "assistant"]
        await send(pilot, "again")
        assert app.chat_screen.session.turns[-1].reused_tokens == 0          # the cached prefix no longer matched


async def test_an_empty_system_removes_the_prompt(running_app):
    async with running_app(system="be brief") as (app, pilot):
        await command(pilot, "/system")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and "removed" in notices(app)[-1], what="the note")
        assert app.chat_screen.session.chat.state().system is None


async def test_sampling_commands_change_what_f5_regenerates_with(fake, running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        greedy = app.chat_screen.session.turns[-1].reply
        assert greedy == REPLIES[0].replace("  ", " ")
        await command(pilot, "/temperature 0.8")
        await command(pilot, "/top-p 0.9")
        await command(pilot, "/seed 7")
        assert "temperature 0.8 · top-p 0.9 · seed 7" in app.chat_screen.panels.notes[-1]
        fake.cfg.replies = (greedy,)                    # the same script: only the sampling differs
        await pilot.press("f5")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 2 and app.chat_screen.jobs.busy is None, what="the sampled reply")
        sp = fake.sampling_seen[-1]
        assert (sp.temperature, sp.top_p, sp.seed) == (0.8, 0.9, 7)
        sampled = app.chat_screen.session.turns[-1].reply
        words = greedy.split()
        random.Random(7).shuffle(words)
        assert sampled != greedy and sampled == " ".join(words)
        await pilot.press("f5")                          # seeded: the same sample again
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 3 and app.chat_screen.jobs.busy is None, what="the second sample")
        assert app.chat_screen.session.turns[-1].reply == sampled
        assert app.query(Reply).last().text.strip() == sampled


async def test_bad_sampling_values_are_refused_with_what_is_accepted(running_app):
    async with running_app() as (app, pilot):
        await command(pilot, "/top-p 0")
        assert "/top-p must be in (0, 1], got 0" in notices(app)[-1]
        await command(pilot, "/temperature hot")
        assert "/temperature needs a number" in notices(app)[-1]
        assert app.options.sampling.temperature == 0 and app.options.sampling.top_p == 1.0


async def test_the_status_line_shows_the_sampling_in_force(running_app):
    from kvchat.widgets import StatusBar
    async with running_app() as (app, pilot):
        assert app.query_one(StatusBar).info.endswith("· greedy")
        await command(pilot, "/temperature 0.7")
        assert app.query_one(StatusBar).info.endswith("· temperature 0.7 · unseeded")


async def test_temperature_top_p_and_seed_come_back_with_resume(running_app):
    """Issue 26 low: /temperature, /top-p and /seed were not restored on --resume."""
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        for text in ("/temperature 0.7", "/top-p 0.9", "/seed 5"):
            await command(pilot, text)
        app.chat_screen.session.log.close()
    restored = restore(last_conversation())
    assert restored.sampling == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
    async with running_app(restored=restored) as (app, pilot):
        sp = app.chat_screen.generation.sampling
        assert (sp.temperature, sp.top_p, sp.seed) == (0.7, 0.9, 5)
        app.chat_screen.session.log.close()
