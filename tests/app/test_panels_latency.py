"""The latency panel keeps one series per (cache mode, KV dtype), fits each on its own only
where a fit means something, says why where it does not, and labels its axes with round,
evenly spaced ticks."""
from __future__ import annotations

import re

import pytest

from kvchat.latency import LatencyData, fit_series
from kvchat.text import duration
from kvchat.widgets import LatencyPanel
from kvchat.widgets.latency_panel import STEP_TITLES, STEP_XLABELS, TITLES, nice_ticks

from .conftest import screen_text
from .panel_host import PanelHost, as_turn

# ms per position by KV dtype: fp8 reads fewer bytes, so it grows more slowly than fp32
GROWTH = {"fp32": 0.008, "bf16": 0.004, "fp8": 0.002}


def turn(n: int, start: int, count: int, kv_dtype: str = "fp32", mode: str = "cache", base: float = 30.0,
         growth: float | None = None, policy: str = "stop", cap: int | None = None, ttft_ms: float = 50.0):
    g = GROWTH.get(kv_dtype, 0.01) if growth is None else growth
    positions = list(range(start, start + count))
    return as_turn({"turn": n, "prompt_tokens": 10, "reused_tokens": 0, "computed_tokens": 10,
                    "generated_tokens": count, "ttft_ms": ttft_ms, "mode": mode, "kv_dtype": kv_dtype,
                    "policy": policy, "cap": cap, "positions": positions,
                    "decode_ms": [base + g * p for p in positions]})


def test_each_kv_dtype_and_cache_mode_is_its_own_series_with_its_own_fit():
    data = LatencyData()
    data.add_turn(turn(1, 0, 400, "fp32"))
    data.add_turn(turn(2, 400, 400, "bf16", base=10.0))
    data.add_turn(turn(3, 800, 400, "fp8", base=5.0))
    data.add_turn(turn(4, 1200, 20, "fp8", mode="off", base=400.0, growth=0.5))
    assert set(data.series) == {("cache", "fp32"), ("cache", "bf16"), ("cache", "fp8"), ("off", "")}
    for kv, g in GROWTH.items():
        assert abs(data.fit(("cache", kv)).slope - 1000 * g) < 1e-6
    assert data.points["cache"] and len(data.points["cache"]) == 1200 and data.point_count == 1220


def test_live_points_join_the_series_of_the_turn_and_are_replaced_by_the_exact_ones():
    data = LatencyData()
    data.add_turn(turn(1, 0, 10, "bf16"))
    data.begin_turn("cache")                      # no dtype given: the last turn's
    data.add_points(((10, 99.0), (11, 99.0)))
    assert data.latest_key() == ("cache", "bf16") and len(data.series[("cache", "bf16")]) == 12
    data.end_turn(turn(2, 10, 3, "fp8"))
    assert len(data.series[("cache", "bf16")]) == 10 and len(data.series[("cache", "fp8")]) == 3


def test_sink_window_positions_that_stop_growing_get_no_fit_and_say_why():
    data = LatencyData()
    # the window holds 128 tokens: from position 128 on every step reads the same context
    data.add_turn(turn(1, 200, 600, "fp32", growth=-0.0132, policy="sink-window", cap=128))
    fit = data.fit(("cache", "fp32"))
    assert fit.slope is None and fit.describe() == "no fit: positions do not grow (sink-window)"


def test_a_falling_latency_is_never_shown_as_a_negative_growth():
    fit = fit_series([(p, 50.0 - 0.01 * p) for p in range(0, 1000, 10)])
    assert fit.slope is None and "fell" in fit.reason and "-" not in fit.describe()


def test_too_few_points_or_too_short_a_span_gets_no_fit_with_the_reason():
    assert fit_series([(p, 1.0) for p in range(5)]).describe() == "no fit: 5 points, needs 8"
    assert fit_series([(p, 1.0) for p in range(100, 120)]).describe() == "no fit: positions span 19, needs 256"


