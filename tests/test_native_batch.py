"""The C kernels with a batch of B rows or B sequences (issue 22's batched decode step): the
product that reads each weight row once for all B rows, RMSNorm of B rows, decode attention
over B sequences each through its own block table, and the K/V write of rows from several
sequences. Against float64 on fresh random inputs, within the error bounds of
tests/tolerance.py; and each row or sequence bit for bit what it gets alone, so a conversation
decodes the same tokens batched or not.
"""
from __future__ import annotations

import pytest
import torch

from counting import count_calls
from tolerance import assert_within, gemv_reference, paged_decode_reference, rms_norm_reference
from kvchat.engine import attention as A
from kvchat.engine import native

FP8 = torch.float8_e4m3fn
BS = 16
NOT_A_BLOCK = 10 ** 6     # table entries past a sequence's blocks: read, they would crash or show


# ---- the product and the norm --------------------------------------------------------------
# the bundled model's matrices (fused qkv, o, gate_up, down) and shapes that leave tails: k not
# a multiple of 16, n not a multiple of the rows a thread takes at a time
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (13, 33), (7, 100), (1, 1), (9, 17)]


@pytest.mark.parametrize("n, k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_of_b_rows_is_each_rows_own_product(n, k):
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=gen)
    # one row, two (their own tile), then whole tiles (8 rows on AVX-512, 2 elsewhere) and every tail
    for b in (1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, native.GEMV_MAX_ROWS):
        x = torch.randn(b, k, generator=gen) * 3
        got = native.gemv(x, w)
        assert_within(got, *gemv_reference(x, w), what=f"B={b}")
        alone = torch.cat([native.gemv(x[i:i + 1].contiguous(), w) for i in range(b)])
        assert torch.equal(got, alone), f"B={b}: a row's bits depend on the batch"


def test_gemv_of_the_lm_head_for_one_and_sixteen_rows():
    gen = torch.Generator().manual_seed(49152)
    w = torch.randn(49152, 576, generator=gen)
    for b in (1, 16):
        x = torch.randn(b, 576, generator=gen)
        assert_within(native.gemv(x, w), *gemv_reference(x, w), what=f"lm_head B={b}")


def test_gemv_serves_a_decode_steps_rows_and_leaves_a_prefills_to_mkl():
    w, norm = torch.randn(8, 16), torch.randn(16)
    for b in range(1, native.max_rows() + 1):
        assert native.gemv_serves(torch.randn(b, 16), w) and native.gemv_serves(torch.randn(b, 16), norm)
    assert not native.gemv_serves(torch.randn(native.max_rows() + 1, 16), w)   # a prefill: MKL's GEMM
    assert not native.gemv_serves(torch.randn(0, 16), w)
    assert not native.gemv_serves(torch.randn(2, 32)[:, ::2], w)                # strided rows
    assert not native.gemv_serves(torch.randn(2, 16), w.t().contiguous().t())   # strided weights
    assert not native.gemv_serves(torch.randn(2, 16).bfloat16(), w.bfloat16())
    with native.disabled():
        assert not native.gemv_serves(torch.randn(2, 16), w)


def test_the_row_limit_follows_the_builds_tile():
    """8-row fp32 tiles (AVX-512) take up to 32 rows; 2-row tiles (AVX2, SSE, aarch64, where the
    C time grows with the rows and MKL's hardly does) up to 16. The tile is the build's, read
    from the library: the native build of a CPU with AVX-512F has 8-row tiles, one without 2."""
    import os

    from kvchat.engine.native_build import cpu_flags
    if native.lib() is None:
        pytest.skip(f"C kernels off: {native.status()}")
    tile = native.lib().kv_gemv_tile()
    assert native.max_rows() == {8: native.GEMV_MAX_ROWS, 2: native.NARROW_MAX_ROWS}[tile]
    level = os.environ.get("KVCHAT_NATIVE_LEVEL") or "native"
    if level == "native" and os.uname().machine == "x86_64" and cpu_flags():
        assert tile == (8 if "avx512f" in cpu_flags() else 2)
    w = torch.randn(8, 16)
    assert native.gemv_serves(torch.randn(native.max_rows(), 16), w)
    assert not native.gemv_serves(torch.randn(native.max_rows() + 1, 16), w)


def test_the_model_routes_b_rows_to_the_kernels(monkeypatch):
    from kvchat.engine import model
    calls = count_calls(monkeypatch, native, "gemv", "rms_norm")
    gen = torch.Generator().manual_seed(3)
    w, norm, x = torch.randn(40, 64, generator=gen), torch.randn(64, generator=gen), torch.randn(5, 64, generator=gen)
    assert torch.equal(model.linear(x, w), native.gemv(x, w))
    model.rms_norm(x, norm, 1e-5)
    model.linear(torch.randn(native.max_rows() + 1, 64), w)                 # a prefill's rows: MKL
    assert calls == {"gemv": 2, "rms_norm": 1}


