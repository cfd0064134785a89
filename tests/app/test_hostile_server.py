"""The app on a vLLM server that never stops streaming (issue 27, high 6, the client side):
Escape stops the reply within a second whatever the server does, and the client itself ends
a reply at the max_tokens it asked for. The server is tests/hostile/fake_vllm.py (real HTTP);
it reports usage with every chunk (vLLM's continuous usage stats), so the turn's figures are
whole even when it is cut."""
from __future__ import annotations

import time

import pytest

from hostile.fake_vllm import fake_vllm, token
from kvchat.backends.vllm import VllmBackend

from .conftest import wait_until

pytestmark = pytest.mark.timeout(60)


def with_usage(text: str, tid: int) -> dict:
    return {**token(text, tid), "usage": {"prompt_tokens": 5, "completion_tokens": 1,
                                          "prompt_tokens_details": {"cached_tokens": 0}}}


def endless_trickle(h):
    """Two tokens, then keep-alive comments for ever: no event, so no chance for a client
    that waits for the next event to see its cancel."""
    h.start_stream()
    h.event(with_usage("Once", 1))
    h.event(with_usage(" upon", 2))
    h.server.sent_tokens = True
    while h.write(": keep-alive\n"):
        time.sleep(0.05)


def endless_tokens(h):
    h.start_stream()
    i = 0
    while h.event(with_usage(" x", i)):
        i += 1


async def test_escape_stops_a_reply_that_never_ends_within_a_second(running_app):
    with fake_vllm({"/v1/chat/completions": endless_trickle}) as server:
        backend = VllmBackend(server.url, geometry="smollm2-135m")
        try:
            async with running_app(backend) as (app, pilot):
                app.query_one("#input").load_text("tell me a story")
                await pilot.press("enter")
                await wait_until(pilot, lambda: getattr(server, "sent_tokens", False), what="the first tokens")
                await pilot.pause(0.3)
                t0 = time.monotonic()
                await pilot.press("escape")
                await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and len(app.chat_screen.session.turns) == 1, timeout=5,
                                 what="the reply to stop")
                assert time.monotonic() - t0 < 1.5
                assert app.chat_screen.session.turns[-1].stop_reason == "cancelled" and app.chat_screen.session.turns[-1].reply == "Once upon"
        finally:
            backend.shutdown()


async def test_a_reply_past_max_tokens_is_ended_by_the_client(running_app):
    with fake_vllm({"/v1/chat/completions": endless_tokens}) as server:
        backend = VllmBackend(server.url, geometry="smollm2-135m")
        try:
            async with running_app(backend, max_tokens=16) as (app, pilot):
                app.query_one("#input").load_text("count")
                await pilot.press("enter")
                await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and len(app.chat_screen.session.turns) == 1, timeout=20,
                                 what="the reply to end")
                turn = app.chat_screen.session.turns[-1]
                assert turn.stop_reason == "max_tokens" and turn.reply == " x" * 16
        finally:
            backend.shutdown()


async def test_a_reply_whose_connection_is_lost_says_the_conversation_is_kept(running_app):
    """The backend's line speaks of no conversation (ask, replay, bench and crowd share it);
    the chat, which has one, adds that it is kept."""
    from hostile.fake_vllm import lost_mid_chunk
    from kvchat.widgets import Notice, Reply
    with fake_vllm({"/v1/chat/completions": lost_mid_chunk}) as server:
        backend = VllmBackend(server.url, geometry="smollm2-135m")
        try:
            async with running_app(backend) as (app, pilot):
                app.query_one("#input").load_text("are you there")
                await pilot.press("enter")

                def said() -> list[str]:
                    lines = [n.text for n in app.query(Notice) if n.has_class("error")]
                    return lines + [str(r.query_one(".stats").render()) for r in app.query(Reply)]
                await wait_until(pilot, lambda: any("lost mid-reply" in line for line in said()), what="the error line")
                line = next(line for line in said() if "lost mid-reply" in line)
                assert line.endswith("the conversation so far is kept") and "try again once the server is back" in line
        finally:
            backend.shutdown()
