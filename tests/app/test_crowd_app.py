"""/crowd in the app, on the scripted FakeBackend (its turns take no model time, and it lists
its chats as the engine's scheduler does; tests/test_crowd.py runs the crowd on the real
engine): simulated users join the pool, the crowd panel lists them, the user's own
conversation keeps replying, /crowd off and the key end them, and quitting with a crowd
running exits at once and keeps the user's conversation, and only it."""
from __future__ import annotations

import threading
import time

import pytest

from kvchat.commands import Command, CommandError, parse
from kvchat.crowd.figures import Meter
from kvchat.widgets import Notice
from kvchat.widgets.crowd_panel import CrowdPanel

from .conftest import send, wait_until


def notices(app) -> list[str]:
    return [n.text for n in app.chat_screen.view.query(Notice)]


def crowd_of(app):
    return app.chat_screen.controls.crowd


def test_crowd_parses_n_long_and_off_and_names_bad_input():
    assert parse("/crowd 3") == Command("crowd", (3, False))
    assert parse("/crowd 4 long") == Command("crowd", (4, True))
    assert parse("/crowd off") == Command("crowd", "off")
    for bad, words in (("/crowd", "usage: /crowd N"), ("/crowd 0", "1 to 64"), ("/crowd 65", "1 to 64"),
                       ("/crowd many", "number of users"), ("/crowd 3 short", "usage: /crowd N")):
        with pytest.raises(CommandError, match=words) as err:
            parse(bad)
        assert "\n" not in str(err.value)


async def test_a_crowd_joins_the_pool_beside_the_users_own_conversation(fake, running_app):
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        app.query_one("#input").load_text("/crowd 3")
        await pilot.press("enter")
        control = crowd_of(app)
        await wait_until(pilot, lambda: control.running, what="the crowd to start")
        panel = app.query_one(CrowdPanel)
        switcher = app.chat_screen.panels.switcher
        assert "crowd" in switcher.names and panel.display
        assert any("3 simulated users joined" in n for n in notices(app))
        await wait_until(pilot, lambda: min(u.turns for u in control.crowd.users) >= 2, timeout=30,
                         what="every simulated user's second turn")
        await wait_until(pilot, lambda: panel.figures is not None and len(panel.figures.rows) == 4,
                         what="the panel's rows")
        rows = panel.figures.rows
        assert rows[0].name == "you" and rows[0].own and [r.name for r in rows[1:]] == ["user 1", "user 2", "user 3"]
        assert all(r.context_tokens and r.context_tokens > 0 for r in rows)
        own_chat = app.chat_screen.session.chat
        assert rows[0].context_tokens == own_chat.tokens_held
        await send(pilot, "still here?")                  # the user's own conversation keeps working
        assert len(app.chat_screen.session.turns) == 2
        turns = control.crowd.turns()
        for u in control.crowd.users:                      # each user's history grows turn by turn
            mine = [t for t in turns if t.user == u.index]
            assert all(b.prompt_tokens > a.context_tokens for a, b in zip(mine, mine[1:]))
        app.query_one("#input").load_text("/crowd off")
        await pilot.press("enter")
        await wait_until(pilot, lambda: "crowd" not in switcher.names, what="the panel to go")
        await wait_until(pilot, lambda: fake.chats == [own_chat], timeout=5, what="the crowd's chats to close")
        assert not panel.display and any("the crowd left" in n for n in notices(app))


async def test_the_key_starts_and_stops_a_crowd(fake, running_app):
    async with running_app() as (app, pilot):
        control = crowd_of(app)
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: control.running and len(fake.chats) == 5, what="4 users to join")
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: not control.running and len(fake.chats) == 1, timeout=5,
                         what="the users to leave")


