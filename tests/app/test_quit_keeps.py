"""Quitting loses nothing typed (found in a real terminal, session 7): a message sent in the
same instant as ctrl+q, a message waiting for the model's load, and the draft left in the input
are kept in the conversation's log as its unanswered last message, so --resume puts them back
in the input.

Before the fix the App's quit dropped the job queue (a message sent while the model loaded was
gone) and never looked at the input; in a terminal, Enter and ctrl+q in one burst reach the App's
quit before the input has handled Enter, so that message was gone too (the tmux test in
tests/app/test_tmux.py sends that burst)."""
from __future__ import annotations

from pathlib import Path

from kvchat.store.log import restore

from .conftest import held_load, make_app, ready, wait_until
from .fake_backend import FakeBackend, FakeConfig


def restored_logs(root: Path) -> list:
    return [restore(p) for p in sorted((root / "data" / "conversations").glob("*.jsonl"))]


async def test_a_message_waiting_for_the_load_and_the_draft_are_kept_when_the_app_quits(private_dirs):
    loaded, factory = held_load(FakeBackend(FakeConfig(token_delay_s=0.01)))
    app = make_app(factory=factory)
    async with app.run_test(size=(140, 60)) as pilot:
        app.chat_screen.input.load_text("sent while it loads")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.jobs) == 1, what="the message to wait in the queue")
        app.chat_screen.input.load_text("a draft")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: app.return_code is not None, what="the app to exit")
    loaded.set()
    logs = restored_logs(private_dirs)
    assert len(logs) == 1 and logs[0].messages == []
    assert logs[0].unanswered == "sent while it loads\n\na draft"


async def test_quitting_mid_reply_saves_the_reply_then_keeps_the_draft_after_it(private_dirs):
    backend = FakeBackend(FakeConfig(token_delay_s=0.05, replies=(" ".join(f"w{i}" for i in range(200)),)))
    app = make_app(backend)
    async with app.run_test(size=(140, 60)) as pilot:
        await ready(pilot)
        screen = app.chat_screen
        screen.input.load_text("tell me a story")
        await pilot.press("enter")
        await wait_until(pilot, lambda: screen.jobs.replying is not None and screen.jobs.replying.prefilled,
                         what="the reply to stream")
        screen.input.load_text("and then?")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: app.return_code is not None, timeout=20, what="the app to exit")
    [log] = restored_logs(private_dirs)
    assert [m["role"] for m in log.messages] == ["user", "assistant"]
    assert log.messages[0]["content"] == "tell me a story" and log.messages[1]["content"].startswith("w0")
    assert log.turns[-1].stop_reason == "cancelled"
    assert log.unanswered == "and then?"


async def test_a_commands_draft_is_not_kept_as_a_message(private_dirs, running_app):
    async with running_app() as (app, pilot):
        app.chat_screen.input.load_text("hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 1 and app.chat_screen.jobs.busy is None,
                         what="the reply")
        app.chat_screen.input.load_text("/cap 512")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: app.return_code is not None, what="the app to exit")
    [log] = restored_logs(private_dirs)
    assert [m["content"] for m in log.messages][0] == "hello" and log.unanswered is None
