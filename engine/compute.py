"""One thread in the process runs the engine's tensor work: every step and a pool rebuild.

torch's CPU ops and the C kernels share one OpenMP runtime (torch's libgomp), which keeps a
pool of worker threads for each thread that starts a parallel region. When the threads of
all those pools outnumber the CPUs, libgomp's idle workers stop spinning (from 10,000 spins,
GOMP_SPINCOUNT, to 100) and sleep, so each of a step's ~150 parallel regions waits for a
futex wake-up. A crowd's users run on threads of their own, a chat's turns on worker
threads, and `kvchat crowd` built its engine on the main thread: each of them that ran a
step kept a pool. Measured on a 2-core EPYC (bundled model, bf16, one user, 48 tokens): 15.7
ms a step when the main thread built the engine and ran the steps, 24.6 ms when a worker
thread ran them; two users on two threads 26.6 ms a step for both.

So the work goes to one long-lived thread, whatever thread asks for it: `run(fn)` hands fn
over and waits for its result (about 0.06 ms a hand-over against a step of 10-100 ms). A
thread that ran torch ops of its own keeps a pool all the same (the main thread after a
large tensor op: the next step 24-26 ms where it had taken 15.7-16.8), so the asking thread
first lets its own pool go (`release_pool`: OpenMP 5's omp_pause_resource_all, which frees
the calling thread's pool; nothing to do, and about a microsecond, when it has none). The
engine's lock stays with the thread that asked: readers queue for it and drive steps exactly
as before, and the step itself runs here. The thread is a daemon that waits idle between
calls; a caller interrupted while it waits (ctrl+c in the main thread) waits for the work
to end before the interrupt goes on, so the lock is never let go under a running step. (So a
model load stays on its caller, where ctrl+c stops it at once; the Engine lets that thread's
pool go after it.)
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_thread: threading.Thread | None = None
_jobs: queue.SimpleQueue = queue.SimpleQueue()


class _Job:
    __slots__ = ("fn", "done", "result", "error")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.done = fn, threading.Lock()   # held until the work ends (cheaper than an Event)
        self.done.acquire()
        self.result: object = None
        self.error: BaseException | None = None


def _serve() -> None:
    while True:
        job = _jobs.get()
        try:
            job.result = job.fn()
        except BaseException as err:  # noqa: BLE001  (handed to the caller, which raises it)
            job.error = err
        finally:
            job.done.release()
            job = None    # drop the reference to the result before waiting for the next job


def _started() -> threading.Thread:
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="kvchat-compute", daemon=True)
            _thread.start()
        return _thread


def _find_pause() -> Callable[[int], int] | None:
    """torch's libgomp (pip's torch on Linux), its pause call, or None. Only libgomp: its pause
    frees the calling thread's pool and nothing else, which is what was measured; LLVM's and
    Intel's runtimes keep one pool for the process and pause all of it."""
    try:
        import torch  # noqa: F401  (loads the runtime)
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    for path in sorted(paths, key=lambda p: "torch" not in p):      # torch's own copy first
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


_pause: Callable[[int], int] | None = None
_looked = False


def release_pool() -> None:
    """Let go of this thread's OpenMP pool, if it has one (a soft pause: the runtime makes a
    new one if this thread runs a parallel region again)."""
    global _pause, _looked
    if not _looked:
        _pause, _looked = _find_pause(), True
    if _pause is not None:
        _pause(1)          # omp_pause_soft


def on_compute_thread() -> bool:
    return threading.current_thread() is _thread


def run(fn: Callable[[], T]) -> T:
    """fn() on the compute thread (at once when called from it); its result, or its error."""
    if on_compute_thread():
        return fn()
    release_pool()
    _started()
    job = _Job(fn)
    _jobs.put(job)
    try:
        job.done.acquire()
    except BaseException:
        while not job.done.acquire(timeout=0.1):   # the work holds what the caller's lock guards: let it end
            pass
        raise
    if job.error is not None:
        raise job.error
    return job.result  # type: ignore[return-value]


def _after_fork() -> None:
    # a forked child has none of the parent's threads: it starts its own on its first call
    global _thread, _lock, _jobs
    _thread, _lock, _jobs = None, threading.Lock(), queue.SimpleQueue()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
