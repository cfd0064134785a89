"""The fused C calls around the kernels (engine/native_step.py; engine/csrc/step.c and
write.c's kv_rope_write) against float64 references within the bounds of tests/tolerance.py,
on fresh random inputs, and the whole C decode step (kv_decode_step) against the
layer-by-layer path it replaces: the same kernels in the same order, so the same bits, for
one sequence or a batch, fp32 or bf16 weights, fp32, bf16, fp16 or fp8 cache. Every build level runs the
same checks (tests/test_native_levels.py).
"""
from __future__ import annotations

import pytest
import torch

from tolerance import (ETA, EXP_ULPS, U, assert_within, attention_reference, gamma, rms_norm_reference,
                       rope_reference, silu_mul_reference)
from kvchat.engine import attention as A
from kvchat.engine import cpu_attention
from kvchat.engine import native, native_step
from kvchat.engine.geometry import Geometry
from kvchat.engine.kv_cache import KVPool, plan_pool
from kvchat.engine.model import Batch, Step
from kvchat.engine.weights import random_model

FP8 = torch.float8_e4m3fn
BS = 16


# ---- the ops -----------------------------------------------------------------------------------
def check_add_rms_norm(gen: torch.Generator, b: int, k: int, what: str = "") -> None:
    x, r = torch.randn(b, k, generator=gen) * 3, torch.randn(b, k, generator=gen)
    w = torch.randn(k, generator=gen)
    got = x.clone()
    y = native_step.add_rms_norm(got, r, w, 1e-5)
    assert torch.equal(got, x + r), f"{what}: the residual add is one fp32 rounding, as torch's"
    assert_within(y, *rms_norm_reference(x + r, w, 1e-5), what=f"{what} add+norm")
    alone = x.clone()
    assert_within(native_step.add_rms_norm(alone, None, w, 1e-5), *rms_norm_reference(x, w, 1e-5), what=what)
    assert torch.equal(alone, x), f"{what}: without a residual x is not written"


def check_silu_mul(gen: torch.Generator, b: int, n: int, what: str = "") -> None:
    """Gates far into both tails of exp, and at its edges: e^88.5 is near fp32's largest (its
    exponent 2^128 times a fraction), e^100 overflows (torch's exp too: silu is -0 there, and
    the exact value, -100 e^-100, is within the bound's underflow term). Between 88.72 and
    88.73 fp32's exp overflows where the exact value does not: torch fails the bound there
    too, so no gate is drawn from there."""
    gu = torch.randn(b, 2 * n, generator=gen) * 20
    gu[0, : min(n, 8)] = torch.tensor([0.0, 87.5, -87.5, 88.5, -88.5, 100.0, -100.0, 1e-3])[: min(n, 8)]
    assert_within(native_step.silu_mul(gu), *silu_mul_reference(gu), what=f"{what} silu*up")


def check_chunk_ops(gen: torch.Generator, b: int, k: int, n: int, what: str = "") -> None:
    """A prompt chunk's rows (add_rms_norm_rows, silu_mul_rows; threads over the rows past
    65,536 values): each row the bits the decode step's own call gives it; the residual
    taken in bf16 widened exactly, the norm given in bf16 as torch rounds fp32 to bf16 (nearest
    even; a NaN stays a NaN, though not torch's vector path's 0xFFFF); silu * up on bf16 rows
    within its bound."""
    x, r = torch.randn(b, k, generator=gen) * 3, torch.randn(b, k, generator=gen)
    w = torch.randn(k, generator=gen)
    got, want = x.clone(), x.clone()
    y = native_step.add_rms_norm_rows(got, r, w, 1e-5)
    assert torch.equal(y, native_step.add_rms_norm(want, r, w, 1e-5)) and torch.equal(got, want), what
    rb = r.bfloat16()
    got, want = x.clone(), x.clone()
    y = native_step.add_rms_norm_rows(got, rb, w, 1e-5)
    assert torch.equal(got, x + rb.float()), f"{what}: a bf16 residual is widened exactly, then one fp32 add"
    assert torch.equal(y, native_step.add_rms_norm(want, rb.float(), w, 1e-5)), what
    x[0, 0] = float("nan")
    y16 = native_step.add_rms_norm_rows(x.clone(), None, w, 1e-5, torch.bfloat16)
    y32 = native_step.add_rms_norm_rows(x.clone(), None, w, 1e-5)
    want16 = y32.bfloat16()
    assert y16.dtype == torch.bfloat16 and torch.equal(y16.isnan(), want16.isnan()) and y16[0].isnan().all(), what
    assert torch.equal(y16[1:].view(torch.int16), want16[1:].view(torch.int16)), \
        f"{what}: the bf16 norm is torch's rounding of the fp32 one, bit for bit"
    gu = torch.randn(b, 2 * n, generator=gen) * 20
    gate = gu[:, :n]     # below -88.72 fp32's e^-gate overflows where gate e^gate is not yet below
    gate[gate < -87] = -100.0   # the bound's underflow term (check_silu_mul); -100 is within it
    assert torch.equal(native_step.silu_mul_rows(gu), native_step.silu_mul(gu)), what
    g16 = gu.bfloat16()
    assert_within(native_step.silu_mul_rows(g16).float(), *silu_mul_reference(g16), what=f"{what} bf16 silu*up")


