"""scripts/soak.py, briefly: several conversations in a pool too small for all of them, so
cached blocks are evicted and idle conversations preempted. Its bookkeeping checks run after
every turn and its leak check after all close; here the script itself is the thing tested
(it once went stale on a moved import with nothing to notice)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def figure(out: str, name: str) -> int:
    return int(re.search(rf"^{re.escape(name)}\s+(\d+)", out, re.M).group(1))


def test_a_short_soak_leaks_nothing_and_its_bookkeeping_adds_up_under_preemption():
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "soak.py"), "--conversations", "8", "--turns", "4",
                          "--pool-blocks", "40", "--max-tokens", "4", "--rounds", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert figure(out, "blocks leaked after all closed") == 0
    assert figure(out, "bookkeeping violations") == 0
    assert figure(out, "preemptions") > 0, "the pool must be too small for every conversation at once"
