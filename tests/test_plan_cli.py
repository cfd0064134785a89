"""`kvchat plan` from the command line: every bad input is one line and exit status 2, and
the good runs print and write what they promise (the seeds' table, JSON, a trace that
replays to the same figures, a PNG). The plan never needs a model's weights, so these run in
a second or two each."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvchat.cli.command import main
from kvchat.plan.options import NO_SEQ_LIMIT

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--users", "4", "--turns", "2", "--think", "1s"]


def trace_file(text: str):
    def setup(tmp: Path) -> list[str]:
        (tmp / "t.jsonl").write_text(text)
        return ["plan", "--trace", str(tmp / "t.jsonl")]
    return setup


def calibration_file(d: dict | str, gpu: str = "cpu"):
    def setup(tmp: Path) -> list[str]:
        (tmp / "c.json").write_text(d if isinstance(d, str) else json.dumps(d))
        return ["plan", "--gpu", gpu, "--model", "smollm2-135m", "--calibration", str(tmp / "c.json")]
    return setup


GOOD_CAL = {"format": "kvchat-plan-calibration/1", "hardware": "cpu", "model": "smollm2-135m", "dtype": "fp32",
            "source": "test", "constants": {"bandwidth": 4e10, "bw_efficiency": 0.5, "kv_bw_efficiency": {"fp32": 0.5},
                                            "flops": 1e11, "attn_flops": 1e11, "flops_efficiency": 1.0,
                                            "attn_efficiency": 1.0, "overhead": 0.001, "row_overhead": 0.0,
                                            "request_overhead": 0.05},
            "sources": {}, "fit": {"mape": 0.05, "points": 10}}

CASES = [
    ("unknown-gpu", ["plan", "--gpu", "h1000"], "unknown GPU 'h1000'"),
    ("unknown-gpu-near-miss", ["plan", "--gpu", "h100"], "did you mean"),
    ("weights-do-not-fit", ["plan", "--model", "llama-3.1-70b", "--gpu", "l4"], "impossible pool"),
    ("pool-past-the-memory", ["plan", "--pool", "500GB"], "impossible pool: --pool 500.0 GB"),
    ("pool-below-one-block", ["plan", "--pool", "1KiB"], "hold no block"),
    ("pool-unreadable", ["plan", "--pool", "lots"], "cannot read size"),
    ("pool-negative", ["plan", "--pool=-5GB"], "must be positive"),
    ("zero-users", ["plan", "--users", "0"], "--users must be a positive integer"),
    ("negative-rate", ["plan", "--rate", "-1"], "--rate must be in (0, 1e+06]"),
    ("zero-rate", ["plan", "--rate", "0"], "--rate must be in"),
    ("nan-rate", ["plan", "--rate", "nan"], "--rate must be in"),
    ("rate-and-ramp", ["plan", "--rate", "1", "--ramp", "5s"], "not both"),
    ("slo-unknown-metric", ["plan", "--slo", "speed=2s"], "unknown metric 'speed'"),
    ("slo-no-value", ["plan", "--slo", "ttft"], "expected METRIC=VALUE"),
    ("slo-negative", ["plan", "--slo", "ttft=-2s"], "expected METRIC=VALUE"),
    ("slo-zero", ["plan", "--slo", "ttft=0"], "must be a positive duration"),
    ("slo-twice", ["plan", "--slo", "ttft=1s,ttft=2s"], "names ttft twice"),
    ("slo-empty", ["plan", "--slo", " "], "is empty"),
    ("context-backwards", ["plan", "--context", "5000-100"], "runs backwards"),
    ("reply-negative", ["plan", "--reply", "-3"], "is negative"),
    ("reply-zero", ["plan", "--reply", "0"], "must be positive"),
    ("think-not-a-duration", ["plan", "--think", "soon"], "expected a duration"),
    ("think-exp-negative", ["plan", "--think", "exp:-1s"], "expected a duration"),
    ("turns-absurd", ["plan", "--turns", "1e12"], "past 10,000,000"),
    ("lognormal-one-number", ["plan", "--context", "lognormal:1000"], "needs a median and a sigma"),
    ("ramp-a-range", ["plan", "--ramp", "1-5s"], "give one duration"),
    ("horizon-bad", ["plan", "--horizon", "forever"], "expected a duration"),
    ("tp-not-dividing-heads", ["plan", "--tp", "3"], "do not split evenly"),
    ("tp-zero", ["plan", "--tp", "0"], "--tp must be a positive integer"),
    ("cap-past-the-model", ["plan", "--cap", "200000"], "past the longest request"),
    ("unknown-policy", ["plan", "--policy", "forever"], "unknown cap policy 'forever'"),
    ("unknown-dtype", ["plan", "--dtype", "int4"], "invalid choice"),
    ("unknown-model", ["plan", "--model", "gpt-5"], "not an alias"),
    ("model-and-geometry", ["plan", "--model", "llama-3.1-8b", "--geometry", "llama-2-7b"], "not both"),
    ("geometry-unreadable", ["plan", "--geometry", "layers=banana"], "cannot read"),
    ("geometry-incomplete", ["plan", "--geometry", "layers=2,hidden=64"], "lacks heads"),
    ("geometry-heads-not-dividing", ["plan", "--geometry", "layers=2,hidden=64,heads=4,kv_heads=3,head_dim=16,"
                                     "intermediate=128,vocab=100"], "not a multiple of 3 KV heads"),
    ("scenario-unknown", ["plan", "--scenario", "doom"], "unknown --scenario 'doom'"),
    ("max-seqs-zero", ["plan", "--max-seqs", "0"], "--max-seqs must be a positive integer"),
    ("memory-utilization-above-one", ["plan", "--memory-utilization", "1.5"], "--memory-utilization must be in"),
    ("bw-efficiency-zero", ["plan", "--bw-efficiency", "0"], "--bw-efficiency must be in (0, 1.5]"),
    ("json-into-a-missing-dir", ["plan", "--json", "/no/such/dir/x.json"], "does not exist"),
    ("plot-not-png", ["plan", "--plot", "x.svg"], "expected a .png file name"),
    ("trace-missing", ["plan", "--trace", "no-such.jsonl"], "no such file"),
    ("trace-no-header", trace_file('{"turns": [[1, 2, 0]]}\n'), "header"),
    ("trace-bad-turn", trace_file('{"format": "kvchat-plan-trace/1", "system_tokens": 0}\n{"turns": [[1, 2]]}\n'),
     "each turn is [new tokens, reply tokens, think seconds]"),
    ("trace-negative-think", trace_file('{"format": "kvchat-plan-trace/1", "system_tokens": 0}\n'
                                        '{"turns": [[1, 2, -1]]}\n'), "think must be seconds"),
    ("trace-no-users", trace_file('{"format": "kvchat-plan-trace/1", "system_tokens": 0}\n'), "no users"),
    ("trace-not-json", trace_file('{"format": "kvchat-plan-trace/1", "system_tokens": 0}\n{oops\n'),
     "line 2 is not valid JSON"),
    ("calibration-missing", ["plan", "--gpu", "cpu", "--calibration", "none.json"], "no such file"),
    ("calibration-not-json", calibration_file("{"), "not valid JSON"),
    ("calibration-other-hardware", calibration_file(GOOD_CAL, gpu="h100-sxm"), "was measured on 'cpu'"),
    ("calibration-negative-constant", calibration_file({**GOOD_CAL, "constants": {**GOOD_CAL["constants"],
                                                                                   "overhead": -1}}),
     "finite numbers >= 0"),
    ("two-modes", ["plan", "--scenario", "seeds", "--validate"], "one mode at a time"),
    ("write-calibration-alone", ["plan", "--write-calibration", "c.json"], "goes with --calibrate"),
    ("server-alone", ["plan", "--server", "http://127.0.0.1:1"], "goes with --validate or --calibrate"),
    ("probe-context-alone", ["plan", "--probe-context", "512"], "goes with --calibrate --server"),
    ("probe-context-tiny", ["plan", "--calibrate", "--server", "http://127.0.0.1:1", "--probe-context", "8"],
     "--probe-context"),
    ("save-trace-into-a-missing-dir", ["plan", "--save-trace", "/no/such/dir/t.jsonl"], "does not exist"),
    ("calibrate-not-a-bench", lambda tmp: ["plan", "--calibrate", str(ROOT / "pyproject.toml")], "not valid JSON"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_plan_input_is_one_line_and_status_2(workdir, capsys, argv, fragment):
    argv = argv(workdir) if callable(argv) else argv
    before = sorted(p.name for p in workdir.iterdir())
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert (code, len(lines)) == (2, 1), captured.err
    assert fragment in lines[0] and "Traceback" not in captured.err
    assert sorted(p.name for p in workdir.iterdir()) == before          # nothing written


def test_the_seeds_scenario_prints_the_arithmetic_and_one_row_per_remedy(capsys, tmp_path):
    out_json = tmp_path / "seeds.json"
    assert main(["plan", "--scenario", "seeds", "--users", "6", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "30,000 tokens = 9.83 GB, 66% of a 15 GB pool" in out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["label"].split(":")[0] for r in rows] == [
        "as the text sets it", "fp8 KV cache", "cap 8,192 tokens per request (drop-oldest)", "prefix caching on",
        "4 GPUs (tp 4)", "fp8 weights", "fp8 cache + cap + prefix caching"]
    base, fp8 = rows[0], rows[1]
    assert (base["pool"]["tokens"], fp8["pool"]["tokens"]) == (45_776, 91_552)
    assert base["pool_story"]["long_user_peak_share"] > 0.6          # the long chat holds most of the pool
    assert fp8["pool_story"]["long_user_peak_share"] < base["pool_story"]["long_user_peak_share"]
    assert "what the simulation cannot know" in out


def test_json_holds_the_constants_with_their_sources_and_the_figures(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", *SMALL, "--json", str(path), "--no-terminal-plot"]) == 0
    rec = json.loads(path.read_text())
    assert rec["constants"]["bandwidth"]["source"].startswith("spec sheet: NVIDIA H100")
    assert rec["constants"]["overhead per step"]["source"].startswith("default, not calibrated")
    s = rec["summary"]
    assert s["requests"] == 8 and set(s["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
    assert rec["occupancy"]["rows"] and len(rec["occupancy"]["columns"]) == 6
    out = capsys.readouterr().out
    assert "Serving Benchmark Result (simulated)" in out and "Median TPOT (ms):" in out


def test_a_saved_trace_replays_to_the_same_figures(capsys, tmp_path):
    trace, a, b = tmp_path / "t.jsonl", tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", *SMALL, "--long", "5000", "--save-trace", str(trace), "--json", str(a)]) == 0
    assert main(["plan", "--trace", str(trace), "--json", str(b)]) == 0
    first, again = json.loads(a.read_text()), json.loads(b.read_text())
    assert first["summary"] == again["summary"] and first["long_user"] == again["long_user"]


def test_list_gpus_names_each_rows_source(capsys):
    assert main(["plan", "--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM" in out and "mi300x" in out


def test_a_calibration_file_round_trips_into_a_plan(capsys, tmp_path):
    cal = tmp_path / "cal.json"
    assert main(["plan", "--calibrate", str(ROOT / "docs" / "bench.json"), "--write-calibration", str(cal)]) == 0
    assert "mean absolute percentage error of the fit" in capsys.readouterr().out
    path = tmp_path / "p.json"
    assert main(["plan", "--gpu", "cpu", "--model", "smollm2-135m", "--calibration", str(cal), "--users", "1",
                 "--turns", "1", "--context", "0", "--message", "1000", "--reply", "8", "--json", str(path)]) == 0
    rec = json.loads(path.read_text())
    assert str(cal) in rec["constants"]["overhead per step"]["source"]
    assert rec["scheduler"]["max_batched_tokens"] == 512


@pytest.mark.skipif("matplotlib" not in sys.modules and __import__("importlib").util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed")
def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "plan.png"
    assert main(["plan", *SMALL, "--plot", str(path), "--no-terminal-plot"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cpu_row_is_this_machine_measured_and_kvchats_engine_as_it_is(tmp_path):
    path = tmp_path / "cpu.json"
    assert main(["plan", "--gpu", "cpu", "--model", "smollm2-135m", "--users", "2", "--turns", "1", "--reply", "8",
                 "--json", str(path), "--no-terminal-plot"]) == 0
    rec = json.loads(path.read_text())
    assert rec["hardware"] == "cpu" and rec["dtype"] == "fp32"
    assert rec["constants"]["bandwidth"]["source"].startswith("measured: this machine, now")
    assert (rec["scheduler"]["max_seqs"], rec["scheduler"]["max_batched_tokens"]) == (NO_SEQ_LIMIT, 512)
    assert rec["kv_bytes_per_token"] == 46_080                     # 2 x 30 x 3 x 64 x 4 B


def test_a_probe_the_server_never_answers_stops_the_calibration_in_one_line():
    """A server that takes a probe and never answers (a stand-in object: a real server hung on
    purpose cannot be had): the calibration ends at the probe's time limit with a line naming
    the probe and the smaller --probe-context, not a wait without end."""
    import threading
    import time

    from kvchat.cli.args import UsageError
    from kvchat.plan.server_probe import _streams
    release = threading.Event()

    class Hung:
        def send(self, text, params):
            release.wait(30)
            yield from ()

    class Backend:
        def open(self):
            return Hung()

        def close(self, chat):
            pass

    t0 = time.monotonic()
    with pytest.raises(UsageError) as err:
        _streams(Backend(), ["a", "b"], 16, "2 streams decoding at 2048", timeout_s=0.5)
    release.set()
    assert time.monotonic() - t0 < 5
    assert "'2 streams decoding at 2048' did not finish within 0.5 s" in str(err.value)
    assert "--probe-context 512" in str(err.value) and len(str(err.value).splitlines()) == 1
