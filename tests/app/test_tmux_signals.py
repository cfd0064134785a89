"""A signal mid-reply (issue 27 high 8, issue 26's SIGHUP/SIGTERM item): kvchat in tmux on the
bundled model gets SIGINT, SIGTERM or SIGHUP while a reply streams, or its terminal closes.
It must end within seconds with the shell's status for the signal, the reply streamed so far
saved in the conversation's log as ctrl+q saves it (the assistant message and a turn record
stopped "cancelled"), and the terminal back out of the alternate screen and mouse mode.

Before the fix: SIGINT left kvchat running (the turn's thread kept replying) with nothing
saved; SIGTERM and SIGHUP killed it at once, the partial reply lost and the terminal left in
the alternate screen with mouse reporting on."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from .test_tmux import REPO, Tmux

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]
PROMPT = "Write a very long story about a dragon who learns to bake bread."
EXIT_WITHIN_S = 15        # the app's own bound is 3 s for the stop and 2 s to restore the terminal


def start(tmp_path: Path, name: str) -> tuple[Tmux, Path, Path]:
    """kvchat in a tmux pane, its pid and exit status written to files; a reply streaming."""
    pid_file, exit_file = tmp_path / "pid", tmp_path / "exit-status"
    env = (f"PYTHONPATH={REPO} KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'}")
    command = (f"cd {tmp_path} && sh -c 'echo $$ > {pid_file}; exec env {env} {sys.executable} -m kvchat "
               f"--max-tokens 400'; echo $? > {exit_file}; sleep 60")
    tmux = Tmux(name)
    tmux.run("new-session", "-d", "-s", tmux.session, "-x", "140", "-y", "45", command)
    tmux.wait_for(lambda t: "F1 shows the keys" in t, timeout=240, what="loaded model")
    tmux.run("send-keys", "-t", tmux.session, "-l", PROMPT)
    tmux.run("send-keys", "-t", tmux.session, "Enter")
    tmux.wait_for(lambda t: re.search(r"replying · ([3-9]|\d\d+) tokens", t), timeout=240, what="a reply streaming")
    return tmux, pid_file, exit_file


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_gone(pid: int, what: str) -> float:
    t0 = time.monotonic()
    while not gone(pid):
        if time.monotonic() - t0 > EXIT_WITHIN_S:
            raise AssertionError(f"kvchat (pid {pid}) still runs {EXIT_WITHIN_S} s after {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


def assert_partial_reply_saved(data: Path) -> None:
    log = next((data / "conversations").glob("*.jsonl"))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    messages = [r for r in records if r["type"] == "message"]
    turns = [r for r in records if r["type"] == "turn"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[0]["content"] == PROMPT
    assert len(turns) == 1 and turns[0]["stop_reason"] == "cancelled", turns
    assert messages[1]["content"] == turns[0]["reply"] and len(turns[0]["decode_ms"]) >= 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_mid_reply_saves_the_partial_reply_and_restores_the_terminal(tmp_path, sig):
    tmux, pid_file, exit_file = start(tmp_path, f"signal-{sig.name}")
    try:
        pid = int(pid_file.read_text())
        os.kill(pid, sig)
        wait_gone(pid, sig.name)
        tmux.wait_for(lambda _: exit_file.exists(), timeout=5, what="the exit status")
        assert exit_file.read_text().strip() == str(128 + sig)
        modes = tmux.run("display", "-p", "-t", tmux.session,
                         "#{alternate_on} #{mouse_any_flag} #{mouse_button_flag} #{mouse_sgr_flag} "
                         "#{mouse_standard_flag}").stdout.split()
        assert modes == ["0"] * 5, f"alternate screen, then mouse modes any/button/sgr/standard: {modes}"
        assert_partial_reply_saved(tmp_path / "data")
    finally:
        tmux.run("kill-server", check=False)


def test_the_terminal_closing_mid_reply_saves_the_partial_reply_and_ends_kvchat(tmp_path):
    """A real hangup: the pane's terminal goes away (SIGHUP, and every write to it fails)."""
    tmux, pid_file, _ = start(tmp_path, "hangup")
    pid = int(pid_file.read_text())
    try:
        tmux.run("kill-server")
        wait_gone(pid, "its terminal closed")
        assert_partial_reply_saved(tmp_path / "data")
    finally:
        tmux.run("kill-server", check=False)
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
