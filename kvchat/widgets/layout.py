"""Which arrangement of the chat and the four telemetry panels suits a terminal size.

One pure function, so the decision is in one place and testable without a screen; the app
calls it on every resize and widgets/panel_switcher.py arranges the panels by its answer.

The thresholds come from the rows the panels take, measured in the app (scripted backend,
after four turns, when the latency table is at its longest; a pool of 728 blocks, which
fills the block map's ten rows as the bundled model's default pool, 1,024 blocks here,
does). Each panel's width includes its border:

    layout    terminal  panel width  KV cache  cap  blocks  latency   rows needed
    stacked   140 wide      62          20      5     12      19      56 + 2 = 58
    stacked   160 wide      71          20      5     11      19      55 + 2 = 57
    columns   140-160       44          24      6     17      20      max(24 + 6, 17 + 20) + 2 = 39
    tabs      90-100        44          24      6     18      20      24 + 1 (tabs) + 2 = 27
    compact   80            31          30      6     18      18      latency 18 + 1 + 2 = 21; the KV cache scrolls

(+2: the status line and the footer.) 44 columns is the narrowest panel whose figures are
not cut in the wide form (the cache panel's comparison table, the latency turn table), so
two of them and a 50-column chat need 140 columns, and one at a time needs a 45-column
column, 45% of 100 and the minimum from 90 down. Narrower, the chat keeps most of the width
(80 x 24: 48 columns) and the panels take their narrow form (a figure over its
description; the latency plot 8 rows high, so the whole panel fits 24 rows); below 64
columns the chat would keep under 36, so the panels start hidden. Height decides between
the layouts with every panel at once; one panel at a time taller than the screen scrolls.
"""
from __future__ import annotations

STACKED = "stacked"     # today's layout: the four panels in one column beside the chat
COLUMNS = "columns"     # the four panels in two columns beside the chat (KV cache + cap | blocks + latency)
TABS = "tabs"           # one panel at a time beside the chat, under a row of tabs (the cycle key, a click)
COMPACT = "compact"     # as TABS in a narrow column: the chat keeps most of the width
CHAT = "chat"           # the panels hidden until F6 shows them (as COMPACT)
LAYOUTS = (STACKED, COLUMNS, TABS, COMPACT, CHAT)
ALL_AT_ONCE = (STACKED, COLUMNS)

WIDE = 140                # columns: the stacked and two-column layouts need at least this many
STACKED_ROWS = 58         # rows for the four panels in one 62-column stack
COLUMNS_ROWS = 40         # rows for two stacks of 44 columns (39 measured)
TABS_WIDTH = 90           # one panel at a time in a 45-column column, nothing cut, the chat keeping 45
PANELS_WIDTH = 64         # below this, the panels start hidden (F6 shows them)


def layout_for(width: int, height: int) -> str:
    """The layout for a terminal of width x height cells."""
    if width >= WIDE and height >= STACKED_ROWS:
        return STACKED
    if width >= WIDE and height >= COLUMNS_ROWS:
        return COLUMNS
    if width >= TABS_WIDTH:
        return TABS
    return COMPACT if width >= PANELS_WIDTH else CHAT
