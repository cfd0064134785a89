"""benchmarks/cpu_attention.py cannot rot unseen: a tiny run of it on the real kernel, its
bytes figure checked by hand, and its flags refused with exit status 2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvchat.engine import native

REPO = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("cpu_attention", REPO / "benchmarks" / "cpu_attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(native.lib() is None, reason="the C kernels are not built here")
def test_a_small_run_prints_a_row_per_point_with_the_bytes_each_call_reads(monkeypatch, capsys):
    bench = load()
    monkeypatch.setattr(bench, "POOL_BYTES", 2 << 20)     # a few layers' pools, not 1.2 GB
    assert bench.main(["--kv", "fp32,fp8", "--batches", "2", "--contexts", "400", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp")]
    assert [r.split("|")[1].strip() for r in rows] == ["fp32", "fp8"]
    for r in rows:
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert cells[1:3] == ["2", "400"]
        assert float(cells[3]) > 0 and float(cells[4]) <= float(cells[3]) and float(cells[6]) > 0
    # K and V of 2 sequences x 400 rows x 3 KV heads x 64: fp32 4 bytes each; fp8 1 byte and a
    # 4-byte scale per row and head (0.33 MB; 0.31 without the scales)
    fp32_mb, fp8_mb = (float(r.split("|")[6]) for r in rows)
    assert fp32_mb == round(2 * 2 * 400 * 3 * 64 * 4 / 1e6, 2)
    assert fp8_mb == round((2 * 2 * 400 * 3 * 64 + 2 * 2 * 400 * 3 * 4) / 1e6, 2)
    assert "read bandwidth" in out


@pytest.mark.parametrize("flags", [["--kv", "int4"], ["--batches", "0"], ["--geometry", "3,3"], ["--reps", "0"]])
def test_bad_flags_are_refused_with_status_2(flags, capsys):
    with pytest.raises(SystemExit) as ended:
        load().main(flags)
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip()
