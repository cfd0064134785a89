"""Fixtures for the app tests: a private data and config dir per test, an app factory on
the scripted FakeBackend, `running_app` (an app loaded and ready, with its Pilot), and
`wait_until`, which polls instead of sleeping."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvchat.engine.sampler import SamplingParams
from kvchat.app.shell import AppOptions, KvChatApp
from kvchat.chat.session import ChatOptions
from kvchat.store.settings import Settings

from .fake_backend import FakeBackend, FakeConfig

SIZE = (140, 60)     # the stacked layout (kvchat/widgets/layout.py): every panel shown, 62 columns wide


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run `async def` tests in a fresh event loop (no async plugin is a dependency)."""
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        asyncio.run(pyfuncitem.obj(**{n: pyfuncitem.funcargs[n] for n in names}))
        return True
    return None


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """Conversations and settings go to the test's tmp dir, never the user's."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def wait_until(pilot, condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Let the app run until condition() holds; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        await pilot.pause(0.02)


def make_app(backend: FakeBackend | None = None, *, cap: int | None = None, policy: str = "stop",
             system: str | None = None, max_tokens: int = 64, settings: Settings | None = None,
             restored=None, factory: Callable | None = None, settings_path: Path | None = None,
             reopen: list[Path] | None = None) -> KvChatApp:
    backend = backend or FakeBackend()
    options = AppOptions(model="fake-smollm2", sampling=SamplingParams(max_tokens=max_tokens),
                         chat=ChatOptions(system=system, cap=cap, policy=policy), restored=restored,
                         reopen=reopen or [])
    return KvChatApp(factory or (lambda: backend), options, settings or Settings(), settings_path)


def held_load(backend: FakeBackend) -> tuple[threading.Event, Callable[[], FakeBackend]]:
    """A backend factory whose load waits until the event is set (at most 30 s), so what a
    test types meanwhile waits for the model."""
    loaded = threading.Event()

    def factory() -> FakeBackend:
        loaded.wait(30)
        return backend
    return loaded, factory


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def slow_fake() -> FakeBackend:
    """Replies slowly enough to be stopped mid-way."""
    return FakeBackend(FakeConfig(token_delay_s=0.05, replies=(" ".join(f"w{i}" for i in range(200)),)))


@pytest.fixture
def running_app(fake):
    """`async with running_app() as (app, pilot):` an app on `fake` (or on the backend and
    options given), at the test screen size (or `size`), loaded and ready."""
    @contextlib.asynccontextmanager
    async def run(backend: FakeBackend | None = None, size: tuple[int, int] = SIZE, **options):
        app = make_app(backend or fake, **options)
        async with app.run_test(size=size) as pilot:
            await ready(pilot)
            yield app, pilot
    return run


def screen_text(app) -> str:
    """What the screen shows, as plain text (via the compositor: Textual has no public
    text export)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def ready(pilot) -> None:
    screen = pilot.app.chat_screen
    await wait_until(pilot, lambda: screen.conversations.session is not None and screen.jobs.busy is None
                     and screen.conversations.session.snapshot is not None, what="the backend to load")


async def send(pilot, text: str, timeout: float = 60.0) -> None:
    """Type text and Enter, then wait for the reply to finish."""
    app, screen = pilot.app, pilot.app.chat_screen
    n = len(screen.session.turns) if screen.conversations.session else 0
    app.query_one("#input").load_text(text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: screen.conversations.session is not None and len(screen.session.turns) > n
                     and screen.jobs.busy is None, timeout=timeout, what=f"the reply to {text!r}")


PREFILL_LINE = re.compile(r"prefilling [█░]+ ([\d,]+) / ([\d,]+) tokens · .* tok/s · ETA")


def record_status(app) -> list[str]:
    """Every state the status line is given from now on, in order (the screen shows only
    the last)."""
    seen: list[str] = []
    shown = app.chat_screen.panels.status

    def status(text: str) -> None:
        seen.append(text)
        shown(text)
    app.chat_screen.panels.status = status
    return seen


def prefill_steps(seen: list[str]) -> list[tuple[int, int]]:
    """(done, total) of each prefill progress line among the states seen."""
    out = []
    for line in seen:
        m = PREFILL_LINE.search(line)
        if m:
            out.append((int(m[1].replace(",", "")), int(m[2].replace(",", ""))))
    return out
