"""Input at any speed is safe (issue 27 high 8): twenty messages typed and sent without waiting,
while the model loads and while a reply streams, crash nothing and lose nothing.

The crash the issue saw (Textual's MountError "Can't mount widget(s) before
ChatView(id='transcript') is mounted", 2 runs of 4) came from the App's on_mount mounting the
loading bar into the first transcript before the screen had attached it, a race with a
start-up under load; the chat screen now composes that bar inside its transcript. These
tests keep every path that mounts into a transcript honest under input that does not wait.

Nothing lost: a message sent while the conversation still replies is refused with a notice
and put back in the input, where the next keys typed go after it; so what the conversation
received, followed by what is left in the input, is everything typed, in order."""
from __future__ import annotations

from .conftest import held_load, make_app, wait_until
from .fake_backend import FakeBackend, FakeConfig

MESSAGES = [f"m{i} " for i in range(20)]


async def type_all(pilot) -> None:
    """Each message key by key, then enter, with no wait for anything in between."""
    for text in MESSAGES:
        await pilot.press(*split_keys(text))
        await pilot.press("enter")


def sent_and_left(app) -> str:
    screen = app.chat_screen
    users = [m["content"] for m in screen.session.log.messages if m["role"] == "user"]
    return "".join(users) + screen.input.text


async def settle(pilot) -> None:
    screen = pilot.app.chat_screen
    await wait_until(pilot, lambda: screen.conversations.session is not None and screen.jobs.busy is None
                     and not screen.jobs, timeout=60, what="every job to end")
    await pilot.pause(0.2)


def split_keys(text: str) -> list[str]:
    return ["space" if c == " " else c for c in text]


async def test_twenty_messages_typed_while_the_model_loads_crash_nothing_and_lose_nothing():
    loaded, factory = held_load(FakeBackend(FakeConfig(token_delay_s=0.01)))
    app = make_app(factory=factory)
    async with app.run_test(size=(140, 60)) as pilot:
        await type_all(pilot)
        loaded.set()
        await settle(pilot)
        assert app.return_code is None and app._exception is None
        assert sent_and_left(app) == "".join(MESSAGES)
        assert len(app.chat_screen.session.turns) >= 1
        # the input still sends: what was left in it goes, and gets its reply
        await pilot.press("enter")
        await settle(pilot)
        assert app.chat_screen.input.text == ""
        assert "".join(m["content"] for m in app.chat_screen.session.log.messages
                       if m["role"] == "user") == "".join(MESSAGES)


async def test_twenty_messages_typed_while_a_reply_streams_crash_nothing_and_lose_nothing(running_app):
    backend = FakeBackend(FakeConfig(token_delay_s=0.005))
    async with running_app(backend) as (app, pilot):
        await type_all(pilot)
        await settle(pilot)
        assert app._exception is None
        assert sent_and_left(app) == "".join(MESSAGES)
        replies = [m for m in app.chat_screen.session.log.messages if m["role"] == "assistant"]
        assert len(replies) == len(app.chat_screen.session.turns) >= 1


async def test_messages_keys_and_closing_conversations_without_waiting_crash_nothing(running_app):
    """Sending, opening, switching, closing and stopping in one burst: every transcript a
    message or a notice is mounted into is still on screen, or the job skips it."""
    backend = FakeBackend(FakeConfig(token_delay_s=0.005))
    async with running_app(backend) as (app, pilot):
        for i in range(20):
            await pilot.press(*split_keys(f"x{i}"), "enter")
            await pilot.press(("ctrl+n", "f9", "alt+left", "escape", "f5")[i % 5])
        await settle(pilot)
        assert app._exception is None
        screen = app.chat_screen
        assert all(v.is_attached for v in screen.conversations.views)
        assert screen.view in screen.conversations.views
