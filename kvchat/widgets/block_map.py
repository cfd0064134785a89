"""The block map: one cell per pool block, drawn by state with a glyph and a colour (the
glyph alone tells the states apart, for colour-blind readers and monochrome terminals),
with a legend, the occupancy and the slots wasted in this conversation's partial last block.

With more blocks than cells, each cell stands for k blocks (the ratio is shown) and takes
the most notable state among them, so a few held blocks in a huge pool stay visible.
The work is done with bytes.translate / max over slices, which run in C: a 10^5-block
pool costs about a millisecond per redraw.
"""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from kvchat.engine.telemetry import BLOCK_STATE_NAMES, CACHED, FREE, HELD, OTHER, PARTIAL, REUSED, SHARED, CacheSnapshot
from kvchat.engine.units import human_bytes

from ..text import plural
from .panel import Panel

NOTABLE = (FREE, CACHED, OTHER, HELD, PARTIAL, SHARED, REUSED)   # least to most
_RANK = bytes(NOTABLE.index(c) if c in NOTABLE else 0 for c in range(256))
_UNRANK = bytes(NOTABLE) + bytes(256 - len(NOTABLE))
LEGEND_LABELS = {FREE: "free", HELD: "held", PARTIAL: "partial", REUSED: "reused",
                 CACHED: "cached", SHARED: "shared", OTHER: "other chats"}
# one glyph per state, all one cell wide (WGL4 shapes, in every common terminal font): empty for
# free, full for held, half-full for partial, hollow for cached (held by none, evictable)
GLYPHS = {FREE: "·", HELD: "■", PARTIAL: "▄", REUSED: "●", CACHED: "□", SHARED: "≡", OTHER: "▪"}
CELL = GLYPHS[HELD]
_GLYPH = tuple(GLYPHS.get(c, "?") for c in range(max(GLYPHS) + 1))


def aggregate(codes: bytes, cells: int) -> tuple[bytes, int]:
    """Squeeze a block map into at most `cells` cells; returns (cell codes, blocks per cell)."""
    n = len(codes)
    if n <= cells:
        return codes, 1
    k = -(-n // cells)
    ranked = codes.translate(_RANK)
    out = bytes(max(ranked[i:i + k]) for i in range(0, n, k))
    return out.translate(_UNRANK), k


class BlockMap(Panel, Widget):
    """Draws CacheSnapshot.block_map: a glyph per state (GLYPHS), coloured by the component
    classes (themes); while hidden it only keeps the snapshot."""

    COMPONENT_CLASSES = {f"blockmap--{name}" for name in BLOCK_STATE_NAMES}
    DEFAULT_CSS = """
    BlockMap { height: auto; border: round $primary 50%; padding: 0 1; }
    BlockMap > .blockmap--free { color: $foreground 25%; }
    BlockMap > .blockmap--held { color: $success; }
    BlockMap > .blockmap--partial { color: $warning; }
    BlockMap > .blockmap--reused { color: $accent; }
    BlockMap > .blockmap--cached { color: $secondary; }
    BlockMap > .blockmap--shared { color: $primary; }
    BlockMap > .blockmap--other { color: $foreground 60%; }
    """
    MAX_ROWS = 10

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "blocks"
        self.snapshot: CacheSnapshot | None = None
        self.why_not: str | None = None     # the backend cannot draw a block map: why
        self.ratio = 1
        self._grid_key: tuple | None = None
        self._grid_text = Text()

    def show(self, snapshot: CacheSnapshot) -> None:
        old = self.snapshot
        self.snapshot = snapshot
        if old is None or old.block_map != snapshot.block_map or old.wasted_slots != snapshot.wasted_slots:
            # the height only changes with the number of blocks or the legend's entries
            same_shape = old is not None and old.num_blocks == snapshot.num_blocks and (
                {c for c in LEGEND_LABELS if old.block_map.count(c)} ==
                {c for c in LEGEND_LABELS if snapshot.block_map.count(c)})
            if self.drawing():
                self.refresh(layout=not same_shape)

    def unavailable(self, why: str | None) -> None:
        """Say why there is no block map (None: there is one)."""
        if why != self.why_not:
            self.why_not = why
            if self.drawing():
                self.draw()

    def draw(self) -> None:
        self.refresh(layout=True)

    def on_resize(self) -> None:
        self.refresh(layout=True)

    def _style(self, code: int):
        return self.get_component_rich_style(f"blockmap--{BLOCK_STATE_NAMES[code]}")

    def _grid(self, codes: bytes, width: int) -> Text:
        """The cells, one span per run of equal cells; cached, as it changes once a block."""
        styles = tuple(self._style(c) for c in range(len(BLOCK_STATE_NAMES)))
        key = (codes, width, styles)
        if self._grid_key == key:
            return self._grid_text
        cells, self.ratio = aggregate(codes, width * self.MAX_ROWS)
        out = Text()
        for row in range(0, len(cells), width):
            line = cells[row:row + width]
            i = 0
            while i < len(line):
                j = i
                while j < len(line) and line[j] == line[i]:
                    j += 1
                out.append(_GLYPH[line[i]] * (j - i), styles[line[i]])
                i = j
            out.append("\n")
        self._grid_key, self._grid_text = key, out
        return out

    def render(self) -> Text:
        s = self.snapshot
        if self.why_not:
            return Text(f"no block map: {self.why_not}", style="dim")
        if s is None:
            return Text("no pool yet", style="dim")
        width = max(self.content_region.width or self.size.width, 8)
        out = self._grid(s.block_map, width).copy()
        line_len = 0
        for code, label in LEGEND_LABELS.items():
            count = s.block_map.count(code)
            if not count and code not in (FREE, HELD, PARTIAL, REUSED, CACHED):
                continue
            entry = f" {label} {count:,}"
            if line_len and line_len + 2 + len(entry) + 1 > width:   # wrap between entries, never inside
                out.append("\n")
                line_len = 0
            elif line_len:
                out.append("  ")
                line_len += 2
            out.append(_GLYPH[code], self._style(code))
            out.append(entry)
            line_len += 1 + len(entry)
        out.append("\n")
        ratio = "1 cell = 1 block" if self.ratio == 1 else f"1 cell = {self.ratio:,} blocks"
        occupancy = f"{100 * s.occupancy:.1f}%" if s.occupancy is not None else "unknown"
        out.append(f"occupancy {occupancy} · {ratio} of {s.block_size} tokens\n", style="dim")
        if s.wasted_slots is None or s.bytes_per_token is None:   # a server's map: no partial blocks in it
            out.append("resident full prefix blocks only, in no physical order (KV events)", style="dim")
        else:
            out.append(f"wasted {plural(s.wasted_slots, 'slot')} in the partial block "
                       f"({human_bytes(s.wasted_slots * s.bytes_per_token)})", style="dim")
        return out
