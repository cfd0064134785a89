"""A tiny host App that mounts one panel widget alone, so the panel tests do not depend on
the chat app's wiring; and a CacheSnapshot builder with the formula's numbers."""
from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widget import Widget

from kvchat.engine.geometry import KNOWN
from kvchat.engine.telemetry import FREE, CacheSnapshot


def as_turn(summary: dict):
    """A turn as the widgets take it: a TurnStats.summary() dict here; the typed TurnRecord
    where kvchat.records exists (the app's restructure), so these tests hold across the merge."""
    try:
        from kvchat.store.records import TurnRecord
    except ImportError:
        return summary
    return TurnRecord.from_dict(summary)


class PanelHost(App):
    """Mounts `widget` and nothing else."""

    def __init__(self, widget: Widget) -> None:
        super().__init__()
        self.widget = widget

    def compose(self) -> ComposeResult:
        yield self.widget


def snapshot(tokens: int = 100, kv_dtype: str = "fp32", block_map: bytes | None = None, block_size: int = 16,
             mode: str = "cache", geometry=KNOWN["smollm2-135m"], bytes_per_token: int | None = None) -> CacheSnapshot:
    scales = 2 * geometry.n_layers * geometry.n_kv_heads * 4 if kv_dtype == "fp8" else 0
    bpt = bytes_per_token if bytes_per_token is not None else geometry.kv_bytes_per_token(kv_dtype) + scales
    codes = block_map if block_map is not None else bytes([FREE] * 64)
    blocks = -(-tokens // block_size)
    return CacheSnapshot(
        model=geometry.name, kv_dtype=kv_dtype, block_size=block_size, num_blocks=len(codes), bytes_per_token=bpt,
        capacity_bytes=len(codes) * block_size * bpt, tokens_held=tokens, bytes_used=tokens * bpt,
        bytes_allocated=blocks * block_size * bpt, blocks_used=blocks, wasted_slots=blocks * block_size - tokens,
        pool_free=codes.count(FREE), pool_active=len(codes) - codes.count(FREE), pool_cached=0, pool_shared=0,
        block_map=codes, cap=None, policy="stop", mode=mode, evictions=0, preemptions=0, scale_bytes_per_token=scales)
