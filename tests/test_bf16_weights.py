"""bf16 weights on the CPU (engine/model.py's act_dtype, engine/csrc/gemv_bf16.c): the
bundled model with its matrices in bf16 decodes within the quality bounds that let `--dtype
auto` pick bf16 where the CPU multiplies bf16 natively (engine.cpu_auto_dtype), through the
C kernel's bf16 path, with rows and norms in fp32 and the cache in bf16 (auto: the weights'
dtype) or fp32."""
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
MEAN_ABS = 0.1      # mean |logit difference| to fp32 (measured 0.041; with a bf16 KV cache too 0.046)


def decode(engine: Engine, ids: list[int], kv: str = "fp32") -> torch.Tensor:
    g = engine.geometry
    spec = plan_pool(g, kv, 2 * (PREFIX + STEPS + 16) * g.kv_bytes_per_token(kv), 16)
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
    assert m.layers[0].attn_norm.dtype == torch.float32 and bf.kv_dtype == "bf16"     # auto: the weights' dtype
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
    # a bf16 cache as well (--kv-dtype bf16): every step still one C step, within the same bounds
    steps["decode_step"] = 0
    both = decode(bf, ids, "bf16")
    assert steps["decode_step"] == STEPS
    agree = float((both.argmax(-1) == want.argmax(-1)).float().mean())
    mean_abs = float((both - want).abs().mean())
    assert agree >= AGREE and mean_abs < MEAN_ABS and not torch.equal(both, got), (agree, mean_abs)
    # auto, asked for again (the app's /kv auto), gives the bf16 cache it gave at the start
    bf.set_kv_dtype("fp32")
    assert bf.kv_dtype == "fp32" and bf.pool.data.dtype == torch.float32
    bf.set_kv_dtype("auto")
    assert bf.kv_dtype == "bf16" and bf.pool.data.dtype == torch.bfloat16
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


def test_many_rows_against_bf16_weights_widen_them_where_the_cpu_has_no_bf16_arithmetic(monkeypatch):
    """A prefill's rows against bf16 weights: on a CPU without bf16 arithmetic the weights are
    widened to fp32 a slice at a time (model.widened) and the rows stay fp32, so the product
    carries only fp32's rounding of the bf16 weights' exact values; the bf16 path rounds x to
    bf16 first (about 2^-9 relative per element). Both against float64 on fresh random data,
    with slices smaller than the matrix so that several slices and a ragged last one run."""
    from kvchat.engine import model as M
    from kvchat.engine.native_build import cpu_flags
    assert M.WIDEN_BF16 == (not {"avx512_bf16", "amx_bf16"} & cpu_flags())
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = torch.randn(M.WIDEN_MIN_ROWS + 7, 576, generator=gen)
    w = torch.randn(1000, 576, generator=gen).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    # fp32 sums of k = 576 products: |error| <= k * 2^-24 * sum |x_i w_i| (a loose form of
    # Higham's gamma_k bound), far below bf16's rounding of x
    bound = 576 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    monkeypatch.setattr(M, "WIDEN_SLICE_BYTES", 300 * 576 * 4)         # slices of 300 rows: 300, 300, 300, 100
    calls = count_calls(monkeypatch, M, "widened")
    monkeypatch.setattr(M, "WIDEN_BF16", True)
    with native.disabled():                          # a decode step's few rows would go to C
        wide = M.linear(x, w)
    assert calls["widened"] == 1 and wide.dtype == torch.float32 and wide.shape == (x.shape[0], 1000)
    assert bool(((wide.double() - ref).abs() <= bound).all())
    monkeypatch.setattr(M, "WIDEN_BF16", False)
    with native.disabled():
        narrow = M.linear(x, w)
    assert calls["widened"] == 1                                         # the bf16 GEMM instead
    # x rounded to bf16 breaks the fp32 bound: the test tells the two paths apart
    assert not bool(((narrow.double() - ref).abs() <= bound).all())
    # fewer rows than WIDEN_MIN_ROWS keep the bf16 product even where widening is on
    monkeypatch.setattr(M, "WIDEN_BF16", True)
    with native.disabled():
        M.linear(x[:M.WIDEN_MIN_ROWS - 1], w)
    assert calls["widened"] == 1


