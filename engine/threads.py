"""How many threads a CPU decode step uses: what this process can get, not a fixed count.

A decode step is about 150 short parallel regions (the C kernels and torch's ops share one
OpenMP pool: torch's libgomp, which the C library links to by soname). With a fixed count
of 2 on 2 cores and one other busy process, each region waits at its barrier for a thread
the scheduler has parked behind the other process, a time slice at a time: 2-30x slower
per token where a fair share of the cores is 2x (issue 25; tests/test_threads.py and
`kvchat bench --busy N` measure it). So the count is chosen, about twice a second, from
- the CPUs this process may run on (os.sched_getaffinity; a container's cpuset, taskset),
  capped by torch's thread count at first use (OMP_NUM_THREADS, --threads);
- less what other processes kept busy on those CPUs over the last interval (/proc/stat's
  busy time of those CPUs minus this process's own CPU time, os.times()).
Only the C kernels follow the count (a decode step's weight and cache reads); torch's own
ops keep torch's count: MKL's GEMM blocks by its thread count, so a prefill's bits would
otherwise change with the load (the C kernels' bits do not: gemv sums each output in one
order, decode splits by the cap). KVCHAT_THREADS=N fixes the count for both (benchmarks
comparing two builds). Where /proc/stat is missing (macOS), the cap serves.

Idle pool threads spin about 0.1 ms, then sleep (OMP_WAIT_POLICY=PASSIVE with
GOMP_SPINCOUNT=10000, set by kvchat/__init__.py before torch loads libgomp):
- threads spinning without end took the cores the busy process and our own main thread
  needed (a step went from about 190 ms to 740 ms median on a loaded 2-core machine);
- threads sleeping at once (the spin count 0 that PASSIVE alone gives) paid a futex wake-up
  at each of the step's regions: on an idle 2-core Xeon the bundled model's step at 1,024
  tokens took 35.4 ms against 23.8 with spinning, and 28.6 against 17.5 with bf16 weights.
  A spin of 10,000 got 24.1 (1,000: 26.0). Beside one busy process the step is the same
  either way (46.0 against 46.3 ms: the count is 1, no region wakes a thread); beside two,
  65-72 ms against 53-54 in `kvchat bench --busy 2`'s rounds, though a plain decode loop
  beside two busy processes showed no difference within its noise (54-88 ms either way).
"""
from __future__ import annotations

import os
import time

import torch

INTERVAL = 0.5        # seconds between looks at the load
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cpus: set[str]) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over the named CPUs ("cpu0", ...), or None."""
    try:
        with open("/proc/stat") as f:
            busy = total = 0
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                parts = line.split()
                if parts[0] not in cpus:
                    continue
                v = [int(x) for x in parts[1:9]]          # user nice system idle iowait irq softirq steal
                total += sum(v)
                busy += sum(v) - v[3] - v[4]
            return (busy, total) if total else None
    except (OSError, ValueError):
        return None


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * _TICK


def cpus() -> set[str]:
    """This process's CPUs as /proc/stat names them ("cpu0", ...)."""
    return {f"cpu{c}" for c in _affinity()}


def sample(names: set[str] | None = None) -> tuple[int, int, float] | None:
    """(busy, total) clock ticks of this process's CPUs and its own CPU ticks, now; None
    without /proc/stat. Two samples give `free_cpus` (kvchat/host_load.py shows the others'
    share over a turn)."""
    ticks = _busy_ticks(names if names is not None else cpus())
    return None if ticks is None else (*ticks, _own_ticks())


def free_cpus(before: tuple[int, int, float], after: tuple[int, int, float], ncpu: int) -> float:
    """CPUs left to this process between two samples (busy, total, own ticks): ncpu less the
    cores other processes kept busy. Own time can exceed what /proc/stat charged the CPUs by
    a tick of rounding; the result stays within [0, ncpu]."""
    busy, total, own = (a - b for a, b in zip(after, before))
    if total <= 0:
        return float(ncpu)
    others = max(0.0, busy - own) / (total / ncpu)
    return min(float(ncpu), max(0.0, ncpu - others))


class Threads:
    """The thread count for the next kernel call; see the module docstring."""

    def __init__(self) -> None:
        fixed = os.environ.get("KVCHAT_THREADS")
        self.fixed = int(fixed) if fixed and fixed.isdigit() and int(fixed) > 0 else None
        self.cap: int | None = None
        self.n = 0
        self._cpus: set[str] = set()
        self._sample: tuple[int, int, float] | None = None
        self._next = 0.0
        self.free: int | None = None   # CPUs others left free over the last interval

    def count(self) -> int:
        if self.fixed:
            if self.cap is None:
                self.cap = self.fixed
                torch.set_num_threads(self.fixed)
            return self.fixed
        if not self._cpus:
            self._cpus = cpus()
        self.cap = max(1, min(len(self._cpus), torch.get_num_threads()))   # --threads, OMP_NUM_THREADS
        now = time.monotonic()
        if now >= self._next:
            self._next = now + INTERVAL
            now_sample = sample(self._cpus)
            if now_sample is not None:
                if self._sample is not None:
                    self.free = round(free_cpus(self._sample, now_sample, len(self._cpus)))
                self._sample = now_sample
        self.n = max(1, min(self.cap, self.free if self.free is not None else self.cap))
        return self.n

    def describe(self) -> str:
        self.count()
        if self.fixed:
            return f"{self.fixed} (KVCHAT_THREADS)"
        return f"{self.n} of up to {self.cap}, chosen from the load"


_threads = Threads()


def count() -> int:
    """Threads for the next parallel call: at most the cap, at least 1, fewer while other
    processes keep this process's CPUs busy."""
    return _threads.count()


def most() -> int:
    """The cap: the most threads count() gives (work split by it keeps its bits under any load)."""
    _threads.count()
    return _threads.fixed or _threads.cap or 1


def describe() -> str:
    return _threads.describe()
