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


def test_a_rebuild_lets_go_of_the_old_pool_before_making_the_new_one(engine, monkeypatch):
    """On a GPU the default pool takes 90% of the free memory, so the old one must be freed first:
    the engine's, the runner's and a graph decoder's holds on it all go (the H200 run found the
    runner and the decoder keeping it, and `/kv fp8` out of memory). Here the new pool's
    allocation looks for the old tensors still alive."""
    import gc
    import weakref

    from kvchat.engine import cuda_graph, kv_cache

    cuda_graph.decoder_for(engine.model, engine.pool)   # as a CUDA step would have made it
    old = weakref.ref(engine.pool.data)
    alive_at_build = []
    real = kv_cache.KVPool.__init__

    def build(self, *args, **kwargs):
        gc.collect()
        alive_at_build.append(old() is not None)
        real(self, *args, **kwargs)
    monkeypatch.setattr(kv_cache.KVPool, "__init__", build)
    try:
        engine.set_kv_dtype("fp8")
        assert alive_at_build == [False]
        assert engine.kv_dtype == "fp8" and engine.runner.pool is engine.pool
    finally:
        monkeypatch.undo()
        engine.set_kv_dtype("fp32")
