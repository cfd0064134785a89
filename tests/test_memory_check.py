"""A model that cannot fit is refused in one line before anything is allocated."""
from __future__ import annotations

import pytest

from kvchat.engine import Engine, EngineConfig, KvchatError
from kvchat.engine import engine as engine_mod
from kvchat.engine.geometry import KNOWN
from kvchat.engine.sizing import WORKING_MARGIN, memory_plan

from cli_helpers import fails_with


def test_plan_counts_weights_pool_and_margin():
    g = KNOWN["llama-3.1-8b"]
    plan = memory_plan(g, "fp32", 2**30, 24 * 2**30, "cpu")
    assert plan.weight_bytes == g.param_count() * 4
    assert plan.needed == plan.weight_bytes + 2**30 + WORKING_MARGIN
    assert not plan.fits
    line = plan.refusal({"bf16": g.param_count() * 2})
    assert line.endswith("try --dtype bf16") and "\n" not in line
    assert memory_plan(g, "bf16", 2**30, 24 * 2**30, "cpu").fits


def test_engine_refuses_before_allocating(monkeypatch):
    """With 3 GiB free (a fake figure) the bundled model's weights fit but 8B's do not."""
    monkeypatch.setattr(engine_mod, "available_memory", lambda device: 3 * 2**30)
    loaded = []
    monkeypatch.setattr(engine_mod, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(KvchatError, match=r"llama-3.1-8b in fp32 does not fit on cpu: it needs about 32\.\d GB"):
        Engine(EngineConfig(model="llama-3.1-8b", random_weights=True, device="cpu", dtype="fp32", kv_budget="64MiB"))
    assert loaded == []


def test_cli_refuses_8b_in_fp32_on_this_machine(capsys):
    """On the real free memory of a machine of less than 32 GB: no 21 GB climb, one line."""
    if engine_mod.available_memory(engine_mod.pick_device("cpu")) > 34 * 10**9:
        pytest.skip("this machine has room for 8B in fp32")
    fails_with(capsys, ["ask", "--model", "llama-3.1-8b", "--random-weights", "--device", "cpu", "--dtype", "fp32",
                        "hi"], "does not fit", "--dtype bf16")
