"""`kvchat bench --runs 100000000` printed nothing for minutes: every run's history was built
before the first measurement (issue 27, medium). The count is bounded, and a history is built
when its run comes."""
from __future__ import annotations

import time

import pytest

from kvchat.bench.run import Bench, BenchConfig

from .conftest import cli, one_line

pytestmark = pytest.mark.timeout(60)


def test_an_absurd_run_count_is_one_line(capsys):
    code, out, err = cli(capsys, ["bench", "--runs", "100000000", "--contexts", "256", "--no-peers"])
    one_line(code, err, "--runs", "up to 1,000")


@pytest.mark.slow
def test_a_thousand_runs_start_at_once(engine):
    cfg = BenchConfig(contexts=(512,), new_tokens=4, runs=1000, json_path=None, plot_path=None, peers=False,
                      llama_cpp=False, nocache_max=0, nocache_tokens=4, seed=0)
    t0 = time.monotonic()
    Bench(cfg, engine)
    assert time.monotonic() - t0 < 2.0
