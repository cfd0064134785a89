"""The bf16 product on AMX tiles (engine/csrc/gemv_amx.c): a decode step's 1 to 32 rows
against bf16 weights in one read of W, where the CPU has AMX and Linux grants its tile state.
Against float64 on fresh random inputs, within the bound of x rounded to bf16 then summed in
fp32 (tests/tolerance.py); each row bit for bit what it gets alone; shapes the tiles do not cut
declined, and the vdpbf16ps loop serving then. On a CPU without AMX the tiles must decline
everything (the other bf16 tests cover the loop there)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tolerance import assert_within, gemv_bf16_reference
from kvchat.engine import native, native_build

HAS_AMX = {"amx_tile", "amx_bf16"} <= native_build.cpu_flags()
# the bundled model's matrices; 3 tiles of 16 rows (two threads: one takes 16 rows, the other
# 32), one tile, and a long k that the threads split
SHAPES = [(960, 576), (3072, 576), (576, 1536), (48, 2048), (16, 32), (64, 4096)]


def tiles(x: torch.Tensor, w: torch.Tensor) -> tuple[int, torch.Tensor]:
    """kv_gemv_amx called directly: its status and y."""
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    status = native.lib().kv_gemv_amx(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], w.shape[0],
                                      w.shape[1], 2)
    return status, y


@contextmanager
def tiles_aside():
    was = native.lib().kv_amx_use(0)
    try:
        yield
    finally:
        native.lib().kv_amx_use(was)


@pytest.fixture(autouse=True)
def kernels():
    if native.lib() is None:
        pytest.skip(f"C kernels off: {native.status()}")


def test_the_tiles_serve_exactly_where_the_cpu_has_amx():
    if HAS_AMX and not native.amx():
        pytest.skip("the CPU has AMX but this build (a compiler without AMX) or Linux (arch_prctl) gives no tiles")
    assert native.amx() == HAS_AMX
    assert ("AMX" in native.describe_bf16()) == HAS_AMX
    status, _ = tiles(torch.randn(2, 64), torch.randn(32, 64).bfloat16())
    assert (status == 0) == HAS_AMX


@pytest.mark.parametrize("n, k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_the_tiles_products_are_within_the_bound_and_each_rows_own(n, k):
    if not native.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(n + 7 * k)
    w = (torch.randn(n, k, generator=gen) * 0.5).bfloat16()
    for b in (1, 2, 7, 15, 16, 17, 31, native.GEMV_MAX_ROWS):   # one B tile, full, a second one
        x = torch.randn(b, k, generator=gen) * 3
        status, got = tiles(x, w)
        assert status == 0
        assert_within(got, *gemv_bf16_reference(x, w, True), what=f"{n}x{k} B={b}")
        assert torch.equal(native.gemv(x, w), got), "native.gemv did not take the tiles"
        alone = torch.cat([tiles(x[i:i + 1].contiguous(), w)[1] for i in range(b)])
        assert torch.equal(got, alone), f"B={b}: a row's bits depend on the batch"


def test_shapes_the_tiles_do_not_cut_go_to_the_vdpbf16ps_loop():
    if not native.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(5)
    for b, n, k in ((2, 24, 64), (2, 32, 48), (33, 32, 64), (2, 8, 32)):   # n % 16, k % 32, rows, n < 16
        x, w = torch.randn(b, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
        status, y = tiles(x, w)
        assert status == -1 and y.isnan().all(), (b, n, k)
        if b <= native.GEMV_MAX_ROWS:
            assert_within(native.gemv(x, w), *gemv_bf16_reference(x, w, native.bf16_native()))


def test_set_aside_the_loop_serves_within_its_bound_with_other_bits():
    """KVCHAT_AMX=0's switch: the tiles decline, vdpbf16ps (or the widening loop) serves with
    its own order of sums, and the tiles come back after."""
    if not native.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(8, 576, generator=gen), torch.randn(960, 576, generator=gen).bfloat16()
    on = native.gemv(x, w)
    with tiles_aside():
        assert not native.amx() and tiles(x, w)[0] == -1 and "AMX" not in native.describe_bf16()
        off = native.gemv(x, w)
        assert_within(off, *gemv_bf16_reference(x, w, native.bf16_native()))
        assert torch.equal(off, torch.cat([native.gemv(x[i:i + 1].contiguous(), w) for i in range(8)]))
    assert native.amx() and torch.equal(native.gemv(x, w), on)
    assert not torch.equal(on, off), "the same bits both ways: the switch did not switch"


def test_the_bound_catches_a_row_written_to_its_neighbour_and_a_dropped_k_step():
    if not native.amx():
        pytest.skip("no AMX tiles here")
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(17, 576, generator=gen), torch.randn(960, 576, generator=gen).bfloat16()
    ref, bound = gemv_bf16_reference(x, w, True)
    got = tiles(x, w)[1]
    assert_within(got, ref, bound)
    dropped = x.clone()
    dropped[:, 544:] = 0                      # the last k step of 32
    with pytest.raises(AssertionError):
        assert_within(tiles(dropped, w)[1], ref, bound)
    with pytest.raises(AssertionError):
        assert_within(got.roll(1, 0), ref, bound)
