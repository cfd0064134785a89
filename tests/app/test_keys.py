"""Keys, on the scripted engine: each does what the footer says, while the input has focus."""
from __future__ import annotations

import json

from kvchat.store import settings as settings_mod
from kvchat.store.settings import Settings
from kvchat.widgets import CachePanel, CapGauge, Notice, Reply, UserMessage
from kvchat.screens import HelpScreen, PolicyPicker

from .conftest import screen_text, send, wait_until


def notices(app) -> list[str]:
    return [n.text for n in app.query(Notice)]


async def test_ctrl_r_frees_the_cache_and_the_next_turn_prefills_everything(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "first message here")
        assert app.query_one(CachePanel).snapshot.bytes_used > 0
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.query_one(CachePanel).snapshot.bytes_used == 0, what="bytes to drop")
        assert any(n.startswith("cache reset: freed") for n in notices(app))
        await send(pilot, "second message")
        last = app.chat_screen.session.turns[-1]
        assert last.reused_tokens == 0 and last.computed_tokens == last.prompt_tokens
        assert app.query_one(CachePanel).snapshot.bytes_used > 0


async def test_cap_keys_step_the_cap_by_powers_of_two_and_past_the_top_remove_it(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f3")
        assert app.chat_screen.session.chat.state().cap == 4096 and app.query_one(CapGauge).cap == 4096
        await pilot.press("f3", "f3")
        assert app.chat_screen.session.chat.state().cap == 1024
        await pilot.press("f4", "f4")
        assert app.chat_screen.session.chat.state().cap == 4096
        await pilot.press("f4")
        assert app.chat_screen.session.chat.state().cap is None and app.query_one(CapGauge).cap is None


async def test_escape_stops_the_reply_and_keeps_what_was_generated(slow_fake, running_app):
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("tell me a long story")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.query_one(Reply).text.split()) >= 3, what="a few tokens")
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_screen.jobs.busy is None and app.chat_screen.session.turns, what="the reply to stop")
        turn = app.chat_screen.session.turns[-1]
        assert turn.stop_reason == "cancelled"
        assert 3 <= turn.generated_tokens < 200
        assert app.chat_screen.session.chat.state().messages[-1] == {"role": "assistant", "content": turn.reply}
        assert app.query_one(Reply).text.strip() == turn.reply


async def test_f2_chooses_the_cap_policy_from_a_list(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, PolicyPicker), what="the picker")
        await pilot.press("down", "enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, PolicyPicker), what="the picker to close")
        assert app.chat_screen.session.chat.state().policy == "drop-oldest"
        assert app.query_one(CapGauge).policy == "drop-oldest"


async def test_ctrl_n_opens_another_conversation_with_the_same_settings_and_keeps_the_old_one(fake, running_app):
    async with running_app(cap=2048, system="be brief") as (app, pilot):
        await send(pilot, "hello")
        old = app.chat_screen.view
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: app.chat_screen.view is not old and app.chat_screen.jobs.busy is None, what="the new conversation")
        assert app.chat_screen.conversations.views == [old, app.chat_screen.view] and fake.chats == [old.session.chat, app.chat_screen.session.chat]
        assert not app.chat_screen.view.query(UserMessage) and not app.chat_screen.view.query(Reply)
        assert old.query(UserMessage) and not old.display
        state = app.chat_screen.session.chat.state()
        assert state.cap == 2048 and state.messages == ({"role": "system", "content": "be brief"},)
        assert old.session.log.path.exists() and old.session.log.path != app.chat_screen.session.log.path
        assert app.query_one(CachePanel).snapshot.bytes_used == 0
        assert old.session.chat.state().tokens_held > 0              # its cache is still there


async def test_f5_regenerates_the_last_reply(running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        first = app.query_one(Reply).text
        await pilot.press("f5")
        await wait_until(pilot, lambda: len(app.chat_screen.session.turns) == 2 and app.chat_screen.jobs.busy is None, what="the new reply")
        assert len(app.query(Reply)) == 1 and app.query_one(Reply).text != first
        assert [m["role"] for m in app.chat_screen.session.chat.state().messages] == ["user", "assistant"]


async def test_f5_with_no_reply_says_so(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f5")
        assert "nothing to regenerate" in notices(app)[-1]


async def test_f1_shows_every_key_and_command_and_escape_closes_it(running_app):
    async with running_app() as (app, pilot):
        await pilot.press("f1")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen), what="help")
        await pilot.pause()
        text = screen_text(app)
        app.screen.query_one("VerticalScroll").scroll_end(animate=False)    # the list is taller than the screen
        await pilot.pause()
        text += screen_text(app)
        for word in ("ctrl+r", "reset_cache", "/cap N", "/policy", "/load FILE", "ctrl+j", "alt+right",
                     "close_conversation", "ctrl+o", "/chats", "/edit [N]", "ctrl+y", "alt+e"):
            assert word in text
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen), what="help to close")
        assert app.chat_screen.jobs.busy is None   # escape closed the dialog, it did not reach "stop"


async def test_keys_rebound_in_the_settings_file_replace_the_defaults(running_app):
    async with running_app(settings=Settings(keys={"reset_cache": "ctrl+e"})) as (app, pilot):
        await send(pilot, "hello")
        await pilot.press("ctrl+r")
        await pilot.pause(0.1)
        assert app.query_one(CachePanel).snapshot.bytes_used > 0
        await pilot.press("ctrl+e")
        await wait_until(pilot, lambda: app.query_one(CachePanel).snapshot.bytes_used == 0, what="the reset")


async def test_ctrl_t_switches_theme_and_remembers_it(running_app):
    async with running_app(settings_path=settings_mod.config_path()) as (app, pilot):
        assert app.has_class("theme-dark")
        await pilot.press("ctrl+t")
        assert app.has_class("theme-light") and not app.has_class("theme-dark")
        assert app.theme == "textual-light"
    assert json.loads(settings_mod.config_path().read_text())["theme"] == "light"


async def test_ctrl_q_mid_reply_stops_saves_the_partial_reply_and_exits(slow_fake, running_app):
    async with running_app(slow_fake) as (app, pilot):
        app.query_one("#input").load_text("a long story please")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.query_one(Reply).text.split()) >= 2, what="tokens")
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: not app.is_running, timeout=10, what="the app to exit")
    assert app.return_code == 0
    records = [json.loads(line) for line in app.chat_screen.session.log.path.read_text().splitlines()]
    turn = next(r for r in records if r["type"] == "turn")
    assert turn["stop_reason"] == "cancelled" and turn["reply"]
    assert {"type": "message", "role": "assistant", "content": turn["reply"]} in records


def test_every_key_in_the_table_has_a_handler():
    """Each key binds by its id to an action of the App or of the chat screen."""
    from kvchat.app.shell import KvChatApp
    from kvchat.chat.screen import ChatScreen
    from kvchat.keys import KEYS, bindings
    for k in KEYS:
        owner = KvChatApp if k.app else ChatScreen
        assert callable(getattr(owner, f"action_{k.id}", None)), k.id
    assert [(b.id, b.action) for b in bindings()] == [(k.id, f"app.{k.id}" if k.app else k.id) for k in KEYS]


async def test_the_screen_has_everything_its_parts_take_it_for(running_app):
    from kvchat.chat.host import Host
    async with running_app() as (app, pilot):
        for name in [n for n in dir(Host) if not n.startswith("_")] + list(Host.__annotations__):
            assert hasattr(app.chat_screen, name), name
