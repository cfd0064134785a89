"""Triton kernels for the paged KV cache: the cache write and paged decode attention.

Same signatures and semantics as the torch references in `engine/attention.py`
(`write_kv_ref`, `paged_decode_ref`); `engine.attention` dispatches CUDA tensors here.
Importing this package needs triton but no GPU: nothing touches a driver until a kernel
is launched. Without triton the import raises ImportError and the engine keeps its torch
paths. With TRITON_INTERPRET=1 set before this import, the kernels also run on CPU tensors
(slowly), which is how the tests check them on machines without a GPU.
"""
from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError as err:  # the engine's torch paths stand in
    raise ImportError(f"engine.kernels needs triton ({err})") from err

from .cache_write import write_kv
from .decode import DecodeConfig, paged_decode

__all__ = ["write_kv", "paged_decode", "DecodeConfig"]