def test_ticks_are_round_and_evenly_spaced():
    for lo, hi in ((13, 40), (0.0, 4096), (10.13, 10.4), (37, 1234)):
        ticks = nice_ticks(lo, hi)
        steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
        assert len(ticks) >= 2 and len(steps) == 1 and lo <= ticks[0] and ticks[-1] <= hi
        step = steps.pop()
        assert any(abs(step / 10 ** k - m) < 1e-9 for k in range(-3, 5) for m in (1, 2, 2.5, 5))


def test_long_durations_read_in_seconds():
    assert duration(9_870) == "9,870 ms" and duration(212_234) == "212.2 s"


async def test_the_panel_shows_a_fit_line_per_series_and_the_reason_where_there_is_none():
    panel = LatencyPanel()
    async with PanelHost(panel).run_test(size=(72, 40)) as pilot:
        panel.data.add_turn(turn(1, 0, 400, "fp32"))
        panel.changed()
        panel.data.add_turn(turn(2, 400, 400, "fp8", base=5.0))
        panel.changed()
        panel.data.add_turn(turn(3, 800, 600, "bf16", policy="sink-window", cap=128, ttft_ms=212_234))
        panel.changed()
        await pilot.pause()
        text = screen_text(pilot.app).replace("\u00a0", " ")
    assert "fp32 cache: +8.0 ± 0.0 ms per 1k tokens (400 points)" in text
    assert "fp8 cache: +2.0 ± 0.0 ms per 1k tokens" in text
    assert "bf16 cache: no fit: positions do not grow (sink-window)" in text
    assert "212.2 s" in text and "212234" not in text
    assert panel.slope("cache", "fp32") == 8.0 or abs(panel.slope("cache", "fp32") - 8.0) < 1e-6
    assert panel.slope("cache") is None             # the latest cache turn: the sink-window one


def test_y_ticks_land_on_evenly_spaced_character_rows():
    from kvchat.widgets.latency_panel import row_ticks
    for lo, hi, rows in ((10.13, 10.4, 6), (30.0, 35.6, 6), (0.5, 212.0, 6), (32.0, 161.9, 9)):
        lower, upper, ticks = row_ticks(lo, hi, rows)
        at = [(rows - 1) * (t - lower) / (upper - lower) for t in ticks]
        assert lower <= lo and hi <= upper and len(ticks) >= 3
        assert all(abs(a - round(a)) < 1e-9 for a in at)                       # exactly on a row
        assert len({round(b - a, 9) for a, b in zip(at, at[1:])}) == 1           # evenly spaced rows


def test_a_typed_turn_record_is_read_like_a_summary_dict():
    """Turns may come as TurnStats.summary() dicts or as typed records with the same fields."""
    from types import SimpleNamespace
    data = LatencyData()
    fields = turn(1, 0, 400, "bf16")
    data.add_turn(SimpleNamespace(**(fields if isinstance(fields, dict) else fields.to_dict())))
    assert abs(data.fit(("cache", "bf16")).slope - 4.0) < 1e-6 and data.latest_key() == ("cache", "bf16")


async def test_a_single_point_or_a_flat_series_is_drawn_without_error():
    panel = LatencyPanel()
    async with PanelHost(panel).run_test(size=(60, 30)) as pilot:
        panel.data.add_turn(turn(1, 5, 1, "fp32"))
        panel.changed()
        await pilot.pause()
        panel.data.add_turn(turn(2, 6, 3, "fp32", growth=0.0))
        panel.changed()
        await pilot.pause()
        assert "fp32 cache: no fit: 4 points, needs 8" in screen_text(pilot.app)


async def test_the_turn_table_fits_a_narrow_panel():
    """The reused / computed bar narrows, then goes, then the KV column, then the turn
    numbers: the figures themselves are never cut."""
    for width, bar, kv, turn_col in ((72, True, True, True), (50, True, True, True), (44, False, True, True),
                                     (38, False, False, True), (32, False, False, False)):
        panel = LatencyPanel()
        async with PanelHost(panel).run_test(size=(width, 30)) as pilot:
            panel.data.add_turn(turn(1, 0, 40, "fp32", ttft_ms=2_759))
            panel.changed()
            await pilot.pause()
            text = screen_text(pilot.app).replace("\u00a0", " ")
        table = text[text.index("TTFT") - 10:]
        assert "…" not in table and "2,759 ms" in table, (width, text)
        assert ("▒" in table or "█" in table) == bar and ("fp32" in table.split("\n", 1)[1]) == kv, (width, text)
        assert ("turn" in table) == turn_col, (width, text)


