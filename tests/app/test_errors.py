"""Errors reach the user as one line and the app goes on; a load failure exits with 2."""
from __future__ import annotations

import threading

from kvchat.engine.errors import KvchatError, ModelLoadError
from kvchat.widgets import Notice, Reply, UserMessage

from .conftest import SIZE, make_app, send, wait_until
from .fake_backend import FakeBackend


async def test_a_model_that_fails_to_load_exits_with_status_2_and_one_line():
    def factory():
        raise ModelLoadError("/models/x: no *.safetensors weights")
    app = make_app(factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: not app.is_running, what="the app to exit")
    assert app.return_code == 2 and app.failure == "/models/x: no *.safetensors weights"


async def test_an_engine_error_before_the_first_token_refuses_the_turn_and_gives_the_text_back(fake, running_app):
    async with running_app() as (app, pilot):
        fake.fail_next = KvchatError("KV pool full: this turn needs 9 more blocks")
        app.query_one("#input").load_text("hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.query(Notice), what="the refused turn")
        assert app.query(Notice).last().has_class("error") and "KV pool full" in app.query(Notice).last().text
        assert app.query_one(UserMessage).has_class("refused") and not app.query(Reply)
        assert app.query_one("#input").text == "hello" and app.chat_screen.session.chat.state().messages == ()
        await send(pilot, "and again")
        assert app.chat_screen.session.turns[-1].generated_tokens > 0


async def test_an_engine_error_mid_turn_is_shown_under_the_reply_and_the_app_goes_on(fake, running_app):
    async with running_app() as (app, pilot):
        fake.fail_mid_turn = KvchatError("KV pool full: this turn needs 9 more blocks")
        app.query_one("#input").load_text("hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.query(Reply), what="the failed turn")
        stats = app.query_one("Reply .stats")
        assert stats.has_class("error") and "KV pool full" in stats.render().plain
        await send(pilot, "and again")
        assert app.chat_screen.session.turns[-1].generated_tokens > 0


async def test_a_bug_in_a_turn_is_reported_with_where_the_traceback_went(fake, private_dirs, running_app):
    async with running_app() as (app, pilot):
        fake.fail_mid_turn = RuntimeError("boom")
        app.query_one("#input").load_text("hello")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.query(Reply), what="the failed turn")
        line = app.query_one("Reply .stats").render().plain
        assert "internal error (RuntimeError: boom); traceback in" in line
    assert "RuntimeError: boom" in (private_dirs / "data" / "errors.log").read_text()


async def test_sending_while_replying_says_so_and_keeps_the_text(slow_fake, running_app):
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("first")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy == "reply", what="the reply to start")
        app.query_one("#input").load_text("second")
        await pilot.press("enter")
        await pilot.pause()
        assert app.query(Notice).last().text.startswith("still replying")
        assert app.query_one("#input").text == "second" and len(app.query(UserMessage)) == 1
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None, what="the stop")


async def test_a_message_typed_while_the_model_loads_is_sent_once_it_is_ready():
    loaded = threading.Event()
    engine = FakeBackend()

    def factory():
        loaded.wait(10)
        return engine
    app = make_app(factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        app.query_one("#input").load_text("early bird")
        await pilot.press("enter")
        await pilot.pause()
        assert "loading" in app.query_one("StatusBar").state
        loaded.set()
        await wait_until(pilot, lambda: app.chat_screen.conversations.session is not None and app.chat_screen.session.turns
                     and app.chat_screen.jobs.busy is None,
                         what="the queued turn")
        assert app.chat_screen.session.chat.state().messages[0]["content"] == "early bird"
