"""What other processes took of this machine's cores while a turn ran, so a user does not read
contention as cache growth (issue 25): a decode step on 2 cores that shares them with one busy
process takes about twice as long, a jump the latency fit would otherwise blame on the context.

On Linux the figure is exact over the turn: the CPU time every process used (/proc/stat's busy
jiffies) less the time this process used (os.times, every thread of it: the local engine's
decode runs here), over the wall time, in cores. Elsewhere the 1-minute load average stands in,
less the cores this process kept busy, which is rougher (a run queue, not a share).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)     # user nice system irq softirq steal (idle 3, iowait 4 are not busy)
NOTICEABLE = 0.25                    # cores taken by others that make the line a warning


def cores() -> int:
    """The cores this process may run on (its affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True, slots=True)
class HostLoad:
    others: float          # cores' worth of CPU that other processes used, on average
    cores: int
    exact: bool            # from /proc/stat over the interval; False: from the load average

    @property
    def noticeable(self) -> bool:
        return self.others >= NOTICEABLE

    def line(self) -> str:
        share = f"{self.others:.1f} of {self.cores} core{'s' if self.cores != 1 else ''}"
        how = "during the last turn" if self.exact else "(1-minute load average)"
        if not self.noticeable:
            return f"host: other processes used {share} {how}"
        return (f"host: other processes used {share} {how}: steps slow down from sharing the cores, "
                "not from the cache")


def _busy_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of every CPU since boot, or None without /proc/stat."""
    try:
        with open(PROC_STAT, encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    try:
        values = [int(v) for v in fields[1:9]]
    except ValueError:
        return None
    return sum(values[i] for i in BUSY_FIELDS), sum(values)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class HostSampler:
    """`start()` when a turn starts, `stop()` when it ends: the others' share in between."""

    def __init__(self) -> None:
        self._start: tuple[float, float, tuple[int, int] | None] | None = None

    def start(self) -> None:
        self._start = (time.monotonic(), _own_cpu_s(), _busy_jiffies())

    def stop(self) -> HostLoad | None:
        """None when not started, or over an interval too short to say anything."""
        if self._start is None:
            return None
        t0, own0, jiffies0 = self._start
        self._start = None
        wall, own = time.monotonic() - t0, _own_cpu_s() - own0
        n = cores()
        if wall < 0.05:
            return None
        jiffies1 = _busy_jiffies()
        if jiffies0 is not None and jiffies1 is not None and jiffies1[1] > jiffies0[1]:
            busy, total = jiffies1[0] - jiffies0[0], jiffies1[1] - jiffies0[1]
            all_cores = busy / total * (os.cpu_count() or n)
            return HostLoad(max(0.0, min(float(n), all_cores - own / wall)), n, exact=True)
        try:
            load = os.getloadavg()[0]
        except OSError:
            return None
        return HostLoad(max(0.0, min(float(n), load - own / wall)), n, exact=False)
