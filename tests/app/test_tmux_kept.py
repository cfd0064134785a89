"""Nothing lost, walked in a real terminal (issue 26, high 1 and 2; the "done when" asks for
this walk): kvchat in tmux on the bundled model with a small cap and drop-oldest drops the
first turn; `/save` keeps it, marked; `--resume` shows it again, dimmed; while that kvchat
holds the conversation open, a second kvchat's chat browser cannot delete it (its note names
the holder's pid), and the first one's next turn lands in the file.

The Pilot tests (test_history_kept.py, test_catalog.py) check the same pieces one at a time
in one process; this one runs two real processes on one data folder, as a user would."""
from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from kvchat.store.log import restore

from .test_tmux import REPO, Tmux

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]
FIRST = "Tell me about sourdough bread and its starter."
LATER = ("Now tell me about rye bread in a few words.", "And what about spelt flour for bread?",
         "Which of them keeps longest?")
STATS = re.compile(r"TTFT [\d.,]+ m?s · [\d.,]+ tok/s")
SGR = re.compile(r"\x1b\[([\d;]*)m")


def kvchat(tmux: Tmux, tmp_path: Path, name: str, flags: str) -> Path:
    """kvchat in a new tmux session on the test's data folder; returns the file its pid is in."""
    pid_file = tmp_path / f"{name}.pid"
    env = f"PYTHONPATH={REPO} KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'}"
    command = (f"cd {tmp_path} && sh -c 'echo $$ > {pid_file}; exec env {env} {sys.executable} -m kvchat "
               f"{flags}'; echo $? > {tmp_path / name}.exit; sleep 60")
    tmux.run("new-session", "-d", "-s", name, "-x", "160", "-y", "50", command)
    wait(tmux, name, lambda t: "F1 shows the keys" in t, 240, f"kvchat {name} loaded")
    return pid_file


def pane(tmux: Tmux, name: str, escapes: bool = False) -> str:
    return tmux.run("capture-pane", "-p", *(["-e"] if escapes else []), "-t", name, check=False).stdout


def wait(tmux: Tmux, name: str, found, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = pane(tmux, name)
        if found(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout:.0f} s; the pane shows:\n{pane(tmux, name)}")


def type_line(tmux: Tmux, name: str, text: str) -> None:
    tmux.run("send-keys", "-t", name, "-l", text)
    tmux.run("send-keys", "-t", name, "Enter")


def say(tmux: Tmux, name: str, text: str) -> None:
    """Send a message and wait for its reply's stats line (one more than before)."""
    before = len(STATS.findall(pane(tmux, name)))
    type_line(tmux, name, text)
    # the message on screen first: before it arrives, "dropped" in the notices above matched
    # at once, and the quit that followed came before the message was sent
    wait(tmux, name, lambda t: text[:30] in t and (len(STATS.findall(t)) > before or "dropped" in t.split(text[:30])[-1]),
         240, f"the reply to {text!r}")
    wait(tmux, name, lambda t: "replying" not in t and "prefilling" not in t, 240, "the reply's end")


def quit_and_wait(tmux: Tmux, tmp_path: Path, name: str) -> None:
    tmux.run("send-keys", "-t", name, "C-q")
    exit_file = tmp_path / f"{name}.exit"
    deadline = time.monotonic() + 30
    while not exit_file.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert exit_file.exists() and exit_file.read_text().strip() == "0", f"{name} did not quit:\n{pane(tmux, name)}"


def style_before(screen: str, text: str) -> str:
    """The last SGR parameters in force where `text` starts on the captured screen."""
    at = screen.index(text[:20])
    found = SGR.findall(screen[:at])
    return found[-1] if found else ""


def test_drop_oldest_export_resume_and_a_second_kvchat_that_cannot_delete_an_open_conversation(tmp_path):
    tmux = Tmux("kept")
    try:
        # 1. drop-oldest drops the first turn; /save keeps it, marked as dropped
        kvchat(tmux, tmp_path, "first", "--cap 150 --policy drop-oldest --max-tokens 20")
        say(tmux, "first", FIRST)
        for text in LATER:
            say(tmux, "first", text)
        log = next((tmp_path / "data" / "conversations").glob("*.jsonl"))
        records = [json.loads(x) for x in log.read_text().splitlines()]
        assert sum(r.get("dropped_messages", 0) for r in records if r["type"] == "turn") >= 2, records
        type_line(tmux, "first", "/save kept")
        wait(tmux, "first", lambda t: "kept.md" in t, 30, "the /save notice")
        md = (tmp_path / "kept.md").read_text()
        assert f"## You (dropped by drop-oldest: the model no longer saw it)\n\n{FIRST}" in md
        assert "## Assistant (dropped by drop-oldest: the model no longer saw it)" in md
        assert LATER[-1] in md and md.count("*") >= 2 * (1 + len(LATER))      # each reply with its stats line
        quit_and_wait(tmux, tmp_path, "first")

        # 2. --resume shows the dropped turn again, dimmed beside the turns the model still sees
        pid_file = kvchat(tmux, tmp_path, "resumed", "--resume --max-tokens 12")
        screen = wait(tmux, "resumed", lambda t: LATER[-1][:20] in t, 30, "the resumed transcript")
        assert FIRST[:20] in screen
        colour = pane(tmux, "resumed", escapes=True)
        assert style_before(colour, FIRST) != style_before(colour, LATER[-1])
        holder = int(pid_file.read_text())

        # 3. a second kvchat on the same data folder cannot delete the conversation held open
        kvchat(tmux, tmp_path, "second", "")
        tmux.run("send-keys", "-t", "second", "C-o")
        # the list read (in a thread: until then d has no conversation to delete)
        wait(tmux, "second", lambda t: "Saved conversations" in t and "reading the saved" not in t, 30,
             "the chat browser's list")
        tmux.run("send-keys", "-t", "second", "d")
        wait(tmux, "second", lambda t: "cannot be undone" in t, 30, "the delete question")
        tmux.run("send-keys", "-t", "second", "y")
        note = wait(tmux, "second", lambda t: "open in another kvchat" in t, 30, "the refusal")
        assert f"pid {holder}" in note and log.exists()
        tmux.run("send-keys", "-t", "second", "Escape")
        wait(tmux, "second", lambda t: "Saved conversations" not in t, 30, "the browser closed")
        quit_and_wait(tmux, tmp_path, "second")

        # 4. the first kvchat's next turn lands in the same file, which is still there
        say(tmux, "resumed", "One more question about bread.")
        quit_and_wait(tmux, tmp_path, "resumed")
        kept = restore(log)
        assert "One more question about bread." in [m["content"] for m in kept.messages] + [kept.unanswered]
        assert kept.messages[len(kept.history.system)]["content"] == FIRST       # the dropped turn is still there
    finally:
        tmux.run("kill-server", check=False)