async def test_quitting_with_a_crowd_running_exits_at_once_and_saves_only_the_users_conversation(
        fake, running_app, private_dirs):
    async with running_app() as (app, pilot):
        await send(pilot, "remember me")
        app.query_one("#input").load_text("/crowd 4 long")
        await pilot.press("enter")
        control = crowd_of(app)
        await wait_until(pilot, lambda: control.running and sum(u.turns for u in control.crowd.users) >= 4,
                         timeout=30, what="the crowd's turns")
        log = app.chat_screen.session.log.path
        t0 = time.monotonic()
        await pilot.press("ctrl+q")
        await wait_until(pilot, lambda: not app.is_running, timeout=5, what="the app to exit")
        took = time.monotonic() - t0
    assert took < 1.0, f"quitting took {took:.2f} s with a crowd running"
    assert app.return_code == 0
    # then, before the interpreter ends (cli/launch.py), every crowd thread has left the backend
    assert app.settle(5.0)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("crowd-")]
    text = log.read_text()
    assert "remember me" in text
    saved = [p for p in (private_dirs / "data").rglob("*.jsonl") if p.name != "errors.log"]
    assert saved == [log], saved                          # the crowd's conversations are not saved
    assert not any("Here is a report" in p.read_text() for p in saved)


def test_the_meter_names_the_crossover_and_the_rates():
    """The panel's totals from a scheduler snapshot: tokens/s over the recent steps, the
    crossover in tokens (weights / bytes per token), preemptions per minute."""
    from kvchat.engine.telemetry import SchedulerSnapshot, StepRecord
    from kvchat.text import crossover_line
    steps = tuple(StepRecord(i, 3, 3, 0, 0, 0, 3, 12_000, 3, 100.0, 538_000_000, 552_960_000, 0, 10.0 + 0.1 * i)
                  for i in range(10))
    meter = Meter()
    first = meter.figures([], SchedulerSnapshot((), 3, 0, 0, 0, 10, 512, steps), None, None, now=11.0)
    assert first.tokens_per_s == pytest.approx(30 / 1.0)          # 10 steps of 3 tokens over 1.0 s
    later = meter.figures([], SchedulerSnapshot((), 3, 1, 6, 120, 10, 512, steps), None, None, now=41.0)
    assert later.preemptions_per_min == pytest.approx(6 / 0.5) and later.waiting == 1
    assert later.caches_pass_weights
    line = crossover_line(538_000_000, 552_960_000, 11_675)
    assert line.endswith("the caches now read more than the weights")
    assert "the caches pass the weights at 11,675 tokens in a step" in crossover_line(538_000_000, 269_000_000, 11_675)


def test_against_a_server_the_meter_reads_its_metrics_and_the_streams_and_marks_the_rest():
    """No scheduler to ask (a vLLM server): running, waiting, preemptions and KV usage from its
    /metrics (the ServerSnapshot), tokens/s from the streams' own turns, the steps n/a."""
    from dataclasses import replace

    from kvchat.backends.server_stats import ServerSnapshot, ServerStats
    from kvchat.crowd.driver import CrowdTurn, CrowdUser
    from .fake_backend import FakeBackend
    base = FakeBackend().snapshot()
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    stats = ServerStats("http://127.0.0.1:8000", 0.4, None, 3, 2, 5, None, None, None, None, None)
    snap = ServerSnapshot(**fields, server=stats)
    user = CrowdUser(0, False, conversation=None, state="thinking", turns=1)
    user.last = CrowdTurn(0, 0, False, None, 1.0, 2.0, 40, 0, 8, 120.0, 11.0)
    turns = [user.last, replace(user.last, turn=1, end_s=9.0, generated_tokens=12)]
    meter = Meter()
    meter.figures([user], None, snap, None, now=100.0, turns=turns, clock=10.0)
    f = meter.figures([user], None, snap, None, now=130.0, turns=turns, clock=10.0)
    assert (f.running, f.waiting, f.pool_used, f.source) == (2, 5, 0.4, "http://127.0.0.1:8000")
    assert f.tokens_per_s == pytest.approx(20 / 10.0) and f.preemptions_per_min == 0.0
    assert f.step_ms is None and f.weight_bytes is None and not f.caches_pass_weights
    row = f.rows[0]
    assert (row.context_tokens, row.ttft_ms, row.blocks_held, row.pool_share) == (48, 120.0, None, None)


