"""Edit and resend (/edit N, F6 for the last): the message goes back in the input, Enter
resends it in its place, the history after it is dropped, and the next turn's prefix reuse
stops at the block holding the edit (the fake's block rule here; the real engine's in
test_real_engine.py)."""
from __future__ import annotations

from kvchat.engine.telemetry import REUSED
from kvchat.widgets import BlockMap, ChatInput, UserMessage

from .conftest import send, wait_until
from .fake_backend import GENERATION_PROMPT, count_tokens

LONG = [" ".join(f"{w}{i}" for i in range(20)) for w in ("alpha", "beta", "gamma")]
EDITED = " ".join(f"delta{i}" for i in range(40))   # long enough that a cache kept whole would reuse more


async def submit(pilot, text: str) -> None:
    pilot.app.query_one(ChatInput).load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def test_edit_and_resend_drops_the_later_history_and_reuse_stops_at_the_edited_block(running_app):
    async with running_app() as (app, pilot):
        for text in LONG:
            await send(pilot, text)
        normal_reuse = app.chat_screen.session.turns[-1].reused_tokens
        await submit(pilot, "/edit 2")
        assert app.query_one(ChatInput).text == LONG[1]
        n = len(app.chat_screen.session.turns)
        app.query_one(ChatInput).load_text(EDITED)
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) > n and app.chat_screen.jobs.busy is None, what="the resent turn")

        messages = list(app.chat_screen.session.state.messages)
        assert [m["content"] for m in messages if m["role"] == "user"] == [LONG[0], EDITED]
        assert len(messages) == 4
        assert [w.text for w in app.chat_screen.view.query(UserMessage)] == [LONG[0], EDITED]
        kept = count_tokens(messages[:2]) - GENERATION_PROMPT        # the tokens before the edited message
        edited_block = kept // 16
        turn = app.chat_screen.session.turns[-1]
        assert turn.reused_tokens == edited_block * 16 < normal_reuse
        assert turn.computed_tokens == turn.prompt_tokens - edited_block * 16
        assert app.query_one(BlockMap).snapshot.block_map.count(REUSED) == edited_block
        log = app.chat_screen.session.log
        assert log.messages == messages           # the log says the history was replaced


async def test_alt_e_edits_the_last_message_and_edit_off_leaves_the_conversation_as_it_is(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "first question")
        await send(pilot, "second question")
        await pilot.press("alt+e")
        assert app.query_one(ChatInput).text == "second question" and app.chat_screen.session.editing is not None
        await submit(pilot, "/edit off")
        assert app.chat_screen.session.editing is None and app.query_one(ChatInput).text == ""
        await send(pilot, "third question")
        users = [m["content"] for m in app.chat_screen.session.state.messages if m["role"] == "user"]
        assert users == ["first question", "second question", "third question"]


async def test_edit_of_a_message_that_does_not_exist_says_which_do(running_app):
    async with running_app() as (app, pilot):
        await submit(pilot, "/edit")
        assert "nothing to edit" in app.chat_screen.view.query("Notice").last().render().plain
        await send(pilot, "only one")
        await submit(pilot, "/edit 3")
        assert "no message 3 to edit: you sent 1 message (1 to 1)" in app.chat_screen.view.query("Notice").last().render().plain
        assert app.chat_screen.session.editing is None
