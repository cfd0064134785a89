"""The chat browser (ctrl+o, /chats): saved conversations listed, searched, opened again
(cache empty), renamed and deleted; --resume reopening every conversation open at the last
quit; and a conversation resumed under another model."""
from __future__ import annotations

import json

from kvchat.store import catalog
from kvchat.store.log import restore
from kvchat.widgets import LatencyPanel, UserMessage
from kvchat.screens.chat_browser import ChatBrowser, Confirm

from .conftest import send, wait_until
from .fake_backend import FakeBackend, FakeConfig


async def save_two(running_app, model: str = "fake-smollm2") -> None:
    """Two saved conversations: 'apples are red', then 'bananas are yellow'."""
    async with running_app(FakeBackend(FakeConfig(model=model))) as (app, pilot):
        await send(pilot, "apples are red")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="conversation 2")
        await send(pilot, "bananas are yellow")


async def open_browser(app, pilot) -> ChatBrowser:
    await pilot.press("ctrl+o")
    await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser) and app.screen.loaded, what="the chat browser")
    await pilot.pause()
    return app.screen


def titles(browser: ChatBrowser) -> list[str]:
    return [s.title for s in browser.shown]


async def test_the_browser_lists_searches_and_opens_a_saved_conversation_with_an_empty_cache(running_app):
    await save_two(running_app)
    async with running_app() as (app, pilot):
        browser = await open_browser(app, pilot)
        assert titles(browser) == ["bananas are yellow", "apples are red"]     # the most recent first
        first = browser.shown[0]
        assert first.model == "fake-smollm2" and first.turns == 1 and first.tokens > 0

        await pilot.press("slash")
        for ch in "apple":
            await pilot.press(ch)
        assert titles(browser) == ["apples are red"]
        await pilot.press("enter")           # leaves the search box for the table
        await pilot.press("enter")           # opens the row
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="the reopened conversation")
        assert app.screen is app.screen_stack[0]
        view = app.chat_screen.view
        assert [m["content"] for m in view.session.state.messages if m["role"] == "user"] == ["apples are red"]
        assert [w.text for w in view.query(UserMessage)] == ["apples are red"]
        assert view.session.state.tokens_held == 0           # restored: the cache starts empty
        await send(pilot, "and grapes?")
        turn = view.session.turns[-1]
        assert turn.reused_tokens == 0 and turn.computed_tokens == turn.prompt_tokens


async def test_rename_and_delete_with_confirmation_change_the_saved_conversations(running_app):
    await save_two(running_app)
    async with running_app() as (app, pilot):
        browser = await open_browser(app, pilot)
        bananas = browser.shown[0]
        await pilot.press("r")
        box = browser.query_one("#rename")
        assert box.value == "bananas are yellow"
        box.value = "Fruit colours"
        await pilot.press("enter")
        await pilot.pause()
        assert catalog.summarize(bananas.path).title == "Fruit colours"
        assert titles(browser)[0] == "Fruit colours"
        assert restore(bananas.path).messages[-2]["content"] == "bananas are yellow"   # the history is untouched

        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, Confirm), what="the delete question")
        await pilot.press("n")
        await pilot.pause()
        assert bananas.path.exists() and len(browser.shown) == 2
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, Confirm), what="the delete question")
        await pilot.press("y")
        await wait_until(pilot, lambda: not bananas.path.exists(), what="the file to go")
        assert titles(browser) == ["apples are red"]

        await pilot.press("enter")          # a renamed conversation keeps its name when opened
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="the reopened one")
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser), what="the browser again")
        await pilot.press("d")              # the open one cannot be deleted
        await pilot.pause()
        assert app.screen.query_one("#browser-note").render().plain.startswith("'apples are red' is open")
        assert app.chat_screen.conversations.views[1].session.log.path.exists()


async def test_slash_chats_opens_the_browser_and_escape_closes_it(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/chats")
        await pilot.press("enter")
        await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser), what="the chat browser")
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, ChatBrowser), what="the browser to close")


async def three_conversations(app, pilot) -> None:
    """Conversations 1, 2 and 3, one turn each."""
    for text in ("apples are red", "bananas are yellow", "cherries are dark"):
        if app.chat_screen.session.turns:
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: app.chat_screen.session.turns == [] and app.chat_screen.jobs.busy is None,
                             what="a new one")
        await send(pilot, text)


async def test_resume_reopens_every_conversation_open_at_quit_but_not_a_closed_one(running_app):
    async with running_app() as (app, pilot):
        await three_conversations(app, pilot)
        app.query_one("#input").load_text("/close 2")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="conversation 2 to close")
    focus, others = catalog.resume_paths()
    assert focus is not None and len(others) == 1
    async with running_app(restored=restore(focus), reopen=others) as (app, pilot):
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2, what="both to reopen")
        firsts = {v.session.state.messages[0]["content"] for v in app.chat_screen.conversations.views}
        assert firsts == {"apples are red", "cherries are dark"}
        assert app.chat_screen.session.state.messages[0]["content"] == "cherries are dark"   # the last used is in focus


