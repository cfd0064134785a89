"""The message input: Enter sends, ctrl+j adds a line, up/down recall sent messages; and
settings typed while a reply streams take effect at once."""
from __future__ import annotations

from kvchat.widgets import ChatInput, Notice, UserMessage

from .conftest import send, wait_until


async def test_ctrl_j_adds_a_line_and_enter_sends_both_lines(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("o", "n", "e", "ctrl+j", "t", "w", "o")
        assert app.query_one(ChatInput).text == "one\ntwo"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.session.turns and app.chat_screen.jobs.busy is None, what="the reply")
        assert app.query_one(UserMessage).text == "one\ntwo" and app.query_one(ChatInput).text == ""


async def test_up_and_down_walk_the_sent_messages_and_come_back_to_the_draft(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "first")
        await send(pilot, "second")
        box = app.query_one(ChatInput)
        await pilot.press("d", "r", "a", "f", "t")
        await pilot.press("up")
        assert box.text == "second"
        await pilot.press("up")
        assert box.text == "first"
        await pilot.press("down", "down")
        assert box.text == "draft"


async def test_a_cap_set_while_a_reply_streams_stops_it_at_the_cap(slow_fake, running_app):
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("a long one please")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy == "reply", what="the reply to start")
        app.query_one("#input").load_text("/cap 30")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.chat_screen.session.turns, what="the reply to stop")
        turn = app.chat_screen.session.turns[-1]
        assert turn.stop_reason == "cap" and turn.prompt_tokens + turn.generated_tokens <= 30
        assert "stopped at the cap" in app.query("Reply .stats").last().render().plain


async def test_page_up_and_down_scroll_the_transcript_while_typing(running_app):
    """Issue 26: no keyboard way to scroll the transcript; the input keeps focus (typing always
    reaches it), so PageUp/PageDown page the conversation, not the draft's cursor."""
    async with running_app() as (app, pilot):
        for i in range(6):
            await send(pilot, f"message {i} " + "word\n" * 30)
        view, field = app.chat_screen.view, app.query_one(ChatInput)
        await pilot.pause(0.2)
        assert view.max_scroll_y > 2 * view.size.height and field.has_focus
        field.load_text("a draft\nof two lines")       # the input grows a line: the transcript's end moves
        await pilot.pause(0.1)
        view.scroll_end(animate=False)
        await pilot.pause(0.1)
        bottom = view.scroll_y
        await pilot.press("pageup")
        await pilot.pause(0.1)
        assert view.scroll_y < bottom
        up = view.scroll_y
        await pilot.press("pageup")
        await pilot.pause(0.1)
        assert view.scroll_y < up or view.scroll_y == 0
        await pilot.press("pagedown", "pagedown")
        await pilot.pause(0.1)
        assert view.scroll_y == view.max_scroll_y == bottom
        assert field.has_focus and field.text == "a draft\nof two lines"


async def test_ctrl_c_stops_the_reply_and_otherwise_says_which_keys_do(slow_fake, running_app):
    """Issue 26 low: ctrl+c neither stopped the reply nor said what does. With nothing
    selected it stops the reply in progress; idle, it names the keys; a selection it copies."""
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("a long one please")
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy == "reply", what="the reply to start")
        await pilot.press("ctrl+c")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.chat_screen.session.turns,
                         what="the reply to stop")
        assert app.chat_screen.session.turns[-1].stop_reason == "cancelled"
        await pilot.press("ctrl+c")
        await pilot.pause()
        notes = [n.text for n in app.chat_screen.view.query(Notice)]
        assert "escape stops a reply, ctrl+q quits" in notes[-1]
        field = app.query_one(ChatInput)
        field.load_text("copy me")
        field.select_all()
        await pilot.press("ctrl+c")                    # a selection: copied, as before
        await pilot.pause()
        assert [n.text for n in app.chat_screen.view.query(Notice)] == notes and field.text == "copy me"
