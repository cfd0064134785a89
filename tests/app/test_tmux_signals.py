"""A signal mid-reply (issue 27 high 8, issue 26's SIGHUP/SIGTERM item): kvchat in tmux on the
bundled model gets SIGINT, SIGTERM or SIGHUP while a reply streams, or its terminal closes.
It must end within seconds with the shell's status for the signal, the reply streamed so far
saved in the conversation's log as ctrl+q saves it (the assistant message and a turn record
stopped "cancelled"), and the terminal back out of the alternate screen and mouse mode.

Before the fix: SIGINT left kvchat running (the turn's thread kept replying) with nothing
saved; SIGTERM and SIGHUP killed it at once, the partial reply lost and the terminal left in
the alternate screen with mouse reporting on.

The event loop blocked: a terminal that closes under a parent that keeps SIGHUP to itself (make
waits for its children; here a shell's `trap : HUP`) sends kvchat no signal, and its loop soon
waits forever for Textual's writer thread, which ended on the dead terminal; a tmux server that
stops reading blocks the loop the same way with the terminal alive. Before the fix the signal
handlers ran on that loop: kvchat spun on the dead terminal forever, closed while loading or
just after, and SIGTERM did nothing; only SIGKILL ended it."""
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
LOADING = re.compile(r"loading .* … [\d.]+ s")


def kvchat_env(tmp_path: Path) -> str:
    return f"PYTHONPATH={REPO} KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'}"


def start(tmp_path: Path, name: str, max_tokens: int = 400) -> tuple[Tmux, Path, Path]:
    """kvchat in a tmux pane, its pid and exit status written to files; a reply streaming."""
    pid_file, exit_file = tmp_path / "pid", tmp_path / "exit-status"
    command = (f"cd {tmp_path} && sh -c 'echo $$ > {pid_file}; exec env {kvchat_env(tmp_path)} {sys.executable} "
               f"-m kvchat --max-tokens {max_tokens}'; echo $? > {exit_file}; sleep 60")
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


def exit_status(exit_file: Path) -> str:
    """What the pane's shell wrote once kvchat ended (within 5 s; tmux itself may be stopped
    or gone)."""
    deadline = time.monotonic() + 5
    while not exit_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return exit_file.read_text().strip()


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


@pytest.mark.parametrize("when", ["loading", "ready"])
def test_the_terminal_closing_at_startup_ends_kvchat_when_no_sighup_reaches_it(tmp_path, when):
    """The pane's shell (the session leader, the one process the closing terminal signals)
    traps SIGHUP and waits for kvchat, as make does: kvchat gets no signal, only a dead
    terminal, and must end by itself with the status for a hangup."""
    pid_file, exit_file = tmp_path / "pid", tmp_path / "exit-status"
    command = (f"trap : HUP; cd {tmp_path} && sh -c 'echo $$ > {pid_file}; exec env {kvchat_env(tmp_path)} "
               f"{sys.executable} -m kvchat'; echo $? > {exit_file}")
    tmux = Tmux(f"hangup-{when}")
    tmux.run("new-session", "-d", "-s", tmux.session, "-x", "160", "-y", "48", command)
    pid = None
    try:
        if when == "loading":
            tmux.wait_for(lambda t: LOADING.search(t), timeout=120, what="the model loading")
        else:
            tmux.wait_for(lambda t: "F1 shows the keys" in t, timeout=240, what="loaded model")
        pid = int(pid_file.read_text())
        tmux.run("kill-session", "-t", tmux.session)
        wait_gone(pid, f"its terminal closed ({when})")
        assert exit_status(exit_file) == str(128 + signal.SIGHUP)
    finally:
        tmux.run("kill-server", check=False)
        if pid is not None and not gone(pid):
            os.kill(pid, signal.SIGKILL)


def main_thread_blocked(pid: int) -> bool:
    """The main thread asleep on a lock (not on the loop's epoll) and using no CPU for 1 s."""
    task = Path(f"/proc/{pid}/task/{pid}")

    def cpu() -> int:
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])       # utime, stime
    before = cpu()
    for _ in range(10):
        time.sleep(0.1)
        if "futex" not in (task / "wchan").read_text():
            return False
    return cpu() == before


def test_a_signal_ends_kvchat_while_its_event_loop_is_blocked_on_the_terminal(tmp_path):
    """The tmux server stopped mid-reply: the terminal's buffer fills, Textual's writer thread
    waits in write(), and the loop then waits on the writer's full queue. SIGTERM must still
    end kvchat, with the status for it, and the reply streamed so far saved: the loop that would
    stop the reply never runs, so the signal's thread stops it."""
    # a reply long enough (1,500 tokens, greedy: no end of turn before) to outlast the terminal's
    # buffer filling up; 400 sometimes ended first, so there was no reply left to stop
    tmux, pid_file, exit_file = start(tmp_path, "blocked", max_tokens=1500)
    pid = int(pid_file.read_text())
    server = int(tmux.run("display", "-p", "-t", tmux.session, "#{pid}").stdout)
    os.kill(server, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 60
        while not main_thread_blocked(pid):
            assert time.monotonic() < deadline, "kvchat's main thread never blocked on the stopped terminal"
        os.kill(pid, signal.SIGTERM)
        wait_gone(pid, "SIGTERM with its loop blocked")
        assert exit_status(exit_file) == str(128 + signal.SIGTERM)
        assert_partial_reply_saved(tmp_path / "data")
    finally:
        os.kill(server, signal.SIGCONT)
        tmux.run("kill-server", check=False)
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
