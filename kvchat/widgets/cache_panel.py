"""The cache panel: bytes used / allocated / pool capacity, the bytes-per-token formula with
this model's numbers, what one decode step reads for the weights against the cache (and the
context at which the two are equal), what the same tokens would cost on well-known Llamas in
their own serving dtypes, and the pool's reclaim and preemption counters (every
conversation shares the pool). The words: sink-window "evicts" from a conversation's middle
(the cap gauge), the pool "reclaims" cached blocks for new content (here), and it "preempts"
a conversation whose blocks it frees.

fp8 figures count the scales as every figure of kvchat does (the engine's snapshot, the logs,
`ask --json`, the bench): one fp32 scale per token, layer, K/V and KV head, beside the
one-byte elements, with the scales' share shown.
"""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from kvchat.engine.geometry import DTYPE_BYTES, KNOWN, SCALE_BYTES, Geometry
from kvchat.engine.sizing import step_reads
from kvchat.engine.telemetry import CacheSnapshot
from kvchat.engine.units import human_bytes

from ..backends.server_stats import ServerSnapshot, ServerStats
from ..text import per_token as per_token_text
from .panel import Panel
from ..text import inert

COMPARE = (("3.1 8B", "llama-3.1-8b"), ("3.1 70B", "llama-3.1-70b"), ("2 7B", "llama-2-7b"))   # Llama ...
SERVING = (("bf16", "bf16"), ("fp8", "fp8 + scales"))     # the other models in the dtypes they are served in
GAUGE_WIDTH = 30
COMPARE_WIDTH = 42       # the comparison's columns ("fp8 + scales", then 3 x "28.4 MiB"), two spaces apart
NARROW = 39              # narrower than this (a compact column), figures and descriptions go on two lines
UNKNOWN_GEOMETRY = ("unknown geometry: the formula, the step reads and the per-model figures need the "
                    "model's layers, KV heads and head size; give them with --geometry ALIAS "
                    "(e.g. llama-3.1-8b) or --model PATH (a folder with its config.json)")


def scale_bytes_per_token(g: Geometry, kv_dtype: str) -> int:
    """fp8: 2 x L x H_kv fp32 scales per token; other dtypes store none."""
    return g.kv_scale_bytes_per_token(kv_dtype)


def per_token(g: Geometry, kv_dtype: str) -> int:
    """Bytes one token holds, scales included."""
    return g.kv_bytes_per_token(kv_dtype) + scale_bytes_per_token(g, kv_dtype)


def formula(g: Geometry, kv_dtype: str, tokens: int) -> str:
    """2 x L x H_kv x d_h x S x b with this model's numbers, and the total (+ the fp8 scales)."""
    b = DTYPE_BYTES[kv_dtype]
    total = 2 * g.n_layers * g.n_kv_heads * g.head_dim * tokens * b
    out = f"2 × {g.n_layers} × {g.n_kv_heads} × {g.head_dim} × {tokens:,} × {b} B = {total:,} B"
    if kv_dtype == "fp8":
        scales = scale_bytes_per_token(g, kv_dtype) * tokens
        out += (f"\n+ scales 2 × {g.n_layers} × {g.n_kv_heads} × {tokens:,} × {SCALE_BYTES} B = {scales:,} B"
                f"\n= {total + scales:,} B")
    return out


def _bytes(n: int | None) -> str:
    return human_bytes(n) if n is not None else "unknown"


def _count(n: int | None) -> str:
    return f"{n:,}" if n is not None else "unknown"


def server_lines(v: ServerStats) -> Text:
    """A serving engine's own figures (ServerSnapshot.server), and what this mode cannot show."""
    pct = lambda x: f"{100 * x:.0f}%" if x is not None else "unknown"   # noqa: E731
    ms = lambda x: f"{x:,.1f} ms" if x is not None else "unknown"       # noqa: E731
    out = Text(f"server {inert(v.url)}\n", style="bold")
    out.append(f"pool in use {pct(v.usage)} · prefix hits {pct(v.prefix_hit_rate)} · "
               f"{_count(v.running)} running, {_count(v.waiting)} waiting\n")
    out.append(f"its histograms: inter-token {ms(v.inter_token_ms)} · TTFT {ms(v.ttft_ms)} (means)\n")
    if v.resident_blocks is not None:
        replayed = f"{v.event_replayed:,} replayed, " if v.event_replayed is not None else ""
        out.append(f"resident prefix blocks {v.resident_blocks:,} (KV events: {_count(v.event_batches)} batches, "
                   f"{replayed}{_count(v.event_gaps)} lost)\n")
    for note in v.notes:
        out.append(f"{inert(note)}\n", style="dim italic")     # a server's label values may be in it
    out.rstrip()
    return out


