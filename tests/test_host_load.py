"""The host's load beside the latency fit (issue 25): what other processes took of the cores
while a turn ran, from the kernel's counters less this process's own CPU time."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvchat import host_load
from kvchat.engine import threads
from kvchat.host_load import HostLoad, HostSampler

pytestmark = pytest.mark.skipif(threads.sample() is None, reason="no /proc/stat (not Linux)")


def test_the_share_is_the_cpus_busy_time_less_this_processs_own(monkeypatch):
    """Crafted counters (the real machine's load cannot be set): over 1 s on 2 CPUs, 150 of
    200 ticks busy is 1.5 cores, of which this process used 50 ticks (0.5 core): the others
    used 1.0 core."""
    samples = iter([(1500, 4600, 300.0), (1650, 4800, 350.0)])     # (busy, total, own) ticks
    monkeypatch.setattr(threads, "sample", lambda names=None: next(samples))
    monkeypatch.setattr(threads, "cpus", lambda: {"cpu0", "cpu1"})
    clock = iter([100.0, 101.0])
    monkeypatch.setattr(host_load.time, "monotonic", lambda: next(clock))
    sampler = HostSampler()
    sampler.start()
    load = sampler.stop()
    assert load == HostLoad(others=pytest.approx(1.0), cores=2, exact=True)
    assert load.noticeable and "1.0 of 2 cores during the last turn" in load.line()
    assert "not from the cache" in load.line()


def test_a_busy_process_beside_this_one_is_counted_and_this_ones_own_work_is_not():
    sampler = HostSampler()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        sampler.start()
        time.sleep(1.5)
        load = sampler.stop()
    finally:
        busy.kill()
        busy.wait()
    assert load is not None and load.exact and load.cores >= 1
    assert load.others >= 0.6, load          # the busy child alone is about one core


def test_an_interval_never_started_or_too_short_says_nothing():
    sampler = HostSampler()
    assert sampler.stop() is None
    sampler.start()
    assert sampler.stop() is None             # well under 50 ms


def test_the_latency_panel_shows_the_last_turns_host_line_for_a_local_engine_not_a_server(tmp_path, monkeypatch):
    """In the app (fake backend, which runs in this process as the local engine does): after a
    turn the line is under the fits; for a vLLM server it is not (its cores are elsewhere)."""
    import asyncio

    from textual.widgets import Static

    from tests.app.conftest import make_app, ready, send

    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    # a quiet host's figure: on a loaded one the line is the warning, in a shorter form here
    monkeypatch.setattr(HostSampler, "stop", lambda self: HostLoad(others=0.1, cores=2, exact=True))

    async def run() -> tuple[str, str]:
        app = make_app()
        async with app.run_test(size=(140, 60)) as pilot:
            await ready(pilot)
            await send(pilot, "hello")
            await pilot.pause(0.2)
            fits = app.query_one("#latency-fits", Static)
            shown = str(fits.content)
            app.chat_screen.panels.latency.show_host = False      # what backend_ready sets for a server
            app.chat_screen.panels.latency.draw()
            await pilot.pause(0.1)
            return shown, str(fits.content)
    local, server = asyncio.run(run())
    assert "host: other processes used" in local and "during the last turn" in local
    assert "host: other processes used" not in server
