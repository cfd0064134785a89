"""The CPU model's weight matrices in one arena (engine/arena.py): page-aligned, the values of
the file bit for bit, and in 2 MiB pages where the kernel's transparent huge pages are on."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from kvchat.engine import weights
from kvchat.engine.arena import ALIGN, HUGE, Arena, footprint


def test_take_hands_out_page_aligned_tensors_until_the_arena_is_full():
    shapes = [(3, 5), (1000,), (7, 11, 13)]
    arena = Arena(footprint(shapes, torch.float32))
    ts = [arena.take(s, torch.float32) for s in shapes]
    for s, t in zip(shapes, ts):
        assert tuple(t.shape) == s and t.is_contiguous() and t.dtype == torch.float32
        assert t.data_ptr() % ALIGN == 0
    assert ts[0].data_ptr() % HUGE == 0           # the first at a huge page's start
    for i, t in enumerate(ts):                    # none overlaps another
        t.fill_(i)
    assert [t.unique().tolist() for t in ts] == [[0.0], [1.0], [2.0]]
    with pytest.raises(ValueError, match="bytes left"):
        arena.take((1,), torch.float32)


def test_the_mapping_lives_while_a_tensor_from_it_does():
    t = Arena(footprint([(1 << 20,)], torch.float32)).take((1 << 20,), torch.float32)
    t.copy_(torch.arange(1 << 20, dtype=torch.float32))     # the arena itself is gone
    assert t[-1].item() == (1 << 20) - 1


def _matrices(model) -> list[torch.Tensor]:
    out = []
    for ly in model.layers:
        out += [ly.wqkv, ly.wo, ly.w_gate_up, ly.w_down]
    return out + [model.embed, model.lm_head]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bundled_model_loads_into_the_arena_bit_for_bit(engine, monkeypatch, dtype):
    src, cpu = engine.source, torch.device("cpu")
    kept = weights.load_model(src, cpu, dtype)
    monkeypatch.setattr(weights, "_arena", lambda *a: None)
    plain = weights.load_model(src, cpu, dtype)
    assert kept.lm_head is kept.embed                          # tied: one copy, as before
    for a, b in zip(_matrices(kept), _matrices(plain), strict=True):
        assert a.dtype == dtype and a.data_ptr() % ALIGN == 0
        assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    # loaded as it was, some matrices sat at the file's 8-byte offsets (what the arena is for)
    assert any(b.data_ptr() % 64 for b in _matrices(plain)) or dtype != torch.float32


def _huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages of this process's mappings that overlap [lo, hi)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_weights_sit_in_huge_pages_where_the_kernel_grants_them():
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'absent'} here")
    n = 16 * HUGE
    arena = Arena(n)
    assert arena.huge
    t = arena.take((n // 4,), torch.float32)
    t.fill_(1.0)                                               # fault every page in
    assert _huge_kib(t.data_ptr(), t.data_ptr() + n) >= HUGE >> 10
