"""Fixtures for the app tests: a private data and config dir per test, an app factory on
the scripted FakeEngine, and `wait_until`, which polls instead of sleeping."""
from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

import pytest

from kvchat.engine.sampler import SamplingParams
from kvchat.app import AppOptions, KvChatApp
from kvchat.session import SessionOptions
from kvchat.settings import Settings

from .fake_engine import FakeEngine, FakeEngineConfig

SIZE = (140, 45)


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


def make_app(engine: FakeEngine | None = None, *, cap: int | None = None, policy: str = "stop",
             system: str | None = None, max_tokens: int = 64, settings: Settings | None = None,
             restored=None, factory: Callable | None = None, tmp=None) -> KvChatApp:
    engine = engine or FakeEngine()
    options = AppOptions(model="fake-smollm2", sampling=SamplingParams(max_tokens=max_tokens),
                         session=SessionOptions(system=system, cap=cap, policy=policy), restored=restored)
    return KvChatApp(factory or (lambda: engine), options, settings or Settings())


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def slow_fake() -> FakeEngine:
    """Replies slowly enough to be stopped mid-way."""
    return FakeEngine(FakeEngineConfig(token_delay_s=0.05, replies=(" ".join(f"w{i}" for i in range(200)),)))


def screen_text(app) -> str:
    """What the screen shows, as plain text (via the compositor: Textual has no public
    text export)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def ready(pilot) -> None:
    await wait_until(pilot, lambda: pilot.app.session is not None and pilot.app.busy is None
                     and pilot.app.snapshot is not None, what="the engine to load")


async def send(pilot, text: str, timeout: float = 60.0) -> None:
    """Type text and Enter, then wait for the reply to finish."""
    app = pilot.app
    n = len(app.session.turns) if app.session else 0
    app.query_one("#input").load_text(text)
    await pilot.press("enter")
    await wait_until(pilot, lambda: app.session is not None and len(app.session.turns) > n and app.busy is None,
                     timeout=timeout, what=f"the reply to {text!r}")
