"""Resizing and hiding panels; the block map's aggregation."""
from __future__ import annotations

from kvchat.engine.telemetry import CACHED, FREE, HELD, PARTIAL, REUSED
from kvchat.widgets import BlockMap
from kvchat.widgets.block_map import aggregate

from .conftest import screen_text, send, wait_until
from .fake_backend import FakeBackend, FakeConfig


def test_aggregation_keeps_one_cell_per_block_when_they_fit():
    codes = bytes([FREE, HELD, PARTIAL])
    assert aggregate(codes, 10) == (codes, 1)


def test_aggregation_groups_blocks_and_shows_the_most_notable_state_of_each_group():
    codes = bytes([FREE] * 10 + [HELD] + [FREE] * 9 + [CACHED, REUSED] + [FREE] * 8)   # 30 blocks
    cells, ratio = aggregate(codes, 3)
    assert ratio == 10 and cells == bytes([FREE, HELD, REUSED])


async def test_a_narrow_terminal_hides_the_panels_and_f6_brings_them_back(running_app):
    async with running_app() as (app, pilot):
        panels = app.query_one("#panels")
        assert panels.display
        await pilot.resize_terminal(60, 30)
        await wait_until(pilot, lambda: not panels.display, what="panels to hide")
        await pilot.press("f6")
        assert panels.display
        await pilot.resize_terminal(50, 30)   # the user's choice now wins over the width
        await pilot.pause()
        assert panels.display
        await send(pilot, "still chatting in a small window")


async def test_panel_command_hides_one_panel(running_app):
    async with running_app() as (app, pilot):
        app.query_one("#input").load_text("/panel blocks")
        await pilot.press("enter")
        await pilot.pause()
        assert not app.query_one(BlockMap).display and app.query_one("#cache-panel").display


async def test_a_big_pool_is_drawn_aggregated_with_the_ratio_shown(running_app):
    async with running_app(FakeBackend(FakeConfig(num_blocks=5000))) as (app, pilot):
        await send(pilot, "hello")
        await pilot.pause()
        bm = app.query_one(BlockMap)
        assert bm.ratio > 1 and f"1 cell = {bm.ratio} blocks" in screen_text(app)
        assert "held 1" in screen_text(app).replace("\u00a0", " ")


def test_the_latency_fit_is_exact_on_a_line_and_withheld_over_a_short_span():
    from kvchat.latency import fit_series
    line = [(p, 20.0 + 0.004 * p) for p in range(0, 1000, 10)]     # +4 ms per 1k positions
    assert abs(fit_series(line).slope - 4.0) < 1e-9
    assert fit_series([(p, 20.0) for p in range(100, 120)]).slope is None   # 20 positions: noise, not growth
