"""The app when its conversation log cannot be written (issue 11, high item 2), and /save!.

A regular file where the conversations folder should be makes every write fail, even as
root (who ignores a read-only mode): the same path as a read-only or full disk."""
from __future__ import annotations

from kvchat.widgets import Notice

from .conftest import send, wait_until


def errors(app) -> list[str]:
    return [n.text for n in app.query(Notice) if n.has_class("error")]


async def command(pilot, text: str) -> None:
    pilot.app.query_one("#input").load_text(text)
    await pilot.press("enter")
    await pilot.pause()


async def test_a_log_that_cannot_be_written_is_one_line_and_the_conversation_goes_on(running_app, private_dirs):
    data = private_dirs / "data"
    data.mkdir()
    (data / "conversations").write_text("a file where the folder should be")
    async with running_app() as (app, pilot):
        await send(pilot, "hello")                    # the reply finishes: nothing freezes
        await send(pilot, "and again")
        await wait_until(pilot, lambda: errors(app), what="the log's error line")
        assert len(errors(app)) == 1                   # said once, not once per record
        assert "cannot write the conversation log" in errors(app)[0] and "/save FILE" in errors(app)[0]
        roles = [m["role"] for m in app.chat_screen.session.chat.state().messages]
        assert roles == ["user", "assistant", "user", "assistant"] and len(app.chat_screen.session.turns) == 2
        assert [r["type"] for r in app.chat_screen.session.log.unsaved].count("message") == 4
        await command(pilot, "/save elsewhere/chat")   # the way out the line offers
        md = private_dirs / "elsewhere" / "chat.md"
        await wait_until(pilot, md.exists, what="the saved transcript")
        assert "and again" in md.read_text()


async def test_save_never_overwrites_but_save_bang_does(running_app, private_dirs):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        (private_dirs / "chat.md").write_text("precious")
        await command(pilot, "/save chat")
        await wait_until(pilot, lambda: errors(app), what="the refusal")
        assert "exists; /save! FILE overwrites it" in errors(app)[-1]
        assert (private_dirs / "chat.md").read_text() == "precious"
        await command(pilot, "/save! chat")
        await wait_until(pilot, lambda: "hello" in (private_dirs / "chat.md").read_text(), what="the overwrite")
        assert (private_dirs / "chat.md").stat().st_mode & 0o777 == 0o600


async def test_resuming_a_damaged_conversation_says_how_many_records_were_skipped(running_app):
    from kvchat.store.log import last_conversation, restore
    async with running_app() as (app, pilot):
        await send(pilot, "remember me")
        path = app.chat_screen.session.log.path
        app.chat_screen.session.log.close()
    with open(path, "a") as fh:
        fh.write('not json\n{"type": "message", "role": "user"}\n{"type": "turn", "tor')
    restored = restore(last_conversation())
    async with running_app(restored=restored) as (app, pilot):
        await wait_until(pilot, lambda: errors(app), what="the skipped-records line")
        assert "3 damaged records of" in errors(app)[0] and "the rest is restored" in errors(app)[0]
        assert [m["content"] for m in app.chat_screen.session.chat.state().messages][0] == "remember me"
