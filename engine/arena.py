"""The CPU model's weights in one block of memory the kernel may back with 2 MiB pages.

A CPU decode step streams every weight once (538 MB a step for the bundled model in fp32).
In 4 KiB pages that is 131,000 pages a step, each a TLB miss and a page walk, and the
hardware prefetchers stop at every page's end. Loaded as they were, the weights were worse
still: the ones read straight out of the safetensors file (wo, w_down, the embedding that is
also lm_head) sit in the page cache at the file's offsets, 8-byte aligned, so every 64-byte
vector load of a row straddled two cache lines.

Here every weight matrix is copied into one private anonymous mapping advised
MADV_HUGEPAGE (Linux's transparent huge pages, granted where the system's setting is
`madvise` or `always`), each at a 4 KiB boundary. The bundled model's products on 2 Zen 4
cores, the same weights three ways in one process, taking turns (ms a step, medians of 28):
one row 20.1 (as loaded) -> 19.3 (4 KiB pages) -> 19.0 (2 MiB pages); eight rows
22.2 -> 21.9 -> 19.0. Where the kernel grants no huge pages (the setting `never`, another
OS) the copy is still aligned and nothing else changes. The values are copied bit for bit.
"""
from __future__ import annotations

import mmap

import torch

HUGE = 2 << 20      # the x86-64 and aarch64 (4 KiB granule) transparent huge page
ALIGN = 4096        # each tensor's start: a page, so a 64-byte vector never straddles lines


def _rounded(n: int, to: int) -> int:
    return -(-n // to) * to


class Arena:
    """A fixed number of bytes, handed out as tensors at ALIGN boundaries. The mapping is
    released when the arena and every tensor taken from it are gone (each tensor holds it)."""

    def __init__(self, nbytes: int) -> None:
        size = _rounded(max(nbytes, 1), HUGE) + HUGE      # room to start at a huge page's boundary
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:        # a kernel built without transparent huge pages
                pass
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._next = (-self._bytes.data_ptr()) % HUGE
        self._end = self._next + _rounded(max(nbytes, 1), ALIGN)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of this shape and dtype from the arena."""
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        start = self._next
        if start + n > self._end:
            raise ValueError(f"the arena has {self._end - start} bytes left; {n} asked")
        self._next = start + _rounded(n, ALIGN)
        return self._bytes[start:start + n].view(dtype).view(shape)


def footprint(shapes, dtype: torch.dtype) -> int:
    """Bytes an Arena needs for tensors of these shapes, each at an ALIGN boundary."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(_rounded(torch.Size(s).numel() * size, ALIGN) for s in shapes)
