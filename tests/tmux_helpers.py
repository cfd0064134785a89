"""tmux for the real-terminal tests: one command on a private socket."""
from __future__ import annotations

import os
import subprocess
import time


def tmux_run(socket: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """One tmux command on a private socket. A failure raises with tmux's own message.

    new-session is tried a second time after a short pause: a fresh server that fails to start
    on a loaded 2-core machine (seen once in a full suite, exit 1) is not what a test checks."""
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    for attempt in (1, 2):
        out = subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, env=env)
        if out.returncode == 0 or not check or "new-session" not in args or attempt == 2:
            break
        time.sleep(1.0)
    if check and out.returncode != 0:
        raise AssertionError(f"tmux {' '.join(args[:6])} exited {out.returncode}: "
                             f"{(out.stderr or out.stdout).strip() or 'no message'}")
    return out