async def test_one_slow_step_does_not_set_the_y_range_and_is_marked():
    """Issue 26: one slow step set the chart's y-range, flattening every real point and the
    fit onto the bottom row. The range ends at the series' robust top; the step is marked."""
    panel = LatencyPanel()
    async with PanelHost(panel).run_test(size=(72, 40)) as pilot:
        slow = turn(1, 0, 400, "fp32")
        ms = list(slow.decode_ms)
        ms[200] = 2_000.0
        panel.data.add_turn(as_turn({**slow.to_dict(), "decode_ms": ms}))
        panel.changed()
        await pilot.pause()
        text = screen_text(pilot.app).replace("\u00a0", " ")
        assert panel.y_range[1] < 50 and panel.outliers == [(200, 2_000.0)]
        assert "▲ 1 slow step above the chart (up to 2,000 ms)" in text and "▲" in text.split("▲ 1 slow")[0]
        assert "fp32 cache: +" in text                      # the fit still uses every point


@pytest.mark.parametrize("width", [36, 44, 52, 64, 72])
async def test_the_chart_keeps_a_title_once_data_arrives_and_its_y_axis_says_ms(width):
    """Issue 26 low: the chart's title went blank once points came (the y ticks push the
    canvas right, and plotext leaves out a centred title that no longer fits: at a 44-column
    panel, the columns layout's) and the y axis had no unit. The longest title that fits is
    drawn, and "ms" labels the y ticks' column."""
    panel = LatencyPanel()
    async with PanelHost(panel).run_test(size=(width, 30)) as pilot:
        data = LatencyData()
        data.add_turn(turn(1, 0, 400, "fp32"))
        panel.attach(data)
        await pilot.pause()
        text = screen_text(pilot.app).replace("\u00a0", " ")
        assert any(title in text for title in TITLES), text
        assert re.search(r"│ ms +context position", text), text
        panel.plot_against_step(True)       # a crowd's x axis, the longer labels
        data.add_turn(as_turn({**turn(2, 400, 300, "fp32").to_dict(), "step_tokens": list(range(500, 800))}))
        panel.changed()
        await pilot.pause()
        text = screen_text(pilot.app).replace("\u00a0", " ")
        assert any(title in text for title in STEP_TITLES), text
        assert any(re.search(rf"│ ms +{re.escape(x)}", text) for x in STEP_XLABELS), text


async def test_sink_window_points_stay_within_the_models_maximum_on_the_x_axis(fake):
    """Issue 26 low: the sink-window chart's x axis ran past the model's maximum context (the
    text's position, 8,600 on an 8,192-token model), while sink-window gives each token its
    index in the cache as its position. The points are drawn at the context the step read, the
    window (the model's maximum without a cap), where the fit already measured them."""
    from kvchat.chat.session import ChatOptions, Session
    session = Session.open(fake, 1, ChatOptions(policy="sink-window"))
    assert session.latency.max_position == 8192 == fake.info().max_position
    session.latency.add_turn(turn(1, 7800, 800, "fp32", policy="sink-window", cap=None))   # no cap: the maximum
    panel = LatencyPanel()
    async with PanelHost(panel).run_test(size=(72, 40)) as pilot:
        panel.attach(session.latency)
        await pilot.pause()
        xs = [p for points in panel.drawn_series().values() for p, _ in points]
        assert min(xs) == 7800 and max(xs) == 8192
        ticks = screen_text(pilot.app).replace("\u00a0", " ").split("└")[1].splitlines()[1]
        labels = [int(t.replace(",", "")) for t in re.findall(r"[\d,]+", ticks)]
        assert labels and max(labels) <= 8192, ticks
    capped = LatencyData(8192)
    capped.add_turn(turn(1, 100, 400, "fp32", policy="sink-window", cap=256))       # a cap: the window
    assert max(p for p, _ in capped.drawn(("cache", "fp32"))) == 256
    session.log.close()
