"""The C kernels (engine/native.py, engine/csrc/), compiled here with the machine's own
compiler, against float64 references on fresh random data, within the error bounds of
tests/tolerance.py (they grow with the dot products' lengths, the operands' and the scores'
magnitudes, and the context's length). The batched forms: tests/test_native_batch.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from counting import count_calls
from test_native_batch import CACHES, bits_of
from tolerance import assert_within, gemv_reference, paged_decode_reference, rms_norm_reference
from kvchat.engine import attention as A
from kvchat.engine import native, native_step, threads

FP8 = torch.float8_e4m3fn
BS = 16


def test_the_kernels_compile_and_load_here():
    """CI and the README's machines have a C compiler: the kernels must serve there, built
    for the level asked for (.ci/run runs this file once per level with KVCHAT_NATIVE_LEVEL)."""
    level = os.environ.get("KVCHAT_NATIVE_LEVEL") or "native"
    assert native.status().startswith("on:") and f"(level {level})" in native.status(), native.status()
    assert native.lib() is not None


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (7, 100), (13, 33), (8, 16), (1, 1)])   # lm_head: test_native_batch
def test_gemv_is_the_matmul(n, k):
    gen = torch.Generator().manual_seed(n * 7 + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(1, k, generator=gen)
    got = native.gemv(x, w)
    assert got.shape == (1, n)
    assert_within(got, *gemv_reference(x, w))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 63, 64, 1000, 3 * 64 * 1024 + 17])
def test_the_read_probe_sums_every_float_once(n, threads):
    """kv_read_sum, the bench's bandwidth probe (kvchat/bench/floor.py): each thread's share
    and the tail counted once, none twice. Small integers, so that every partial sum is exact
    in fp32 and the total must be exactly the count."""
    x = torch.randint(0, 8, (n,), generator=torch.Generator().manual_seed(n)).float()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.read_sum(x)
    finally:
        torch.set_num_threads(before)
    assert got == x.double().sum().item()
    assert native.read_sum(x.double()) is None
    if n > 2:
        assert native.read_sum(x[::2]) is None


def test_gemv_declines_what_it_does_not_serve():
    w, x = torch.randn(8, 16), torch.randn(1, 16)
    assert native.gemv_serves(x, w)
    assert not native.gemv_serves(torch.randn(native.max_rows() + 1, 16), w)   # a prefill: MKL's GEMM
    assert not native.gemv_serves(x, w.t().contiguous().t())            # strided weights
    assert not native.gemv_serves(x.bfloat16(), w.bfloat16())
    with native.disabled():
        assert not native.gemv_serves(x, w)


def paged(length: int, hk: int, d: int, gen: torch.Generator, kv: str, head_major: bool):
    """A sequence of N(0, 1) K/V rows written through write_kv_ref into a pool (kv: a key of
    CACHES) of 5 spare blocks more than it needs, its blocks in a random order. Slots the sequence does not own,
    and the tail of its last block, hold NaN (fp8: e4m3fn's NaN byte, NaN scales), so a read
    outside the sequence shows in the result. Returns (k, v, ks, vs, table, clean) where
    clean is the same pool with the poison zeroed, for the reference."""
    need = -(-length // BS)
    nb = need + 5

    def empty(dtype, *last):
        if head_major:   # KVPool's CPU layout: (H_kv, blocks, bs, d) storage, viewed token-major
            return torch.empty(hk, nb, BS, *last, dtype=dtype).movedim(0, 2)
        return torch.empty(nb, BS, hk, *last, dtype=dtype)

    table = torch.randperm(nb, generator=gen)[:need].to(torch.int32)
    rows = torch.arange(length)
    slots = table.long()[rows // BS] * BS + rows % BS
    kr, vr = torch.randn(length, hk, d, generator=gen), torch.randn(length, hk, d, generator=gen)
    dtype, fp8 = CACHES[kv], kv == "fp8"
    k, v = empty(dtype, d), empty(dtype, d)
    for t in (k, v):
        (t.view(torch.uint8).fill_(0x7F) if fp8 else t.fill_(float("nan")))
    ks = vs = None
    if fp8:
        ks, vs = empty(torch.float32).fill_(float("nan")), empty(torch.float32).fill_(float("nan"))
    A.write_kv_ref(k, v, kr, vr, slots, ks, vs)
    clean = []
    for t in (k, v, ks, vs):
        if t is None:
            clean.append(None)
            continue
        c = t.clone()
        bad = c.view(torch.uint8) == 0x7F if t.dtype == FP8 else c.isnan()
        (c.view(torch.uint8) if t.dtype == FP8 else c)[bad] = 0
        clean.append(c)
    return k, v, ks, vs, table, clean


def reference(q, clean, table, length, scale=None):
    """(float64 result, its bound), both (n_heads, head_dim), for one sequence of the pool."""
    k, v, ks, vs = clean
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref, bound = paged_decode_reference(q[None], k, v, table[None], [length], scale, ks, vs,
                                        dot_bf16=native.bf16_native())
    return ref[0], bound[0]


# the bundled model (3 KV heads x 3), Llama 3.1 8B (8 x 4, d 128), MHA, a group past the
# specialised ones (10) and head sizes that take the general code (d 32, 96)
GEOMETRIES = [(3, 3, 64), (8, 4, 128), (4, 1, 64), (2, 10, 64), (2, 2, 32), (1, 5, 96)]


@pytest.mark.parametrize("kv", list(CACHES))
@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("hk, g, d", GEOMETRIES, ids=[f"{a}x{b}x{c}" for a, b, c in GEOMETRIES])
@pytest.mark.parametrize("length", [1, 17, 2049])   # one row; a block and one; many blocks and splits
def test_decode_matches_the_reference_on_a_shuffled_table(length, hk, g, d, head_major, kv):
    gen = torch.Generator().manual_seed(length * 131 + hk * 17 + g * 5 + d + list(CACHES).index(kv))
    k, v, ks, vs, table, clean = paged(length, hk, d, gen, kv, head_major)
    q = torch.randn(hk * g, d, generator=gen)
    assert native.decode_serves(q, k)
    got = native.decode(q, k, v, table, length, d ** -0.5, ks, vs)
    assert got is not None and got.isfinite().all()
    assert_within(got, *reference(q, clean, table, length))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_decode_gives_the_same_result_on_any_thread_count(threads):
    """Splits follow the thread count; the result must not (within fp32 tolerance)."""
    gen = torch.Generator().manual_seed(threads)
    k, v, ks, vs, table, clean = paged(1500, 3, 64, gen, "fp32", True)
    q = torch.randn(9, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.decode(q, k, v, table, 1500, 0.125)
    finally:
        torch.set_num_threads(before)
    assert_within(got, *reference(q, clean, table, 1500))   # scale 64^-0.5 = 0.125


def test_decode_declines_what_it_does_not_serve():
    q = torch.randn(9, 64)
    k = torch.empty(4, BS, 3, 64)
    assert native.decode_serves(q, k)
    assert not native.decode_serves(torch.randn(9, 40), torch.empty(4, BS, 3, 40))     # d not a multiple of 16
    assert native.decode_serves(q, k.bfloat16()) and native.decode_serves(q, k.half())  # 16-bit caches
    assert not native.decode_serves(q.bfloat16(), k.bfloat16())                        # bf16 queries
    assert not native.decode_serves(q, k.double())                                     # an fp64 cache
    assert not native.decode_serves(torch.randn(34, 64), torch.empty(4, BS, 2, 64))    # 17 queries per KV head


def test_large_scores_do_not_overflow_the_softmax():
    """Scores far from 0 (here up to about +-150 after scaling; e^150 is past fp32's range):
    the running max must keep exp in range. The bound grows with the scores' magnitude: a
    fixed atol of 1e-5 failed here against an fp32 reference, whose own error was the larger
    (issue 21); against float64 this kernel is within 1% of its bound."""
    gen = torch.Generator().manual_seed(5)
    k, v, ks, vs, table, clean = paged(700, 3, 64, gen, "fp32", True)
    q = torch.randn(9, 64, generator=gen) * 40
    got = native.decode(q, k, v, table, 700, 64 ** -0.5)
    assert_within(got, *reference(q, clean, table, 700))


@pytest.mark.slow   # the bundled model
def test_the_engine_takes_the_kernels_for_a_decode_step(engine, monkeypatch):
    """The model's decode step goes through the C step (both kernels and what surrounds them),
    and its logits are the torch path's within the model-level tolerance of
    tests/test_model_reference.py (fp32 cache), or within fp8_bound (fp8 cache)."""
    # At a fixed count of 2 threads for torch and the kernels (their splits and GEMM blocking),
    # so every machine checks the same sums, whatever its cores: the fp8 comparison moves with
    # a sum's order (e4m3 roundings flip), 1.07e-3 at 1 thread on an Intel Xeon, 4.4e-3 at 2
    # on an AMD EPYC, where a fixed 1e-3 failed CI.
    saved = torch.get_num_threads()
    monkeypatch.setattr(threads._threads, "fixed", 2)
    monkeypatch.setattr(threads._threads, "cap", None)
    try:
        _engine_decode_through_the_kernels(engine, monkeypatch)
    finally:
        torch.set_num_threads(saved)


def fp8_bound(wants: dict) -> float:
    """The fp8 cache's bound between the two paths: half of what the fp8 cache itself moves
    the logits (the torch path's fp8 logits against its fp32 ones), and never under REL_TOL.
    Each decode step quantizes its new K/V rows to e4m3 on both sides from fp32 inputs that
    differ in their last bits (the fp32 comparison's ~1e-6); an element near a rounding
    boundary then lands one e4m3 step apart, twice its quantization error at most, and only a
    few elements are that near, so the paths differ by a fraction of the quantization's own
    effect. Measured on an AMD EPYC (2 threads): 4.4e-3 between the paths against 2.8e-2 for
    the quantization (1.07e-3 on an Intel Xeon: the flips follow the sums' order). A dropped
    block, a wrong scale or a softmax without its running max moves the logits by far more
    than the quantization does."""
    from test_cpu_attention import REL_TOL  # noqa: PLC0415
    quant = float((wants["fp8"] - wants["fp32"]).abs().max() / wants["fp32"].abs().max())
    return max(REL_TOL, 0.5 * quant)


def _engine_decode_through_the_kernels(engine, monkeypatch) -> None:
    import copy  # noqa: PLC0415

    from test_cpu_attention import REL_TOL, STEPS, bundled_text_ids, decode_from, prefilled  # noqa: PLC0415

    ids = bundled_text_ids(engine)
    calls = count_calls(monkeypatch, native, "decode")
    steps = count_calls(monkeypatch, native_step, "decode_step")
    wants = {}
    for kv in ("fp32", "fp8"):
        # one prefill (the torch path) for both sides: what is compared is the decode steps,
        # each side from its own copy of the same cached prefix
        with native.disabled():
            pool, table, runs = prefilled(engine, ids, kv, "runs")
            start = copy.deepcopy(pool)
            want = wants[kv] = decode_from(engine, ids, pool, table, runs)
        got = decode_from(engine, ids, start, table, runs)
        err = float((got - want).abs().max() / want.abs().max())
        assert err < fp8_bound(wants) if kv == "fp8" else err < REL_TOL, f"{kv}: max |diff| / max |logit| = {err:.2e}"
    # every decode step is one C call (kv_decode_step: products, RoPE and write, attention);
    # the per-layer decode call of the layer-by-layer path never ran
    assert steps["decode_step"] == 2 * STEPS and calls["decode"] == 0


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
@pytest.mark.parametrize("kv", list(CACHES))
@pytest.mark.parametrize("rows", [1, 37, 3000])
def test_write_puts_the_bytes_and_scales_of_the_torch_path(rows, kv, head_major):
    """Rows of a wide dynamic range (N(0, 1) times e^(3 N(0, 1)), some all zero, some
    with values at the e4m3 subnormal end), K and V as views with different row strides, as
    the model hands them over (K out of RoPE, V out of the projection), into shuffled slots: every byte and scale equal to write_kv_ref's."""
    gen = torch.Generator().manual_seed(rows + list(CACHES).index(kv))
    hk, d, nb = 3, 64, 200
    proj = torch.randn(rows, 5, hk, d, generator=gen) * torch.exp(3 * torch.randn(rows, 5, hk, 1, generator=gen))
    proj[::7, :, 1] = 0.0
    proj[::5, :, 2, :8] *= 1e-4
    k, v = proj[:, 1], proj[:, 2:4].reshape(rows, 2, hk * d)[:, 1].view(rows, hk, d)  # (rows, hk, d) each
    v = torch.cat((v, proj[:, 0, :1]), dim=1)[:, :hk]                 # a row stride of (hk + 1) d, not 5 hk d
    assert k.stride(0) != v.stride(0) and k.stride(1) == v.stride(1)
    slots = torch.randperm(nb * BS, generator=gen)[:rows]
    dtype = CACHES[kv]

    def pool():
        shape = (hk, nb, BS) if head_major else (nb, BS, hk)
        c = [torch.zeros(*shape, d, dtype=dtype) for _ in range(2)]
        s = [torch.zeros(*shape) for _ in range(2)] if kv == "fp8" else [None, None]
        if head_major:
            c, s = [t.movedim(0, 2) for t in c], [t.movedim(0, 2) if t is not None else None for t in s]
        return c + s
    got, want = pool(), pool()
    assert native.write_serves(got[0], k, v, slots)
    native.write(got[0], got[1], k, v, slots, got[2], got[3])
    A.write_kv_ref(want[0], want[1], k, v, slots, want[2], want[3])
    for g, w in zip(got, want):
        if g is not None:
            assert torch.equal(bits_of(g), bits_of(w))


def test_e4m3_rounding_is_torchs_for_a_sweep_of_values():
    """Every float32 from 2^-12 to 448 at a step of 1/64 of an e4m3 step, both signs, through
    the write kernel with a scale of exactly 1 (a row whose absolute maximum is 448)."""
    vals = []
    e = -12.0
    while e < 9:
        vals.append(torch.arange(2 ** e, 2 ** (e + 1), 2 ** (e - 9)))
        e += 1
    x = torch.cat(vals)
    x = torch.cat((x[x <= 448], -x[x <= 448]))
    d = 64
    x = x[: x.numel() // (d - 1) * (d - 1)].view(-1, d - 1)
    rows = torch.cat((x, torch.full((x.shape[0], 1), 448.0)), dim=1)[:, None, :]   # (n, 1, d)
    nb = -(-rows.shape[0] // BS)
    cache = [torch.zeros(nb, BS, 1, d, dtype=FP8) for _ in range(2)]
    scales = [torch.zeros(nb, BS, 1) for _ in range(2)]
    native.write(cache[0], cache[1], rows, rows, torch.arange(rows.shape[0]), scales[0], scales[1])
    assert torch.equal(scales[0].flatten()[: rows.shape[0]], torch.ones(rows.shape[0]))
    got = cache[0].view(torch.uint8).reshape(-1, d)[: rows.shape[0]]
    assert torch.equal(got, rows[:, 0].to(FP8).view(torch.uint8))


@pytest.mark.parametrize("head_major", [False, True], ids=["tokens", "heads"])
def test_decode_reads_every_e4m3_byte_exactly(head_major):
    """Every e4m3fn byte but NaN (subnormals, both zeros, 448) as the V row of a one-row
    sequence, scales 1: the softmax of one row is exactly 1, so the output is V as the kernel
    widened it, and it must be torch's e4m3 -> float32 exactly (as values: the output is summed
    from +0, so -0 comes out +0). The widening goes through a float32 subnormal for e4m3's
    subnormals (decode.c's widen_rows); this pins its values for any rewrite. On AVX512-BF16
    (native.bf16_native()) p V is vdpbf16ps's, which takes subnormals for zero: those come out 0."""
    d = 256
    byte = torch.arange(256, dtype=torch.uint8)
    byte[(byte & 0x7F) == 0x7F] = 0                      # 0x7f, 0xff: e4m3fn's NaNs
    shape = (1, 1, BS, d) if head_major else (1, BS, 1, d)
    k, v = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    if head_major:
        k, v = k.movedim(0, 2), v.movedim(0, 2)          # (blocks, bs, H_kv, d) views of head-major storage
    v.view(torch.uint8)[0, 0, 0] = byte
    ks, vs = torch.ones(k.shape[:-1]), torch.ones(k.shape[:-1])
    q = torch.randn(3, d, generator=torch.Generator().manual_seed(7))
    got = native.decode(q, k, v, torch.zeros(1, dtype=torch.int32), 1, d ** -0.5, ks, vs)
    want = byte.view(FP8).float()
    if native.bf16_native():
        want[((byte & 0x78) == 0) & ((byte & 0x07) != 0)] = 0.0
    assert got is not None
    for row in got:
        assert torch.equal(row, want)


@pytest.mark.parametrize("k", [576, 4096, 100])
def test_rms_norm_is_torchs(k):
    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(1, k, generator=gen) * 3, torch.randn(k, generator=gen)
    assert_within(native.rms_norm(x, w, 1e-5), *rms_norm_reference(x, w, 1e-5))
