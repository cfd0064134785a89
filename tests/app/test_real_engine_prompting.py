"""/system, sampling and the draft count on the real engine and the bundled model: the
counts are the tokenizer's, a new system prompt breaks prefix reuse at the first block, and
a seeded sample differs from the greedy reply and repeats."""
from __future__ import annotations

import pytest

from kvchat.backends.local import LocalBackend
from kvchat.widgets import ChatInput, Notice

from .conftest import send, wait_until

pytestmark = pytest.mark.slow


async def test_system_prompt_draft_count_and_a_seeded_regenerate_on_the_real_engine(engine, running_app):
    backend = LocalBackend(engine)
    system = "You are a pirate. Answer in one short sentence."
    tokens = len(engine.tokenizer.encode(system, add_special_tokens=False))
    async with running_app(factory=lambda: backend, max_tokens=10) as (app, pilot):
        try:
            assert backend.count_tokens("Name three colours.") == len(
                engine.tokenizer.encode("Name three colours.", add_special_tokens=False))
            await pilot.press(*"Name a colour.")
            field = app.query_one(ChatInput)
            typed = backend.count_tokens("Name a colour.")
            first = len(engine.render([{"role": "user", "content": "Name a colour."}]))   # the template's system prompt too
            full = f"draft: {first} tokens ({typed} typed + {first - typed} chat template)"
            await wait_until(pilot, lambda: field.border_title.startswith(full), what="the count once typing pauses")
            field.load_text("")
            await send(pilot, "Name a colour.")
            assert app.chat_screen.session.turns[-1].prompt_tokens == first
            # issue 26 low: '2 shown, 13 used'; the count is what the turn's prompt grows by
            await pilot.press(*"hi there")
            await wait_until(pilot, lambda: field.border_title.startswith("draft: "), what="the second count")
            shown = int(field.border_title.split()[1])
            assert field.border_title.startswith(f"draft: {shown} tokens (2 typed + {shown - 2} chat template)")
            field.load_text("")
            before = app.chat_screen.session.turns[-1]
            await send(pilot, "hi there")
            reply = len(engine.tokenizer.encode(before.reply, add_special_tokens=False))
            assert app.chat_screen.session.turns[-1].prompt_tokens - before.prompt_tokens - reply == shown == 13
            field.load_text(f"/system {system}")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and "system prompt set" in app.query(Notice).last().text,
                             what="the system prompt")
            history = app.chat_screen.session.chat.state().messages[1:]
            net = len(engine.render([{"role": "system", "content": system}, *history])) - len(engine.render(history))
            assert net < tokens       # the bundled template's default system prompt gave way (issue 26: "adds 9")
            assert (f"system prompt set: {tokens} tokens, in place of the chat template's default one; every "
                    f"prompt {net:+,} tokens") in app.query(Notice).last().text
            assert app.chat_screen.session.chat.state().messages[0] == {"role": "system", "content": system}
            await send(pilot, "Name a fruit.")
            assert app.chat_screen.session.turns[-1].reused_tokens == 0           # the first block changed
            greedy = app.chat_screen.session.turns[-1].reply
            for command in ("/temperature 1.5", "/seed 3"):
                field.load_text(command)
                await pilot.press("enter")
            await pilot.press("f5")
            await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 4 and app.chat_screen.jobs.busy is None, what="a sample")
            sampled = app.chat_screen.session.turns[-1].reply
            await pilot.press("f5")
            await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 5 and app.chat_screen.jobs.busy is None, what="the same sample")
            assert sampled != greedy and app.chat_screen.session.turns[-1].reply == sampled
        finally:
            for view in app.chat_screen.conversations.views:
                backend.close(view.session.chat)
