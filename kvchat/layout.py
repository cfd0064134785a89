"""Which arrangement of the chat and the four telemetry panels suits a terminal size.

One pure function, so the decision is in one place and testable without a screen; the app
calls it on every resize and widgets/panel_switcher.py arranges the panels by its answer.

The thresholds come from the rows the panels take, measured in the app (scripted backend,
after four turns, when the latency table is at its longest; a 728-block pool, as the
bundled model's default is, fills the block map's ten rows). Each panel's width includes
its border:

    layout    terminal  panel width  KV cache  cap  blocks  latency   rows needed
    stacked   140 wide      62          20      5     12      19      56 + 2 = 58
    stacked   160 wide      71          20      5     11      19      55 + 2 = 57
    columns   140-160       44          25      6     17      20      max(31, 37) + 2 = 39
    tabs      90-100        44          25      6     18      20      25 + tabs 1 + 2 = 28
    compact   80            31          37      6     18      18      (the KV cache scrolls)

(+2: the status line and the footer.) 44 columns is the narrowest panel whose figures are
not cut (the cache panel's comparison table, the latency turn table), so two of them and
a 50-column chat need 140 columns; a 45% tabs column is 44 columns from 90. Below that the
chat keeps most of the width and the panel is narrow; below 64 columns it would leave the
chat under 36, and the panels start hidden. Height decides between the three wide layouts
only; in the narrow ones a panel taller than the screen scrolls.
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
TABS_WIDTH = 90           # a 45% column of 44 columns: one panel at a time, nothing cut
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
