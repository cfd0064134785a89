"""The flags this round bounded (issue 27): `bench --runs` (at most 1,000: a run's history is
built when it comes) and `--timeouts` (seconds in (0, a day], on `ask` and on `bench
--server`). Each bad value is one line on stderr naming the flag, exit 2, before any model
loads or any server is asked (bench prints a header line once its model has loaded, so a
second line would show a check made too late)."""
from __future__ import annotations

import pytest

from .conftest import cli, one_line
from .fake_vllm import fake_vllm

pytestmark = pytest.mark.timeout(60)

NOWHERE = "http://127.0.0.1:9"     # the discard port: nothing listens, and nothing may be asked


@pytest.mark.parametrize("value, fragment", [("0", "'0'"), ("-3", "'-3'"), ("1001", "up to 1,000"),
                                             ("three", "'three'"), ("1e3", "'1e3'")])
def test_bench_runs_out_of_bounds(capsys, value, fragment):
    code, out, err = cli(capsys, ["bench", "--runs", value, "--contexts", "256", "--no-peers"])
    one_line(code, err, "--runs", fragment)


@pytest.mark.parametrize("value, fragment", [("gap=0", "gap=0"), ("total=86401", "total=86401"),
                                             ("answer=nan", "answer=nan"), ("first-token=inf", "first-token=inf"),
                                             ("connect=-1", "connect=-1"), ("soon=3", "NAME=SECONDS")])
def test_bench_server_timeouts_out_of_bounds(capsys, value, fragment):
    code, out, err = cli(capsys, ["bench", "--server", NOWHERE, "--timeouts", value, "--contexts", "256",
                                  "--no-peers", "--runs", "1"])
    one_line(code, err, "--timeouts", fragment)


def test_bench_timeouts_without_a_server(capsys):
    code, out, err = cli(capsys, ["bench", "--timeouts", "gap=1", "--contexts", "256", "--no-peers"])
    one_line(code, err, "--timeouts needs --server")


@pytest.mark.parametrize("value, fragment", [("total=86401", "total=86401"), ("answer=nan", "answer=nan"),
                                             ("connect=", "not a number"), ("gap=1,,", "NAME=SECONDS")])
def test_ask_timeouts_out_of_bounds(capsys, value, fragment):
    with fake_vllm() as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "--timeouts", value, "hi"])
        assert not s.seen, "a bad --timeouts must be refused before the server is asked"
    one_line(code, err, "--timeouts", fragment)
