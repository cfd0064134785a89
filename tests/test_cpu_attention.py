"""The CPU decode path (engine/attention.py) against the plain-torch reference
`paged_decode_ref`, on fresh random caches read through shuffled block tables.

Split-K decode cuts the context into windows run as one batch and merges them by
log-sum-exp; it reorders the sums of softmax, so it is held to fp32 tolerance, not bits:
atol 1e-5 and rtol 1e-5 on attention outputs of magnitude ~1 (the same as the Triton
kernels' fp32 tolerance in tests/test_kernels.py). An fp8 cache is dequantized one piece at a
time inside the loop; against the reference over the same fp8 cache the same tolerance holds,
since both compute in fp32 from identical dequantized values.
"""
from __future__ import annotations

import pytest
import torch

from kvchat.engine import attention as A

FP8 = torch.float8_e4m3fn
TOL = dict(atol=1e-5, rtol=1e-5)
HK, G, D, BS = 3, 3, 64, 16  # the bundled model's attention geometry, 16-token blocks


def shuffled_cache(length: int, gen: torch.Generator, fp8: bool = False):
    """(k_cache, v_cache, k_scale, v_scale, table) of N(0, 1) rows: the sequence's blocks in a
    random order among spare blocks, which hold NaN so that a read outside it shows."""
    need = -(-length // BS)
    nb = need + 5
    k = torch.full((nb, BS, HK, D), float("nan"))
    v = torch.full((nb, BS, HK, D), float("nan"))
    table = torch.randperm(nb, generator=gen)[:need].to(torch.int32)
    rows = torch.arange(length)
    slots = (table.long()[rows // BS] * BS + rows % BS)
    k.view(-1, HK, D)[slots] = torch.randn(length, HK, D, generator=gen)
    v.view(-1, HK, D)[slots] = torch.randn(length, HK, D, generator=gen)
    if not fp8:
        return k, v, None, None, table
    k8, v8 = torch.empty(nb, BS, HK, D, dtype=FP8), torch.empty(nb, BS, HK, D, dtype=FP8)
    k8.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
    v8.view(torch.uint8).fill_(0x7F)
    ks, vs = torch.full((nb, BS, HK), float("nan")), torch.full((nb, BS, HK), float("nan"))
    A.write_kv_ref(k8, v8, k.view(-1, HK, D)[slots], v.view(-1, HK, D)[slots], slots, ks, vs)
    return k8, v8, ks, vs, table


def reference(q, k, v, ks, vs, table, length):
    """paged_decode_ref on the caches with their poison cleared (it reads whole blocks and
    masks the tail after the products, so a NaN past the context would reach it)."""
    if k.dtype == FP8:
        k, v = k.clone(), v.clone()
        for t in (k, v):
            t.view(torch.uint8).masked_fill_(t.view(torch.uint8) == 0x7F, 0)
        ks, vs = ks.nan_to_num(0.0), vs.nan_to_num(0.0)
    else:
        k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    return A.paged_decode_ref(q[None], k, v, table[None], torch.tensor([length], dtype=torch.int32),
                              D ** -0.5, ks, vs)[0]


@pytest.mark.parametrize("length", [1, 17, 511, 1024, 1537, 4099])
@pytest.mark.parametrize("windows", [2, 3, 7])
def test_split_k_decode_matches_the_reference_on_a_shuffled_table(length, windows):
    gen = torch.Generator().manual_seed(length * 31 + windows)
    k, v, _, _, table = shuffled_cache(length, gen)
    q = torch.randn(HK * G, D, generator=gen)
    rows_k = A.gather_kv(k, None, table, length, torch.float32)
    rows_v = A.gather_kv(v, None, table, length, torch.float32)
    got = A.decode_split(q, rows_k, rows_v, D ** -0.5, n=min(windows, length))
    torch.testing.assert_close(got, reference(q, k, v, None, None, table, length), **TOL)


@pytest.mark.parametrize("length", [1, 100, 1024, 2048 + 5])
def test_decode_one_matches_the_reference_with_the_threads_it_has(length):
    """decode_one picks its own window count from torch's thread count: 2 and 1 here."""
    gen = torch.Generator().manual_seed(length)
    k, v, _, _, table = shuffled_cache(length, gen)
    q = torch.randn(HK * G, D, generator=gen)
    want = reference(q, k, v, None, None, table, length)
    before = torch.get_num_threads()
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            torch.testing.assert_close(A.decode_one(q, k, v, table, length, D ** -0.5), want, **TOL)
    finally:
        torch.set_num_threads(before)


def test_decode_one_reads_an_ascending_run_as_a_view_with_the_same_result():
    gen = torch.Generator().manual_seed(5)
    length = 1300
    k = torch.randn(100, BS, HK, D, generator=gen)
    v = torch.randn(100, BS, HK, D, generator=gen)
    q = torch.randn(HK * G, D, generator=gen)
    table = torch.arange(10, 100, dtype=torch.int32)
    want = reference(q, k, v, None, None, table, length)
    torch.testing.assert_close(A.decode_one(q, k, v, table, length, D ** -0.5, first_block=10), want, **TOL)


def test_window_partials_give_the_log_sum_exp_of_plain_torch():
    """The fused kernel's log-sum-exp (when torch has the op) against logsumexp in plain torch,
    with the overlap mask of `windows`."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, HK, G, D, generator=gen)
    k = torch.randn(3, HK, 300, D, generator=gen)
    v = torch.randn(3, HK, 300, D, generator=gen)
    bias = A.window_bias(3, 300, 290)
    out, lse = A.partial_attention(q, k, v, 0.125, bias)
    ref_out, ref_lse = A.partial_attention_ref(q, k, v, 0.125, bias)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_split_k_without_the_fused_op_falls_back_to_plain_torch(monkeypatch):
    monkeypatch.setattr(A, "_FLASH_LSE", None)
    gen = torch.Generator().manual_seed(11)
    length = 1500
    k, v, _, _, table = shuffled_cache(length, gen)
    q = torch.randn(HK * G, D, generator=gen)
    got = A.decode_split(q, A.gather_kv(k, None, table, length, torch.float32),
                         A.gather_kv(v, None, table, length, torch.float32), D ** -0.5, n=4)
    torch.testing.assert_close(got, reference(q, k, v, None, None, table, length), **TOL)


@pytest.mark.parametrize("length", [1, 300, 1024, 2500])
@pytest.mark.parametrize("piece", [256, 1000, A.FP8_PIECE_ROWS])
def test_fp8_decode_dequantizing_piece_by_piece_matches_the_reference(length, piece):
    gen = torch.Generator().manual_seed(length + piece)
    k, v, ks, vs, table = shuffled_cache(length, gen, fp8=True)
    q = torch.randn(HK * G, D, generator=gen)
    rows = [A.cached_rows(t, table, length) for t in (k, v, ks, vs)]
    got = A.decode_fp8(q, *rows, D ** -0.5, piece=piece)
    torch.testing.assert_close(got, reference(q, k, v, ks, vs, table, length), **TOL)
    torch.testing.assert_close(A.decode_one(q, k, v, table, length, D ** -0.5, ks, vs),
                               reference(q, k, v, ks, vs, table, length), **TOL)


def test_fp8_table_lookup_is_torchs_own_conversion_for_every_byte():
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = torch.isfinite(every.float())
    scale = torch.full((256,), 0.5)
    got = A.dequantize_rows(every[:, None], scale, torch.float32)[:, 0]
    torch.testing.assert_close(got[finite], every.float()[finite] * 0.5, atol=0, rtol=0)


# ---- the bundled model: decode steps through the split and the fp8 paths ---------------------
PREFIX, STEPS = 1300, 6   # past 2 x SPLIT_MIN_ROWS, so decode splits; two fp8 pieces
REL_TOL = 1e-3            # tests/test_model_reference.py: max |diff| / max |logit|
FP8_MEAN_ABS = 0.35       # tests/test_experiments.py FP8_LIMITS: mean |dlogit|, fp8 vs fp32 cache


def decode_logits(engine, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """Prefill ids[:PREFIX] into a fresh pool with a shuffled table, then decode the next
    STEPS ids teacher-forced. Returns their logits (STEPS, vocab)."""
    from kvchat.engine.kv_cache import KVPool, plan_pool
    from kvchat.engine.model import Step
    g = engine.geometry
    spec = plan_pool(g, kv_dtype, 2 * (PREFIX + STEPS + 32) * g.kv_bytes_per_token(kv_dtype), 16)
    pool = KVPool(g, spec, engine.device)
    table = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(3)).to(torch.int32)

    def slots(a: int, b: int) -> torch.Tensor:
        pos = torch.arange(a, b)
        return table.long()[pos // 16] * 16 + pos % 16

    model = engine.model
    model.forward(torch.tensor(ids[:PREFIX]), torch.arange(PREFIX), Step(table, slots(0, PREFIX), 0, False), pool)
    out = []
    for p in range(PREFIX, PREFIX + STEPS):
        out.append(model.forward(torch.tensor([ids[p]]), torch.tensor([p]),
                                 Step(table, slots(p, p + 1), p, True), pool)[0])
    return torch.stack(out)


@pytest.fixture(scope="module")
def text_ids(engine) -> list[int]:
    from pydoc_data.topics import topics  # the stdlib's own long English text
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return engine.tokenizer.encode(text[: 8 * (PREFIX + STEPS)])[:PREFIX + STEPS]


def test_split_k_decode_steps_give_the_logits_of_a_full_forward(engine, text_ids):
    got = decode_logits(engine, text_ids, "fp32")
    # logits at position p predict p + 1: decode step p's logits are the dense forward's row p
    want = engine.model.forward_dense(torch.tensor(text_ids), last_only=False)[PREFIX:PREFIX + STEPS]
    err = float((got - want).abs().max() / want.abs().max())
    assert err < REL_TOL, f"max |diff| / max |logit| = {err:.2e}"


def test_fp8_cache_decode_logits_stay_near_the_fp32_cache(engine, text_ids):
    full = decode_logits(engine, text_ids, "fp32")
    fp8 = decode_logits(engine, text_ids, "fp8")
    diff = float((full - fp8).abs().mean())
    assert 0 < diff < FP8_MEAN_ABS, f"mean |dlogit| {diff:.3f}"
    assert int((full.argmax(-1) == fp8.argmax(-1)).sum()) >= STEPS - 1
