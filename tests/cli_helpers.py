"""Helpers shared by the CLI-level tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvchat.cli.command import main


def fails_with(capsys, argv, *fragments):
    """Run the CLI in-process and check it failed the way bad input must: exit status 2 and
    one line on stderr, no traceback, naming each fragment. Returns the line."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, err
    return err


@contextmanager
def refusing_port() -> Iterator[int]:
    """A local port where a connection is refused, for as long as the block runs: bound here and
    never listened on. (A port found free and let go could be taken by another test's server
    before the connection: with the suite on several workers, one was, and a "nothing answers"
    test got an answer.)"""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


ROOT = Path(__file__).resolve().parents[1]


def run_kvchat(args, **kw) -> subprocess.CompletedProcess:
    """`python -m kvchat ARGS` in a subprocess that imports this checkout's kvchat (not an
    editable install elsewhere), whatever its working directory."""
    env = dict(os.environ, **kw.pop("env", {}))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    kw.setdefault("capture_output", True)
    kw.setdefault("timeout", 300)
    return subprocess.run([sys.executable, "-m", "kvchat", *args], env=env, **kw)
