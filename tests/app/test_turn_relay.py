"""turn.relay batches a turn's events; turn.Governor bounds the UI's share of the turn."""
from __future__ import annotations

from kvchat.engine.telemetry import PrefillEvent, PrefillProgress, TokenEvent, TurnStats
from kvchat.chat.jobs import RunningTurn
from kvchat.chat.relay import Governor, relay

from .fake_backend import FakeBackend


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def events(clock: Clock, n: int, step: float):
    """A turn: a prefill, n tokens `step` seconds apart, and its stats."""
    chat = FakeBackend().open()
    yield PrefillEvent(10, 0, 10, 1.0)
    for i in range(n):
        clock.t += step
        yield TokenEvent(f"t{i} ", 100 + i, 10 + i, 5.0)
    yield next(ev for ev in chat.send("hi") if isinstance(ev, TurnStats))     # the fake's also has PrefillProgress


def test_relay_batches_tokens_at_the_interval_and_loses_none():
    clock, out, snaps = Clock(), [], []
    stats = relay(events(clock, 100, 0.01), lambda: snaps.append(clock.t) or None, out.append,
                  interval=lambda: 0.25, clock=clock)
    assert stats is not None and stats.reply
    assert "".join(p.text for p in out) == "".join(f"t{i} " for i in range(100))
    assert [pt for p in out for pt in p.points] == [(10 + i, 5.0) for i in range(100)]
    assert out[0].prefill is not None and out[0].text == ""          # prefill is shown at once
    assert 4 <= len(out) <= 6                                        # 1 s of tokens at 4 updates a second
    assert out[-1].generated == 100


def test_relay_stretches_the_interval_when_snapshots_are_slow():
    clock, out = Clock(), []

    def slow_snapshot():
        clock.t += 0.02          # 20 ms per snapshot: at most one per second (2% of the turn)
    relay(events(clock, 200, 0.01), slow_snapshot, out.append, interval=lambda: 0.1, clock=clock)
    assert len(out) <= 4


def test_governor_slows_updates_when_the_ui_costs_too_much_and_speeds_up_when_cheap():
    cpu, wall = Clock(), Clock()
    gov = Governor(share=0.03, lo=0.1, hi=1.0, cpu=cpu, wall=wall, window=0.5)
    for _ in range(20):                    # the UI spends 15% of the time: intervals grow to the cap
        wall.t += 0.5
        cpu.t += 0.075
        gov.tick()
    assert gov.interval == 1.0
    for _ in range(20):                    # now 0.5%: back to the fastest rate
        wall.t += 0.5
        cpu.t += 0.0025
        gov.tick()
    assert gov.interval == 0.1


def test_relay_passes_each_prefill_progress_on_at_once_without_a_snapshot():
    from kvchat.engine.telemetry import PrefillProgress
    clock, out = Clock(), []

    def turn():
        for done in (0, 64, 128):
            yield PrefillProgress(done, 128, done * 1.0)
        yield from events(clock, 2, 0.01)
    relay(turn(), lambda: None, out.append, interval=lambda: 10.0, clock=clock)
    assert [p.prefill_progress.done for p in out[:3]] == [0, 64, 128]
    assert all(p.snapshot is None and p.text == "" for p in out[:3])


def test_the_worker_waits_for_each_batch_to_be_drawn_before_its_next_step(monkeypatch):
    """A redraw during a step would take the GIL from it: run_turn holds the engine between
    steps until the UI says it drew the batch (TurnProgress.drawn)."""
    import threading
    import types

    from kvchat.chat import worker
    from kvchat.engine.sampler import SamplingParams

    chat = FakeBackend().open()
    posted, undrawn_at_step = [], []

    def send(text, sampling, cancel):
        for ev in FakeBackend().open().send(text):
            undrawn_at_step.append(sum(not m.drawn.is_set() for m in posted))
            yield ev

    def post_message(msg):
        if hasattr(msg, "drawn"):
            posted.append(msg)
            threading.Timer(0.05, msg.drawn.set).start()   # the UI draws it a little later
        return True
    log = types.SimpleNamespace(sync=lambda *a: None, turn=lambda *a: None, history=types.SimpleNamespace(dropped=0))
    session = types.SimpleNamespace(chat=types.SimpleNamespace(send=send, state=chat.state), log=log)
    turn = RunningTurn(view=None, text="hi")     # its view is the UI's; the worker never touches it
    monkeypatch.setattr(worker, "TurnProgress", lambda t, s, p, f: types.SimpleNamespace(drawn=threading.Event()))
    monkeypatch.setattr(worker, "TurnEnded", lambda *a, **k: object())
    worker.run_turn(turn, session, types.SimpleNamespace(snapshot=lambda chat: None), SamplingParams(),
                    lambda: session, lambda: 0.0, post_message)
    assert len(posted) > 2 and undrawn_at_step and max(undrawn_at_step) == 0


def test_a_token_without_an_id_counts_and_a_text_tail_does_not():
    """A server's stream may carry a token's text without its id (TokenEvent.token_id None):
    it is a generated token with its latency point; the engine's held-back text tail (id -1)
    is text only."""
    clock, out = Clock(), []
    tokens = [TokenEvent("a", 7, 10, 5.0), TokenEvent("b", None, 11, 6.0), TokenEvent("c", -1, 11, 0.0)]
    relay(iter([PrefillEvent(10, None, None, None), *tokens]), lambda: None, out.append, clock=clock)
    assert "".join(p.text for p in out) == "abc"
    assert out[-1].generated == 2 and [pt for p in out for pt in p.points] == [(10, 5.0), (11, 6.0)]


def test_a_slow_snapshot_during_a_prefill_spaces_the_next_ones_but_never_stops_them():
    """A chunk every 0.1 s and a snapshot costing 3 ms (more than 2% of 0.1 s): the snapshots
    are spaced to keep their share (one per 150 ms at most) and go on to the end. Timing the
    spacing from the last update instead stopped them after the first (the panels froze)."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    def snapshot():
        now[0] += 0.003
        return object()

    def events():
        for done in range(0, 2000, 100):
            now[0] += 0.1
            yield PrefillProgress(done, 2000, 1000 * now[0])
    got = []
    relay(events(), snapshot, got.append, clock=clock)
    taken = [i for i, p in enumerate(got) if p.snapshot is not None]
    assert len(got) == 20 and len(taken) >= 8, taken
    assert all(b - a >= 2 for a, b in zip(taken, taken[1:]))       # never two chunks in a row
