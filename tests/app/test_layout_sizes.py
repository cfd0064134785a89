"""A layout per terminal size (kvchat/widgets/layout.py), live on resize: every panel at once on a
big terminal; one at a time under tabs on a smaller one, with the cycle key and clicks; the
hidden panels draw nothing and show current figures the moment they are shown."""
from __future__ import annotations

import pytest

from kvchat.widgets.layout import CHAT, COLUMNS, COMPACT, STACKED, TABS, layout_for
from kvchat.host_load import HostLoad
from kvchat.store.settings import Settings
from kvchat.widgets import BlockMap, CachePanel, CapGauge, ChatInput, LatencyPanel
from kvchat.widgets.panel_switcher import PANELS, PanelScroll, PanelSwitcher, PanelTabs

from .conftest import screen_text, send, wait_until

CLASSES = {"cache": CachePanel, "cap": CapGauge, "blocks": BlockMap, "latency": LatencyPanel}


def test_the_layout_follows_the_terminal_size():
    assert layout_for(160, 48) == layout_for(140, 45) == layout_for(140, 40) == COLUMNS
    assert layout_for(140, 60) == layout_for(200, 58) == STACKED
    assert layout_for(100, 30) == layout_for(139, 60) == layout_for(140, 39) == layout_for(90, 50) == TABS
    assert layout_for(80, 24) == layout_for(89, 40) == layout_for(64, 20) == COMPACT
    assert layout_for(63, 40) == layout_for(40, 12) == CHAT


def panel(app, name: str):
    return app.query_one(f"#{PANELS[name]}")


def fully_visible(app, widget) -> bool:
    """On screen and not scrolled out of the panel column."""
    r = widget.region
    return (widget.display and r.area > 0 and app.screen.region.contains_region(r)
            and app.query_one(PanelScroll).region.contains_region(r))


def displayed(app) -> list[str]:
    return [n for n in PANELS if panel(app, n).display]


async def four_turns(pilot) -> None:
    """The latency table at its longest (four turns)."""
    for i in range(4):
        await send(pilot, f"What does the KV cache hold? {i}")


@pytest.mark.parametrize("size", [(160, 48), (140, 60)])
async def test_on_a_big_terminal_all_four_panels_are_on_screen(running_app, size):
    async with running_app(size=size) as (app, pilot):
        await four_turns(pilot)
        await pilot.pause()
        switcher = app.query_one(PanelSwitcher)
        assert switcher.arrangement == layout_for(*size) and not app.query_one(PanelTabs).display
        assert displayed(app) == list(PANELS)
        for name in PANELS:
            assert fully_visible(app, panel(app, name)), (name, panel(app, name).region)
        assert app.query_one("#chat").region.width >= 50


@pytest.mark.parametrize("size", [(100, 30), (80, 24)])
async def test_on_a_smaller_terminal_the_key_cycles_the_panels_and_latency_fits(running_app, size):
    async with running_app(size=size) as (app, pilot):
        await four_turns(pilot)
        assert app.query_one(PanelSwitcher).arrangement == (TABS if size[0] >= 90 else COMPACT)
        assert app.query_one(PanelTabs).display and displayed(app) == ["cache"]
        seen = []
        for _ in PANELS:
            await pilot.press("f10")
            seen.append(displayed(app))
        assert seen == [["cap"], ["blocks"], ["latency"], ["cache"]]     # all four, one at a time, and round
        while displayed(app) != ["latency"]:
            await pilot.press("f10")
        await pilot.pause()
        assert fully_visible(app, panel(app, "latency")), panel(app, "latency").region
        assert "context position" in screen_text(app)
        assert app.query_one("#chat").region.width > app.query_one(PanelSwitcher).region.width
        assert app.focused is app.query_one(ChatInput)      # the key leaves typing with the input


