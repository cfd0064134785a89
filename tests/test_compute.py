"""engine/compute.py: the engine's tensor work runs on one thread of the process, whichever
thread drives it, so only that thread keeps an OpenMP pool (with one pool per driving thread,
libgomp's workers slept between a step's regions: a step 1.6x slower)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvchat.engine import compute
from kvchat.engine.sampler import SamplingParams


def test_work_from_several_threads_runs_on_the_one_compute_thread_and_returns_its_result():
    seen, results = [], {}

    def ask(i: int) -> None:
        results[i] = compute.run(lambda: (seen.append(threading.current_thread().name), i * i)[1])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    ask(7)                                     # and from this thread
    assert results == {i: i * i for i in (0, 1, 2, 3, 4, 7)}
    assert set(seen) == {"kvchat-compute"} and len(seen) == 6


def test_an_error_in_the_work_reaches_the_caller_and_the_thread_serves_on():
    def fail() -> None:
        raise ValueError("bad shape 3")

    with pytest.raises(ValueError, match="bad shape 3"):
        compute.run(fail)
    assert compute.run(lambda: 41 + 1) == 42


def test_work_that_asks_for_more_work_runs_it_at_once_instead_of_waiting_on_itself():
    assert compute.run(lambda: compute.run(lambda: threading.current_thread().name)) == "kvchat-compute"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only")
def test_an_interrupt_while_waiting_lets_the_work_end_before_it_goes_on():
    """The caller holds the engine's lock for the step: it must not let it go under a running step."""
    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    ended = []

    def work() -> None:
        time.sleep(0.4)
        ended.append(time.monotonic())

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        main = threading.main_thread().ident
        threading.Timer(0.1, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            compute.run(work)
        raised = time.monotonic()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert ended and ended[0] <= raised and raised - t0 >= 0.35


def test_the_steps_of_conversations_on_several_threads_all_run_on_the_compute_thread(engine, monkeypatch):
    ran_on, drivers = [], set()
    real = engine.runner.run

    def recording(plan):
        ran_on.append(threading.current_thread().name)
        return real(plan)

    monkeypatch.setattr(engine.runner, "run", recording)
    convs = [engine.new_conversation() for _ in range(3)]

    def talk(conv) -> None:
        drivers.add(threading.current_thread().name)
        replies = [e for e in conv.send("Name a colour.", SamplingParams(temperature=0.0, max_tokens=6))]
        assert replies

    try:
        threads = [threading.Thread(target=talk, args=(c,), name=f"user-{i}") for i, c in enumerate(convs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        for c in convs:
            engine.close_conversation(c)
    assert drivers == {"user-0", "user-1", "user-2"}
    assert len(ran_on) >= 6 and set(ran_on) == {"kvchat-compute"}


POOLS = textwrap.dedent("""
    import os, threading, time
    os.environ["KVCHAT_THREADS"] = "2"
    import torch
    torch.set_num_threads(2)
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.sampler import SamplingParams
    eng = Engine(EngineConfig(dtype="fp32", kv_budget="32MiB"))
    convs = [eng.new_conversation() for _ in range(3)]
    for c in convs:                              # the tokenizer's own threads start here, not below
        eng.tokenizer.encode("warm up")
    for _ in convs[0].send("Hi.", SamplingParams(temperature=0.0, max_tokens=2)):
        pass                                     # and the compute thread with its pool
    def tasks():
        return len(os.listdir("/proc/self/task"))
    base, most, stop = tasks(), [0], threading.Event()
    def talk(c):
        for _ in c.send("Count to twenty.", SamplingParams(temperature=0.0, max_tokens=24)):
            pass
    users = [threading.Thread(target=talk, args=(c,)) for c in convs]
    for u in users:
        u.start()
    while any(u.is_alive() for u in users):
        most[0] = max(most[0], tasks())
        time.sleep(0.002)
    print(base, most[0])
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux's /proc and 2 CPUs for a pool of 2 threads")
def test_three_users_add_their_own_threads_and_no_openmp_pool_of_their_own():
    """Counted in a process of its own, with 2 threads for torch and the kernels: the users'
    three threads, and no worker threads started for them (each driving thread that ran a
    step used to start its own pool: 3 more)."""
    out = subprocess.run([sys.executable, "-c", POOLS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    base, most = map(int, out.stdout.split()[-2:])
    assert most - base <= 3, f"{most - base} threads came with 3 users (base {base})"


RELEASE = textwrap.dedent("""
    import os, time, torch
    torch.set_num_threads(2)
    from kvchat.engine import compute
    def tasks():
        return len(os.listdir("/proc/self/task"))
    def settled(want):
        deadline = time.monotonic() + 5
        while tasks() != want and time.monotonic() < deadline:
            time.sleep(0.01)
        return tasks()
    compute.run(lambda: torch.randn(4_000_000).exp_())     # the compute thread and its pool
    before = tasks()
    torch.randn(4_000_000).exp_()                           # this thread's own pool: a worker more
    mine = tasks()
    compute.run(lambda: None)                               # asking lets it go
    print(before, mine, settled(before))
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_a_thread_asking_for_work_first_lets_its_own_openmp_pool_go():
    """The main thread after a large tensor op of its own kept a pool, and the compute thread's
    steps then ran as slowly as with a pool per driving thread (24-26 ms against 15.7-16.8)."""
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, mine, after = map(int, out.stdout.split()[-3:])
    assert mine == before + 1, (before, mine)
    assert after == before, f"{after - before} thread(s) of this thread's pool still there"
