"""The crowd in a real terminal on the bundled model (160 x 48, the columns layout): /crowd 3
shows the crowd panel with its rows moving, the user's own message still gets its reply,
/crowd off takes the panel away, and ctrl+q with a crowd running exits at once with status 0."""
from __future__ import annotations

import re
import shutil
import sys
import time

import pytest

from .test_tmux import REPO, Tmux

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]


def test_a_crowd_starts_shows_its_rows_stops_and_quits_fast_in_tmux(tmp_path):
    exit_file = tmp_path / "exit-status"
    env = f"KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'} PYTHONPATH={REPO}"
    command = (f"cd {REPO} && env {env} {sys.executable} -m kvchat --kv-budget 32MiB --max-tokens 12; "
               f"echo $? > {exit_file}")
    tmux = Tmux("crowd")
    tmux.run("new-session", "-d", "-s", tmux.session, "-x", "160", "-y", "48", command)

    def type_line(text: str) -> None:
        tmux.run("send-keys", "-t", tmux.session, "-l", text)
        tmux.run("send-keys", "-t", tmux.session, "Enter")
    try:
        tmux.wait_for(lambda t: "F1 shows the keys" in t, timeout=240, what="loaded model")
        type_line("/crowd 3")
        tmux.wait_for(lambda t: "─ crowd ─" in t and "3 simulated users joined" in t, timeout=30, what="the crowd panel")
        # every user's row with a first token timed: the rows move
        tmux.wait_for(lambda t: all(re.search(rf"\bu{i} +\w+ +[\d,]+ +[\d.,]+ ", t) for i in (1, 2, 3)),
                      timeout=240, what="three users' rows with their TTFT")
        assert re.search(r"3 simulated · [\d.,]+ tok/s in all", tmux.pane())
        type_line("Name a colour.")
        tmux.wait_for(lambda t: re.search(r"TTFT [\d.,]+ m?s · [\d.,]+ tok/s", t), timeout=240,
                      what="the user's own reply beside the crowd")
        type_line("/crowd off")
        tmux.wait_for(lambda t: "the crowd left" in t and "─ crowd ─" not in t, timeout=30, what="the crowd gone")
        type_line("/crowd 2")
        tmux.wait_for(lambda t: "─ crowd ─" in t, timeout=30, what="a second crowd")
        t0 = time.monotonic()
        tmux.run("send-keys", "-t", tmux.session, "C-q")
        while tmux.alive() and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert not tmux.alive(), "kvchat did not exit after ctrl+q with a crowd running"
        assert time.monotonic() - t0 < 5, f"quitting took {time.monotonic() - t0:.1f} s (the process, torch's exit included)"
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.run("kill-server", check=False)
