"""`kvchat plan --validate`'s error split (diagnose.py) and what it led to: the chunk-step
overhead in the step-time model and the fit, the per-request overhead measured instead of
fitted, the simulator's step log. Every figure is worked out by hand from the records given."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvchat.engine.geometry import KNOWN
from kvchat.engine.telemetry import StepRecord
from kvchat.plan.diagnose import Diagnosis, burst_share, diagnose, engine_stats, request_spans, sim_stats, time_split
from kvchat.plan.fitter import Point, fit
from kvchat.plan.hardware import TABLE
from kvchat.plan.request import SchedulerConfig
from kvchat.plan.run_points import request_overhead_ms, step_points, step_row
from kvchat.plan.simulator import Simulator
from kvchat.plan.step_time import Constant, default_model, model_costs
from kvchat.plan.workload import Trace, Turn, UserTrace

MS = 1e-3


def rec(index, end, ms, decode=0, chunk=0, chunks=None, context=0, preemptions=0) -> StepRecord:
    """A StepRecord ending at `end` seconds that took `ms`; `chunk` prompt tokens in `chunks`
    chunks (1 when there are any)."""
    n = (1 if chunk else 0) if chunks is None else chunks
    return StepRecord(index=index, rows=decode + chunk, decode_rows=decode, prefill_tokens=chunk, prefill_chunks=n,
                      dense_rows=0, sequences=decode + n, context_tokens=context, tokens_out=decode + n, step_ms=ms,
                      weight_bytes=0, cache_bytes=0, preemptions=preemptions, time=end)


class Linear:
    """Step time = 10 ms + 1 ms per token, + 100 ms when the step holds a prompt chunk; a
    request reaches the scheduler 5 ms after it is sent."""
    request = 5 * MS

    def seconds(self, tokens, logit_rows, rows, kv_read, pairs, chunks=0) -> float:
        return 10 * MS + 1 * MS * tokens + (100 * MS if chunks else 0.0)


# ---- the step-time model's chunk overhead ----------------------------------------------------------
def test_a_step_with_a_prompt_chunk_pays_the_chunk_overhead_once():
    c = model_costs(KNOWN["smollm2-135m"], "fp32", "fp32", 1, kv_scales=True)
    t = default_model(TABLE["l4"], c, "fp32", {"chunk_overhead": Constant(0.15, "s", "given")}).timer()
    decode = t.seconds(3, 3, 3, 300, 303)
    assert t.seconds(3, 3, 3, 300, 303, chunks=1) - decode == pytest.approx(0.15, rel=1e-12)
    assert t.seconds(3, 3, 3, 300, 303, chunks=2) - decode == pytest.approx(0.15, rel=1e-12)   # per step, not chunk


def test_the_fit_recovers_the_chunk_overhead_from_steps_timed_on_their_own():
    """Steps timed by the model itself with a 150 ms chunk overhead; decode-only and mixed
    steps, no request in any: the fit finds the overhead and the others exactly."""
    g = KNOWN["smollm2-135m"]
    c = model_costs(g, "fp32", "fp32", 1, kv_scales=True)
    truth = {"overhead": Constant(0.03, "s", "t"), "row_overhead": Constant(4e-3, "s", "t"),
             "chunk_overhead": Constant(0.15, "s", "t"), "bw_efficiency": Constant(0.5, "", "t"),
             "kv_bw_efficiency": Constant(0.5, "", "t"), "flops_efficiency": Constant(0.3, "", "t")}
    t = default_model(TABLE["l4"], c, "fp32", truth).timer()
    steps = [(b, b, b, 300.0 * b, 301.0 * b) for b in (1, 2, 4, 6)]
    steps += [(b + n, b + 1, b + 1, 300.0 * b + 200, 301.0 * b + n * (n + 1) / 2, 1)
              for b in (0, 2, 5) for n in (40, 200, 450)]
    points = [Point(f"step {s}", "fp32", (s,), t.seconds(*s) * 1000) for s in steps]
    prior = {"overhead": 1e-3, "row": 0.0, "weight": 1e-11, "kv": 1e-11, "lin": 1e-12, "attn": 1e-12, "request": 0.0}
    f = fit(points, {"fp32": c}, prior, model_kv="fp32")
    assert "chunk" not in f.fixed
    assert f.mape(points) < 1e-6
    assert f.value("chunk") == pytest.approx(0.15, rel=1e-6)
    assert f.value("row") == pytest.approx(4e-3, rel=1e-6)


def test_prefills_timed_with_their_request_leave_the_chunk_overhead_at_its_prior():
    from kvchat.plan.bench_points import prefill_steps
    c = model_costs(KNOWN["smollm2-135m"], "fp32", "fp32", 1, kv_scales=True)
    points = [Point(f"decode {b}", "fp32", ((b, b, b, 300.0 * b, 301.0 * b),), 40 + 5 * b) for b in (1, 2, 4)]
    points += [Point(f"prefill {n}", "fp32", prefill_steps(n, 0, 512), 200 + 2 * n, requests=1) for n in (64, 300)]
    prior = {"overhead": 1e-3, "row": 0.0, "weight": 1e-11, "kv": 1e-11, "lin": 1e-12, "attn": 1e-12, "request": 0.0}
    f = fit(points, {"fp32": c}, prior, model_kv="fp32")
    assert "chunk" in f.fixed and f.value("chunk") == 0.0


def test_a_step_with_a_chunk_is_a_calibration_point_even_alone():
    records = [rec(i, i, 40.0, decode=1, context=300) for i in range(3)] + [rec(9, 9, 300.0, decode=2, chunk=50)]
    points = step_points(records, "fp32")
    assert len(points) == 2
    (chunked,) = [p for p in points if len(p.steps[0]) > 5 and p.steps[0][5]]
    assert chunked.ms == 300.0 and chunked.steps[0][:3] == (52, 3, 3)
    (decode,) = [p for p in points if p is not chunked]
    assert decode.weight == 3 and chunked.weight == 1          # the fit weighs each by the steps it stands for
    assert step_row(records[-1])[5] == 1


def test_a_calibration_from_an_older_file_reads_its_chunk_overhead_as_zero(tmp_path):
    import json

    from kvchat.plan.calibration import load_calibration
    consts = {"bandwidth": 4.9e10, "bw_efficiency": 0.6, "flops": 1.7e11, "attn_flops": 1.1e11,
              "flops_efficiency": 1.0, "attn_efficiency": 1.0, "overhead": 0.006, "row_overhead": 0.0,
              "request_overhead": 0.07, "kv_bw_efficiency": {"fp32": 0.6}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "kvchat-plan-calibration/1", "hardware": "cpu", "model": "smollm2-135m",
                                "dtype": "fp32", "source": "s", "constants": consts, "sources": {}}))
    cal = load_calibration(str(path), "cpu", KNOWN["smollm2-135m"])
    assert cal.constants["chunk_overhead"] == 0.0
    assert "written before it was fitted" in cal.sources["chunk_overhead"]


def test_steps_that_read_faster_than_the_measured_bandwidth_set_the_calibrations_bandwidth():
    """A busy machine's copy test read 5 GB/s; the steps read the weights at 20 GB/s: the
    calibration keeps 20 GB/s at efficiency 1 (an efficiency of 4 is refused by the model)."""
    from kvchat.plan.calibration import calibration_from_fit
    from kvchat.plan.fitter import BASE, Fit
    x = [0.03, 0.0, 1 / 20e9, 1e-11, 1e-11, 0.0, 0.1, 1 / 20e9]
    f = Fit((*BASE, "kv:fp32"), tuple(x), {}, (1.0, 1.0, 1.0))
    pts = [Point("p", "fp32", ((1, 1, 1, 0.0, 1.0),), 1.0)] * 3
    cal = calibration_from_fit(f, "cpu", "smollm2-135m", "fp32", 5e9, "measured: copy", "a run", pts)
    assert cal.constants["bandwidth"] == pytest.approx(20e9) and cal.constants["bw_efficiency"] == pytest.approx(1.0)
    assert cal.kv_efficiency["fp32"] == pytest.approx(1.0) and cal.constants["chunk_overhead"] == 0.1
    assert "above the 5.0 GB/s" in cal.sources["bandwidth"]


# ---- the measured request overhead ------------------------------------------------------------------
def measured(user, arrival, tokens, prompt=60, cached=0):
    return SimpleNamespace(user=user, turn=0, arrival=arrival, token_times=list(tokens), prompt_tokens=prompt,
                           cached_tokens=cached, output=len(tokens), error=None, prefill_ms=None)


def test_the_request_overhead_is_the_ttft_less_its_own_steps_over_turns_that_waited_alone():
    # t0 = 100 s. Turn A arrives at 1.000, its lone chunk step runs 1.004-1.204, first token
    # seen at 1.210: 210 ms - 200 ms = 10 ms. Turn B: 2.000, step 2.006-2.106, token 2.112:
    # 12 ms. Turn C shares its step with a decode row: left out. Median of 10 and 12: 11 ms.
    run = SimpleNamespace(t0=100.0, measured=[measured(0, 1.0, [1.21]), measured(1, 2.0, [2.112]),
                                              measured(2, 3.0, [3.2])])
    records = [rec(1, 101.204, 200.0, chunk=60), rec(2, 102.106, 100.0, chunk=60),
               rec(3, 103.19, 180.0, decode=1, chunk=60)]
    ms, n = request_overhead_ms(run, records)
    assert n == 2 and ms == pytest.approx(11.0)


# ---- the split ----------------------------------------------------------------------------------------
def test_the_step_time_half_sets_each_step_against_the_model_and_finds_the_gaps():
    # Linear predicts 11 ms for a decode row, 160 ms for a 50-token chunk. Steps (end, ms):
    # decode 1.011 took 22 ms (2x), decode 1.035 took 11 (1x; it started at 1.024, 13 ms after
    # the last ended, inside the request's span), chunk 1.235 took 160 ms (1x; started 1.075,
    # a 40 ms gap), and a decode at 5.011 after an idle gap outside every request (not counted).
    records = [rec(1, 1.011, 22.0, decode=1), rec(2, 1.035, 11.0, decode=1), rec(3, 1.235, 160.0, chunk=50),
               rec(4, 5.011, 11.0, decode=1)]
    t = time_split(records, Linear(), [(0.9, 1.3)])
    assert t.steps == 4
    assert t.decode_p50 == pytest.approx(1.0) and t.prompt_p50 == pytest.approx(1.0)
    assert t.ratio_p90 == pytest.approx(1.7)          # of 1, 1, 1, 2: rank 2.7 -> 1 + 0.7 x 1
    assert t.gap_p50_ms == pytest.approx(26.5) and t.gap_p90_ms == pytest.approx(37.3)
    assert t.gap_share == pytest.approx(0.053 / (0.053 + 0.171))


def test_the_scheduler_half_sets_the_engines_steps_beside_the_simulators():
    """One user, a 100-token prompt and 3 tokens: the engine's steps as it ran them, and the
    simulator's step log for the same trace, hand-checked, then one Diagnosis of both."""
    trace = Trace(0, (UserTrace(0, 0.0, (), (Turn(100, 3, 0.0),)),))
    for fast in (True, False):
        res = Simulator(trace, SchedulerConfig(num_blocks=100, max_len=1600, decode_first=True, fast_forward=fast),
                        Linear(), log_steps=True).run()
        # a 100-token chunk (10 + 100 + 100 ms), then two decode steps of 11 ms
        assert [s[:3] for s in res.step_log] == [(0, 1, 100), (1, 0, 0), (1, 0, 0)]
        assert [s[3] for s in res.step_log] == pytest.approx([0.21, 0.011, 0.011])
    s = sim_stats(res)
    assert (s.steps, s.decode_only, s.chunks, s.prompt_tokens, s.preemptions) == (3, 2, 1, 100, 0)
    assert (s.batch_p50, s.batch_p90, s.busy_s) == (1.0, 1.0, pytest.approx(0.232))
    records = [rec(1, 1.25, 240.0, chunk=100), rec(2, 1.262, 11.0, decode=1), rec(3, 1.274, 11.0, decode=1),
               rec(4, 1.3, 11.0, decode=2, preemptions=1)]
    m = engine_stats(records)
    assert (m.steps, m.decode_only, m.chunks, m.prompt_tokens, m.preemptions) == (4, 3, 1, 100, 1)
    assert (m.batch_p50, m.batch_mean) == (1.0, 1.25) and m.batch_p90 == pytest.approx(1.7)
    run = SimpleNamespace(t0=0.0, measured=[measured(0, 1.0, [1.255, 1.263, 1.275])])
    run.measured[0].prefill_ms = 252.0
    assert request_spans(run) == [(1.0, 1.275)]
    sim = SimpleNamespace(model=SimpleNamespace(timer=Linear), result=res)
    d = diagnose("light", run, records, sim)
    assert isinstance(d, Diagnosis) and d.lag_ms == pytest.approx(3.0) and d.request_ms == pytest.approx(5.0)
    assert d.bursts == 0.0                      # gaps of 8 and 12 ms
    burst = SimpleNamespace(t0=0.0, measured=[measured(0, 1.0, [1.2, 1.2004, 1.25, 1.2503])])
    assert burst_share(burst) == pytest.approx(2 / 3)      # 0.4 and 0.3 ms of 0.4, 49.6, 0.3
    text = "\n".join(d.lines())
    assert "4 / 3 steps" in text and "preemptions 1 / 0" in text and "prompt chunks 1 / 1" in text
    assert d.to_dict()["measured_steps"]["steps"] == 4


