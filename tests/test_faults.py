"""Faults that must lose nothing (issue 11): a read-only data directory, a full disk, kill -9
in the middle of a reply followed by two resumes, and two processes on one conversation.

The disks are real: a tmpfs mounted read-only or 64 KiB small (root can mount here; where it
cannot, those tests skip and a file-size limit, RLIMIT_FSIZE, stands in for the full disk).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import ROOT
from kvchat.cli.command import main
from kvchat.store.history import History
from kvchat.store.records import TurnRecord
from kvchat.store.export import export
from kvchat.store.log import ConversationBusy, ConversationLog, restore
from tmux_helpers import tmux_run

START = {"model": "m", "system": None, "cap": None, "policy": "stop", "mode": "cache"}


def mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({out.stderr.decode().strip()})")


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs: a real ENOSPC."""
    d = tmp_path / "small"
    mount_tmpfs(d, "size=64k")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only tmpfs: a real EROFS, which root cannot write past (chmod would not stop it)."""
    d = tmp_path / "ro"
    mount_tmpfs(d, "ro,size=64k")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def jsonl_is_whole(path: Path) -> bool:
    text = path.read_text()
    return text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


# ---- read-only data dir ---------------------------------------------------------------------
def test_a_read_only_data_dir_keeps_the_conversation_in_memory_and_says_so_once(read_only_dir):
    said = []
    log = ConversationLog.create(read_only_dir, **START)
    log.on_error = said.append
    msgs = [{"role": "user", "content": "hello"}]
    log.sync(msgs)                                          # would raise into the reply worker before
    log.sync(msgs + [{"role": "assistant", "content": "hi"}])
    log.turn(TurnRecord.from_dict({"turn": 1, "reply": "hi"}))
    assert len(said) == 1 and "Read-only file system" in said[0] and "/save FILE" in said[0]
    assert [r["type"] for r in log.unsaved] == ["start", "message", "message", "turn"]
    assert log.messages == msgs + [{"role": "assistant", "content": "hi"}]
    with pytest.raises(OSError):                            # /save there fails too, as one OSError
        export(read_only_dir / "chat", log.history, [], "m")


def test_a_conversation_resumed_on_a_disk_gone_read_only_opens_and_keeps_new_turns_in_memory(tmp_path):
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "size=64k")
    try:
        log = ConversationLog.create(disk, **START)
        log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
        log.close()
        before = log.path.read_bytes()
        if subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only here")
        r = restore(log.path)
        again = ConversationLog(log.path, r.messages)           # opens: EROFS is a failed write, not a crash
        assert again.error is not None and "Read-only file system" in again.error
        again.sync(r.messages + [{"role": "user", "content": "still here?"}])
        assert again.messages[-1]["content"] == "still here?" and again.unsaved
        assert log.path.read_bytes() == before
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_an_internal_error_log_on_a_read_only_dir_still_gives_one_line(read_only_dir, monkeypatch, capsys):
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(read_only_dir))
    monkeypatch.setattr("kvchat.cli.command.cmd_info", lambda args: 1 / 0)   # a bug, to reach the catch-all
    assert main(["info"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (ZeroDivisionError" in err and "Traceback" not in err


# ---- a full disk ----------------------------------------------------------------------------
def test_a_full_disk_leaves_no_half_record_and_everything_is_written_once_space_returns(small_disk):
    filler = small_disk / "filler"
    filler.write_bytes(b"x" * 40_000)
    log = ConversationLog.create(small_disk, **START)
    msgs = []
    for i in range(8):                                      # 8 x 4 KB: past the 24 KB left
        msgs = msgs + [{"role": "user", "content": f"{i} " + "y" * 4000}]
        log.sync(msgs)
    assert log.error is not None and "No space left" in log.error
    assert jsonl_is_whole(log.path)                         # the record that did not fit was cut back
    kept = len(log.unsaved)
    assert kept > 0
    filler.unlink()                                         # space comes back
    log.event("cap", value=64)
    assert log.unsaved == [] and log.error is None
    r = restore(log.path)
    assert r.skipped == 0 and r.unanswered.startswith("7 ") and len(r.messages) == 7 and r.cap == 64


def test_save_to_a_full_disk_fails_in_one_error_and_leaves_no_partial_file(small_disk):
    (small_disk / "filler").write_bytes(b"x" * 60_000)
    with pytest.raises(OSError):
        export(small_disk / "chat", History([{"role": "user", "content": "z" * 20_000}]), [], "m")
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]
    (small_disk / "chat.md").write_text("precious")
    with pytest.raises(OSError):
        export(small_disk / "chat", History([{"role": "user", "content": "z" * 20_000}]), [], "m", overwrite=True)
    assert (small_disk / "chat.md").read_text() == "precious"   # /save! over a full disk keeps the old file


def test_a_file_size_limit_stands_in_for_a_full_disk_anywhere(tmp_path):
    """RLIMIT_FSIZE in a subprocess: writes past 16 KiB fail with EFBIG, as on a full disk."""
    script = f"""
