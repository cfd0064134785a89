"""Shared pieces of the hostile-input tests: the escape sequences an attacker would send, and a
CLI runner that returns what reached stdout and stderr."""
from __future__ import annotations

import pytest

from kvchat.cli.command import main

# what a hostile reply, name, body or file carries: retitle the terminal, write the clipboard,
# clear the screen, switch to (or out of) the alternate screen
SEQUENCES = {
    "osc0-title": "\x1b]0;PWNED-TITLE\x07",
    "osc52-clipboard": "\x1b]52;c;cHduZWQtY2xpcGJvYXJk\x07",
    "csi-2j-clear": "\x1b[2J",
    "alt-screen": "\x1b[?1049h",
}
RAW = ("\x1b", "\x07", "\x9b", "\x9d")


def raw_control(text: str) -> bool:
    """Whether `text` holds a byte a terminal would act on (ESC, BEL, 8-bit CSI or OSC)."""
    return any(c in text for c in RAW)


@pytest.fixture(params=sorted(SEQUENCES))
def sequence(request) -> str:
    return SEQUENCES[request.param]


@pytest.fixture(autouse=True)
def private_dirs(tmp_path, monkeypatch):
    """Each test's own data and config folders, and no API key from the environment."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("KVCHAT_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """Run `kvchat ARGV` in this process: (exit status, stdout, stderr)."""
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def one_line(code: int, err: str, *fragments: str) -> str:
    """The failure bad input gets: exit 2, one line on stderr, no traceback, naming each fragment
    (the progress line a server run prints first, "attached to ...", aside)."""
    assert code == 2, (code, err)
    lines = [x for x in err.strip().splitlines() if not x.startswith(("attached to ", "loading "))]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    for f in fragments:
        assert f in err, (f, err)
    return err.strip()
