"""The trace runner on kvchat's real engine (the bundled model on CPU): users in threads, the
client's clock, and the trace as it really ran, which the simulator must replay to the same
prompts."""
from __future__ import annotations

import pytest

from kvchat.plan.request import SchedulerConfig
from kvchat.plan.simulator import Simulator
from kvchat.plan.run_points import first_token_points, step_points
from kvchat.plan.trace_runner import run_trace, text_of
from kvchat.plan.workload import Trace, Turn, UserTrace

pytestmark = pytest.mark.slow


class Linear:
    """A step time simple to reason about; these tests check token accounting, not time."""
    request = 0.0

    def seconds(self, tokens, logit_rows, rows, kv_read, pairs, chunks=0) -> float:
        return 1e-3 + 1e-5 * tokens


RECORDS: list = []


@pytest.fixture(scope="module")
def run(engine):
    from kvchat.backends.local import LocalBackend
    trace = Trace(12, (UserTrace(0, 0.0, (40,), (Turn(30, 5, 0.0), Turn(20, 4, 0.05))),
                       UserTrace(1, 0.02, (), (Turn(25, 6, 0.0), Turn(15, 3, 0.0), Turn(10, 3, 0.01)))))
    from kvchat.plan.diagnose import every_step
    with every_step(engine) as steps:             # every engine step of the run
        r = run_trace(trace, LocalBackend(engine), timeout_s=300)
    RECORDS[:] = steps
    return trace, r


def test_every_turn_runs_and_its_tokens_are_timed_on_one_clock(run):
    trace, r = run
    assert [(m.user, m.turn) for m in sorted(r.measured, key=lambda m: (m.user, m.turn))] == \
        [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    for m in r.measured:
        assert m.error is None
        assert 1 <= m.output <= trace.users[m.user].turns[m.turn].reply
        assert len(m.token_times) == m.output
        assert m.arrival < m.token_times[0] and m.token_times == sorted(m.token_times)
        assert len(m.step_ms) == len(m.step_pos) >= m.output - 1


def test_a_later_turn_reuses_the_cache_of_the_earlier_ones(run):
    _, r = run
    by = {(m.user, m.turn): m for m in r.measured}
    for later, earlier in (((0, 1), (0, 0)), ((1, 2), (1, 1))):
        assert by[later].cached_tokens >= 16 * ((by[earlier].prompt_tokens) // 16) - 16


def test_the_replayed_trace_gives_the_simulator_the_prompts_the_engine_counted(run):
    _, r = run
    sim = Simulator(r.replayed, SchedulerConfig(num_blocks=4096, max_len=8192, max_batched_tokens=512,
                                                decode_first=True), Linear()).run()
    measured = {(m.user, m.turn): (m.prompt_tokens, m.output) for m in r.measured}
    assert {(x.user, x.turn): (x.prompt, x.output) for x in sim.records} == measured


def test_calibration_points_are_the_engines_own_steps(run):
    """Every step of the run is kept (more than the scheduler's ring would hold in a longer
    run); binned with at least one step a bin, the points hold every step the binning keeps,
    each at the median of its steps; the first tokens that waited alone give request points."""
    _, r = run
    records = RECORDS
    assert sum(s.tokens_out for s in records) == sum(m.output for m in r.measured)
    points = step_points(records, "fp32", least=1)
    kept = [s for s in records if not s.dense_rows and not s.preemptions]
    assert sum(int(p.what.split()[0]) for p in points) == len(kept)
    assert all(min(s.step_ms for s in kept) <= p.ms <= max(s.step_ms for s in kept) for p in points)
    assert any(p.steps[0][2] > 1 for p in points)            # the two users shared steps
    alone = first_token_points(r, records, r.t0, "fp32", 512)
    assert all(p.requests == 1 and p.ms > 0 for p in alone)
    assert len(alone) >= 1


def test_text_of_hits_the_token_count_it_is_asked_for(engine):
    count = lambda t: len(engine.tokenizer.encode(t))        # noqa: E731
    for n in (5, 17, 300):
        assert n - 2 <= count(text_of(n, count, 3)) <= n
