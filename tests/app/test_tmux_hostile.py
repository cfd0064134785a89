"""Escape sequences from outside never reach the real terminal (issue 27, high 1): kvchat in
tmux, attached to a fake vLLM server whose model name, replies and error bodies carry OSC 0
(title), OSC 52 (clipboard), CSI 2J (clear) and alternate-screen sequences, resuming a log
that carries them, and /load-ing a file that carries them. tmux is told to accept both a
title and a clipboard write from the application, so a sequence that got through would show
in the pane's title or in a tmux buffer; the pane must show each as visible text instead."""
from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest

import kvchat
from hostile.fake_vllm import fake_vllm, models, reply

from .test_tmux import Tmux

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]
TITLE, CLIP = "PWNED-TITLE", "pwned-clipboard"
CODE = Path(kvchat.__file__).resolve().parents[1]      # the kvchat under test runs in the pane
EVIL = f"\x1b]0;{TITLE}\x07\x1b]52;c;cHduZWQtY2xpcGJvYXJk\x07\x1b[2J\x1b[?1049l\x1b]2;{TITLE}\x1b\\"


def saved_log(data: Path) -> None:
    folder = data / "conversations"
    folder.mkdir(parents=True)
    lines = [{"type": "start", "time": 1.7e9, "model": "evil", "system": None, "cap": None, "policy": "stop",
              "mode": "cache"},
             {"type": "message", "role": "user", "content": f"saved{EVIL}question"},
             {"type": "message", "role": "assistant", "content": f"saved{EVIL}answer"},
             {"type": "event", "event": "title", "value": f"title{EVIL}"}]
    (folder / "20250101-000000-aaaaaaaa.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def settle(tmux: Tmux) -> None:
    """Until the status line has said "ready" three times in a row, 0.4 s apart: the job
    before (a turn, the snapshot after it) is over."""
    deadline, seen = time.monotonic() + 60, 0
    while time.monotonic() < deadline:
        lines = tmux.pane().splitlines()
        seen = seen + 1 if lines and lines[0].rstrip().endswith("ready") else 0
        if seen == 3:
            return
        time.sleep(0.4)
    raise AssertionError(f"never ready; the pane shows:\n{tmux.pane()}")


def test_no_sequence_from_a_server_a_log_or_a_file_reaches_the_terminal(tmp_path):
    turns = {"n": 0}

    def completions(h):
        turns["n"] += 1
        if turns["n"] == 3:
            h.send_body(500, {"error": {"message": f"server{EVIL}error"}})
        else:
            h.stream(reply("live", EVIL, "reply"))
    loaded = Path(f"/tmp/kvchat-evil-{tmp_path.name[-8:]}.txt")     # short: a long path wraps in the pane
    loaded.write_text(f"file{EVIL}text")
    saved_log(tmp_path / "data")
    routes = {"/v1/models": (200, models(name=f"evil{EVIL}model")), "/v1/chat/completions": completions}
    with fake_vllm(routes) as server:
        env = f"KVCHAT_DATA_DIR={tmp_path / 'data'} KVCHAT_CONFIG_DIR={tmp_path / 'config'}"
        command = (f"cd {CODE} && env {env} {sys.executable} -m kvchat --server {server.url} --geometry smollm2-135m "
                   f"--resume; sleep 30")
        tmux = Tmux("evil")
        tmux.run("-f", "/dev/null", "new-session", "-d", "-s", tmux.session, "-x", "160", "-y", "50")
        tmux.run("set-option", "-g", "set-clipboard", "on")       # let an application write tmux's buffer
        tmux.run("set-option", "-g", "allow-rename", "on")
        title_before = tmux.run("display-message", "-p", "-t", tmux.session, "#{pane_title}").stdout.strip()
        tmux.run("respawn-pane", "-k", "-t", tmux.session, command)
        try:
            tmux.wait_for(lambda t: "loaded in" in t, timeout=120, what="the app")
            pane = tmux.pane()
            assert "saved\\x1b]0;" in pane                             # the resumed log, visible
            for n, text in enumerate(("hello", f"/load {loaded}", "and again"), 1):
                settle(tmux)
                tmux.run("send-keys", "-t", tmux.session, "-l", text)
                tmux.run("send-keys", "-t", tmux.session, "Enter")
                deadline = time.monotonic() + 30
                while turns["n"] < n and time.monotonic() < deadline:     # the server has the request
                    time.sleep(0.05)
                assert turns["n"] == n, tmux.pane()
            pane = tmux.wait_for(lambda t: "server\\x1b]0;" in t, timeout=30, what="the error line")
            assert "live\\x1b]0;" in pane and "file\\x1b]0;" in pane and "evil\\x1b]0;" in pane
            tmux.run("send-keys", "-t", tmux.session, "C-o")
            tmux.wait_for(lambda t: "title\\x1b]0;" in t, timeout=30, what="the browser's title column")
            alternate = tmux.run("display-message", "-p", "-t", tmux.session, "#{alternate_on}").stdout.strip()
            assert alternate == "1", "an escape sequence took the terminal out of the alternate screen"
            tmux.run("send-keys", "-t", tmux.session, "Escape")
            tmux.run("send-keys", "-t", tmux.session, "C-q")
            title = tmux.run("display-message", "-p", "-t", tmux.session, "#{pane_title}").stdout.strip()
            assert TITLE not in title and title == title_before
            buffers = tmux.run("list-buffers", "-F", "#{buffer_sample}", check=False).stdout
            assert CLIP not in buffers, buffers
        finally:
            tmux.run("kill-server", check=False)
            loaded.unlink()