async def test_at_80x24_latency_fits_with_slow_steps_and_a_busy_host_under_its_fits(running_app):
    """A loaded machine adds two notes under the fits (slow steps above the chart, the host's
    load): on the smallest tabbed layout each takes its short form, so the panel still fits."""
    async with running_app(size=(80, 24)) as (app, pilot):
        await four_turns(pilot)
        latency = panel(app, "latency")
        key = latency.data.latest_key("cache")
        last = latency.data.series[key][-1][0]
        latency.data.begin_turn(*key)
        latency.data.add_points(((last + 1, 60_000.0), (last + 2, 45_000.0)))   # far above the chart's top
        latency.data.host = HostLoad(1.6, 2, exact=True)
        latency.show_host = True
        while displayed(app) != ["latency"]:
            await pilot.press("f10")
        latency.draw()
        await pilot.pause()
        assert len(latency.outliers) == 2
        text = screen_text(app)
        assert "2 slow" in text and "1.6" in text, text
        assert fully_visible(app, latency), (latency.region, app.query_one(PanelScroll).region, text)


async def test_a_click_on_a_tab_shows_its_panel(running_app):
    async with running_app(size=(100, 30)) as (app, pilot):
        tabs = app.query_one(PanelTabs)
        for name in ("latency", "blocks"):
            start = next(s for s, _, n in tabs._spans if n == name)
            await pilot.click(PanelTabs, offset=(start + 1, 0))
            assert displayed(app) == [name]
        assert app.focused is app.query_one(ChatInput)


async def test_resizing_switches_the_layout_live_and_back(running_app):
    async with running_app(size=(160, 48)) as (app, pilot):
        await send(pilot, "hello")
        switcher = app.query_one(PanelSwitcher)
        assert switcher.arrangement == COLUMNS and displayed(app) == list(PANELS)
        await pilot.resize_terminal(80, 24)
        await wait_until(pilot, lambda: switcher.arrangement == COMPACT, what="the compact layout")
        await pilot.press("f10", "f10", "f10")
        await pilot.pause()
        assert displayed(app) == ["latency"] and fully_visible(app, panel(app, "latency"))
        await pilot.resize_terminal(100, 30)
        await wait_until(pilot, lambda: switcher.arrangement == TABS, what="the tabs layout")
        assert displayed(app) == ["latency"]                 # the panel in front stays in front
        await pilot.resize_terminal(160, 48)
        await wait_until(pilot, lambda: switcher.arrangement == COLUMNS, what="the two-column layout")
        await pilot.pause()
        assert displayed(app) == list(PANELS) and not app.query_one(PanelTabs).display
        assert all(fully_visible(app, panel(app, n)) for n in PANELS)
        await send(pilot, "still chatting")


def count_draws(monkeypatch) -> dict[str, int]:
    """How often each panel really draws (not how often it is given telemetry)."""
    counts = dict.fromkeys(PANELS, 0)
    hooks = {"cache": "render_snapshot", "cap": "render", "blocks": "render", "latency": "_fit_lines"}
    for name, method in hooks.items():
        cls = CLASSES[name]
        original = getattr(cls, method)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, method, counted)
    return counts


async def test_hidden_panels_do_not_draw_and_show_current_figures_when_switched_to(running_app, monkeypatch):
    async with running_app(size=(100, 30)) as (app, pilot):
        await send(pilot, "a first turn")
        await pilot.press("f10", "f10", "f10")
        assert displayed(app) == ["latency"]
        await pilot.pause()
        counts = count_draws(monkeypatch)
        latency = app.query_one(LatencyPanel)
        before = latency.point_count
        await send(pilot, "a second turn, drawn only in the latency panel")
        await pilot.pause()
        assert latency.point_count > before and counts["latency"] >= 1       # the panel in front: live
        assert counts["cache"] == counts["cap"] == counts["blocks"] == 0      # the hidden ones: nothing
        held = app.chat_screen.session.snapshot.tokens_held
        assert app.query_one(CachePanel).snapshot.tokens_held == held        # ... but they kept the figures
        await pilot.press("f10")                                              # to the cache panel
        assert displayed(app) == ["cache"] and counts["cache"] == 1
        await pilot.pause()
        assert f"{held} tokens" in screen_text(app)
        await pilot.press("f10", "f10")                                       # past the cap gauge to the blocks
        await pilot.pause()
        assert displayed(app) == ["blocks"] and counts["cap"] >= 1 and counts["blocks"] >= 1
        assert "occupancy" in screen_text(app)


