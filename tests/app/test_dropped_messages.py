"""drop-oldest takes whole old turns out of what the model reads; the transcript keeps them
but dims them, with a note, so the user sees what the model no longer sees."""
from __future__ import annotations

from kvchat.widgets import Notice, Reply, UserMessage

from .conftest import send
from .fake_backend import FakeBackend, FakeConfig


async def test_drop_oldest_dims_the_messages_the_model_no_longer_sees():
    from .conftest import make_app, ready, SIZE
    fake = FakeBackend(FakeConfig(replies=("a short reply here",)))
    app = make_app(fake, cap=40, policy="drop-oldest")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first message with some words")
        await send(pilot, "second message with some words")
        await send(pilot, "third message with some words")
        dropped = app.chat_screen.session.turns[-1].dropped_messages + app.chat_screen.session.turns[-2].dropped_messages
        assert dropped >= 2
        widgets = list(app.chat_screen.view.query("UserMessage, Reply"))
        dim = [w for w in widgets if w.has_class("dropped")]
        assert dim == widgets[:dropped]                       # the oldest ones, in order
        assert isinstance(dim[0], UserMessage)
        assert isinstance(dim[1], Reply)
        seen = [m["content"] for m in app.chat_screen.session.chat.state().messages]
        assert "first message with some words" not in seen
        assert any("dimmed above: drop-oldest dropped them to stay under the cap of 40 tokens" in n.text
                   for n in app.chat_screen.view.query(Notice))
