"""Helpers shared by the CLI-level tests."""
from __future__ import annotations

from kvchat.cli import main


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
