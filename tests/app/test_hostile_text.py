"""A reply from the local engine that carries terminal sequences (issue 27 high 1, the local
model's path): the model's text reaches the screen as visible escapes, and no control character of it is
in the segments the app would write to the terminal (tmux checks the real terminal for
the server's path, test_tmux_hostile.py). The FakeBackend stands in for the engine: a
real model cannot be made to emit an escape sequence on demand; the Reply widget it feeds is
the one the engine feeds."""
from __future__ import annotations

from .conftest import screen_text, send
from .fake_backend import FakeBackend, FakeConfig

SEQUENCES = ("\x1b]0;PWNED\x07", "\x1b]52;c;cHduZWQ=\x07", "\x1b[2J", "\x1b[?1049l")


async def test_a_local_reply_with_escape_sequences_reaches_the_terminal_inert(running_app):
    evil = "title " + SEQUENCES[0] + " clip " + SEQUENCES[1] + " clear " + SEQUENCES[2] + " alt " + SEQUENCES[3]
    async with running_app(FakeBackend(FakeConfig(replies=(evil,)))) as (app, pilot):
        await send(pilot, "say something nasty")
        await pilot.pause(0.2)
        assert app.chat_screen.session.turns[-1].reply == evil        # the text kept is as written
        shown = screen_text(app)
        assert "\\x1b]0;PWNED\\x07" in shown and "\\x1b[2J" in shown     # drawn as visible escapes
        texts = [seg.text for strip in app.screen._compositor.render_strips() for seg in strip]
        assert not [t for t in texts if any(c in t for c in "\x1b\x07\x9b\x9d")]   # what a driver would write
