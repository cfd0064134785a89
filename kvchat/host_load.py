"""What other processes took of this process's cores while a turn ran, so a user does not read
contention as cache growth (issue 25): a decode step on 2 cores that shares them with one busy
process takes about twice as long, a jump the latency fit would otherwise blame on the context.

The figure is the engine's own measure of the load (engine/threads.py, which picks the C
kernels' thread count from it): the busy time of this process's CPUs in /proc/stat, less the
CPU time this process used itself (every thread of it: the local engine decodes here), over
the turn. Without /proc/stat (macOS) the 1-minute load average stands in, less the cores this
process kept busy: rougher, a run queue rather than a share.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvchat.engine import threads

NOTICEABLE = 0.25                    # cores taken by others that make the line a warning


@dataclass(frozen=True, slots=True)
class HostLoad:
    others: float          # cores' worth of CPU that other processes used, on average
    cores: int
    exact: bool            # from /proc/stat over the interval; False: from the load average

    @property
    def noticeable(self) -> bool:
        return self.others >= NOTICEABLE

    def line(self) -> str:
        return self.lines()[0]

    def lines(self) -> tuple[str, ...]:
        """The line's forms, longest first (a narrow panel takes a shorter one)."""
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        share = f"{self.others:.1f} of {cores}"
        how = "during the last turn" if self.exact else "(1-minute load average)"
        if not self.noticeable:
            return (f"host: other processes used {share} {how}", f"host: others used {share}",
                    f"others: {share}")
        return (f"host: other processes used {share} {how}: steps slow down from sharing the cores, "
                "not from the cache",
                f"host: others used {share}: slower from sharing, not the cache",
                f"host: others used {share}: not the cache",
                f"host busy: {share}")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class HostSampler:
    """`start()` when a turn starts, `stop()` when it ends: the others' share in between."""

    def __init__(self) -> None:
        self._start: tuple[float, float, tuple[int, int, float] | None] | None = None

    def start(self) -> None:
        self._start = (time.monotonic(), _own_cpu_s(), threads.sample())

    def stop(self) -> HostLoad | None:
        """None when not started, or over an interval too short to say anything."""
        if self._start is None:
            return None
        t0, own0, before = self._start
        self._start = None
        wall = time.monotonic() - t0
        if wall < 0.05:
            return None
        n = len(threads.cpus())
        after = threads.sample()
        if before is not None and after is not None and after[1] > before[1]:
            return HostLoad(n - threads.free_cpus(before, after, n), n, exact=True)
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
        return HostLoad(max(0.0, min(float(n), load - (_own_cpu_s() - own0) / wall)), n, exact=False)