def prefill_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    g = engine.geometry
    spec = plan_pool(g, "fp32", 2 * (len(ids) + 16) * g.kv_bytes_per_token("fp32"), 16)
    pool = KVPool(g, spec, engine.device)
    table = torch.arange(spec.num_blocks, dtype=torch.int32)
    with torch.inference_mode():
        return engine.model.forward(torch.tensor(ids), torch.arange(len(ids)), Step(table, torch.arange(len(ids)), 0,
                                                                                 False), pool, last_only=False)


@pytest.mark.slow   # the bundled model, three prefills
def test_a_prefill_against_bf16_weights_attends_and_gates_in_bf16_within_the_bounds(engine):
    """Where the CPU has bf16 arithmetic, a prefill's attention and its gate/up/down rows run
    in bf16 (model.prefill_dtype: torch's bf16 kernels, AMX where present; 1,024 tokens 899 ->
    651 ms on a 2-core Xeon). Forced here on any CPU (torch's bf16 kernels run everywhere, if
    slower), so the path is checked on every machine: every row's logits against fp32
    weights within the decode test's bounds, and different from the same prefill with fp32
    attention and gating (so the bf16 path did run)."""
    from kvchat.engine.native_build import computes_bf16
    from test_cpu_attention import bundled_text_ids  # noqa: PLC0415
    ids = bundled_text_ids(engine)[:PREFIX]
    bf = Engine(EngineConfig(dtype="bf16", kv_budget="16MiB"))
    m = bf.model
    assert m.prefill_dtype == (torch.bfloat16 if computes_bf16() else torch.float32)
    want = prefill_logits(engine, ids)
    m.prefill_dtype = torch.float32
    plain = prefill_logits(bf, ids)
    m.prefill_dtype = torch.bfloat16
    got = prefill_logits(bf, ids)
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    mean_abs = float((got - want).abs().mean())
    assert agree >= AGREE and mean_abs < MEAN_ABS, (agree, mean_abs)
    assert not torch.equal(got, plain)


def test_a_short_bf16_chunk_takes_the_amx_products_within_the_bounds(engine, monkeypatch):
    """A chat's next turn (16 to 32 rows) in a bf16 prefill: its products on the AMX tiles
    (native.amx_serves: the rows widened exactly, summed in fp32, rounded back to bf16) rather
    than torch's bf16 product, which copies each matrix into its own layout at every call.
    Every row's logits against fp32 weights within the decode test's bounds, and beside
    torch's product's (on a Xeon with AMX, torch 2.13: the same bits, oneDNN's tiles summing k
    in the same order; not asserted, another oneDNN may order its sums otherwise)."""
    if not native.amx():
        pytest.skip("no AMX tiles here")
    from test_cpu_attention import bundled_text_ids  # noqa: PLC0415
    ids = bundled_text_ids(engine)[:24]
    bf = Engine(EngineConfig(dtype="bf16", kv_budget="16MiB"))
    m = bf.model
    calls = count_calls(monkeypatch, native, "gemv")
    got = prefill_logits(bf, ids)
    assert calls["gemv"] == 4 * len(m.layers) + 1     # qkv, o, gate/up, down a layer; the logits (fp32 rows)
    monkeypatch.setattr(native, "amx_serves", lambda x, w: False)
    torch_mm = prefill_logits(bf, ids)
    assert calls["gemv"] == 4 * len(m.layers) + 2     # only the logits': torch's product served the layers
    want = prefill_logits(engine, ids)
    for out in (got, torch_mm):
        agree = float((out.argmax(-1) == want.argmax(-1)).float().mean())
        assert agree >= AGREE and float((out - want).abs().mean()) < MEAN_ABS, agree
    assert float((got - torch_mm).abs().mean()) < MEAN_ABS / 2