async def test_f6_hides_and_shows_the_panels_in_every_layout_and_hidden_ones_catch_up(running_app, monkeypatch):
    for size in ((160, 48), (100, 30), (80, 24)):
        async with running_app(size=size) as (app, pilot):
            switcher = app.query_one(PanelSwitcher)
            assert switcher.display
            await pilot.press("f6")
            assert not switcher.display and not screen_text(app).count("occupancy")
            counts = count_draws(monkeypatch)
            await send(pilot, "typed while the panels are hidden")
            assert sum(counts.values()) == 0, counts
            await pilot.press("f6")
            await pilot.pause()
            assert switcher.display and all(counts[n] >= 1 for n in displayed(app)), counts
            assert app.query_one(CachePanel).snapshot == app.chat_screen.session.snapshot                 # drawn from current figures
            monkeypatch.undo()


async def test_the_cycle_key_is_rebindable_and_shown_on_the_tab_row(running_app):
    async with running_app(size=(100, 30), settings=Settings(keys={"next_panel": "ctrl+l"})) as (app, pilot):
        assert screen_text(app).splitlines()[1].rstrip().endswith(("ctrl+l", "ctrl+l next"))   # the key at the row's end
        await pilot.press("ctrl+l")
        assert displayed(app) == ["cap"]
        await pilot.press("f10")                     # the default is no longer bound
        assert displayed(app) == ["cap"]


async def test_a_closed_panel_is_skipped_by_the_cycle_and_reopened_by_its_tab(running_app):
    async with running_app(size=(100, 30)) as (app, pilot):
        app.query_one(ChatInput).load_text("/panel cap")
        await pilot.press("enter")
        await pilot.press("f10")
        assert displayed(app) == ["blocks"]
        app.query_one(ChatInput).load_text("/panel blocks")     # the one in front: the next open one shows
        await pilot.press("enter")
        assert displayed(app) == ["latency"]
        await pilot.press("f10")
        assert displayed(app) == ["cache"]
        tabs = app.query_one(PanelTabs)
        await pilot.click(PanelTabs, offset=(next(s for s, _, n in tabs._spans if n == "cap") + 1, 0))
        assert displayed(app) == ["cap"]


async def test_at_100x30_the_bar_shows_the_focused_conversation_however_many_are_open(running_app):
    """Issue 26 low: at 100x30 the conversation bar cut its line at the chat's width, and the
    newest conversation, the focused one, was past the cut. The labels around the focused one
    show, the others counted at the ends ("‹2", "1›")."""
    titles = ["tell me about caches", "second chat here", "a third chat", "the fourth one"]
    async with running_app(size=(100, 30)) as (app, pilot):
        for i, title in enumerate(titles):
            if i:
                await pilot.press("ctrl+n")
                await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == i + 1)
            await send(pilot, title)
        await pilot.pause()
        bar = screen_text(app).splitlines()[1]
        assert " 4 the fourth one " in bar and "‹" in bar, bar          # the focused one, the others counted
        await pilot.press("alt+left", "alt+left", "alt+left")
        await pilot.pause()
        bar = screen_text(app).splitlines()[1]
        assert " 1 tell me about… " in bar and "›" in bar, bar
        await pilot.press("alt+right", "alt+right")
        await pilot.pause()
        assert " 3 a third chat " in screen_text(app).splitlines()[1]


@pytest.mark.parametrize("size", [(80, 24), (100, 30)])
async def test_the_header_keeps_the_cap_and_the_policy_on_a_small_terminal(running_app, size):
    """Issue 26 low: at 80x24 the status line kept the model, device and dtypes and cut the cap
    and the policy, the settings a user changes; they come right after the model now, before
    what changes only with a restart, with one conversation or several."""
    async with running_app(size=size, cap=256, policy="drop-oldest") as (app, pilot):
        await send(pilot, "hello")
        header = screen_text(app).splitlines()[0]
        assert "cap 256 · drop-oldest" in header, header
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: len(app.chat_screen.conversations.views) == 2)
        await pilot.pause()
        header = screen_text(app).splitlines()[0]
        assert "cap 256 · drop-oldest" in header, header
