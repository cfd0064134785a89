"""The whole screen after one scripted turn, compared with a committed SVG snapshot.

The FakeBackend's telemetry is fixed (latencies, token counts, block map), so the picture is
deterministic; the host's load under the latency fits (measured from the kernel's counters)
is set to a fixed figure here. Update after an intended change with `pytest tests/app/test_snapshot.py
--snapshot-update` and look at the new SVG before committing it.
"""
from __future__ import annotations

import pytest

from kvchat.host_load import HostLoad, HostSampler

from .conftest import make_app, ready, send


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch):
    """The machine's real load would change the picture from run to run."""
    monkeypatch.setattr(HostSampler, "stop", lambda self: HostLoad(others=0.1, cores=2, exact=True))


def test_the_screen_after_one_turn(snap_compare, fake):
    app = make_app(fake, cap=256)

    async def run_before(pilot) -> None:
        app.query_one("#input").cursor_blink = False     # a blinking cursor would make the picture flaky
        await ready(pilot)
        await send(pilot, "What does the KV cache hold?")
        await send(pilot, "And per token?")
        await pilot.pause()

    assert snap_compare(app, terminal_size=(160, 48), run_before=run_before)     # two columns of panels


def _small_screen(fake, keys: tuple[str, ...] = ()):
    app = make_app(fake, cap=256)

    async def run_before(pilot) -> None:
        app.query_one("#input").cursor_blink = False
        await ready(pilot)
        await send(pilot, "What does the KV cache hold?")
        await pilot.press(*keys)
        await pilot.pause()
    return app, run_before


def test_the_screen_at_80x24(snap_compare, fake):
    """The compact layout: the chat keeps most of the width, one panel beside it under its
    tabs; the status line cut between segments, not mid-word."""
    app, run_before = _small_screen(fake)
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_the_screen_at_80x24_on_the_latency_panel(snap_compare, fake):
    """Three presses of the cycle key: the latency panel, whole, in the narrow column."""
    app, run_before = _small_screen(fake, ("f10", "f10", "f10"))
    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_the_screen_at_100x30(snap_compare, fake):
    """The tabs layout: one panel at a time in a 45-column column."""
    app, run_before = _small_screen(fake)
    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)


def test_the_screen_at_100x30_on_the_latency_panel(snap_compare, fake):
    app, run_before = _small_screen(fake, ("f10", "f10", "f10"))
    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)
