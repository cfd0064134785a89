"""`kvchat bench`: runs end to end on a tiny setting, writes its JSON and PNG, skips a missing
optional peer with a message, and turns bad arguments into one line and exit status 2.

No timing is asserted: the numbers are the benchmark's output, not a test's."""
from __future__ import annotations

import contextlib
import io
import json
import sys
import types

import pytest
import torch

from kvchat.bench.peers import LLAMA_CPP_MISSING
from kvchat.bench.report import Series, floors, percentile, summarise
from kvchat.cli.command import main
from cli_helpers import fails_with

# the module's tests on one pytest-xdist worker: bench_run, module-scoped, ran once per worker
# that drew one of them (three times, 55-62 s each, in a CI run)
pytestmark = pytest.mark.xdist_group("bench")

# One thread: on a shared 2-core machine, two OpenMP threads per process made this run five
# times slower (measured: 23 s against 119 s while other test suites ran).
TINY = ["bench", "--contexts", "32,64", "--new-tokens", "4", "--runs", "1", "--kv-budget", "64MiB",
        "--nocache-tokens", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One tiny run of the whole command, shared by the tests below. llama-cpp-python is made
    unimportable (a None entry in sys.modules), so the skip path is taken whether or not the
    machine has it."""
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    stdout, stderr = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setitem(sys.modules, "llama_cpp", None)
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main(TINY + ["--json", str(json_path), "--plot", str(png_path)])
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide; later tests keep their setting
    return {"code": code, "out": stdout.getvalue(), "err": stderr.getvalue(), "json": json_path, "png": png_path}


def test_bench_exits_zero_and_prints_the_markdown_tables(bench_run):
    assert bench_run["code"] == 0, bench_run["err"]
    out = bench_run["out"]
    assert "| context | kvchat, KV cache |" in out
    assert "| 32 |" in out and "| 64 |" in out
    assert "median (p10–p90) over 1 run(s) × 4 tokens" in out


def test_bench_json_holds_every_context_and_positive_summary_ratios(bench_run):
    rec = json.loads(bench_run["json"].read_text())
    assert set(rec["contexts"]) == {"32", "64"}
    assert rec["runs"] == 1 and rec["new_tokens"] == 4
    for ctx in ("32", "64"):
        ours = rec["contexts"][ctx]["kvchat"]
        assert ours["decode_ms"]["n"] == 4
        assert ours["kv"]["bytes_used"] == ours["kv"]["tokens_held"] * ours["kv"]["bytes_per_token"]
        assert rec["contexts"][ctx]["transformers"]["decode_ms"]["n"] == 4
    for name in ("decode_ratio_vs_hf", "prefill_ratio_vs_hf", "reuse_ttft_speedup_vs_hf"):
        ratios = rec["summary"][name]
        assert set(ratios) == {"32", "64"}
        assert all(isinstance(v, float) and v > 0 for v in ratios.values()), ratios


def test_bench_plot_is_a_png(bench_run):
    data = bench_run["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_bench_shows_progress_on_stderr_and_a_terminal_plot(bench_run):
    assert "context 64, run 1/1: transformers" in bench_run["err"]
    assert "decode ms/token vs context" in bench_run["out"]
    # the discarded warm-up says so: one run gives one "run 1/1" line per engine, not two
    assert "context 32, warm-up: kvchat " in bench_run["err"]       # at the first context
    assert bench_run["err"].count("context 32, run 1/1: kvchat          prefill") == 1


def test_missing_llama_cpp_is_skipped_with_a_message(bench_run):
    assert LLAMA_CPP_MISSING in bench_run["err"]
    rec = json.loads(bench_run["json"].read_text())
    assert LLAMA_CPP_MISSING in rec["notes"]
    assert "llama_cpp" not in rec["contexts"]["32"]


@pytest.mark.parametrize("argv, fragment", [
    (["--contexts", "abc"], "'abc' is not a whole number"),
    (["--contexts", "256,,1024"], "comma-separated"),
    (["--contexts", ""], "comma-separated"),
    (["--contexts", "0,256"], "0 is not a positive number"),
    (["--contexts", "-64"], "-64 is not a positive number"),
    (["--new-tokens", "0"], "--new-tokens must be a positive integer"),
    (["--runs", "-2"], "--runs must be a positive integer"),
    (["--skip-nocache-above", "-1"], "--skip-nocache-above must be an integer >= 0"),
    (["--json", "/nonexistent-dir/out.json"], "does not exist"),
    (["--plot", "/tmp"], "is a directory"),
    (["--plot", "out.txt"], "expected a .png file name"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, fragment):
    fails_with(capsys, ["bench"] + argv, fragment)


def test_a_context_shorter_than_the_chat_template_is_refused(capsys):
    fails_with(capsys, ["bench", "--contexts", "8", "--no-peers", "--kv-budget", "16MiB"], "--contexts 8", "at least")


def test_a_context_beyond_the_model_positions_is_refused(capsys):
    fails_with(capsys, ["bench", "--contexts", "1000000", "--no-peers", "--kv-budget", "16MiB"],
               "--contexts 1000000", "use contexts up to")


def test_summary_ratios_point_the_way_the_targets_read():
    """decode: ours / theirs (lower is better); prefill: our tokens/s / theirs; reuse:
    their re-prefill TTFT / ours with reuse (higher is better for both)."""
    ours = Series(decode_ms=[10.0], prefill_ms=[100.0], prefill_tokens=1000, ttft_reuse_ms=[5.0])
    hf = Series(decode_ms=[20.0], prefill_ms=[400.0], prefill_tokens=1000, ttft_reset_ms=[500.0])
    s = summarise({1024: {"kvchat": ours, "transformers": hf}})
    assert s == {"decode_ratio_vs_hf": {"1024": 0.5}, "prefill_ratio_vs_hf": {"1024": 4.0},
                 "reuse_ttft_speedup_vs_hf": {"1024": 100.0}, "floor_ratio": {}, "fp8_ratio_vs_fp32": {},
                 "decode_ratio_vs_llama_cpp": {}}


def test_floor_is_the_bytes_a_step_reads_over_the_bandwidth():
    """1 GB/s is 1e6 bytes per ms: 6e6 bytes of weights plus the cache at the timed steps'
    mean length (tokens held minus half the steps) take 6 ms + that many ms."""
    kv = {"tokens_held": 1040, "bytes_per_token": 1000, "scale_bytes": 0}
    ours = Series(decode_ms=[24.0], kv=kv)
    fp8 = Series(decode_ms=[30.0], kv={"tokens_held": 1040, "bytes_per_token": 260, "scale_bytes": 1040 * 10})
    floor = {"gb_s": 1.0, "weight_bytes": 6_000_000, "new_tokens": 32}
    rows = floors({1024: {"kvchat": ours, "kvchat_fp8": fp8}}, floor)
    assert rows[0]["cache_bytes"] == 1024 * 1000 and rows[0]["floor_ms"] == pytest.approx(7.024)
    assert rows[0]["fp8_cache_bytes"] == 1024 * 260
    s = summarise({1024: {"kvchat": ours, "kvchat_fp8": fp8}}, floor)
    assert s["floor_ratio"] == {"1024": pytest.approx(24.0 / 7.024, rel=1e-3)}
    assert s["fp8_ratio_vs_fp32"] == {"1024": 1.25}


def test_the_bandwidth_probe_fits_beside_a_model_that_fills_most_of_memory():
    """1.5x the step's bytes when that fits in half of what is available; else half of what
    is available (Llama 3.1 8B in bf16 on a 24 GB machine: a 22.6 GB buffer beside 16 GB of
    weights had the bench killed); never under MIN_BUFFER."""
    from kvchat.bench.floor import MIN_BUFFER, probe_bytes
    gb = 10**9
    assert probe_bytes(600_000_000, 20 * gb) == 900_000_000             # the bundled model
    assert probe_bytes(15 * gb, 7 * gb) == 3_500_000_000                 # 8B bf16 after its load
    assert probe_bytes(15 * gb, 8 * 2**20) == MIN_BUFFER
    assert probe_bytes(1_000_000, 20 * gb) == MIN_BUFFER


def test_bench_json_holds_the_floor_and_its_ratios(bench_run):
    rec = json.loads(bench_run["json"].read_text())
    assert rec["floor"]["bandwidth"]["gb_s"] > 0 and rec["floor"]["weight_bytes"] > 0
    assert set(rec["summary"]["floor_ratio"]) == {"32", "64"}
    assert set(rec["summary"]["fp8_ratio_vs_fp32"]) == {"32", "64"}
    assert all(v > 0 for v in rec["summary"]["floor_ratio"].values())
    assert "| context | weights read | cache read | floor ms |" in bench_run["out"]


def test_the_bandwidth_is_sampled_between_contexts_and_the_floor_takes_the_median(bench_run):
    """5 sums before, 3 before each context of each run, 5 after; the floor's GB/s is their median."""
    rec = json.loads(bench_run["json"].read_text())
    bw = rec["floor"]["bandwidth"]
    runs, contexts = rec["runs"], len(rec["summary"]["floor_ratio"])
    assert len(bw["samples_ms"]) == 5 + 3 * runs * contexts + 5
    median_ms = sorted(bw["samples_ms"])[len(bw["samples_ms"]) // 2]
    assert bw["gb_s"] == pytest.approx(bw["buffer_bytes"] / median_ms / 1e6, rel=1e-3)
    assert bw["slowest_gb_s"] <= bw["gb_s"] <= bw["fastest_gb_s"]


def test_a_tied_models_step_reads_each_weight_once():
    from kvchat.bench.floor import step_weight_bytes
    from kvchat.engine.geometry import Geometry
    from kvchat.engine.weights import random_model
    geom = Geometry("tiny", n_layers=1, hidden=64, n_heads=2, n_kv_heads=1, head_dim=32, intermediate=128,
                    vocab_size=100, rope_theta=10000.0, max_position=64, tie_embeddings=True)
    model = random_model(geom, torch.device("cpu"), torch.float32, seed=0)
    assert step_weight_bytes(model) == model.weight_bytes


def test_percentiles_interpolate_between_ranks():
    xs = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 10) == pytest.approx(1.4)
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile([], 50) is None


class FakeLlama:
    """Stands in for llama_cpp.Llama: llama-cpp-python is an optional extra that CI never
    installs, so its adapter is checked against the calls it makes, on a recorded script."""
    calls: list[str] = []

    def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, n_batch, verbose):
        self.model_path, self.n_threads = model_path, n_threads
        # as llama-cpp-python's Llama does: its model parameters start from the library's defaults
        self.use_extra_bufts = sys.modules["llama_cpp.llama_cpp"].llama_model_default_params().use_extra_bufts

    def reset(self):
        self.calls.append("reset")

    def generate(self, tokens, top_k, top_p, temp, reset):
        self.calls.append(f"generate {len(tokens)} temp={temp}")
        i = 0
        while True:  # like llama.cpp's, the generator never ends by itself
            i += 1
            yield 100 + i


