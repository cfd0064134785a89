"""A long reply's folded head: where to fold, and the one line that stands for it.

Textual's Markdown keeps a widget per block (per cell in a table) and, on each append,
re-parses the document's last block whole: a 300,000-character reply or a 2,000-row table
streamed in batches cost the UI thread tens of seconds and gigabytes, and froze the app. So
a Reply keeps only its tail as live Markdown: when the live part grows past LIVE_CHARS
characters, LIVE_LINES lines or LIVE_ROWS table rows, its head (up to a block boundary where one is near) moves
into the fold, and the live part starts again with about KEEP_CHARS / KEEP_LINES. What is
folded is one line ("▸ 1,234 earlier lines folded"), shown as written (plain text) when
opened. The cost of a batch is then bounded by the live part, whatever the reply's length;
ordinary replies never reach the bounds and draw exactly as before.

A cut inside a code block or a table would change how the rest draws (the rest of a fenced
block would read as prose, the rest of a table's rows as a paragraph), so the live part
then starts with a `carry`: the fence's opening line, or the table's header and delimiter
rows. The carry is drawn, never kept: the reply's text, its log and /save are never cut.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from rich.text import Text
from textual.binding import Binding
from textual.message import Message
from textual.widgets import Static

from ..text import inert, plural

LIVE_CHARS = 12_000     # a live part past any bound folds its head
LIVE_LINES = 240
LIVE_ROWS = 60          # table rows: each is a widget per cell in a grid, the dearest to lay out
KEEP_CHARS = 6_000      # and keeps about this much live
KEEP_LINES = 120
KEEP_ROWS = 30
NEAR_CHARS = 1_500      # a block boundary this near past the first line start is the better cut
NEAR_LINES = 20
CHUNK_CHARS = 16_000    # an opened fold draws its text in pieces of about this size

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_DELIMITER = re.compile(r"\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


@dataclass(frozen=True, slots=True)
class Cut:
    at: int          # characters of the live source that go into the fold
    carry: str       # what the new live part starts with: a fence's opening line, a table's header


def too_long(live: str) -> bool:
    return len(live) > LIVE_CHARS or live.count("\n") > LIVE_LINES or _rows(live) > LIVE_ROWS


def _rows(text: str) -> int:
    """Lines that start with a pipe: a table's rows, as near as a count can tell."""
    return text.count("\n|") + text.startswith("|")


def fold_point(source: str, start: int = 0) -> Cut:
    """Where to fold `source` (Markdown) so that about KEEP_CHARS and KEEP_LINES stay after
    the cut; the cut is never before `start` (a carry the source begins with). A block
    boundary (a line after a blank line, outside a code block) just past the target wins;
    else the first line start past it; else (one endless line) the first space past it."""
    lines = source.splitlines(keepends=True)
    rows, row_cut = 0, 0          # keep at most KEEP_ROWS table rows: the cut is past the others
    for i in range(len(lines) - 1, -1, -1):
        rows += lines[i].startswith("|")
        if rows > KEEP_ROWS:
            row_cut = sum(len(line) for line in lines[:i + 1])
            break
    target = max(start, len(source) - KEEP_CHARS, row_cut,
                 sum(len(line) for line in lines[:max(0, len(lines) - KEEP_LINES)]))
    fence: str | None = None       # the opening line of the code block we are in
    header: str | None = None      # the header and delimiter rows of the table we are in
    run: list[str] = []            # the run of pipe lines so far (a table's candidate)
    offset, blank, near = 0, False, 0
    first: Cut | None = None       # the first line start past the target
    for line in lines:
        if offset >= target and offset > 0:
            if blank and fence is None:
                return Cut(offset, "")
            if first is None:
                first = Cut(offset, fence or (header if header is not None and line.lstrip().startswith("|") else ""))
            elif offset > first.at + NEAR_CHARS or near > NEAR_LINES:
                break
            near += 1
        fence, header, run, blank = _after(line, fence, header, run)
        offset += len(line)
    if first is not None:
        return first
    space = source.find(" ", target)
    at = space + 1 if 0 <= space < len(source) - 1 else max(target, len(source) - KEEP_CHARS)
    return Cut(at, fence or "")


def _after(line: str, fence: str | None, header: str | None, run: list[str]):
    """The state after `line`: (fence, header, run, blank)."""
    if fence is not None:
        closes = _FENCE.match(line)
        mark = fence.lstrip()[:3]
        if closes and closes.group(1)[0] == mark[0] and not line.strip().strip(mark[0]):
            fence = None
        return fence, None, [], False
    if _FENCE.match(line):
        return line if line.endswith("\n") else line + "\n", None, [], False
    if line.lstrip().startswith("|"):
        run = run + [line] if len(run) < 2 else run
        if header is None and len(run) == 2 and _DELIMITER.match(run[1]):
            header = run[0] + run[1]
        return None, header, run, False
    return None, None, [], not line.strip()


class Fold(Static, can_focus=True):
    """The folded head of a long reply, as one line; a click or Enter opens it (the text as
    written, without Markdown) and closes it again."""

    DEFAULT_CSS = """
    Fold { color: $text-muted; text-style: italic; }
    Fold:hover, Fold:focus { color: $accent; }
    """
    BINDINGS = [Binding("enter,space", "open_or_close", "open / close", show=False)]

    class Toggled(Message):
        """The user opened or closed the fold."""

    def __init__(self) -> None:
        super().__init__("", classes="fold")
        self.display = False
        self.opened = False

    def show(self, chars: int, lines: int) -> None:
        self.display = chars > 0
        sign, then = ("▾", "shown as written · click to fold") if self.opened else \
                     ("▸", "folded to keep the chat fast · click to show them as written")
        self.update(Text(f"{sign} {plural(lines, 'earlier line')} ({chars:,} characters) {then}"))

    def on_click(self) -> None:
        self.action_open_or_close()

    def action_open_or_close(self) -> None:
        self.opened = not self.opened
        self.post_message(self.Toggled())


def pieces(text: str, size: int = CHUNK_CHARS) -> list[Text]:
    """`text` as plain Text pieces of about `size` characters, cut after a newline where one
    is near (each piece is one widget, wrapped once)."""
    out: list[Text] = []
    start = 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start + size // 2, end)
            end = nl + 1 if nl >= 0 else end
        piece = text[start:end]
        out.append(Text(inert(piece[:-1] if piece.endswith("\n") else piece)))   # the widgets stack: no extra line
        start = end
    return out
