"""The CPU's torch paths for attention (engine/attention.py, engine/cpu_attention.py) against
float64 on fresh random caches read through shuffled block tables, within the error bounds of
tests/tolerance.py (they grow with the scores' magnitude and the context's length).

Split-K decode cuts the context into windows run as one batch and merges them by
log-sum-exp; it reorders the sums of softmax, so it is held to what fp32 can promise, not to
bits. An fp8 cache is dequantized one piece at a time inside the loop; the reference reads the
same fp8 values times their scales, exactly.
"""
from __future__ import annotations

import pytest
import torch

from tolerance import assert_within, attention_reference, lse_reference, paged_decode_reference
from kvchat.engine import attention as A
from kvchat.engine import cpu_attention as C
from kvchat.engine import native

FP8 = torch.float8_e4m3fn
HK, G, D, BS = 3, 3, 64, 16  # the bundled model's attention geometry, 16-token blocks


@pytest.fixture(autouse=True)
def torch_path():
    """These tests are about the torch path, which serves wherever the C kernels
    (engine/native.py, tests/test_native.py) do not compile: set the kernels aside."""
    with native.disabled():
        yield


def empty_cache(nb: int, dtype=torch.float32, head_major: bool = False, last=(D,)) -> torch.Tensor:
    """(nb, BS, HK, *last) in the pool's token-major layout, or a view of head-major storage
    (HK, nb, BS, *last) as KVPool lays it out on the CPU."""
    if head_major:
        return torch.empty(HK, nb, BS, *last, dtype=dtype).movedim(0, 2)
    return torch.empty(nb, BS, HK, *last, dtype=dtype)


