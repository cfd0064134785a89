"""The block map tells states apart by glyph, not by colour alone (colour-blind readers,
monochrome terminals), and its legend shows each state's glyph."""
from __future__ import annotations

from kvchat.engine.telemetry import BLOCK_STATE_NAMES, CACHED, FREE, HELD, OTHER, PARTIAL, REUSED, SHARED
from kvchat.widgets import BlockMap
from kvchat.widgets.block_map import GLYPHS, LEGEND_LABELS

from .conftest import screen_text
from .panel_host import PanelHost, snapshot

STATES = (FREE, HELD, PARTIAL, REUSED, CACHED, SHARED, OTHER)


def test_every_state_has_its_own_one_cell_glyph():
    from rich.cells import cell_len
    assert set(GLYPHS) == set(range(len(BLOCK_STATE_NAMES)))
    assert len(set(GLYPHS.values())) == len(GLYPHS)
    assert all(cell_len(g) == 1 for g in GLYPHS.values())


async def test_the_grid_draws_each_state_with_its_glyph_and_the_legend_names_it():
    codes = bytes([REUSED, REUSED, HELD, HELD, PARTIAL, SHARED, CACHED, OTHER] + [FREE] * 12)
    bm = BlockMap()
    async with PanelHost(bm).run_test(size=(60, 20)) as pilot:
        bm.show(snapshot(tokens=70, block_map=codes))
        await pilot.pause()
        text = screen_text(pilot.app).replace("\u00a0", " ")
    grid = "".join(GLYPHS[c] for c in codes)
    assert grid in text
    for code in STATES:
        assert f"{GLYPHS[code]} {LEGEND_LABELS[code]} {codes.count(code)}" in text


async def test_without_colour_held_and_reused_still_differ():
    """Monochrome: the cells' characters alone must tell the states apart."""
    codes = bytes([REUSED, HELD] + [FREE] * 6)
    bm = BlockMap()
    async with PanelHost(bm).run_test(size=(40, 12)) as pilot:
        bm.show(snapshot(tokens=20, block_map=codes))
        await pilot.pause()
        first_row = next(line for line in screen_text(pilot.app).splitlines() if GLYPHS[FREE] * 6 in line)
    cells = first_row.strip("│ ")[:8]
    assert cells[0] != cells[1] != cells[2]


async def test_one_wasted_slot_is_singular_and_a_large_block_count_has_separators():
    """'wasted 1 slots' before (issue 26 low); a block of 2,048 tokens wastes 1,948."""
    bm = BlockMap()
    async with PanelHost(bm).run_test(size=(90, 20)) as pilot:
        bm.show(snapshot(tokens=15))
        await pilot.pause()
        assert "wasted 1 slot in the partial block" in bm.render().plain
        bm.show(snapshot(tokens=100, block_size=2048, block_map=bytes([HELD] + [FREE] * 7)))
        await pilot.pause()
        assert "wasted 1,948 slots in the partial block" in bm.render().plain
