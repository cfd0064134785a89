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

from kvchat.keys import KEYS
from kvchat.store.log import restore
from tmux_helpers import tmux_run

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]
REPO = Path(__file__).resolve().parents[2]


class Tmux:
    """One tmux server on its own private socket, so the user's sessions are never touched and
    no test starts a session on a server the previous test is still shutting down."""
    made = 0

    def __init__(self, name: str) -> None:
        Tmux.made += 1
        self.socket, self.session = f"kvchat-test-{os.getpid()}-{Tmux.made}", name

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return tmux_run(self.socket, *args, check=check)

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
    # fp32: 512-token prompt chunks on CPU (bf16, auto's pick where the CPU computes bf16, takes
    # this model's prompt alone in chunks of 2,048: engine/sizing.py), so that the long /load
    # below moves its progress several times before escape stops it
    command = (f"cd {REPO} && env {env} {sys.executable} -m kvchat --dtype fp32 --max-tokens 24; "
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

        # a long /load: the status line's prefill progress moves (512-token chunks in fp32),
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

        # a message sent in the same instant as ctrl+q (one burst: ctrl+q reaches the App before
        # the input has handled Enter) is kept
        tmux.run("send-keys", "-t", tmux.session, "C-u")
        tmux.wait_for(lambda t: t.count(f"/load {long_file}") == 1, timeout=30, what="the input cleared")
        tmux.run("send-keys", "-t", tmux.session, "-l", "Sent as it quits.")
        tmux.run("send-keys", "-t", tmux.session, "Enter", "C-q")
        deadline = time.monotonic() + 30
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not tmux.alive(), "kvchat did not exit after ctrl+q"
        assert exit_file.read_text().strip() == "0"
        # kept: unanswered (back in the input on --resume), or sent, its reply cut by the quit
        kept = restore(log)
        users = [m["content"] for m in kept.messages if m["role"] == "user"] + [kept.unanswered]
        assert "Sent as it quits." in users[-2:], (kept.messages[-2:], kept.unanswered)
    finally:
        tmux.run("kill-server", check=False)


def tmux_key(key: str) -> str:
    """A Textual key name as tmux's send-keys spells it: ctrl+r -> C-r, alt+left -> M-Left, f7 -> F7."""
    mods, _, name = key.rpartition("+")
    name = name.upper() if name[0] == "f" and name[1:].isdigit() else name.capitalize() if len(name) > 1 else name
    prefix = "".join({"ctrl": "C-", "alt": "M-", "shift": "S-"}[m] for m in mods.split("+") if m)
    return prefix + name


DIALOGS = {"help", "choose_policy", "palette", "chat_browser"}   # keys that open a dialog; escape closes it


def test_every_default_key_reaches_the_app_in_tmux_with_its_prefix_on_ctrl_b(tmp_path):
    """tmux takes its prefix key (ctrl+b, its default) for itself: no default key may be it,
    nor any other key tmux, screen or a terminal emulator keeps (ctrl+pageup/pagedown)."""
    log, exit_file = tmp_path / "keys.log", tmp_path / "exit-status"
    log.touch()
    env = (f"KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'} PYTHONPATH={REPO}")
    command = (f"cd {tmp_path} && env {env} {sys.executable} {REPO / 'tests' / 'app' / 'keys_in_terminal.py'} "
               f"{log}; echo $? > {exit_file}")
    # send-keys writes to a pane directly, past tmux's own key table; so the keys go to an
    # outer tmux's pane, where an inner tmux client (prefix ctrl+b) reads them as typed
    inner = Tmux("keys")
    inner.socket += "-inner"
    inner.run("-f", "/dev/null", "new-session", "-d", "-s", inner.session, "-x", "140", "-y", "45", command)
    inner.run("set-option", "-g", "prefix", "C-b")
    inner.run("set-option", "-g", "escape-time", "50")
    assert "prefix C-b" in inner.run("show-options", "-g", "prefix").stdout
    tmux = Tmux("outer")
    tmux.run("-f", "/dev/null", "new-session", "-d", "-s", tmux.session, "-x", "140", "-y", "45",
             f"env -u TMUX tmux -L {inner.socket} attach -t {inner.session}")
    try:
        tmux.wait_for(lambda t: "F1 shows the keys" in t, timeout=60, what="loaded app")
        seen: list[str] = []

        def wait_log(line: str) -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                lines = log.read_text().splitlines()
                if lines[len(seen):].count(line):
                    seen[:] = lines
                    return
                time.sleep(0.1)
            raise AssertionError(f"{line!r} never reached the app; it got {log.read_text().split()}; "
                                 f"the pane shows:\n{tmux.pane()}")
        for k in [k for k in KEYS if k.id != "quit"]:
            tmux.run("send-keys", "-t", tmux.session, tmux_key(k.keys.split(",")[0]))
            wait_log(k.id)
            if k.id in DIALOGS:
                tmux.run("send-keys", "-t", tmux.session, "Escape")
                wait_log("closed")
        tmux.run("send-keys", "-t", tmux.session, "C-q")
        wait_log("quit")
        deadline = time.monotonic() + 30
        while inner.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exit_file.read_text().strip() == "0"
    finally:
        tmux.run("kill-server", check=False)
        inner.run("kill-server", check=False)