async def test_resuming_under_another_model_says_so_and_starts_a_new_latency_series(running_app):
    async with running_app(FakeBackend(FakeConfig(model="model-a"))) as (app, pilot):
        await send(pilot, "apples are red")
        await send(pilot, "and bananas?")
    path, _ = catalog.resume_paths()
    assert json.loads(path.read_text().splitlines()[0])["model"] == "model-a"     # the header records it

    async with running_app(FakeBackend(FakeConfig(model="model-b")), restored=restore(path)) as (app, pilot):
        notes = [n.render().plain for n in app.chat_screen.view.query("Notice")]
        assert sum("saved under model-a, now running on model-b" in n for n in notes) == 1
        panel = app.query_one(LatencyPanel)
        assert len(app.chat_screen.session.turns) == 2 and panel.point_count == 0       # model-a's points are not drawn
        await send(pilot, "and cherries?")
        new_points = app.chat_screen.session.turns[-1].generated_tokens
        assert panel.point_count == new_points

    async with running_app(FakeBackend(FakeConfig(model="model-b")), restored=restore(path)) as (app, pilot):
        assert not any("saved under" in n.render().plain for n in app.chat_screen.view.query("Notice"))
        assert app.query_one(LatencyPanel).point_count == new_points    # still only model-b's turn


async def test_an_old_log_without_a_model_still_resumes_with_all_its_points(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "apples are red")
    path, _ = catalog.resume_paths()
    lines = path.read_text().splitlines()
    start = json.loads(lines[0])
    del start["model"]
    path.write_text("\n".join([json.dumps(start), *lines[1:]]) + "\n")
    assert catalog.summarize(path).model is None
    async with running_app(restored=restore(path)) as (app, pilot):
        assert not any("saved under" in n.render().plain for n in app.chat_screen.view.query("Notice"))
        assert app.query_one(LatencyPanel).point_count == app.chat_screen.session.turns[0].generated_tokens > 0


async def test_resume_keeps_each_conversations_number_and_counts_a_regenerated_reply_once(running_app):
    """Issue 26 low: --resume numbered the conversations again from 1 (the last used first), and
    its note counted a regenerated reply as another turn. Open 1, 2, 3, regenerate 3's reply,
    close 2: the resumed ones are 1 and 3 again, 3 has one turn, and a new one is 4."""
    async with running_app() as (app, pilot):
        await three_conversations(app, pilot)
        await pilot.press("f5")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 2 and app.chat_screen.jobs.busy is None,
                         what="the regenerated reply")
        assert app.chat_screen.session.turn_count == 1
        app.query_one("#input").load_text("/close 2")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2 and app.chat_screen.jobs.busy is None, what="conversation 2 to close")
    focus, others = catalog.resume_paths()
    async with running_app(restored=restore(focus), reopen=others) as (app, pilot):
        convs = app.chat_screen.conversations
        await wait_until(pilot, lambda: len(convs.views) == 2, what="both to reopen")
        numbers = {v.number: v.session.state.messages[0]["content"] for v in convs.views}
        assert numbers == {1: "apples are red", 3: "cherries are dark"}
        assert [v.number for v in convs.views] == [1, 3] and convs.focused.number == 3 == app.chat_screen.session.number
        said = [n.render().plain for n in app.chat_screen.view.query("Notice")]
        assert any(n.startswith(f"resumed {focus.name}: 1 turn;") for n in said), said
        assert "chat 3 · 2 open" in app.query_one("StatusBar").info
        app.query_one("#input").load_text("/list")
        await pilot.press("enter")
        await pilot.pause()
        listed = [n.render().plain for n in app.chat_screen.view.query("Notice")][-1]
        assert "● 3 cherries are … · 1 turn ·" in listed and "  1 apples are red · 1 turn ·" in listed, listed
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(convs.views) == 3, what="a new one")
        assert convs.focused.number == 4


async def test_the_browser_reads_the_logs_in_a_thread_says_how_far_and_escape_closes_it_meanwhile():
    """A folder of long logs took seconds to read on the app's thread, the screen frozen; the
    reading is a worker's now: the line under the table counts the logs read, keys answer,
    and closing the browser before the reading ends loses nothing and breaks nothing."""
    import threading

    from textual.app import App
    from textual.widgets import Static

    gate, closed = threading.Event(), []

    def load(progress):
        progress(1, 3)
        gate.wait(10)
        return []

    class Host(App):
        def on_mount(self) -> None:
            self.push_screen(ChatBrowser(load, set, lambda s, t: None, lambda s: None), closed.append)

    app = Host()
    async with app.run_test() as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ChatBrowser), what="the browser")
        browser = app.screen
        note = browser.query_one("#browser-note", Static)
        await wait_until(pilot, lambda: "1 of 3" in str(note.render()), what="the reading's progress")
        assert not browser.loaded
        await pilot.press("escape")
        await wait_until(pilot, lambda: closed == [None], what="the browser to close while still reading")
        gate.set()
        await pilot.pause(0.2)
        assert app.is_running and not browser.loaded
