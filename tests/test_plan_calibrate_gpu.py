"""`kvchat plan --calibrate` on a GPU's records: the H200 runs of session 24 (docs/gpu_batch.json,
`kvchat bench --batch 1,8,32,64 --contexts 1024,4096`, and docs/gpu_bench.json, `kvchat bench
--contexts 1024,8192,32768`, Llama 3.1 8B's geometry in bf16). They calibrate the table row that
--gpu names, which must be given and agree with the GPU's name where the record keeps it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.cli.command import main
from kvchat.plan.bench_points import from_bench_json
from kvchat.plan.calibration import costs_for
from kvchat.plan.fitter import fit
from kvchat.plan.step_time import DEFAULT_BW_EFF

ROOT = Path(__file__).resolve().parents[1]
BATCH, SINGLE = ROOT / "docs" / "gpu_batch.json", ROOT / "docs" / "gpu_bench.json"
BOTH = f"{BATCH},{SINGLE}"


def test_the_h200_records_calibrate_the_h200_row_and_its_decode_steps_fit_within_15_percent():
    data = from_bench_json(BOTH, "h200-sxm")
    assert (data.model, data.dtype, data.hardware) == ("llama-3.1-8b", "bf16", "h200-sxm")
    assert data.bandwidth == pytest.approx(json.loads(BATCH.read_text())["bandwidth"]["gb_s"] * 1e9)
    costs = costs_for(data.geometry, data.dtype, {p.kv_dtype for p in data.points}, kv_scales=True)
    bw = data.bandwidth
    prior = {"overhead": 1e-3, "row": 0.0, "weight": 1 / (bw * DEFAULT_BW_EFF), "kv": 1 / (bw * DEFAULT_BW_EFF),
             "lin": 1e-12, "attn": 1e-12, "request": 0.0}
    f = fit(data.points, costs, prior, model_kv="bf16")
    decode = [(p, ms) for p, ms in zip(data.points, f.predicted_ms) if p.what.startswith("batch ") or " decode " in p.what]
    assert len(decode) == 22
    assert all(abs(ms - p.ms) / p.ms < 0.15 for p, ms in decode), [(p.what, p.ms, ms) for p, ms in decode]


def test_a_gpu_record_needs_its_gpu_named(capsys):
    assert main(["plan", "--calibrate", BOTH]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "measured on a GPU; say which with --gpu" in err[0], err


def _named(tmp_path: Path, gpu: str) -> str:
    d = json.loads(BATCH.read_text())
    d["machine"]["gpu"] = gpu
    path = tmp_path / "batch.json"
    path.write_text(json.dumps(d))
    return f"{path},{SINGLE}"


def test_the_gpu_a_record_names_must_be_the_one_given(tmp_path, capsys):
    assert main(["plan", "--calibrate", _named(tmp_path, "NVIDIA A100-SXM4-80GB"), "--gpu", "h200-sxm"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "measured on NVIDIA A100-SXM4-80GB, not on H200 SXM" in err[0] and "a100-sxm-80gb" in err[0]
    cal = tmp_path / "cal.json"
    assert main(["plan", "--calibrate", _named(tmp_path, "NVIDIA H200"), "--gpu", "h200-sxm",
                 "--write-calibration", str(cal)]) == 0
    assert json.loads(cal.read_text())["hardware"] == "h200-sxm"


def test_a_cpu_and_a_gpu_record_are_not_fitted_together(tmp_path, capsys):
    d = json.loads(BATCH.read_text())
    d["model"]["device"] = "cpu"          # the same model measured on a CPU
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(d))
    assert main(["plan", "--calibrate", f"{path},{SINGLE}", "--gpu", "h200-sxm"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "measured on a CPU and on a GPU" in err[0], err


def test_the_h200_calibration_plans_for_the_h200_alone(tmp_path, capsys):
    cal = tmp_path / "h200.json"
    assert main(["plan", "--calibrate", BOTH, "--gpu", "h200-sxm", "--write-calibration", str(cal)]) == 0
    capsys.readouterr()
    assert main(["plan", "--gpu", "h200-sxm", "--calibration", str(cal), "--users", "8", "--no-terminal-plot"]) == 0
    assert "h200" in capsys.readouterr().out.lower()
    assert main(["plan", "--calibration", str(cal), "--users", "8"]) == 2      # the default GPU, the H100
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "'h200-sxm', not 'h100-sxm'" in err[0], err
