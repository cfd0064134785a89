"""The planner's figures as vllm bench serve defines them, its SLO and length syntax, and
its users drawn reproducibly."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvchat.cli.args import UsageError
from kvchat.plan.metrics import parse_slo, percentile, summarize, tpot, weighted_percentile
from kvchat.plan.request import RequestRecord, SimResult
from kvchat.plan.workload import Workload, make_trace, parse_dist


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.sampled_from([50, 90, 99]))
def test_percentiles_are_numpys_linear_ones(xs, p):
    assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-9, abs=1e-9)


def test_weighted_percentiles_count_each_gap_as_often_as_it_happened():
    pairs = [(0.010, 90), (0.050, 9), (0.500, 1)]
    assert [weighted_percentile(pairs, p) for p in (50, 90, 99, 100)] == [0.010, 0.010, 0.050, 0.500]


def test_tpot_excludes_the_first_token_and_goodput_counts_requests_within_every_objective():
    recs = [RequestRecord(0, 0, False, 0.0, 100, 0, 11, ttft=1.0, e2e=2.0, preemptions=0, recomputed=0),   # tpot 0.1
            RequestRecord(1, 0, False, 0.0, 100, 0, 11, ttft=3.0, e2e=4.0, preemptions=0, recomputed=0),   # ttft 3 s
            RequestRecord(2, 0, False, 0.0, 100, 0, 1, ttft=0.5, e2e=0.5, preemptions=0, recomputed=0)]    # no tpot
    assert tpot(recs[0]) == pytest.approx(0.1) and tpot(recs[2]) is None
    s = summarize(SimResult(records=recs, end=10.0), parse_slo("ttft=2s,tpot=100ms"))
    assert (s["good_requests"], s["goodput"]) == (2, 0.2)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)


@pytest.mark.parametrize("text, seconds", [("ttft=2s,tpot=100ms", {"ttft": 2.0, "tpot": 0.1}),
                                           ("ttft:2000 tpot:100", {"ttft": 2.0, "tpot": 0.1}),
                                           ("e2e=30s", {"e2el": 30.0})])
def test_slo_syntax(text, seconds):
    assert parse_slo(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text, kind, mean", [("2000", "fixed", 2000), ("1000-3000", "uniform", 2000),
                                              ("exp:500", "exp", 500), ("lognormal:1000,0.5", "lognormal",
                                                                        1000 * np.exp(0.125))])
def test_length_syntax(text, kind, mean):
    d = parse_dist("--context", text)
    assert (d.kind, d.mean) == (kind, pytest.approx(mean))


def test_durations_take_units():
    assert [parse_dist("--think", t, seconds=True).a for t in ("500ms", "5s", "2min", "1h")] == [0.5, 5, 120, 3600]


def test_a_length_drawn_from_a_distribution_has_its_mean():
    d, rng = parse_dist("--reply", "exp:300"), random.Random(1)
    assert np.mean([d.tokens(rng) for _ in range(20000)]) == pytest.approx(300, rel=0.03)


def test_the_same_seed_draws_the_same_users_and_the_long_user_comes_first():
    w = dict(users=20, rate=2.0, ramp=0.0, turns=parse_dist("t", "1-6"), think=parse_dist("t", "exp:5s", True, True),
             context=parse_dist("c", "0-3000", zero_ok=True), message=parse_dist("m", "100"),
             reply=parse_dist("r", "50-400"), system_tokens=100, long_tokens=30_000)
    a, b = make_trace(Workload(**w, seed=3)), make_trace(Workload(**w, seed=3))
    assert a == b and a != make_trace(Workload(**w, seed=4))
    assert a.users[0].long and sum(a.users[0].history) == 30_000 and a.users[0].start == 0.0
    starts = [u.start for u in a.users[1:]]
    assert starts == sorted(starts) and 5 < starts[-1] < 20      # 20 arrivals at 2/s


def test_zero_users_without_a_long_one_are_refused():
    with pytest.raises(UsageError, match="at least one user"):
        Workload(users=0, rate=None, ramp=1.0, turns=parse_dist("t", "1"), think=parse_dist("t", "1"),
                 context=parse_dist("c", "1"), message=parse_dist("m", "1"), reply=parse_dist("r", "1"))