import resource, signal, sys
from pathlib import Path
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384))
from kvchat.store.log import ConversationLog
log = ConversationLog.create(Path({str(tmp_path)!r}), **{START!r})
msgs = []
for i in range(8):
    msgs = msgs + [{{"role": "user", "content": f"{{i}} " + "y" * 4000}}]
    log.sync(msgs)
print(len(log.unsaved), log.error)
print(log.path)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 0, out.stderr
    first, path = out.stdout.splitlines()
    assert int(first.split()[0]) > 0 and "File too large" in first
    assert jsonl_is_whole(Path(path)) and restore(Path(path)).skipped == 0


# ---- kill -9 mid-reply, then --resume twice with a turn in between --------------------------
class Tmux:
    """kvchat in a real terminal, on a private tmux socket."""

    def __init__(self) -> None:
        self.socket = f"kvchat-faults-{os.getpid()}"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return tmux_run(self.socket, *args, check=check)

    def start(self, name: str, command: str) -> int:
        self.run("new-session", "-d", "-s", name, "-x", "140", "-y", "45", command)
        return int(self.run("list-panes", "-t", name, "-F", "#{pane_pid}").stdout.split()[0])

    def pane(self, name: str) -> str:
        return self.run("capture-pane", "-p", "-t", name, check=False).stdout

    def keys(self, name: str, *keys: str, literal: bool = False) -> None:
        self.run("send-keys", "-t", name, *(["-l"] if literal else []), *keys)


def wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.2)


def records(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, filter(None, path.read_text().splitlines())) if r.get("type") == kind]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_kill_9_mid_reply_then_resume_twice_with_a_turn_between_loses_and_doubles_nothing(tmp_path):
    env = f"KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'} PYTHONPATH={ROOT}"
    kvchat = f"cd {ROOT} && exec env {env} {sys.executable} -m kvchat"
    tmux = Tmux()
    try:
        pid = tmux.start("first", f"{kvchat} --max-tokens 400")
        wait(lambda: "F1 shows the keys" in tmux.pane("first"), 240, "loaded model")
        # a prompt the bundled model answers at length (400 tokens, about 10 s): a short answer
        # can finish inside the second below on a fast decode
        tmux.keys("first", "Write a long story about a dragon who learns to count, in many paragraphs.", literal=True)
        tmux.keys("first", "Enter")
        folder = tmp_path / "data" / "conversations"
        wait(lambda: folder.is_dir() and any(folder.glob("*.jsonl")) and records(next(folder.glob("*.jsonl")),
                                                                                   "message"), 60, "logged message")
        log = next(folder.glob("*.jsonl"))
        time.sleep(1.0)                                         # into the reply
        assert not records(log, "turn"), "the reply finished before the kill; it was not mid-reply"
        os.kill(pid, signal.SIGKILL)
        wait(lambda: gone(pid), 10, "killed kvchat")

        for name, message, turns in (("second", None, 1), ("third", "Thanks.", 2)):
            pid = tmux.start(name, f"{kvchat} --resume --max-tokens 16")
            wait(lambda: "F1 shows the keys" in tmux.pane(name), 240, f"resumed model ({name})")
            if message is None:   # the unanswered message is back in the input: send it as it is
                assert "Write a long story about a dragon" in tmux.pane(name)
            else:
                tmux.keys(name, message, literal=True)
            tmux.keys(name, "Enter")
            wait(lambda: len(records(log, "turn")) >= turns, 240, f"reply {turns}")
            tmux.keys(name, "C-q")
            wait(lambda: gone(pid), 30, f"kvchat quitting ({name})")

        r = restore(log)
        assert r.skipped == 0 and jsonl_is_whole(log)
        users = [m["content"] for m in r.messages if m["role"] == "user"]
        assert users == ["Write a long story about a dragon who learns to count, in many paragraphs.", "Thanks."]
        assert [m["role"] for m in r.messages] == ["user", "assistant", "user", "assistant"]
        assert r.unanswered is None and len(r.turns) == 2
    finally:
        tmux.run("kill-server", check=False)


# ---- two processes on one conversation --------------------------------------------------------
def test_a_second_process_is_told_who_holds_the_conversation(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    log = ConversationLog.create(data, **START)
    log.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}])
    log.close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom kvchat.store.log import ConversationLog\n"
                               f"log = ConversationLog(Path({str(log.path)!r}))\nprint('open', flush=True)\n"
                               "time.sleep(120)\n"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "open"
        with pytest.raises(ConversationBusy, match=f"pid {holder.pid}"):
            ConversationLog(log.path)                   # what the app's session start does
        monkeypatch.setenv("KVCHAT_DATA_DIR", str(data))
        monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
        assert main(["--resume"]) == 2                  # refused before the UI, naming the holder
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"open in another kvchat (pid {holder.pid})" in err
        before = log.path.read_bytes()
    finally:
        holder.kill()
        holder.wait()
    again = ConversationLog(log.path)                   # the holder is gone: the lock went with it
    again.sync([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "back"}])
    again.close()
    assert log.path.read_bytes().startswith(before) and restore(log.path).unanswered == "back"