@pytest.mark.parametrize("k", [576, 100])
def test_rms_norm_of_b_rows_is_each_rows_own(k):
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(7, k, generator=gen) * 3, torch.randn(k, generator=gen)
    got = native.rms_norm(x, w, 1e-5)
    assert_within(got, *rms_norm_reference(x, w, 1e-5))
    for i in range(7):
        assert torch.equal(got[i:i + 1], native.rms_norm(x[i:i + 1].contiguous(), w, 1e-5))


# ---- decode over B sequences ---------------------------------------------------------------
CACHES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8, "fp16": torch.float16}   # the caches the C kernels serve


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """A cache's bits, compared exactly (bf16 and fp32 -0.0 against +0.0, NaN against NaN)."""
    return t.view({FP8: torch.uint8, torch.bfloat16: torch.int16, torch.float16: torch.int16,
                   torch.float32: torch.int32}[t.dtype])


def paged_batch(lens: list[int], hk: int, d: int, gen: torch.Generator, kv: str, head_major: bool):
    """B sequences of N(0, 1) K/V rows in one pool (kv: a key of CACHES), their blocks disjoint
    and shuffled among spare ones. Every slot no sequence owns holds NaN (fp8: e4m3fn's NaN byte and NaN scales)
    and a table's entries past its sequence's blocks name no block at all, so a read outside a
    sequence shows. Returns (k, v, ks, vs, tables (B, width) int32), the caches written by
    write_kv_ref."""
    need = [-(-n // BS) for n in lens]
    nb = sum(need) + 7
    ids = torch.randperm(nb, generator=gen).tolist()
    tables = torch.full((len(lens), max(need) + 2), NOT_A_BLOCK, dtype=torch.int32)
    slots = []
    for i, (n, c) in enumerate(zip(lens, need)):
        row, ids = ids[:c], ids[c:]
        tables[i, :c] = torch.tensor(row, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append(torch.tensor(row)[pos // BS] * BS + pos % BS)
    slots = torch.cat(slots)
    dtype, fp8 = CACHES[kv], kv == "fp8"

    def empty(dtype, *last):
        if head_major:   # KVPool's CPU layout: (H_kv, blocks, bs, d) storage, viewed token-major
            return torch.empty(hk, nb, BS, *last, dtype=dtype).movedim(0, 2)
        return torch.empty(nb, BS, hk, *last, dtype=dtype)

    k, v = empty(dtype, d), empty(dtype, d)
    for t in (k, v):
        (t.view(torch.uint8).fill_(0x7F) if fp8 else t.fill_(float("nan")))
    ks = vs = None
    if fp8:
        ks, vs = empty(torch.float32).fill_(float("nan")), empty(torch.float32).fill_(float("nan"))
    rows = slots.shape[0]
    A.write_kv_ref(k, v, torch.randn(rows, hk, d, generator=gen), torch.randn(rows, hk, d, generator=gen),
                   slots, ks, vs)
    return k, v, ks, vs, tables


def mixed_lengths(b: int, gen: torch.Generator) -> list[int]:
    """b lengths drawn from 1, block boundaries (16, 17, 32, 33) and random ones up to 400."""
    edge = [1, BS, BS + 1, 2 * BS, 2 * BS + 1]
    return [edge[i] if i < len(edge) and int(torch.randint(2, (1,), generator=gen)) else
            int(torch.randint(1, 400, (1,), generator=gen)) for i in range(b)]


# 17 sequences of the bundled model's geometry; 3 of a group past the specialised kernels (10)
# and of Llama 3.1 8B's (8 KV heads of 4, d 128)
BATCHES = [(17, 3, 3, 64), (3, 3, 3, 64), (3, 2, 10, 64), (3, 8, 4, 128)]


@pytest.mark.parametrize("kv", list(CACHES))
@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("b, hk, g, d", BATCHES, ids=[f"{b}x{hk}x{g}x{d}" for b, hk, g, d in BATCHES])
def test_decode_of_b_sequences_matches_float64_and_each_alone(b, hk, g, d, head_major, kv):
    gen = torch.Generator().manual_seed(b * 1000 + hk * 100 + g * 10 + head_major * 2 + list(CACHES).index(kv))
    lens = mixed_lengths(b, gen)
    k, v, ks, vs, tables = paged_batch(lens, hk, d, gen, kv, head_major)
    q = torch.randn(b, hk * g + 3, d, generator=gen)[:, :hk * g]            # strided, as the model hands it over
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    assert native.decode_serves(q, k)
    got = native.decode_batch(q, k, v, tables, context_lens, scale, ks, vs)
    assert got is not None
    assert_within(got, *paged_decode_reference(q, k, v, tables, lens, scale, ks, vs, dot_bf16=native.bf16_native()),
                  what=f"lens {lens}")
    for i, n in enumerate(lens):
        alone = native.decode(q[i], k, v, tables[i], n, scale, ks, vs)
        assert torch.equal(got[i], alone), f"sequence {i} (length {n}): its bits depend on the batch"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_of_b_sequences_on_any_thread_count(threads):
    gen = torch.Generator().manual_seed(threads)
    lens = [1500, 3, 40, 700]
    k, v, ks, vs, tables = paged_batch(lens, 3, 64, gen, "fp32", True)
    q = torch.randn(4, 9, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.decode_batch(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), 0.125)
    finally:
        torch.set_num_threads(before)
    assert_within(got, *paged_decode_reference(q, k, v, tables, lens, 0.125))


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp16"])
def test_paged_decode_takes_the_batch_kernel_for_b_sequences_and_torch_without_it(monkeypatch, kv):
    """B > 1 on the CPU: one call of the C kernel; with the kernels set aside, each sequence
    through decode_one's torch path. Both within the bound, and the second equal to B = 1 calls."""
    gen = torch.Generator().manual_seed(21)
    lens = [33, 1, 300, 16]
    k, v, ks, vs, tables = paged_batch(lens, 3, 64, gen, kv, True)
    q = torch.randn(4, 9, 64, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    ref = paged_decode_reference(q, k, v, tables, lens, 0.125, ks, vs)
    ref_c = paged_decode_reference(q, k, v, tables, lens, 0.125, ks, vs, dot_bf16=native.bf16_native())
    calls = count_calls(monkeypatch, native, "decode_batch", "decode")
    assert_within(A.paged_decode(q, k, v, tables, lens_t, 0.125, ks, vs), *ref_c, what="C kernel")
    assert calls == {"decode_batch": 1, "decode": 0}
    with native.disabled():
        got = A.paged_decode(q, k, v, tables, lens_t, 0.125, ks, vs)
        alone = [A.paged_decode(q[i:i + 1], k, v, tables[i:i + 1], lens_t[i:i + 1], 0.125, ks, vs) for i in range(4)]
    assert_within(got, *ref, what="torch path")
    assert torch.equal(got, torch.cat(alone))


def test_decode_declines_lengths_and_block_ids_outside_the_pool():
    """The C kernel reads what the tables name: a length past a table's width, a block id
    outside the pool or a length of 0 makes it decline (None) instead of reading out of bounds."""
    gen = torch.Generator().manual_seed(4)
    k, v, _, _, tables = paged_batch([40, 20], 3, 64, gen, "fp32", False)
    q = torch.randn(2, 9, 64, generator=gen)
    ok = torch.tensor([40, 20], dtype=torch.int32)
    assert native.decode_batch(q, k, v, tables, ok, 0.125) is not None
    too_long = torch.tensor([40, BS * (tables.shape[1] + 1)], dtype=torch.int32)
    assert native.decode_batch(q, k, v, tables, too_long, 0.125) is None
    past_its_blocks = torch.tensor([40, 2 * BS + 1], dtype=torch.int32)          # reads a NOT_A_BLOCK entry
    assert native.decode_batch(q, k, v, tables, past_its_blocks, 0.125) is None
    assert native.decode_batch(q, k, v, tables, torch.tensor([40, 0], dtype=torch.int32), 0.125) is None
    bad = tables.clone()
    bad[0, 0] = -1
    assert native.decode_batch(q, k, v, bad, ok, 0.125) is None


# ---- the K/V write of a batch --------------------------------------------------------------
@pytest.mark.parametrize("kv", list(CACHES))
def test_write_of_one_row_per_sequence_puts_the_bytes_of_the_torch_path(kv):
    """A decode step writes one row for each of B sequences: B slots in B sequences' blocks,
    scattered over the pool. Every byte and scale equals write_kv_ref's; nothing else is touched."""
    gen = torch.Generator().manual_seed(list(CACHES).index(kv))
    hk, d, nb, b = 3, 64, 60, 16
    k = torch.randn(b, hk, d, generator=gen) * torch.exp(2 * torch.randn(b, hk, 1, generator=gen))
    v = torch.randn(b, hk, d, generator=gen)
    slots = torch.randperm(nb * BS, generator=gen)[:b]
    dtype = CACHES[kv]

    def pool():
        c = [torch.full((hk, nb, BS, d), 1.5).to(dtype).movedim(0, 2) for _ in range(2)]
        s = [torch.full((hk, nb, BS), 2.5).movedim(0, 2) for _ in range(2)] if kv == "fp8" else [None, None]
        return c + s
    got, want = pool(), pool()
    native.write(got[0], got[1], k, v, slots, got[2], got[3])
    A.write_kv_ref(want[0], want[1], k, v, slots, want[2], want[3])
    for g, w in zip(got, want):
        if g is not None:
            assert torch.equal(bits_of(g), bits_of(w))


def test_write_refuses_a_slot_outside_the_pool_before_writing_anything():
    k_cache, v_cache = torch.zeros(4, BS, 2, 16), torch.zeros(4, BS, 2, 16)
    rows = torch.ones(3, 2, 16)
    with pytest.raises(IndexError, match="outside the pool"):
        native.write(k_cache, v_cache, rows, rows, torch.tensor([0, 5, 4 * BS]))
    assert not k_cache.any() and not v_cache.any()