class CachePanel(Panel, Static):
    """Draws the latest CacheSnapshot; `show` is cheap, called at most a few times a second,
    and only keeps the snapshot while the panel is hidden. `geometry` None means a model of
    unknown shape (a remote server's): the panel says so."""

    DEFAULT_CSS = """
    CachePanel { height: auto; border: round $primary 50%; padding: 0 1; }
    CachePanel > .cachepanel--weights { color: $secondary; }
    CachePanel > .cachepanel--cache { color: $warning; }
    """
    COMPONENT_CLASSES = {"cachepanel--weights", "cachepanel--cache"}

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "KV cache"
        self.snapshot: CacheSnapshot | None = None
        self.geometry: Geometry | None = None
        self.dtype: str | None = None         # the weights' dtype; unset: taken as the KV dtype (auto)
        self._width = COMPARE_WIDTH           # the content width, the last one laid out (a hidden panel has none)
        self._drawn_width = 0

    def show(self, snapshot: CacheSnapshot, geometry: Geometry | None = None, dtype: str | None = None) -> None:
        changed = dtype is not None and dtype != self.dtype
        if geometry is not None:
            changed |= geometry != self.geometry
            self.geometry = geometry
        if dtype is not None:
            self.dtype = dtype
        if snapshot == self.snapshot and not changed:
            return
        self.snapshot = snapshot
        if self.drawing():
            self.draw()

    def draw(self) -> None:
        s = self.snapshot
        if s is None:
            return
        self.border_title = f"KV cache · {s.kv_dtype} · cache {'on' if s.mode == 'cache' else 'off'}"
        self.update(self.render_snapshot(s))

    def on_resize(self) -> None:
        """The figures are laid out for the width (wide, 40 columns, narrow): again if that changed."""
        self._width = self.content_region.width or self._width
        if self.snapshot is not None and _form(self._width) != _form(self._drawn_width) and self.drawing():
            self.draw()

    def weights_dtype(self, s: CacheSnapshot) -> str | None:
        """The weights' dtype as given, else the KV dtype when it can be the weights' (auto)."""
        if self.dtype in DTYPE_BYTES:
            return self.dtype
        return s.kv_dtype if s.kv_dtype in DTYPE_BYTES and s.kv_dtype != "fp8" else None

    def render_snapshot(self, s: CacheSnapshot) -> Table:
        S = s.tokens_held
        g = self.geometry
        kv = s.kv_dtype if s.kv_dtype in DTYPE_BYTES else "bf16"
        self._drawn_width = width = self.content_region.width or self._width
        narrow, gauge, _ = _form(width)
        scaled = f" · {human_bytes(S * s.scale_bytes_per_token)} of it scales" if S and s.scale_bytes_per_token else ""
        rows = [("used", _bytes(s.bytes_used), f"{_count(S)} tokens{scaled}"),
                ("allocated", _bytes(s.bytes_allocated), f"{_count(s.blocks_used)} blocks of {s.block_size}"),
                ("pool", _bytes(s.capacity_bytes), f"{s.num_blocks:,} blocks")]
        if g is None:
            rows.append(("per token", _bytes(s.bytes_per_token),
                         per_token_text(s.bytes_per_token, s.scale_bytes_per_token) if s.bytes_per_token else "unknown"))
        else:
            elems, scales = g.kv_bytes_per_token(kv), scale_bytes_per_token(g, kv)
            how = f"2 × {g.n_layers} × {g.n_kv_heads} × {g.head_dim} × {DTYPE_BYTES[kv]} B"
            if scales:
                rows.append(("per token", human_bytes(elems + scales),
                             f"{human_bytes(elems)} + {human_bytes(scales)} scales"))
            else:
                rows.append(("per token", human_bytes(elems), how))
        if isinstance(s, ServerSnapshot):
            # the server's own counter counts requests, every client's; no turn record can say
            # which were this conversation's, so the records' per-turn figure is n/a
            rows.append(("reclaimed", "n/a", "the server does not report its reclaimed blocks"))
            rows.append(("preempted", "n/a" if s.preemptions is None else f"{s.preemptions:,}",
                         "requests, server-wide since it started (per turn: n/a)" if s.preemptions is not None
                         else "the server's /metrics has no vllm:num_preemptions"))
        else:
            rows.append(("reclaimed", _count(s.evictions), "cached blocks given to new content, pool-wide since start"))
            rows.append(("preempted", _count(s.preemptions), "conversations, pool-wide since start"))
        out = Table.grid()
        out.add_row(_figures(rows, narrow))
        if isinstance(s, ServerSnapshot):
            out.add_row(server_lines(s.server))
        if S is None:           # a server without a KV-event stream: this conversation's share is unknown
            return out
        if g is None:
            out.add_row(Text(UNKNOWN_GEOMETRY, style="italic"))
        else:
            out.add_row(Text.assemble(("2 × L × H_kv × d_h × S × b", "dim"), "\n= ", formula(g, kv, S)))
        if s.mode == "off":
            out.add_row(Text("cache off: each token recomputes all S positions", style="italic"))
        if g is not None:
            out.add_row(self._step_reads(g, kv, S, s, gauge))
        out.add_row(self._compare(S, width))
        return out

    def _step_reads(self, g: Geometry, kv: str, S: int, s: CacheSnapshot, gauge: int = GAUGE_WIDTH) -> Text:
        """The lesson: a decode step reads every weight once and the whole cache once; the
        cache read grows with the context until it equals, then passes, the weight read."""
        dtype = self.weights_dtype(s)
        if dtype is None:
            return Text("one decode step reads: the weights' dtype is unknown", style="dim")
        r = step_reads(g, dtype, kv, S)
        filled = round(gauge * r.cache_share)
        out = Text("one decode step reads\n", style="bold")
        # the cache's share fills the bar (█) as the context grows; the weights' share stays ░
        out.append("█" * filled, self.get_component_rich_style("cachepanel--cache"))
        out.append("░" * (gauge - filled), self.get_component_rich_style("cachepanel--weights"))
        out.append(f" cache {100 * r.cache_share:.1f}%\n")
        out.append("weights ", self.get_component_rich_style("cachepanel--weights"))
        out.append(f"{human_bytes(r.weight_bytes)} ({dtype}) · ")
        out.append("cache ", self.get_component_rich_style("cachepanel--cache"))
        out.append(f"{human_bytes(r.cache_bytes)}\n")
        out.append(f"cache read = weight read at {r.crossover_tokens:,} tokens", style="dim")
        return out

    def _compare(self, S: int, width: int) -> Table:
        """The same tokens on the well-known Llamas, each in bf16 and fp8 (+ scales), labelled;
        one space between the columns where two would cut a figure, and in a narrow column
        one model a row, without the per-token rows."""
        cmp = Table(box=None, padding=(0, 0, 0, 2 if width >= COMPARE_WIDTH else 1), pad_edge=False,
                    show_edge=False, header_style="bold", title=f"the same {S:,} tokens on Llama", title_style="dim",
                    title_justify="left")
        if width < NARROW:
            cmp.add_column("", no_wrap=True)
            for dtype, label in SERVING:
                cmp.add_column(label.replace(" + ", "+"), justify="right", no_wrap=True)
            for name, key in COMPARE:
                cmp.add_row(name, *(human_bytes(S * per_token(KNOWN[key], dtype)) for dtype, _ in SERVING))
            return cmp
        cmp.add_column("", no_wrap=True)
        for name, _ in COMPARE:
            cmp.add_column(name, justify="right", no_wrap=True)
        for dtype, label in SERVING:
            cmp.add_row(label, *(human_bytes(S * per_token(KNOWN[key], dtype)) for _, key in COMPARE))
            cmp.add_row(Text("  per token", style="dim"),
                        *(Text(human_bytes(per_token(KNOWN[key], dtype)), style="dim") for _, key in COMPARE))
        return cmp


def _form(width: int) -> tuple[bool, int, int]:
    """What of the panel's layout depends on its width: narrow or not, the step-read gauge's
    width, the comparison's spacing."""
    return width < NARROW, min(GAUGE_WIDTH, max(width - 12, 8)), 2 if width >= COMPARE_WIDTH else 1


def _figures(rows: list[tuple[str, str, str]], narrow: bool) -> Table | Text:
    """Label, figure and what it counts, a row each; narrow: the description on a line of
    its own under the figure, rather than folded into a few columns beside it."""
    if narrow:
        out = Text()
        for label, figure, what in rows:
            out.append(f"{label} ", style="bold").append(figure).append(f"\n  {what}\n", style="dim")
        out.rstrip()
        return out
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(justify="right", no_wrap=True)
    t.add_column(style="dim", overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t
