"""Typing always reaches the input: a click elsewhere does not take the keyboard, and the
focused area shows it."""
from __future__ import annotations

from kvchat.widgets import ChatInput

from .conftest import send


async def test_a_click_in_the_transcript_leaves_typing_with_the_input(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "a first message")
        await pilot.click("#transcript", offset=(5, 3))
        await pilot.press(*"hello")
        assert app.query_one(ChatInput).text == "hello"


async def test_a_click_on_a_panel_leaves_typing_with_the_input(running_app):
    async with running_app() as (app, pilot):
        await pilot.click("#block-map")
        await pilot.press(*"hi there")
        assert app.query_one(ChatInput).text == "hi there"


async def test_characters_typed_while_tab_focused_the_transcript_go_to_the_input(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#transcript").focus()          # as Tab would: deliberately
        await pilot.pause()
        assert app.focused is app.query_one("#transcript")
        await pilot.press("pageup")                   # its own keys stay with it
        assert app.focused is app.query_one("#transcript")
        await pilot.press(*"ok")
        assert app.query_one(ChatInput).text == "ok" and app.focused is app.query_one(ChatInput)


async def test_the_focused_transcript_is_marked(running_app):
    async with running_app() as (app, pilot):
        transcript = app.query_one("#transcript")
        assert transcript.styles.outline_left[0] == ""
        transcript.focus()
        await pilot.pause()
        assert transcript.styles.outline_left[0] == "thick"
