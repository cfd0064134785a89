"""The path of a turn through kvchat's rooms, on the UI thread: each step of it (the turn
starting, each batch of its reply, its end) enters each module of kvchat from at most two
others. A path that goes in and out of the same room again and again is one whose steps have no single
owner (issue 20). The trace counts the real calls of a real turn on the scripted backend."""
from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path

import kvchat
from kvchat.chat.screen import ChatScreen

from .conftest import send
from .fake_backend import FakeBackend, FakeConfig

ROOT = Path(kvchat.__file__).parent
STEPS = ("_start_turn", "on_turn_progress", "on_turn_ended")


def module_of(frame) -> str:
    path = frame.f_code.co_filename
    return str(Path(path).relative_to(ROOT)) if path.startswith(str(ROOT)) else ""


def rooms(doors: set[tuple[str, str]]) -> Counter[str]:
    """How many rooms each module is entered from. A module the step only goes into and never
    out of (the words in text.py, the latency series) is vocabulary, not a room on the path."""
    through = {caller for caller, _ in doors}
    return Counter(callee for _, callee in doors if callee in through)


def traced(handler, into: list[tuple[str, Counter[str]]]):
    """`handler` wrapped: each call appends (its name, the rooms each module is entered from)
    to `into`. A door is a call from one kvchat module into another, counted once however often
    it is used: not a coroutine resumed after an
    await (the same frame again), not a method a widget inherits from its base class (the
    widget's own work), not the engine's code (below the app's seam), and only calls made on
    the handler's behalf (its frame below them: other tasks run while it awaits)."""
    async def step(self, *args):
        doors: set[tuple[str, str]] = set()
        seen: set[int] = set()
        kept: list = []                 # the frames seen, alive so that their ids stay theirs
        ui, top = threading.get_ident(), []

        def profile(frame, event, arg):
            if event != "call" or threading.get_ident() != ui or id(frame) in seen:
                return
            seen.add(id(frame))
            kept.append(frame)
            if not top:
                top.append(frame)       # the handler's own frame: the first call
                return
            back, under = frame.f_back, False
            caller = None
            while back is not None:
                if caller is None and module_of(back):
                    caller = back
                if back is top[0]:
                    under = True
                    break
                back = back.f_back
            callee = module_of(frame)
            if not under or caller is None or not callee or callee.startswith("engine/"):
                return
            if callee != module_of(caller) and frame.f_locals.get("self", frame) is not caller.f_locals.get("self"):
                doors.add((module_of(caller), callee))
        sys.setprofile(profile)
        try:
            await handler(self, *args)
        finally:
            sys.setprofile(None)
        into.append((handler.__name__, rooms(doors)))
    return step


async def test_each_step_of_a_turn_enters_each_module_from_at_most_two_others(running_app, monkeypatch):
    steps: list[tuple[str, Counter[str]]] = []
    for name in STEPS:
        monkeypatch.setattr(ChatScreen, name, traced(getattr(ChatScreen, name), steps))
    backend = FakeBackend(FakeConfig(token_delay_s=0.03, replies=(" ".join(f"w{i}" for i in range(20)),)))
    async with running_app(backend) as (app, pilot):
        await send(pilot, "hello kv cache")
    assert {name for name, _ in steps} == set(STEPS)
    assert sum(name == "on_turn_progress" for name, _ in steps) >= 3, "the reply came in fewer than 3 batches"
    # the modules each step draws through: the session, the transcript, the panels' widgets
    assert all(e for _, e in steps) and any("chat/panels.py" in e for _, e in steps)
    over = [(name, m, n) for name, e in steps for m, n in e.items() if n > 2]
    assert not over, f"steps of the turn that enter a module from more than two others: {over}"
