"""Triton kernels for the paged KV cache: the cache write and paged decode attention, plus
the small fused kernels of the CUDA decode step.

`write_kv` and `paged_decode` have the signatures and semantics of the torch references in
`engine/attention.py` (`write_kv_ref`, `paged_decode_ref`), and `engine.attention`
dispatches CUDA tensors to them. `add_rms_norm`, `rope_write` and `silu_mul` have theirs in
`engine.cuda_graph.TorchOps`.

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
from .fused import add_rms_norm, rope_write, silu_mul

__all__ = ["write_kv", "paged_decode", "DecodeConfig", "add_rms_norm", "rope_write", "silu_mul"]
