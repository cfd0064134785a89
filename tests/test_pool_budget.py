"""A KV dtype switch keeps the pool's byte budget: fixed in bytes at the first build, so
bf16 holds twice fp32's blocks (issue 12: the CPU default budget was recomputed per dtype,
and fp32 -> bf16 halved the pool while keeping its block count)."""
from __future__ import annotations

from kvchat.engine import engine as engine_mod


def test_the_default_budget_is_fixed_in_bytes_across_kv_dtypes(engine, monkeypatch):
    per_dtype = {"fp32": 32 * 2**20, "bf16": 16 * 2**20}      # like default_budget: one per dtype
    monkeypatch.setattr(engine_mod, "default_budget", lambda geom, kv, device: per_dtype[kv])
    monkeypatch.setattr(engine.config, "kv_budget", None)
    saved = engine.kv_budget_bytes
    try:
        engine.kv_budget_bytes = None               # as at the first build
        engine.set_kv_dtype("fp32")
        fp32_blocks = engine.spec.num_blocks
        engine.set_kv_dtype("bf16")
        assert engine.kv_budget_bytes == 32 * 2**20
        assert engine.spec.num_blocks >= 2 * fp32_blocks           # half the bytes per block
        assert engine.pool.nbytes <= 32 * 2**20 and engine.pool.nbytes > 31 * 2**20
    finally:
        engine.kv_budget_bytes = saved
        monkeypatch.undo()
        engine.set_kv_dtype("fp32")
