"""The KV pool: one preallocated tensor of K/V blocks shared by every conversation.

pool shape: (n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim), keys stored
after RoPE. An fp8 pool adds one float32 scale per (slot, KV head), counted in its bytes.
"""
from __future__ import annotations


import torch

from .attention import FP8
from .geometry import Geometry
from .pool_spec import PoolSpec, blocks_for, plan_pool  # noqa: F401  (the pool is planned there)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
if FP8 is not None:
    TORCH_DTYPES["fp8"] = FP8




class KVPool:
    """The tensors behind a PoolSpec, with per-layer views for the model."""

    def __init__(self, geom: Geometry, spec: PoolSpec, device: torch.device) -> None:
        self.spec = spec
        dtype = TORCH_DTYPES[spec.kv_dtype]
        shape = (geom.n_layers, 2, spec.num_blocks, spec.block_size, geom.n_kv_heads, geom.head_dim)
        # empty, not zeros: pages are committed as blocks are written, and unwritten slots are
        # never read (context lengths bound every read).
        self.data = torch.empty(shape, dtype=dtype, device=device)
        self.scales = (torch.empty(shape[:-1], dtype=torch.float32, device=device)
                       if spec.kv_dtype == "fp8" else None)

    def layer(self, i: int):
        """(k_cache, v_cache, k_scale, v_scale) for layer i; caches (num_blocks, bs, H_kv, d)."""
        ks = self.scales[i, 0] if self.scales is not None else None
        vs = self.scales[i, 1] if self.scales is not None else None
        return self.data[i, 0], self.data[i, 1], ks, vs

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0)
