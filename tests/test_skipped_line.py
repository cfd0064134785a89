"""`make test` on a machine without the vLLM venv says, in one line at the end, which tests it
skipped and the command that enables them (issue 21)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_vllm_venv_is_named_in_one_line_with_its_command(tmp_path):
    env = dict(os.environ, KVCHAT_VLLM_VENV=str(tmp_path / "no-venv"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/server"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in done.stdout.splitlines() if "vLLM server tests" in x]
    assert done.returncode == 0, done.stdout[-3000:]
    assert len(lines) == 1, done.stdout[-3000:]
    assert lines[0].startswith("skipped ") and f"no vLLM venv at {tmp_path / 'no-venv'}" in lines[0]
    assert "bash scripts/setup-vllm.sh" in lines[0]
