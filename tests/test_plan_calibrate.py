"""`kvchat plan --calibrate` on the batched bench's record (`kvchat bench --batch --json`):
its rows become decode steps of B sequences, which is what lets the fit tell the per-sequence
overhead from the per-step one; a single bench and a batched one fit together; bad records
are one line and exit status 2.

tests/data/batch-bench-tiny.json is a real run on this project's loaded 2-core machine
(`kvchat bench --batch 1,2,4 --contexts 64,256 --new-tokens 8 --runs 1 --no-peers`, its
command inside): its figures are noisy, so on it the tests check what was read and what the
fit could identify, not how well it fits. How well the fit recovers constants is checked on a
record written from known constants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.cli.command import main
from kvchat.engine.geometry import KNOWN
from kvchat.plan.bench_points import from_bench_json
from kvchat.plan.calibration import costs_for
from kvchat.plan.fitter import fit

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "data" / "batch-bench-tiny.json"
PRIOR = {"overhead": 1e-3, "row": 0.0, "weight": 1e-10, "kv": 1e-10, "lin": 1e-12, "attn": 1e-12, "request": 0.0}


def test_each_row_of_a_real_batched_bench_is_one_step_of_b_sequences():
    rec = json.loads(TINY.read_text())
    data = from_bench_json(str(TINY))
    assert (data.model, data.dtype, data.hardware) == ("smollm2-135m", "fp32", "cpu")
    assert data.bandwidth == pytest.approx(rec["bandwidth"]["gb_s"] * 1e9)
    assert len(data.points) == len(rec["rows"]) == 12
    for p, r in zip(data.points, rec["rows"]):
        b, read = r["batch"], r["context_tokens_per_step"]
        assert p.kv_dtype == r["kv_dtype"] and p.ms == r["step_ms"]["median"] and p.requests == 0
        assert p.steps == ((b, b, b, float(read), float(read + b)),)
        assert b * r["context"] <= read <= b * (r["context"] + rec["new_tokens"] + 1)


def test_the_batched_rows_make_the_per_sequence_overhead_identifiable():
    one = from_bench_json(str(ROOT / "docs" / "bench.json"))
    both = from_bench_json(f"{ROOT / 'docs' / 'bench.json'},{TINY}")
    assert len(both.points) == len(one.points) + 12
    assert "docs/bench.json" in both.source and "batch-bench-tiny.json" in both.source
    assert both.bandwidth == one.bandwidth                   # the first record's probe is the reference
    for data, row_fixed in ((one, True), (both, False)):
        costs = costs_for(KNOWN[data.model], data.dtype, {p.kv_dtype for p in data.points}, kv_scales=True)
        f = fit(data.points, costs, PRIOR, model_kv=data.dtype)
        assert ("row" in f.fixed) is row_fixed
        assert "request" not in f.fixed                       # the single bench's turns hold their first steps


def _record(tmp: Path, overhead: float, row: float, eff: dict[str, float], bw: float) -> Path:
    """A batched bench's record written from known constants (the step-time model's decode
    step, memory-bound): what a perfectly quiet machine would have measured."""
    g = KNOWN["smollm2-135m"]
    costs = costs_for(g, "fp32", {"fp32", "fp8"}, kv_scales=True)
    rows = []
    for kv in ("fp32", "fp8"):
        c = costs[kv]
        for ctx in (256, 2048):
            for b in (1, 2, 4, 8):
                read = b * (ctx + 4)
                s = overhead + b * row + c.weight_bytes / (bw * eff["fp32"]) \
                    + (read + b) * c.kv_bytes_per_token / (bw * eff[kv])
                rows.append({"kv_dtype": kv, "context": ctx, "batch": b, "context_tokens_per_step": read,
                             "step_ms": {"median": s * 1000, "p10": s * 900, "p90": s * 1300, "n": 8}})
    d = {"kind": "kvchat-batch-bench", "version": 1, "command": "kvchat bench --batch 1,2,4,8 (written by a test)",
         "model": {"model": "smollm2-135m", "device": "cpu", "dtype": "fp32", "kv_dtype": "fp32"},
         "new_tokens": 8, "bandwidth": {"gb_s": bw / 1e9}, "rows": rows}
    path = tmp / "batch.json"
    path.write_text(json.dumps(d))
    return path


def test_the_fit_recovers_known_step_and_sequence_overheads_from_batched_rows(tmp_path, capsys):
    bw = 20e9
    path = _record(tmp_path, overhead=4e-3, row=1.5e-3, eff={"fp32": 0.6, "fp8": 0.25}, bw=bw)
    data = from_bench_json(str(path))
    costs = costs_for(KNOWN[data.model], data.dtype, {"fp32", "fp8"}, kv_scales=True)
    f = fit(data.points, costs, PRIOR, model_kv="fp32")
    assert f.mape(data.points) < 1e-6
    assert f.value("overhead") == pytest.approx(4e-3, rel=1e-6)
    assert f.value("row") == pytest.approx(1.5e-3, rel=1e-6)
    assert 1 / (f.value("kv:fp8") * bw) == pytest.approx(0.25, rel=1e-6)
    # and through the command: the constants saved, the sequence overhead no longer a prior
    cal = tmp_path / "cal.json"
    assert main(["plan", "--calibrate", str(path), "--write-calibration", str(cal)]) == 0
    out = capsys.readouterr().out
    saved = json.loads(cal.read_text())
    assert saved["constants"]["row_overhead"] == pytest.approx(1.5e-3, rel=1e-6)
    assert "not identifiable" not in saved["sources"]["row_overhead"]
    assert "batch 8 at 2048 (fp8)" in out


def _bad(tmp: Path, d: dict | str) -> str:
    path = tmp / "b.json"
    path.write_text(d if isinstance(d, str) else json.dumps(d))
    return str(path)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("bandwidth"), "lacks the batched bench's bandwidth probe"),
    (lambda d: d.pop("rows"), "not a `kvchat bench --json` or"),
    (lambda d: d["model"].update(device="cuda:0"), "measured on a GPU; say which with --gpu"),
    (lambda d: d["model"].update(device="mps"), "measured on 'mps'; accepted: cpu or cuda records"),
    (lambda d: d.update(rows=d["rows"][:2]), "found 2 measured points"),
    (lambda d: d["model"].update(model="llama-9"), "not in kvchat's table"),
], ids=["no-bandwidth", "no-rows", "gpu-record", "other-device", "too-few-rows", "unknown-model"])
def test_a_bad_batched_record_is_one_line_and_status_2(tmp_path, capsys, change, fragment):
    d = json.loads(TINY.read_text())
    change(d)
    assert main(["plan", "--calibrate", _bad(tmp_path, d)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and fragment in err[0], err


def test_records_of_different_models_are_not_fitted_together(tmp_path, capsys):
    d = json.loads(TINY.read_text())
    d["model"]["dtype"] = "bf16"
    assert main(["plan", "--calibrate", f"{TINY},{_bad(tmp_path, d)}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "different models or dtypes" in err[0], err


def test_a_single_benchs_prefills_are_cut_in_the_chunks_its_engine_took(tmp_path, capsys):
    """model.prefill_chunk (engine.describe(): 2,048 for the bundled model's bf16 prefill
    alone, engine/sizing.py) cuts each prefill point into its steps; a record written before it
    was recorded is read as 512, the CPU's chunk then; a chunk that is not a positive count is
    one line and exit status 2."""
    rec = json.loads((ROOT / "docs" / "bench.json").read_text())
    rec["model"].pop("prefill_chunk", None)
    path = tmp_path / "bench.json"
    chunks = {}
    for chunk in (None, 2048):
        if chunk is not None:
            rec["model"]["prefill_chunk"] = chunk
        path.write_text(json.dumps(rec))
        pre = [p for p in from_bench_json(str(path)).points if " prefill of " in p.what]
        assert pre and all(sum(s[0] for s in p.steps) == int(p.what.rsplit(" ", 1)[1]) for p in pre)
        chunks[chunk] = {s[0] for p in pre for s in p.steps}
    assert max(chunks[None]) == 512 and max(chunks[2048]) == 2048
    rec["model"]["prefill_chunk"] = "big"
    path.write_text(json.dumps(rec))
    assert main(["plan", "--calibrate", str(path)]) == 2
    assert "model.prefill_chunk is 'big'" in capsys.readouterr().err
