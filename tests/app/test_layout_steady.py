"""The panel column lays out once and stays still.

Its panels' heights depend on their width (the block map's rows, the latency panel's wrapped
notes and table). When the column's scrollbar took a column only while the panels overflowed,
the bar could change whether they overflow, and it came and went in a loop. Seen in a real
terminal (160 x 48, the bundled model, after a 512-token reply): each resize redrew the panels
(block_map and latency_panel's on_resize), about 18 times a second while the chat sat idle,
and Textual's discarded lines started a full garbage collection every half second. The bar's
column is now always kept (scrollbar-gutter: stable), so the panels' width cannot depend on
whether they overflow."""
from __future__ import annotations

import pytest

from kvchat.widgets.panel_switcher import PANELS, PanelScroll

from .test_layout_sizes import four_turns


def widths(app) -> dict[str, int]:
    return {name: app.query_one(f"#{wid}").size.width for name, wid in PANELS.items()}


@pytest.mark.parametrize("size", [(140, 60), (160, 48)])       # stacked, columns
async def test_the_panels_are_as_wide_when_the_column_overflows(running_app, size):
    """The column fits at these sizes; one panel made taller than the screen overflows it."""
    async with running_app(size=size) as (app, pilot):
        await four_turns(pilot)
        await pilot.pause()
        scroll = app.query_one(PanelScroll)
        before = widths(app)
        assert scroll.max_scroll_y == 0 and all(before.values())
        app.query_one("#cache-panel").styles.min_height = size[1] + 10
        await pilot.pause()
        await pilot.pause()
        assert scroll.max_scroll_y > 0
        assert widths(app) == before