def shuffled_cache(length: int, gen: torch.Generator, fp8: bool = False, head_major: bool = False):
    """(k_cache, v_cache, k_scale, v_scale, table) of N(0, 1) rows: the sequence's blocks in a
    random order among spare blocks, which hold NaN so that a read outside it shows."""
    need = -(-length // BS)
    nb = need + 5
    k = empty_cache(nb, head_major=head_major).fill_(float("nan"))
    v = empty_cache(nb, head_major=head_major).fill_(float("nan"))
    table = torch.randperm(nb, generator=gen)[:need].to(torch.int32)
    rows = torch.arange(length)
    slots = (table.long()[rows // BS] * BS + rows % BS)
    kr, vr = torch.randn(length, HK, D, generator=gen), torch.randn(length, HK, D, generator=gen)
    A.write_kv_ref(k, v, kr, vr, slots)
    if not fp8:
        return k, v, None, None, table
    k8, v8 = empty_cache(nb, FP8, head_major), empty_cache(nb, FP8, head_major)
    k8.view(torch.uint8).fill_(0x7F)  # e4m3fn's NaN
    v8.view(torch.uint8).fill_(0x7F)
    ks = empty_cache(nb, head_major=head_major, last=()).fill_(float("nan"))
    vs = empty_cache(nb, head_major=head_major, last=()).fill_(float("nan"))
    A.write_kv_ref(k8, v8, kr, vr, slots, ks, vs)
    return k8, v8, ks, vs, table


def reference(q, k, v, ks, vs, table, length):
    """(float64 result, its bound), both (H, d), for one sequence of the cache (only its own
    rows are read, so the poison around them stays out)."""
    ref, bound = paged_decode_reference(q[None], k, v, table[None], [length], D ** -0.5, ks, vs)
    return ref[0], bound[0]


@pytest.mark.parametrize("length", [1, 17, 511, 1024, 1537, 4099])
@pytest.mark.parametrize("windows", [2, 3, 7])
def test_split_k_decode_matches_the_reference_on_a_shuffled_table(length, windows):
    gen = torch.Generator().manual_seed(length * 31 + windows)
    k, v, _, _, table = shuffled_cache(length, gen)
    q = torch.randn(HK * G, D, generator=gen)
    rows_k = A.gather_kv(k, None, table, length, torch.float32)
    rows_v = A.gather_kv(v, None, table, length, torch.float32)
    got = C.decode_split(q, rows_k, rows_v, D ** -0.5, n=min(windows, length))
    assert_within(got, *reference(q, k, v, None, None, table, length))


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
            assert_within(A.decode_one(q, k, v, table, length, D ** -0.5), *want)
    finally:
        torch.set_num_threads(before)


def runs_table(runs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor([b for first, n in runs for b in range(first, first + n)], dtype=torch.int32)


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("runs", [[(10, 90)], [(40, 30), (3, 1), (75, 20), (5, 34)]], ids=["one run", "four runs"])
def test_decode_one_reads_runs_of_blocks_as_views_with_the_same_result(runs, head_major):
    """Runs given (as the engine passes Sequence.runs) or read from the table: the same result."""
    from kvchat.engine.sequence import block_runs
    gen = torch.Generator().manual_seed(5)
    table = runs_table(runs)
    length = BS * len(table) - 7
    k, v = (empty_cache(110, head_major=head_major).normal_(generator=gen) for _ in range(2))
    q = torch.randn(HK * G, D, generator=gen)
    want = reference(q, k, v, None, None, table, length)
    assert block_runs(table.tolist()) == tuple(runs)
    for given in (tuple(runs), None):
        assert_within(A.decode_one(q, k, v, table, length, D ** -0.5, runs=given), *want)
    pieces = A.row_pieces(k, table, length, tuple(runs))
    assert len(pieces) == len(runs)
    assert all(p.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() for p in pieces), "views"


def test_a_table_of_many_short_runs_is_gathered_once_with_the_same_result():
    gen = torch.Generator().manual_seed(6)
    table = torch.arange(0, 80, 2, dtype=torch.int32)           # 40 runs of one block
    length = BS * 40
    k, v = (empty_cache(80, head_major=True).normal_(generator=gen) for _ in range(2))
    q = torch.randn(HK * G, D, generator=gen)
    assert A.MAX_RUNS < 40 and len(A.row_pieces(k, table, length)) == 1
    assert_within(A.decode_one(q, k, v, table, length, D ** -0.5), *reference(q, k, v, None, None, table, length))


@pytest.mark.parametrize("fused", [True, False], ids=["fused op", "plain torch"])
def test_window_partials_give_each_windows_attention_and_log_sum_exp(fused, monkeypatch):
    """Each window's output and log-sum-exp, with the overlap mask of `windows`: the fused
    kernel's (when torch has the op) and plain torch's, against float64."""
    if not fused:
        monkeypatch.setattr(C, "_FLASH_LSE", None)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, HK, G, D, generator=gen)
    k = torch.randn(3, HK, 300, D, generator=gen)
    v = torch.randn(3, HK, 300, D, generator=gen)
    bias = C.window_bias(3, 300, 290)
    out, lse = C.partial_attention(q, k, v, 0.125, bias)
    for i in range(3):
        mask = (bias[i, 0] == 0) if bias is not None else None              # (1, 300): True where seen
        qi = q[i].reshape(HK * G, 1, D)
        assert_within(out[i].reshape(HK * G, 1, D), *attention_reference(qi, k[i], v[i], 0.125, mask), what=f"window {i}")
        assert_within(lse[i].reshape(HK * G, 1), *lse_reference(qi, k[i], 0.125, mask), what=f"window {i} lse")


def test_split_k_without_the_fused_op_falls_back_to_plain_torch(monkeypatch):
    monkeypatch.setattr(C, "_FLASH_LSE", None)
    gen = torch.Generator().manual_seed(11)
    length = 1500
    k, v, _, _, table = shuffled_cache(length, gen)
    q = torch.randn(HK * G, D, generator=gen)
    got = C.decode_split(q, A.gather_kv(k, None, table, length, torch.float32),
                         A.gather_kv(v, None, table, length, torch.float32), D ** -0.5, n=4)
    assert_within(got, *reference(q, k, v, None, None, table, length))


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("length", [1, 300, 1024, 2500])
@pytest.mark.parametrize("piece", [256, 1000, C.FP8_PIECE_ROWS])
def test_fp8_decode_dequantizing_piece_by_piece_matches_the_reference(length, piece, head_major):
    gen = torch.Generator().manual_seed(length + piece)
    k, v, ks, vs, table = shuffled_cache(length, gen, fp8=True, head_major=head_major)
    q = torch.randn(HK * G, D, generator=gen)
    want = reference(q, k, v, ks, vs, table, length)
    pieces = [A.row_pieces(t, table, length) for t in (k, v, ks, vs)]
    assert_within(C.decode_fp8(q, *pieces, D ** -0.5, piece=piece), *want)
    assert_within(A.decode_one(q, k, v, table, length, D ** -0.5, ks, vs), *want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_bit_placement_is_torchs_own_conversion_for_every_byte(dtype):
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = torch.isfinite(every.float())
    scale = torch.full((256,), 0.5)
    got = C.dequantize_rows(every[:, None], scale, dtype)[:, 0]
    torch.testing.assert_close(got[finite], (every.float()[finite] * 0.5).to(dtype), atol=0, rtol=0)


def test_fp8_dequantization_survives_a_scale_past_the_unscaling_range():
    """Values past 114,688 give a scale above 2^8, where scale x 2^120 would overflow."""
    x = torch.tensor([[3.0e5, -1.0, 7.5e4, 0.0]])
    q, s = A.quantize_fp8(x[:, None, :])                               # (1, 1, 4), (1, 1)
    got = C.dequantize_rows(q, s, torch.float32)
    torch.testing.assert_close(got[0, 0], q.float()[0, 0] * s[0, 0], rtol=0, atol=0)
    assert torch.isfinite(got).all()


def test_fp8_decode_recomputes_exactly_when_a_scale_is_past_the_unscaling_range():
    gen = torch.Generator().manual_seed(13)
    length = 600
    k, v, ks, vs, table = shuffled_cache(length, gen, fp8=True, head_major=True)
    for t, x in ((k, ks), (v, vs)):
        x[table[2], 3] *= 1e5                       # one row's scale past 2^8 (about 560): values near 10^5
    q = torch.randn(HK * G, D, generator=gen) * 1e-4   # keeps the softmax of huge keys finite
    got = A.decode_one(q, k, v, table, length, D ** -0.5, ks, vs)
    assert torch.isfinite(got).all()
    assert_within(got, *reference(q, k, v, ks, vs, table, length))


# ---- the bundled model: decode steps through the split and the fp8 paths ---------------------
PREFIX, STEPS = 1100, 6   # past 2 x SPLIT_MIN_ROWS (1024), so decode splits; two fp8 pieces of 1024 rows
REL_TOL = 1e-3            # tests/test_model_reference.py: max |diff| / max |logit|
FP8_MEAN_ABS = 0.35       # tests/test_experiments.py FP8_LIMITS: mean |dlogit|, fp8 vs fp32 cache


_LOGITS: dict = {}   # decode_logits' results, shared by the tests here and in test_native.py


def decode_logits(engine, ids: list[int], kv_dtype: str, table_kind: str = "shuffled") -> torch.Tensor:
    """Prefill ids[:PREFIX] into a fresh pool in two chunks (the second after a cached
    prefix), then decode the next STEPS ids teacher-forced. Returns their logits (STEPS, vocab).
    table_kind "shuffled": every block in a random order (more runs than MAX_RUNS: gathered);
    "runs": three runs of consecutive ids out of order, passed as Step.runs as the engine does.
    Each run takes about a minute of CPU on 2 cores: the same inputs through the same paths
    (the C kernels on or off, at the same thread count: it orders the sums) are computed once
    a session."""
    key = (id(engine), tuple(ids), kv_dtype, table_kind, native.lib() is not None, torch.get_num_threads())
    if key not in _LOGITS:
        _LOGITS[key] = _decode_logits(engine, ids, kv_dtype, table_kind)
    return _LOGITS[key].clone()


def _decode_logits(engine, ids: list[int], kv_dtype: str, table_kind: str) -> torch.Tensor:
    return decode_from(engine, ids, *prefilled(engine, ids, kv_dtype, table_kind))


def prefilled(engine, ids: list[int], kv_dtype: str, table_kind: str):
    """A fresh pool with ids[:PREFIX] prefilled in two chunks (the second after a cached
    prefix); returns (pool, table, runs) for decode_from."""
    from kvchat.engine.kv_cache import KVPool, plan_pool
    from kvchat.engine.model import Step
    from kvchat.engine.sequence import block_runs
    g = engine.geometry
    spec = plan_pool(g, kv_dtype, 2 * (PREFIX + STEPS + 32) * g.kv_bytes_per_token(kv_dtype), 16)
    pool = KVPool(g, spec, engine.device)
    n = spec.num_blocks
    if table_kind == "shuffled":
        table = torch.randperm(n, generator=torch.Generator().manual_seed(3)).to(torch.int32)
    else:
        table = torch.cat((torch.arange(n // 2, n), torch.arange(0, n // 4), torch.arange(n // 4, n // 2))).to(torch.int32)
    runs = block_runs(table.tolist()) if table_kind == "runs" else None
    for a, b in ((0, 700), (700, PREFIX)):
        engine.model.forward(torch.tensor(ids[a:b]), torch.arange(a, b),
                             Step(table, _slots(table, a, b), a, False, runs=runs), pool)
    return pool, table, runs


def decode_from(engine, ids: list[int], pool, table, runs) -> torch.Tensor:
    """Decode ids[PREFIX:PREFIX + STEPS] teacher-forced over a prefilled pool (which it
    writes); their logits (STEPS, vocab)."""
    from kvchat.engine.model import Step
    out = []
    for p in range(PREFIX, PREFIX + STEPS):
        out.append(engine.model.forward(torch.tensor([ids[p]]), torch.tensor([p]),
                                        Step(table, _slots(table, p, p + 1), p, True, runs=runs), pool)[0])
    return torch.stack(out)


def _slots(table: torch.Tensor, a: int, b: int) -> torch.Tensor:
    pos = torch.arange(a, b)
    return table.long()[pos // 16] * 16 + pos % 16


def bundled_text_ids(engine) -> list[int]:
    """PREFIX + STEPS tokens of the stdlib's own long English text."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return engine.tokenizer.encode(text[: 8 * (PREFIX + STEPS)])[:PREFIX + STEPS]


@pytest.fixture(scope="module")
def text_ids(engine) -> list[int]:
    return bundled_text_ids(engine)


@pytest.fixture(scope="module")
def dense_logits(engine, text_ids) -> torch.Tensor:
    """The no-cache forward's logits at the decode steps' positions (STEPS, vocab)."""
    # logits at position p predict p + 1: decode step p's logits are the dense forward's row p
    return engine.model.forward_dense(torch.tensor(text_ids), last_only=False)[PREFIX:PREFIX + STEPS]


@pytest.mark.parametrize("table_kind", ["shuffled", "runs"])
def test_split_k_decode_steps_give_the_logits_of_a_full_forward(engine, text_ids, dense_logits, table_kind):
    got = decode_logits(engine, text_ids, "fp32", table_kind)
    want = dense_logits
    err = float((got - want).abs().max() / want.abs().max())
    assert err < REL_TOL, f"max |diff| / max |logit| = {err:.2e}"


@pytest.mark.parametrize("table_kind", ["shuffled", "runs"])
def test_fp8_cache_decode_logits_stay_near_the_fp32_cache(engine, text_ids, table_kind):
    full = decode_logits(engine, text_ids, "fp32", table_kind)
    fp8 = decode_logits(engine, text_ids, "fp8", table_kind)
    diff = float((full - fp8).abs().mean())
    assert 0 < diff < FP8_MEAN_ABS, f"mean |dlogit| {diff:.3f}"
    assert int((full.argmax(-1) == fp8.argmax(-1)).sum()) >= STEPS - 1


# ---- prefill after a cached prefix --------------------------------------------------------------
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("new, prefix", [(1, 1), (5, 100), (300, 700), (1, 4000), (512, 512)])
def test_prefill_after_a_prefix_without_a_mask_matches_the_masked_reference(new, prefix, heads):
    """prefix_then_causal (two fused calls merged by log-sum-exp) against the (T, S) causal
    mask in float64, on random queries and keys."""
    h, hk = heads
    gen = torch.Generator().manual_seed(new * 7 + prefix)
    q = torch.randn(new, h, D, generator=gen).transpose(0, 1)               # (H, T, d) strided, as the model passes it
    k = torch.randn(prefix + new, hk, D, generator=gen).transpose(0, 1)     # (Hk, S, d)
    v = torch.randn(prefix + new, hk, D, generator=gen).transpose(0, 1)
    mask = torch.ones(new, prefix + new, dtype=torch.bool).tril(diagonal=prefix)
    got = A.causal_attention(q, k, v, prefix, D ** -0.5)
    assert_within(got, *attention_reference(q, k, v, D ** -0.5, mask))


def test_rope_half_by_half_is_the_plain_formula_bit_for_bit():
    """The Triton rope_write kernel is checked bit for bit against apply_rope on the GPU."""
    from kvchat.engine.model import apply_rope
    gen = torch.Generator().manual_seed(12)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(37, 12, D, generator=gen).to(dtype)
        ang = torch.rand(37, 1, D // 2, generator=gen) * 6.3
        cos, sin = (torch.cat((f, f), -1).to(dtype) for f in (ang.cos(), ang.sin()))
        plain = x * cos + torch.cat((-x[..., D // 2:], x[..., :D // 2]), -1) * sin
        assert torch.equal(apply_rope(x, cos, sin), plain), dtype