def test_llama_cpp_peer_resets_then_times_each_token(monkeypatch):
    from kvchat.engine.sources import resolve
    from kvchat.bench.peers import load_llama_cpp
    fake, lib = type(sys)("llama_cpp"), type(sys)("llama_cpp.llama_cpp")
    fake.Llama, fake.llama_cpp = FakeLlama, lib
    lib.llama_model_default_params = lambda: types.SimpleNamespace(use_extra_bufts=True)
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", lib)
    FakeLlama.calls = []
    peer, why = load_llama_cpp(resolve(None), None, n_ctx=256, threads=2)
    assert why == "" and peer.gguf.name.endswith(".gguf") and peer.llm.n_threads == 2
    # loaded without llama.cpp's repacked weight layouts (its AMX one crashed on Q4_1), and the
    # library's defaults given back afterwards
    assert peer.llm.use_extra_bufts is False and lib.llama_model_default_params().use_extra_bufts is True
    t = peer.generate(list(range(40)), steps=3)
    assert FakeLlama.calls == ["reset", "generate 40 temp=0.0"]
    assert t.prompt_tokens == 40 and len(t.decode_ms) == 3 and t.ttft_ms >= 0


def test_the_same_weights_peers_cache_k_and_v_in_kvchats_cache_dtype(monkeypatch, tmp_path):
    """Like for like: llama.cpp on the exports of kvchat's weights caches K and V as kvchat's run
    does (ggml's F32 0, F16 1, BF16 30); the 4-bit file keeps llama.cpp's defaults. The peer and
    the exports are stood in for (CI has no llama-cpp-python); what is checked is the choice."""
    from kvchat.bench import gguf_export, peers
    from kvchat.engine.sources import resolve
    made: list[tuple[str, int | None]] = []

    class Peer:
        def __init__(self, gguf, n_ctx, threads, precision, cache_type=None):
            made.append((precision, cache_type))

    monkeypatch.setitem(sys.modules, "llama_cpp", type(sys)("llama_cpp"))
    monkeypatch.setattr(peers, "LlamaCppPeer", Peer)
    monkeypatch.setattr(gguf_export, "export", lambda choice: tmp_path / f"{choice}.gguf")
    monkeypatch.setattr(gguf_export, "file_precision", lambda path: path.stem.upper() if path.parent == tmp_path
                        else "Q4_1")
    for kv, want, says in (("fp32", 0, "F32 like"), ("bf16", 30, "BF16 like"), ("fp16", 1, "F16 like"),
                           ("fp8", None, "no such cache type")):
        made.clear()
        got, notes = peers.load_llama_cpp_files(resolve(None), None, ("f32", "bf16", "q4_1"), 256, 2, kv)
        assert made == [("F32", want), ("BF16", want), ("Q4_1", None)], kv
        assert sum(says in n for n in notes) == 2 and "default F16 cache" in notes[2]


@pytest.mark.parametrize("context", [31, 64, 257, 1024])
def test_history_renders_to_exactly_the_requested_tokens(engine, context):
    from kvchat.bench.history import history
    renderer = engine.new_conversation()
    engine.close_conversation(renderer)
    text, ids = history(renderer.render, engine.tokenizer, context, seed=3)
    assert len(ids) == context
    assert text.startswith("Note 1:")


def test_busy_decodes_alone_and_beside_a_busy_process_and_reports_the_slowdown(capsys):
    """`--busy 1` end to end on the real model: each round decodes alone, then beside one
    spinning process, and the table has both rows and a slowdown (no timing asserted)."""
    threads = torch.get_num_threads()
    try:
        code = main(["bench", "--busy", "1", "--contexts", "32", "--new-tokens", "3", "--runs", "2",
                     "--kv-budget", "64MiB", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Decode beside 1 busy process(es), context 32" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| alone") or
            line.startswith("| beside 1 busy")}
    assert set(rows) == {"alone", "beside 1 busy"}
    for line in rows.values():
        median, p90 = (float(c) for c in line.split("|")[2:4])
        assert 0 < median <= p90
    assert "Slowdown (busy over alone's median): median " in out and "round 2/2" in err
