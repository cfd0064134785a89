"""engine/threads.py: the thread count follows what the process can get.

Real processes and the real /proc/stat: spinning processes pinned to this process's CPUs
must bring the count down to 1 (a fixed count of 2 on 2 cores beside one busy process made
decode 2-30x slower, issue 25), and the arithmetic of the free CPUs is checked on figures
worked by hand. No timing is asserted."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from kvchat.engine import threads

LINUX = os.path.exists("/proc/stat") and hasattr(os, "sched_getaffinity")


def test_free_cpus_is_ncpu_less_what_others_kept_busy():
    # 2 CPUs, 100 ticks each: 150 busy, 40 of them ours -> others 110 ticks = 1.1 CPUs -> 0.9 free
    assert threads.free_cpus((0, 0, 0.0), (150, 200, 40.0), 2) == pytest.approx(0.9)
    # all busy ticks ours: both free; own time a tick above the charged busy time: still both
    assert threads.free_cpus((10, 100, 5.0), (110, 300, 105.0), 2) == pytest.approx(2.0)
    assert threads.free_cpus((0, 0, 0.0), (50, 200, 51.0), 2) == pytest.approx(2.0)
    # others busier than the CPUs (rounding): never below 0
    assert threads.free_cpus((0, 0, 0.0), (200, 200, 0.0), 2) == 0.0
    # no time passed: everything free
    assert threads.free_cpus((5, 5, 0.0), (5, 5, 0.0), 4) == 4.0


@pytest.mark.skipif(not LINUX, reason="needs /proc/stat and sched_getaffinity")
def test_busy_processes_on_every_cpu_bring_the_count_to_one(monkeypatch):
    monkeypatch.setattr(threads, "INTERVAL", 0.3)
    saved = torch.get_num_threads()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: the count is 1 anyway")
    t = threads.Threads()
    t.fixed = None
    torch.set_num_threads(len(cpus))

    spin = [subprocess.Popen(["taskset", "-c", str(c), sys.executable, "-c", "while True: pass"])
            for c in cpus]  # one per CPU: others keep every CPU busy
    try:
        seen = []
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            seen.append(t.count())
            if seen[-1] == 1 and len(seen) > 3:
                break
            time.sleep(0.1)
        assert t.cap == len(cpus)
        assert seen[-1] == 1, f"counts seen beside {len(cpus)} busy processes: {seen}"
        assert torch.get_num_threads() == len(cpus)    # torch's own count stays: its GEMM's bits with it
    finally:
        for p in spin:
            p.kill()
            p.wait()
        torch.set_num_threads(saved)


def test_a_count_set_by_the_user_is_the_cap(monkeypatch):
    saved = torch.get_num_threads()
    t = threads.Threads()
    t.fixed = None
    try:
        torch.set_num_threads(1)
        for _ in range(3):
            assert t.count() == 1
        assert t.cap == 1
    finally:
        torch.set_num_threads(saved)


def test_kvchat_threads_fixes_the_count(monkeypatch):
    saved = torch.get_num_threads()
    monkeypatch.setenv("KVCHAT_THREADS", "1")
    try:
        t = threads.Threads()
        assert t.count() == 1 and "KVCHAT_THREADS" in t.describe()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(saved)


def test_idle_pool_threads_spin_briefly_then_sleep_unless_the_user_says_otherwise():
    """Set before torch loads libgomp (which reads them once): kvchat/__init__.py."""
    code = ("import os, sys, kvchat; assert 'torch' not in sys.modules; "
            "print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def policy(**extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True)
        return out.stdout.strip()

    assert policy() == "PASSIVE 10000"
    assert policy(OMP_WAIT_POLICY="active") == "active None"         # the user's policy, its own spin
    assert policy(GOMP_SPINCOUNT="0") == "PASSIVE 0"                  # the user's spin
