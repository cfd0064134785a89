"""bf16 weights on the CPU (engine/model.py's act_dtype, engine/csrc/gemv_bf16.c): the
bundled model with its matrices in bf16 decodes within the quality bounds that let `--dtype
auto` pick bf16 where the CPU multiplies bf16 natively (engine.cpu_auto_dtype), through the
C kernel's bf16 path, with rows, norms and the cache in fp32."""
from __future__ import annotations

import pytest
import torch

from counting import count_calls
from kvchat.engine import Engine, EngineConfig, native, native_step
from kvchat.engine.engine import cpu_auto_dtype
from kvchat.engine.kv_cache import KVPool, plan_pool
from kvchat.engine.model import Step

PREFIX, STEPS = 300, 48
AGREE = 0.95        # greedy agreement with fp32 over teacher-forced decode steps (measured 100% of 96)
MEAN_ABS = 0.1      # mean |logit difference| to fp32 (measured 0.041; bf16 KV 0.046)


def decode(engine: Engine, ids: list[int]) -> torch.Tensor:
    g = engine.geometry
    spec = plan_pool(g, "fp32", 2 * (PREFIX + STEPS + 16) * g.kv_bytes_per_token("fp32"), 16)
    pool = KVPool(g, spec, engine.device)
    table = torch.arange(spec.num_blocks, dtype=torch.int32)
    m = engine.model
    out = []
    with torch.inference_mode():
        m.forward(torch.tensor(ids[:PREFIX]), torch.arange(PREFIX), Step(table, torch.arange(PREFIX), 0, False), pool)
        for p in range(PREFIX, PREFIX + STEPS):
            out.append(m.forward(torch.tensor([ids[p]]), torch.tensor([p]),
                                 Step(table, torch.tensor([p]), p, True, runs=((0, spec.num_blocks),)), pool)[0])
    return torch.stack(out)


@pytest.mark.slow   # the bundled model, twice
def test_bf16_weights_decode_through_the_kernel_within_the_bounds(engine, monkeypatch):
    if native.lib() is None:
        pytest.skip(f"C kernels off: {native.status()}")
    from test_cpu_attention import bundled_text_ids  # noqa: PLC0415
    ids = bundled_text_ids(engine)
    bf = Engine(EngineConfig(dtype="bf16", kv_budget="16MiB"))
    m = bf.model
    assert m.layers[0].wqkv.dtype == torch.bfloat16 and m.act_dtype == torch.float32
    assert m.layers[0].attn_norm.dtype == torch.float32 and bf.kv_dtype == "fp32"
    assert m.weight_bytes < 0.55 * engine.model.weight_bytes
    calls = count_calls(monkeypatch, native, "gemv")
    steps = count_calls(monkeypatch, native_step, "decode_step")
    got = decode(bf, ids)
    # every decode step is one C step (its products in bf16), none layer by layer: that would
    # be 4 products a layer through native.gemv (the prefill's last row makes a few)
    assert steps["decode_step"] == STEPS and calls["gemv"] < 2 * len(m.layers), (steps, calls)
    want = decode(engine, ids)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    mean_abs = float((got - want).abs().mean())
    assert agree >= AGREE and mean_abs < MEAN_ABS, (agree, mean_abs)
    # the same steps with the weights' low bits thrown away (bf16 -> 8 bits of mantissa lost
    # a second time: fp8-like weights) fall outside the bounds: they are not loose
    for layer in m.layers:
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            w = getattr(layer, name)
            setattr(layer, name, (w.view(torch.int16) & ~0xF).view(torch.bfloat16))
    coarse = decode(bf, ids)
    assert float((coarse - want).abs().mean()) > MEAN_ABS


def test_auto_picks_bf16_exactly_where_the_kernel_multiplies_bf16_natively():
    assert cpu_auto_dtype() == ("bf16" if native.bf16_native() else "fp32")
    with native.using("portable"):             # the widening loop: the same bytes, fp32 stays the default
        assert native.lib() is not None and not native.bf16_native() and cpu_auto_dtype() == "fp32"
    with native.disabled():
        assert cpu_auto_dtype() == "fp32"
