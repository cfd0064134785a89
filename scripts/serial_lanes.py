"""`make test`'s second part: the serial tests (tests/conftest.py: SERIAL) in two lanes.

The serial tests run after the others, without pytest-xdist, because they bound a wall-clock
wait or run processes of their own. Run one after another they took 390-420 s on 2 cores with
one core idle most of the time (165 s of CPU in the pytest process and its children; the
Textual tests run on one thread, the tmux and vLLM tests wait on their processes). So they go
in two lanes at once:

- the wall-clock lane (`serial and not processes`), its output live, at normal priority, so
  that its tight bounds (a key answered within a second, the help screen within 8 s) keep
  the machine first;
- the process lane (`serial and processes`: kvchat in tmux, the vLLM server), at a lower
  priority (nice 10), its output printed after the first lane's; its bounds are seconds to
  minutes (a model load within 240 s, an exit within 5-15 s).

On 2 cores the two lanes took 200 s and 245 s side by side, against 420 s in a row. With one
core they run in a row. The exit status is the first failing lane's.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

NO_TESTS = 5     # pytest's status when a selection is empty: not a failure here
NICE = 10


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest(marks: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-m", marks, *extra]


def lower_priority() -> None:
    os.nice(NICE)


def status(code: int) -> int:
    return 0 if code == NO_TESTS else code


def main(argv: list[str]) -> int:
    wall, processes = pytest("serial and not processes", *argv), pytest("serial and processes", *argv)
    if cores() < 2:
        first = status(subprocess.call(wall))
        return first or status(subprocess.call(processes, preexec_fn=lower_priority))
    with tempfile.TemporaryFile("w+") as log:
        # its own cache dir: two pytest sessions must not write one .pytest_cache at once
        lane = subprocess.Popen(processes + ["-p", "no:cacheprovider"], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lower_priority)
        try:
            first = status(subprocess.call(wall))
            second = status(lane.wait())
        except BaseException:
            lane.kill()
            lane.wait()
            raise
        log.seek(0)
        print("\n== the serial tests whose work runs in processes of their own (run beside the above)", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    return first or second


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
