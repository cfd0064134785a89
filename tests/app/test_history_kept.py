"""Nothing of a conversation is lost from what kvchat shows and saves (issue 26 high 2 and 3).

drop-oldest takes old turns out of what the model sees, not out of the conversation: the
`/save` Markdown, the transcript after `--resume`, the chat browser's title and its search
keep them (dimmed, and marked in the Markdown). And a reply's stats line is its own turn's,
also when two replies are the same words (greedy decoding repeats itself)."""
from __future__ import annotations

from kvchat.store import catalog
from kvchat.store.log import last_conversation, restore
from kvchat.text import stats_line
from kvchat.widgets import Reply, UserMessage

from .conftest import SIZE, make_app, ready, send
from .fake_backend import FakeBackend, FakeConfig

FIRST = "first message about sourdough starters"


def fg(app, text: str):
    """The colour the screen draws `text` in."""
    for strip in app.screen._compositor.render_strips():
        for seg in strip:
            if text in seg.text:
                return seg.style.color
    raise AssertionError(f"{text!r} is not on screen")


async def test_drop_oldest_keeps_the_dropped_turns_in_save_resume_and_the_browser(tmp_path):
    fake = FakeBackend(FakeConfig(replies=("alpha reply here", "bravo reply here", "charlie reply here")))
    app = make_app(fake, cap=40, policy="drop-oldest")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for text in (FIRST, "second message with some words", "third message with some words"):
            await send(pilot, text)
        session = app.chat_screen.session
        dropped = sum(t.dropped_messages for t in session.turns)
        assert dropped >= 2 and FIRST not in [m["content"] for m in session.chat.state().messages]
        assert session.title.startswith("first message")
        await pilot.pause(0.3)
        assert fg(app, "alpha reply here") != fg(app, "charlie reply here")   # a dropped reply is dimmed too
        app.chat_screen.input.load_text(f"/save {tmp_path / 'kept'}")
        await pilot.press("enter")
        await pilot.pause()
    app.chat_screen.session.log.close()
    md = (tmp_path / "kept.md").read_text()
    assert f"## You (dropped by drop-oldest: the model no longer saw it)\n\n{FIRST}" in md
    assert "## Assistant (dropped by drop-oldest: the model no longer saw it)\n\nalpha reply here" in md
    assert md.count("dropped by drop-oldest") == dropped and "third message with some words" in md

    restored = restore(last_conversation())
    assert restored.messages[0]["content"] == FIRST and restored.dropped == dropped
    assert [m["content"] for m in restored.visible] == [m["content"] for m in session.chat.state().messages]
    summary = catalog.list_conversations()[0]
    assert summary.title == FIRST and summary.matches("sourdough")
    async with make_app(restored=restored).run_test(size=SIZE) as pilot:
        await ready(pilot)
        resumed = pilot.app.chat_screen
        widgets = list(resumed.view.query("UserMessage, Reply"))
        assert [w.text for w in widgets][:2] == [FIRST, "alpha reply here"]
        assert [w.has_class("dropped") for w in widgets] == [True] * dropped + [False] * (len(widgets) - dropped)
        assert resumed.session.title.startswith("first message")
        sent = [m["content"] for m in resumed.session.chat.state().messages]
        assert FIRST not in sent and "third message with some words" in sent   # the model still does not see it
        await send(pilot, "fourth")
        resumed.session.log.close()
    assert restore(last_conversation()).messages[0]["content"] == FIRST


async def test_identical_replies_keep_their_own_turns_stats_in_save_and_after_resume(tmp_path):
    fake = FakeBackend(FakeConfig(replies=("the same words every time",)))
    app = make_app(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "short")
        await send(pilot, "a much longer message with many more words in it than the first one had")
        first, second = app.chat_screen.session.turns
        assert first.reply == second.reply and stats_line(first) != stats_line(second)
        app.chat_screen.input.load_text(f"/save {tmp_path / 'twice'}")
        await pilot.press("enter")
        await pilot.pause()
    app.chat_screen.session.log.close()
    md = (tmp_path / "twice.md").read_text()
    assert md.index(stats_line(first)) < md.index(stats_line(second))     # each under its own reply
    async with make_app(restored=restore(last_conversation())).run_test(size=SIZE) as pilot:
        await ready(pilot)
        replies = list(pilot.app.chat_screen.view.query(Reply))
        assert [r.record.ttft_ms for r in replies] == [first.ttft_ms, second.ttft_ms]
        assert [u.text for u in pilot.app.chat_screen.view.query(UserMessage)][0] == "short"
        pilot.app.chat_screen.session.log.close()
