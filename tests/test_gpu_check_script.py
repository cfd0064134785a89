"""benchmarks/gpu_check.py cannot rot unseen: its --cpu-dry-run runs every section on a tiny
geometry on the CPU (kernels interpreted). Its timings mean nothing there, so the speed
verdicts may read FAIL; what must hold is that every section runs (no ERROR row) and every
correctness check passes."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_script_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "rows.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-dry-run", "--quick",
                          "--json", str(out)], capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " 0 errors" in run.stdout, run.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert not [r for r in rows if r["value"] == "ERROR"]
    correctness = [r for r in rows if r["section"] == "correct"]
    assert correctness and all("PASS" in r["verdict"] for r in correctness if r["verdict"]), correctness
