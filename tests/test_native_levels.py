"""Every build of the C kernels a user can get, tested here: the library compiled for each
level this CPU can run (native, the portable C without x86 intrinsics, and the x86-64 levels
a distribution would ship: baseline SSE2, v2, v3 with AVX2 and FMA, v4 with AVX-512), each
loaded beside the others and run through every kernel against float64 within the bounds of
tests/tolerance.py. So the AVX2 laptop's code and the ARM server's plain C are tested on
this machine too. (.ci/run also runs the whole of tests/test_native*.py once per level.)
"""
from __future__ import annotations

import pytest
import torch

from test_native_batch import BS, CACHES, bits_of, paged_batch
from test_native_fused import (check_add_rms_norm, check_chunk_ops, check_merge_two, check_rope_write, check_silu_mul,
                               check_step)
from tolerance import assert_within, gemv_bf16_reference, gemv_reference, paged_decode_reference, rms_norm_reference
from kvchat.engine import attention as A
from kvchat.engine import native, native_build

LEVELS = native_build.runnable_levels()


@pytest.fixture(params=LEVELS)
def level(request):
    with native.using(request.param) as why:
        if why.startswith("off:") and "failed" in why and request.param.startswith("x86-64-"):
            pytest.skip(f"this compiler does not build {request.param}: {why}")   # e.g. GCC < 11 and v4
        assert why.startswith("on:") and f"(level {request.param})" in why, why
        yield request.param


def test_each_level_computes_the_products(level):
    gen = torch.Generator().manual_seed(1)
    for n, k in ((960, 576), (13, 33), (9, 100)):
        w = torch.randn(n, k, generator=gen)
        for b in (1, 2, 3, 4, 16, 17):
            x = torch.randn(b, k, generator=gen)
            got = native.gemv(x, w)
            assert_within(got, *gemv_reference(x, w), what=f"{level} {n}x{k} B={b}")
            alone = torch.cat([native.gemv(x[i:i + 1].contiguous(), w) for i in range(b)])
            assert torch.equal(got, alone), f"{level} B={b}: batched != alone"
        assert_within(native.rms_norm(x, w[0], 1e-5), *rms_norm_reference(x, w[0], 1e-5), what=level)


def test_each_level_computes_the_bf16_products(level):
    """vdpbf16ps where this level's build has AVX512-BF16 (native on such a CPU), the widening
    loop elsewhere (portable, v4 and below): each within its own bound, batched == alone."""
    gen = torch.Generator().manual_seed(4)
    rounded = native.bf16_native()
    assert rounded == (level == "native" and "avx512_bf16" in native_build.cpu_flags())
    for n, k in ((960, 576), (13, 33), (9, 100), (64, 1536)):
        w = torch.randn(n, k, generator=gen).bfloat16()
        for b in (1, 2, 3, 4, 16, 17):
            x = torch.randn(b, k, generator=gen)
            got = native.gemv(x, w)
            assert_within(got, *gemv_bf16_reference(x, w, rounded), what=f"{level} {n}x{k} B={b}")
            alone = torch.cat([native.gemv(x[i:i + 1].contiguous(), w) for i in range(b)])
            assert torch.equal(got, alone), f"{level} B={b}: batched != alone"


@pytest.mark.parametrize("kv", list(CACHES))
def test_each_level_decodes_a_batch(level, kv):
    gen = torch.Generator().manual_seed(2 + list(CACHES).index(kv))
    for hk, g, d, head_major in ((3, 3, 64, True), (2, 10, 64, False), (1, 5, 96, True), (8, 4, 128, False)):
        lens = [1, BS, BS + 1, 300, 40]
        k, v, ks, vs, tables = paged_batch(lens, hk, d, gen, kv, head_major)
        q = torch.randn(len(lens), hk * g, d, generator=gen)
        got = native.decode_batch(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), d ** -0.5, ks, vs)
        assert got is not None
        assert_within(got, *paged_decode_reference(q, k, v, tables, lens, d ** -0.5, ks, vs,
                                                   dot_bf16=native.bf16_native()),
                      what=f"{level} {hk}x{g}x{d}")


@pytest.mark.parametrize("kv", list(CACHES))
def test_each_level_writes_the_bytes_of_the_torch_path(level, kv):
    gen = torch.Generator().manual_seed(3)
    hk, d, nb, rows = 3, 64, 40, 50
    src = torch.randn(rows, hk, d, generator=gen) * torch.exp(3 * torch.randn(rows, hk, 1, generator=gen))
    slots = torch.randperm(nb * BS, generator=gen)[:rows]
    dtype = CACHES[kv]

    def pool():
        c = [torch.zeros(hk, nb, BS, d, dtype=dtype).movedim(0, 2) for _ in range(2)]
        s = [torch.zeros(hk, nb, BS).movedim(0, 2) for _ in range(2)] if kv == "fp8" else [None, None]
        return c + s
    got, want = pool(), pool()
    native.write(got[0], got[1], src, src * 0.5, slots, got[2], got[3])
    A.write_kv_ref(want[0], want[1], src, src * 0.5, slots, want[2], want[3])
    for gt, wt in zip(got, want):
        if gt is not None:
            assert torch.equal(bits_of(gt), bits_of(wt)), level


def test_each_level_computes_the_fused_ops(level):
    """The residual add + norm, SiLU-and-multiply, and RoPE + cache write of this level's build
    (engine/csrc/step.c, write.c), each within its float64 bound (tests/test_native_fused.py)."""
    gen = torch.Generator().manual_seed(6)
    for b, k in ((1, 576), (3, 100), (17, 4096)):
        check_add_rms_norm(gen, b, k, level)
    for b, n in ((1, 1536), (5, 9)):
        check_silu_mul(gen, b, n, level)
    for b, k, n in ((5, 100, 9), (130, 576, 1536)):
        check_chunk_ops(gen, b, k, n, level)
    for dtype in (torch.float32, torch.bfloat16):
        check_merge_two(gen, 130, 9, 3, 72, dtype, level)
    for hq, hk, d, kv, head_major in ((9, 3, 64, "fp32", True), (32, 8, 128, "fp8", False), (5, 1, 96, "fp8", True),
                                      (9, 3, 64, "bf16", False), (9, 3, 64, "fp16", True)):
        check_rope_write(gen, hq, hk, d, 7, kv, head_major, f"{level} {hq}x{hk}x{d} {kv}")


@pytest.mark.parametrize("weights, kv", [("fp32", "fp32"), ("fp32", "fp8"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_each_level_runs_the_whole_decode_step(level, weights, kv, monkeypatch):
    """kv_decode_step of this level's build: the layer-by-layer path's bits, batched == alone."""
    check_step(weights, kv, monkeypatch, f"{level} {weights} weights, {kv} cache")
