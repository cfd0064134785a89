"""A reply's Markdown, with a long table drawn as one widget.

Textual's MarkdownTable lays a table out as a grid with a widget per cell; its cost grows
with every cell, and a reply streaming a table re-lays the grid on each batch (a 2,000-row
table froze the chat for 90 s at 1.8 GB, issue 27). A table of up to SMALL_ROWS rows keeps
Textual's grid, so ordinary replies draw exactly as before; past that, the table is one
Static holding a Rich table (plain cell text, the same columns and alignment), which costs
one render however many rows stream in.
"""
from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text
from textual.content import Content
from textual.widgets import Markdown, Static
from textual.widgets._markdown import MarkdownBlock, MarkdownTable, MarkdownTableContent

from ..text import inert

SMALL_ROWS = 20


def rich_table(headers: list[Content], rows: list[list[Content]]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, expand=False, show_edge=False, pad_edge=False,
                  header_style="bold")
    for header in headers:
        table.add_column(Text(inert(header.plain)), overflow="fold")
    for row in rows:
        table.add_row(*(Text(inert(cell.plain)) for cell in row[:len(headers)]))
    return table


class LongTable(MarkdownTable):
    """Textual's table while it is small; one Static past SMALL_ROWS rows."""

    DEFAULT_CSS = "LongTable > .long-table { width: auto; height: auto; }"

    def compose(self):
        headers, rows = self._get_headers_and_rows()
        self._headers, self._rows = headers, rows
        if len(rows) <= SMALL_ROWS:
            yield MarkdownTableContent(headers, rows)
        else:
            yield Static(rich_table(headers, rows), classes="long-table")

    async def _update_from_block(self, block: MarkdownBlock) -> None:
        if isinstance(block, MarkdownTable):
            headers, rows = block._get_headers_and_rows()
            if len(rows) > SMALL_ROWS:
                self._headers, self._rows = headers, rows
                long = self.query(".long-table")
                if long:
                    long.first(Static).update(rich_table(headers, rows))
                else:
                    await self.remove_children()
                    await self.mount(Static(rich_table(headers, rows), classes="long-table"))
                return
        await super()._update_from_block(block)


class ReplyMarkdown(Markdown):
    """Markdown whose long tables are drawn as one widget (LongTable)."""

    BLOCKS = {**Markdown.BLOCKS, "table_open": LongTable}
