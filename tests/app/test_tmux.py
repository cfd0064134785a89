"""kvchat in a real terminal: tmux runs it, the test types, reads the pane, and quits.

Waits poll `tmux capture-pane` with a deadline; nothing sleeps a fixed time.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]
REPO = Path(__file__).resolve().parents[2]


class Tmux:
    """One tmux server on a private socket, so the user's sessions are never touched."""

    def __init__(self, name: str) -> None:
        self.socket, self.session = f"kvchat-test-{os.getpid()}", name

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True,
                              check=check, env=env)

    def pane(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session, check=False).stdout

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.session, check=False).returncode == 0

    def wait_for(self, found, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.pane()
            if found(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout:.0f} s; the pane shows:\n{self.pane()}")


def test_chat_in_tmux_shows_the_reply_and_the_panels_and_quits_cleanly(tmp_path):
    exit_file = tmp_path / "exit-status"
    env = f"KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'}"
    command = (f"cd {REPO} && env {env} {sys.executable} -m kvchat --max-tokens 24; "
               f"echo $? > {exit_file}")
    tmux = Tmux("chat")
    tmux.run("new-session", "-d", "-s", tmux.session, "-x", "140", "-y", "45", command)
    try:
        tmux.wait_for(lambda t: "F1 shows the keys" in t, timeout=240, what="loaded model")
        tmux.run("send-keys", "-t", tmux.session, "-l", "Name three colours.")
        tmux.run("send-keys", "-t", tmux.session, "Enter")
        # the reply's stats line (the prefill status line also says tok/s)
        pane = tmux.wait_for(lambda t: re.search(r"TTFT [\d.,]+ m?s · [\d.,]+ tok/s", t), timeout=240,
                             what="finished reply")

        log = next((tmp_path / "data" / "conversations").glob("*.jsonl"))
        reply = next(json.loads(x) for x in log.read_text().splitlines() if '"type": "turn"' in x)["reply"]
        words = [w.strip(".,!?*:;") for w in reply.split()[:6]]
        assert sum(w in pane for w in words if w) >= 3, (reply, pane)
        for panel in ("KV cache", "used", "per token", "context cap", "blocks", "occupancy", "latency"):
            assert panel in pane

        # a long /load: the status line's prefill progress moves (512-token chunks on CPU),
        # then escape stops it between chunks and the command is back in the input
        long_file = Path(f"/tmp/kvchat-long-{os.getpid()}.txt")     # short: a long path wraps in the pane
        long_file.write_text("\n".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(200)))
        tmux.run("send-keys", "-t", tmux.session, "-l", f"/load {long_file}")
        tmux.run("send-keys", "-t", tmux.session, "Enter")
        seen: set[str] = set()

        def progress_moved(text: str) -> bool:
            m = re.search(r"prefilling [█░]+ ([\d,]+) / ([\d,]+) tokens", text)
            if m:
                seen.add(m[1])
            return len(seen) >= 3          # 0, then two chunks done
        tmux.wait_for(progress_moved, timeout=600, what="prefill progress moving")
        tmux.run("send-keys", "-t", tmux.session, "Escape")
        tmux.wait_for(lambda t: "prefill stopped at" in t, timeout=300, what="the prefill stopped")
        # the refused message in the transcript, and the command back in the input
        tmux.wait_for(lambda t: t.count(f"/load {long_file}") >= 2, timeout=30, what="the command in the input")
        long_file.unlink()

        tmux.run("send-keys", "-t", tmux.session, "C-q")
        deadline = time.monotonic() + 30
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tmux.alive(), "kvchat did not exit after ctrl+q"
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.run("kill-server", check=False)
