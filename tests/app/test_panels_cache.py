"""The cache panel compares the other models in their own serving dtypes (bf16, fp8 with its
scales), teaches weight reads against cache reads, counts the fp8 scales, and copes with a
model of unknown geometry."""
from __future__ import annotations

from kvchat.engine.geometry import KNOWN
from kvchat.widgets import CachePanel

from .conftest import SIZE, make_app, ready, screen_text, send
from .panel_host import PanelHost, snapshot

SMOL, L8B = KNOWN["smollm2-135m"], KNOWN["llama-3.1-8b"]


async def panel_text(snap, geometry=SMOL, dtype=None, width: int = 64) -> str:
    panel = CachePanel()
    async with PanelHost(panel).run_test(size=(width, 50)) as pilot:
        panel.show(snap, geometry, dtype) if dtype else panel.show(snap, geometry)
        await pilot.pause()
        return screen_text(pilot.app).replace("\u00a0", " ")


async def test_other_models_are_shown_in_bf16_and_fp8_whatever_the_kv_dtype_here():
    text = await panel_text(snapshot(tokens=1000, kv_dtype="fp32"))
    assert "256 KiB" not in text                           # Llama 3.1 8B in fp32: not what readers expect
    per_token = [c.strip() for c in text.split("bf16", 1)[1].splitlines()[1].strip("│ ").split("  ") if c.strip()]
    assert per_token == ["per token", "128 KiB", "320 KiB", "512 KiB"]
    fp8 = text.split("fp8 + scales", 1)[1].splitlines()[1]
    assert "66 KiB" in fp8                                 # 65,536 B elements + 2,048 B scales


async def test_the_fp8_per_token_figure_shows_elements_and_scales():
    text = await panel_text(snapshot(tokens=100, kv_dtype="fp8"))
    assert "12 KiB" in text and "11.2 KiB + 720 B scales" in text     # 11,520 + 720 B
    assert "+ scales 2 × 30 × 3 × 100 × 4 B = 72,000 B" in text


async def test_one_step_reads_weights_and_cache_and_says_where_they_are_equal():
    text = await panel_text(snapshot(tokens=1000, kv_dtype="fp32"))
    assert "one decode step reads" in text and "weights 513 MiB (fp32)" in text
    assert "cache read = weight read at 11,677 tokens" in text      # the bundled model in fp32: ~11.7k
    big = await panel_text(snapshot(tokens=1000, kv_dtype="bf16", geometry=L8B), geometry=L8B, dtype="bf16")
    assert "cache read = weight read at 122,532 tokens" in big      # Llama 3.1 8B in bf16: ~122k


async def test_the_weights_dtype_given_wins_over_the_kv_dtype():
    text = await panel_text(snapshot(tokens=10, kv_dtype="fp8"), dtype="fp32")
    assert "weights 513 MiB (fp32)" in text


async def test_a_model_of_unknown_geometry_is_said_so_with_how_to_give_it():
    text = await panel_text(snapshot(tokens=10, kv_dtype="bf16", bytes_per_token=131072), geometry=None)
    flat = " ".join(line.strip("│ ") for line in text.splitlines())
    assert "unknown geometry" in flat and "--geometry ALIAS" in flat and "--model PATH" in flat
    assert "128 KiB" in flat and "2 × L × H_kv" not in flat


async def test_in_the_app_the_cache_panel_teaches_the_crossover(fake):
    app = make_app(fake)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        await pilot.pause()
        text = screen_text(app).replace("\u00a0", " ")
    assert "cache read = weight read at 11,677 tokens" in text


async def test_narrow_panels_cut_no_figure():
    """40 columns (the tabs layout): one space between the comparison's columns; narrower
    (the compact layout): each description under its figure, one model a row."""
    snap = snapshot(tokens=1000, kv_dtype="fp32")
    at_40 = await panel_text(snap, width=44)
    assert "…" not in at_40 and "fp8 + scales 64.5 MiB 161 MiB 258 MiB" in at_40
    narrow = await panel_text(snap, width=32)
    lines = [line.strip("│ ") for line in narrow.splitlines()]
    assert "…" not in narrow
    assert lines[lines.index("used 43.9 MiB") + 1] == "1,000 tokens"
    assert lines[lines.index("per token 45 KiB") + 1] == "2 × 30 × 3 × 64 × 4 B"
    assert "bf16 fp8+scales" in narrow and "3.1 70B 312 MiB    161 MiB" in narrow