async def test_the_block_map_colours_other_chats_by_user_while_a_crowd_runs(fake, running_app):
    from rich.style import Style

    from kvchat.widgets.block_map import BlockMap, owner_colour
    async with running_app() as (app, pilot):
        await send(pilot, "hello")
        control = crowd_of(app)
        await pilot.press("alt+c")
        blocks = app.query_one(BlockMap)
        await wait_until(pilot, lambda: control.running and min(u.turns for u in control.crowd.users) >= 1
                         and blocks.by_owner and blocks.snapshot is not None and len(blocks.snapshot.owners) >= 5,
                         timeout=20, what="the crowd's blocks in the map")
        snap = blocks.snapshot
        text = blocks.render()
        grid = text.plain.split("\n")
        width = len(grid[0])
        checked = 0
        for user in control.crowd.users:
            mine = [b for b in range(snap.num_blocks) if snap.owner_of(b) == user.conversation]
            if not mine:
                continue
            checked += 1
            b = mine[0]
            offset = (b // width) * (width + 1) + b % width     # each grid row ends with a newline
            spans = [sp for sp in text.spans if sp.start <= offset < sp.end]
            assert any(Style.parse(owner_colour(user.conversation)) == (sp.style if isinstance(sp.style, Style)
                       else Style.parse(str(sp.style))) for sp in spans), (user.name, spans)
        assert checked >= 3, "most simulated users hold blocks after their first turn"
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: not blocks.by_owner, what="the map's own colours back")


def test_a_crowd_user_whose_last_turn_was_refused_reads_refused_between_turns():
    from kvchat.crowd.driver import CrowdTurn, CrowdUser
    from kvchat.engine.telemetry import RequestView, SchedulerSnapshot
    user = CrowdUser(0, True, conversation=7, state="thinking", turns=3)
    user.last = CrowdTurn(0, 2, True, 7, 1.0, 1.5, 0, 0, 0, None, None, error="KV pool full: ...")
    view = RequestView(7, None, "idle", 0, 0, 900, 0, None, None, 2, 400)
    f = Meter().figures([user], SchedulerSnapshot((view,), 0, 0, 2, 400, 10, 512, ()), None, None, now=5.0)
    assert f.rows[0].state == "refused" and f.rows[0].name == "user 1 (long)"
    user.last = CrowdTurn(0, 2, True, 7, 1.0, 1.5, 900, 0, 4, 50.0, 90.0)
    f = Meter().figures([user], SchedulerSnapshot((view,), 0, 0, 2, 400, 10, 512, ()), None, None, now=5.0)
    assert f.rows[0].state == "thinking"


async def test_while_a_crowd_runs_the_latency_plot_puts_the_whole_steps_tokens_on_x(fake, running_app):
    """The user's own ms/token against the cached tokens its steps read over every
    conversation (the turn record's step_tokens), and back to its own context after."""
    from kvchat.engine.telemetry import TurnSummary
    from kvchat.latency import LatencyData
    from kvchat.widgets.latency_panel import LatencyPanel
    async with running_app() as (app, pilot):
        panel = app.query_one(LatencyPanel)
        data = LatencyData()
        data.add_turn(TurnSummary(decode_ms=(10.0, 14.0), positions=(100, 101), kv_dtype="fp32",
                                  step_sequences=(3, 4), step_tokens=(900, 1300)))
        panel.attach(data)
        assert panel.drawn_series() == {("cache", "fp32"): [(100, 10.0), (101, 14.0)]}
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: panel.by_step, what="the step axis")
        assert panel.drawn_series() == {("cache", "fp32"): [(900, 10.0), (1300, 14.0)]}
        await pilot.press("alt+c")
        await wait_until(pilot, lambda: not panel.by_step, what="the own axis back")
