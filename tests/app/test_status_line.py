"""The status line on a narrow terminal drops whole trailing segments instead of cutting a
word (issue 12: at 80x24 it read '… · KV fp3…')."""
from __future__ import annotations

from kvchat.text import fit_segments

from .conftest import make_app, ready, screen_text

INFO = "chat 4 · 3 open · smollm2-135m · cpu · fp32 · KV fp32 · cache on · cap 256 · stop"


def test_fit_segments_drops_whole_segments_from_the_end():
    assert fit_segments(INFO, 200) == INFO
    assert fit_segments(INFO, 45) == "chat 4 · 3 open · smollm2-135m · cpu · fp32"
    assert fit_segments(INFO, 3) == "chat 4"               # the first segment always stays


async def test_at_80_columns_the_status_line_ends_on_a_whole_segment(fake):
    app = make_app(fake, cap=256)
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        top = screen_text(app).splitlines()[0]
        info = app.query_one("StatusBar").info
        shown = top.strip().rsplit("ready", 1)[0].strip()
        warning = app.query_one("StatusBar").warning     # random weights, said first
        assert warning and shown.startswith(warning)
        shown = shown[len(warning):].strip()
        assert "…" not in top and shown and info.startswith(shown)
        assert info == shown or info[len(shown):].startswith(" · ")


async def test_a_note_shows_beside_a_long_settings_line(fake):
    """Issue 26: with a long settings line (a server URL, sampling) the note had no room and
    vanished (ctrl+y gave no feedback); the settings' tail now gives way to it."""
    app = make_app(fake, cap=256)
    async with app.run_test(size=(120, 30)) as pilot:
        await ready(pilot)
        bar = app.query_one("StatusBar")
        bar.info = INFO + " · temperature 0.7 · top-p 0.9 · seed 1234 · http://127.0.0.1:8000/v1"
        bar.note = "copied the last reply (1,234 characters)"
        await pilot.pause()
        top = screen_text(app).splitlines()[0]
        assert bar.note in top and top.split(bar.warning)[-1].strip().startswith("chat 4 · 3 open")
