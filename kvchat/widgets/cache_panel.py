"""The cache panel: bytes used / allocated / pool capacity, the bytes-per-token formula with
this model's numbers, what the same tokens would cost on well-known Llamas, and the pool's
eviction and preemption counters (every conversation shares the pool)."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from kvchat.engine.geometry import DTYPE_BYTES, KNOWN, Geometry
from kvchat.engine.telemetry import CacheSnapshot
from kvchat.engine.units import human_bytes

COMPARE = (("Llama 3.1 8B", "llama-3.1-8b"), ("Llama 3.1 70B", "llama-3.1-70b"), ("Llama 2 7B", "llama-2-7b"))


def formula(g: Geometry, kv_dtype: str, tokens: int) -> str:
    """2 x L x H_kv x d_h x S x b with this model's numbers, and the total."""
    b = DTYPE_BYTES[kv_dtype]
    total = 2 * g.n_layers * g.n_kv_heads * g.head_dim * tokens * b
    return f"2 × {g.n_layers} × {g.n_kv_heads} × {g.head_dim} × {tokens:,} × {b} B = {total:,} B"


class CachePanel(Static):
    """Draws the latest CacheSnapshot; `show` is cheap, called at most a few times a second."""

    DEFAULT_CSS = "CachePanel { height: auto; border: round $primary 50%; padding: 0 1; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "KV cache"
        self.snapshot: CacheSnapshot | None = None
        self.geometry: Geometry | None = None

    def show(self, snapshot: CacheSnapshot, geometry: Geometry | None = None) -> None:
        if geometry is not None:
            self.geometry = geometry
        if snapshot == self.snapshot:
            return
        self.snapshot = snapshot
        self.border_title = f"KV cache · {snapshot.kv_dtype} · cache {'on' if snapshot.mode == 'cache' else 'off'}"
        self.update(self.render_snapshot(snapshot))

    def render_snapshot(self, s: CacheSnapshot) -> Table:
        S = s.tokens_held
        t = Table.grid(padding=(0, 1))
        t.add_column(style="bold", no_wrap=True)
        t.add_column(justify="right", no_wrap=True)
        t.add_column(style="dim", overflow="fold")
        t.add_row("used", human_bytes(s.bytes_used), f"{S:,} tokens")
        t.add_row("allocated", human_bytes(s.bytes_allocated), f"{s.blocks_used:,} blocks of {s.block_size}")
        t.add_row("pool", human_bytes(s.capacity_bytes), f"{s.num_blocks:,} blocks")
        g = self.geometry
        kv = s.kv_dtype if s.kv_dtype in DTYPE_BYTES else "bf16"
        per_token = (f"2 × {g.n_layers} × {g.n_kv_heads} × {g.head_dim} × {DTYPE_BYTES[kv]} B"
                     if g is not None else f"{s.bytes_per_token:,} B")
        t.add_row("per token", human_bytes(s.bytes_per_token), per_token)
        t.add_row("evicted", f"{s.evictions:,}", "cached blocks, pool-wide since start")
        t.add_row("preempted", f"{s.preemptions:,}", "conversations, pool-wide since start")
        if g is None:
            return t
        out = Table.grid()
        out.add_row(t)
        out.add_row(Text.assemble(("2 × L × H_kv × d_h × S × b", "dim"), "\n= ", formula(g, kv, S)))
        if S * g.kv_bytes_per_token(kv) != s.bytes_used:
            out.add_row(Text("(+ the fp8 scales)", style="dim"))
        if s.mode == "off":
            out.add_row(Text("cache off: each token recomputes all S positions", style="italic"))
        cmp = Table.grid(padding=(0, 1))
        cmp.add_column(no_wrap=True)
        cmp.add_column(justify="right", no_wrap=True)
        cmp.add_column(style="dim", no_wrap=True)
        for label, key in COMPARE:
            other = KNOWN[key]
            cmp.add_row(label, human_bytes(S * other.kv_bytes_per_token(kv)),
                        f"{human_bytes(other.kv_bytes_per_token(kv))} per token")
        out.add_row(Text(f"the same {S:,} tokens in {kv} on", style="dim"))
        out.add_row(cmp)
        return out