def pool_for(hk: int, d: int, nb: int, kv: str, head_major: bool):
    """NaN-filled K/V caches (e4m3's NaN byte and NaN scales for fp8) in either layout."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8}[kv]

    def one(*last, dt):
        t = torch.empty(hk, nb, BS, *last, dtype=dt) if head_major else torch.empty(nb, BS, hk, *last, dtype=dt)
        (t.view(torch.uint8).fill_(0x7F) if dt == FP8 else t.fill_(float("nan")))
        return t.movedim(0, 2) if head_major else t
    caches = [one(d, dt=dtype), one(d, dt=dtype)]
    scales = [one(dt=torch.float32), one(dt=torch.float32)] if kv == "fp8" else [None, None]
    return caches + scales


def tables(d: int, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(torch.arange(n_pos, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), dim=-1).float()
    return emb.cos()[:, None, :].contiguous(), emb.sin()[:, None, :].contiguous()     # (n_pos, 1, d) each


def rows_at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    nb, bs, hk, d = cache.shape
    return cache.reshape(nb * bs, *cache.shape[2:])[slots]


def check_rope_write(gen: torch.Generator, hq: int, hk: int, d: int, t: int, kv: str, head_major: bool,
                     what: str = "") -> None:
    """q comes back rotated, K lands rotated and V as it was, in their slots only; for a bf16
    or fp8 cache, the bits (and fp8's scales) write_kv_ref gives the same rotated rows."""
    nb, n_pos = 12, 3000
    cos, sin = tables(d, n_pos)
    width = (hq + 2 * hk) * d
    qkv = (torch.randn(t, width + 5, generator=gen) * 2)[:, :width]        # rows at a stride past their width
    pos = torch.randint(0, n_pos, (t,), generator=gen)
    slots = torch.randperm(nb * BS, generator=gen)[:t]
    q_in = qkv[:, :hq * d].reshape(t, hq, d)
    k_in = qkv[:, hq * d:(hq + hk) * d].reshape(t, hk, d)
    v_in = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
    assert native_step.rope_serves(qkv, cos, pool_for(hk, d, 1, kv, head_major)[0], pos, slots)
    f32 = pool_for(hk, d, nb, "fp32", head_major)
    q = native_step.rope_write(qkv, cos, sin, pos, f32[0], f32[1], slots, None, None, hq)
    assert_within(q, *rope_reference(q_in, cos[pos], sin[pos]), what=f"{what} q")
    k_rot = rows_at(f32[0], slots)
    assert_within(k_rot, *rope_reference(k_in, cos[pos], sin[pos]), what=f"{what} k")
    assert torch.equal(rows_at(f32[1], slots), v_in), f"{what}: v copied as it was"
    assert int((~f32[0].isnan()).sum()) == t * hk * d, f"{what}: a slot outside `slots` was written"
    if kv != "fp32":
        got, want = pool_for(hk, d, nb, kv, head_major), pool_for(hk, d, nb, kv, head_major)
        q8 = native_step.rope_write(qkv, cos, sin, pos, *got[:2], slots, *got[2:], hq)
        A.write_kv_ref(*want[:2], k_rot, v_in, slots, *want[2:])
        assert torch.equal(q8, q)
        for g, w in zip(got, want):
            if g is None:                       # bf16: no scales
                continue
            assert torch.equal(g.view(torch.uint8) if g.dtype == FP8 else g.nan_to_num(-1.0),
                               w.view(torch.uint8) if w.dtype == FP8 else w.nan_to_num(-1.0)), f"{what} {kv} bits"


@pytest.mark.parametrize("b", [1, 3, 17])
@pytest.mark.parametrize("k", [576, 100, 4096])
def test_add_rms_norm_is_the_add_then_the_norm(b, k):
    check_add_rms_norm(torch.Generator().manual_seed(b * 31 + k), b, k)


@pytest.mark.parametrize("b", [1, 5])
@pytest.mark.parametrize("n", [1536, 100, 9])
def test_silu_mul_is_torchs_formula_within_its_bound(b, n):
    check_silu_mul(torch.Generator().manual_seed(b * 7 + n), b, n)


@pytest.mark.parametrize("b, k, n", [(1, 576, 1536), (7, 100, 9), (300, 576, 1536), (130, 4096, 14336 // 8)])
def test_a_chunks_rows_take_the_decode_steps_bits_and_bf16_as_torch_rounds(b, k, n):
    check_chunk_ops(torch.Generator().manual_seed(b * 11 + k + n), b, k, n)


# ---- a prompt chunk after a cached prefix: the two partial attentions merged (kv_merge_two) ----
def check_merge_two(gen: torch.Generator, t: int, h: int, hk: int, d: int, dtype: torch.dtype, what: str = "") -> None:
    """Partial outputs and log-sum-exps as torch's fused kernel lays them out (o1 folding each KV
    head's query heads into its rows; the log-sum-exps row-major across heads), merged, against
    the merge in float64 from the same inputs: the weights' exp and division, (EXP_ULPS + 3) u
    each, their sum, one more rounding of fp32, and for bf16 the output's own rounding."""
    g = h // hk
    o1 = torch.randn(1, g * t, hk, d, generator=gen).to(dtype).transpose(1, 2)[0]   # (hk, g t, d), strided
    o2 = torch.randn(h, t, d, generator=gen).to(dtype)
    l1 = (torch.randn(1, g * t, hk, generator=gen) * 8).transpose(1, 2)[0]          # (hk, g t), strided
    l2 = torch.randn(h, t, generator=gen) * 8
    got = native.merge_two(o1, l1, o2, l2)
    assert got is not None and got.shape == (t, h, d) and got.dtype == dtype and got.is_contiguous(), what
    a = o1.double().reshape(hk, g, t, d).reshape(h, t, d)        # query head kvh * g + j, row r
    la = l1.double().reshape(h, t)
    w = torch.softmax(torch.stack((la, l2.double())), dim=0)    # (2, H, T)
    ref = (w[0, ..., None] * a + w[1, ..., None] * o2.double()).transpose(0, 1)    # (T, H, d)
    mag = (w[0, ..., None] * a.abs() + w[1, ..., None] * o2.double().abs()).transpose(0, 1)
    bound = gamma(EXP_ULPS + 5) * mag + 2.0 ** -126
    if dtype != torch.float32:
        bound = bound * (1 + U[dtype]) + U[dtype] * ref.abs() + ETA[dtype]
    assert_within(got, ref, bound, what=f"{what} merge {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t, h, hk, d", [(1, 9, 3, 64), (512, 9, 3, 64), (37, 4, 4, 40), (130, 32, 8, 128)])
def test_a_chunks_two_partial_attentions_merge_as_their_log_sum_exps_say(t, h, hk, d, dtype):
    check_merge_two(torch.Generator().manual_seed(t + h * 3 + d), t, h, hk, d, dtype)


@pytest.mark.parametrize("new, prefix", [(5, 100), (300, 700), (512, 512)])
def test_prefill_after_a_prefix_with_the_c_merge_matches_the_masked_reference(new, prefix):
    """cpu_attention.prefix_then_causal as the model calls it, with the C merge, against the
    (T, S) causal mask in float64 (tests/test_cpu_attention.py checks the torch merge)."""
    gen = torch.Generator().manual_seed(new + prefix)
    q = torch.randn(new, 9, 64, generator=gen).transpose(0, 1)                 # (H, T, d) strided
    k = torch.randn(prefix + new, 3, 64, generator=gen).transpose(0, 1)        # (Hk, S, d)
    v = torch.randn(prefix + new, 3, 64, generator=gen).transpose(0, 1)
    mask = torch.ones(new, prefix + new, dtype=torch.bool).tril(diagonal=prefix)
    got = cpu_attention.prefix_then_causal(q, k, v, prefix, 0.125)
    assert_within(got, *attention_reference(q, k, v, 0.125, mask))


# the bundled model (9 q, 3 KV heads of 64), Llama 3.1 8B (32, 8, 128), MHA of 32, head_dim 96
ROPE_GEOMETRIES = [(9, 3, 64), (32, 8, 128), (4, 4, 32), (5, 1, 96)]


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("hq, hk, d", ROPE_GEOMETRIES, ids=[f"{a}x{b}x{c}" for a, b, c in ROPE_GEOMETRIES])
@pytest.mark.parametrize("t", [1, 7, 32])
def test_rope_write_rotates_q_and_k_and_writes_k_and_v(t, hq, hk, d, kv, head_major):
    gen = torch.Generator().manual_seed(t * 13 + hq + hk * 5 + d + ["fp32", "fp8", "bf16", "fp16"].index(kv) + 2 * head_major)
    check_rope_write(gen, hq, hk, d, t, kv, head_major)


@pytest.mark.parametrize("bad", ["slot", "position"])
def test_rope_write_refuses_a_slot_or_position_out_of_range_before_writing(bad):
    gen = torch.Generator().manual_seed(1)
    cos, sin = tables(64, 100)
    k, v, _, _ = pool_for(3, 64, 4, "fp32", True)
    qkv = torch.randn(3, 15 * 64, generator=gen)
    pos, slots = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 9])
    if bad == "slot":
        slots[2] = 4 * BS
    else:
        pos[2] = 100
    with pytest.raises(IndexError):
        native_step.rope_write(qkv, cos, sin, pos, k, v, slots, None, None, 9)
    assert k.isnan().all() and v.isnan().all()


# ---- the step -----------------------------------------------------------------------------------
TINY = Geometry("tiny", n_layers=3, hidden=256, n_heads=8, n_kv_heads=2, head_dim=64, intermediate=640,
                vocab_size=512, rope_theta=10000.0, max_position=1024)
LENGTHS = (5, 40, 17)     # cached rows of each sequence before the step (40: a prefill past 32 rows)


def tiny_model(weights: str):
    if weights == "bf16":      # the CPU's bf16 setup: bf16 matrices, fp32 rows, norms and RoPE
        m = random_model(TINY, torch.device("cpu"), torch.bfloat16, seed=5)
        m.fp32_rows()
        return m
    return random_model(TINY, torch.device("cpu"), torch.float32, seed=5)


def prefilled(model, kv: str, lengths=LENGTHS):
    """A pool holding each sequence's prompt, each in its own shuffled blocks; returns (pool,
    tables (B, max_blocks) int32, ids of the next token of each)."""
    gen = torch.Generator().manual_seed(9)
    spec = plan_pool(TINY, kv, 24 * BS * TINY.kv_bytes_per_token(kv), BS)
    pool = KVPool(TINY, spec, torch.device("cpu"))
    if kv == "fp8":     # unwritten slots poison any read of them: e4m3 NaN bytes, NaN scales
        pool.data.view(torch.uint8).fill_(0x7F)
        pool.scales.fill_(float("nan"))
    else:
        pool.data.fill_(float("nan"))
    order = torch.randperm(spec.num_blocks, generator=gen).to(torch.int32)
    per = spec.num_blocks // len(lengths)
    tabs = torch.stack([order[i * per:(i + 1) * per] for i in range(len(lengths))])   # (B, per)
    for i, n in enumerate(lengths):
        ids = torch.randint(0, TINY.vocab_size, (n,), generator=gen)
        model.forward(ids, torch.arange(n), Step(tabs[i], slot_of(tabs[i], torch.arange(n)), 0, False), pool)
    return pool, tabs, torch.randint(0, TINY.vocab_size, (len(lengths),), generator=gen)


def slot_of(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return table.long()[pos // BS] * BS + pos % BS


def decode_batch(rows: list[int], lengths=LENGTHS, tabs=None) -> tuple[torch.Tensor, Batch]:
    pos = torch.tensor([lengths[i] for i in rows])
    slots = torch.stack([slot_of(tabs[i], pos[j:j + 1])[0] for j, i in enumerate(rows)])
    return pos, Batch(slots, int(pos.max()) + 1, decode=len(rows), block_tables=tabs[rows].contiguous(),
                      context_lens=(pos + 1).to(torch.int32))


def clone_pool(pool: KVPool) -> KVPool:
    other = KVPool(TINY, pool.spec, torch.device("cpu"))
    other.data.copy_(pool.data)
    if pool.scales is not None:
        other.scales.copy_(pool.scales)
    return other


def same_pool(a: KVPool, b: KVPool) -> bool:
    bits = (lambda t: t.view(torch.uint8)) if a.data.dtype == FP8 else (lambda t: t.nan_to_num(-1.0))
    return torch.equal(bits(a.data), bits(b.data)) and (a.scales is None or torch.equal(
        a.scales.nan_to_num(-1.0), b.scales.nan_to_num(-1.0)))


def check_step(weights: str, kv: str, monkeypatch, what: str = "") -> None:
    """The C step against the layer-by-layer path (the same C ops, one call each) on a batch of
    three sequences: the same logits and cache, bit for bit; each row the bits its sequence
    gets alone; and the torch path (no C at all) within the model-level tolerance."""
    model = tiny_model(weights)
    pool, tabs, nxt = prefilled(model, kv)
    layered = clone_pool(pool)
    alone = [clone_pool(pool) for _ in LENGTHS]
    reference = clone_pool(pool)
    rows = [0, 1, 2]
    pos, batch = decode_batch(rows, tabs=tabs)
    calls = {"step": 0}
    real = native_step.decode_step

    def counted(*args):
        out = real(*args)
        calls["step"] += out is not None
        return out
    monkeypatch.setattr(native_step, "decode_step", counted)
    got = model.forward(nxt, pos, batch, pool)                                  # (3, vocab)
    assert calls["step"] == 1, f"{what}: the C step did not serve"
    with monkeypatch.context() as m:
        m.setattr(native_step, "step_serves", lambda *a: False)
        want = model.forward(nxt, pos, batch, layered)
    assert torch.equal(got, want), f"{what}: the step's logits are not the layer-by-layer path's"
    assert same_pool(pool, layered), f"{what}: the step wrote other K/V than the layer-by-layer path"
    for i in rows:
        p, b1 = decode_batch([i], tabs=tabs)
        one = model.forward(nxt[i:i + 1], p, b1, alone[i])
        assert torch.equal(one[0], got[i]), f"{what}: row {i} batched != alone"
    with native.disabled():
        ref = model.forward(nxt, pos, batch, reference)
    err = float((got - ref).abs().max() / ref.abs().max())
    # an fp8 cache on AVX512-BF16: q and p rounded to bf16 in the attention (2^-8 a value, where
    # e4m3's own rounding is 2^-4): 1.3e-3 measured on fp32 weights
    tol = 5e-2 if weights != "fp32" else 5e-3 if kv == "fp8" and native.bf16_native() else 1e-3
    assert err < tol, f"{what}: {err:.2e} from the torch path"


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16", "fp8"])
@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_the_step_is_the_layer_by_layer_path_bit_for_bit(weights, kv, monkeypatch):
    check_step(weights, kv, monkeypatch)


def test_the_step_declines_a_length_past_its_table_and_writes_nothing():
    """A length past the block table: no kernel reads outside it, the pool is untouched, and
    the forward goes on to the layer-by-layer path (whose decode then says what is wrong)."""
    model = tiny_model("fp32")
    pool, tabs, nxt = prefilled(model, "fp32")
    before = clone_pool(pool)
    pos, batch = decode_batch([0, 1], tabs=tabs)
    batch.context_lens[1] = tabs.shape[1] * BS + 1
    x = model.embed[nxt[:2]].clone()
    assert native_step.step_serves(x, batch)
    assert native_step.decode_step(model, x, pos, batch, pool) is None
    assert same_pool(pool, before)


def test_the_torch_path_serves_without_the_c_kernels():
    """No compiler (or KVCHAT_NATIVE=0): nothing of the step serves, and a decode step still
    runs, in torch, within the model-level tolerance of the C step."""
    model = tiny_model("fp32")
    pool, tabs, nxt = prefilled(model, "fp32")
    other = clone_pool(pool)
    pos, batch = decode_batch([0, 2], tabs=tabs)
    got = model.forward(nxt[[0, 2]], pos, batch, pool)
    with native.disabled():
        assert not native_step.step_serves(model.embed[nxt[:2]], batch)
        assert not native_step.rows_serve(torch.randn(2, 8))
        want = model.forward(nxt[[0, 2]], pos, batch, other)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-3


def test_the_step_reads_weights_put_in_place_of_others(monkeypatch):
    """Its per-layer addresses are kept between steps; a weight replaced on the model (a new
    tensor) is read at once, not the freed old one: the layer-by-layer path's bits again."""
    model = tiny_model("fp32")
    pool, tabs, nxt = prefilled(model, "fp32")
    pos, batch = decode_batch([0, 1], tabs=tabs)
    layered = clone_pool(pool)
    model.forward(nxt[:2], pos, batch, clone_pool(pool))                       # the addresses are kept
    gen = torch.Generator().manual_seed(4)
    model.layers[1].w_down = torch.randn(model.layers[1].w_down.shape, generator=gen) * 0.05
    got = model.forward(nxt[:2], pos, batch, pool)
    with monkeypatch.context() as m:
        m.setattr(native_step, "step_serves", lambda *a: False)
        want = model.forward(nxt[:2], pos, batch, layered)
    assert torch.equal(got, want)