def test_a_rate_the_solve_wants_at_or_below_zero_is_held_and_the_rest_refitted():
    """Steps whose time has no cache or attention cost at all (10 ms + the weights at 15 GB/s
    or the products at 120 GFLOP/s, + 200 ms with a chunk): a start whose solve wants a rate
    at or below zero used to end there, and the fit explained these within 9.9% on average;
    holding that rate and solving the rest again explains them within 2%."""
    c = model_costs(KNOWN["smollm2-135m"], "fp32", "fp32", 1, kv_scales=True)

    def ms(tokens, chunk):
        return (0.01 + max(c.weight_bytes / 15e9, tokens * c.linear_flops_per_token / 1.2e11) + (0.2 if chunk else 0)) * 1e3

    steps = [(b, b, b, 300.0 * b, 301.0 * b) for b in (1, 2, 4, 6)]
    steps += [(b + n, b + 1, b + 1, 300.0 * b + 200, 301.0 * b + n * (n + 1) / 2, 1)
              for b in (0, 2, 5) for n in (40, 200, 450)]
    points = [Point(f"{s}", "fp32", (s,), ms(s[0], len(s) > 5)) for s in steps]
    prior = {"overhead": 1e-3, "row": 0.0, "weight": 1 / 8e9, "kv": 1 / 8e9, "lin": 1e-11, "attn": 1e-11, "request": 0.0}
    f = fit(points, {"fp32": c}, prior, model_kv="fp32")
    assert f.mape(points) < 0.02
    assert f.value("chunk") == pytest.approx(0.2, rel=0.05)
    assert 1 / f.value("lin") == pytest.approx(1.2e11, rel=0.05)


def test_the_vllm_column_is_the_servers_own_figure_in_the_table_and_the_json():
    """--validate --server: each row's vLLM figure is the server run's percentile of that
    metric at that level (hand-computed: TTFT p50 of 100, 200, 300 ms is 200 ms); none
    without a server run at the level."""
    from kvchat.plan.request import RequestRecord, SimResult
    from kvchat.plan.validate import Row, table, vllm_value
    res = SimResult()
    for i, ttft in enumerate((0.1, 0.2, 0.3)):
        res.records.append(RequestRecord(i, 0, False, 0.0, 50, 0, 10, ttft, ttft + 0.9, 0, 0))
    res.itl = [(0.1, 9)] * 3
    row = Row("light", "TTFT p50", 150.0, 160.0)
    assert vllm_value(row, {"light": res}) == pytest.approx(200.0)
    assert vllm_value(row, {}) is None and vllm_value(Row("past it", "TTFT p50", 1.0, 1.0), {"light": res}) is None
    lines = table([row], {"light": res})
    assert "vLLM, measured" in lines[0] and lines[1].rstrip().endswith("200.0")
