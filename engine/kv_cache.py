"""The KV pool: one preallocated tensor of K/V blocks shared by every conversation.

pool shape: (n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim), keys stored
after RoPE. An fp8 pool adds one float32 scale per (slot, KV head), counted in its bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import FP8
from .errors import KvchatError
from .geometry import DTYPE_BYTES, Geometry

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
if FP8 is not None:
    TORCH_DTYPES["fp8"] = FP8


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class PoolSpec:
    num_blocks: int
    block_size: int
    kv_dtype: str
    bytes_per_token: int        # the formula's figure: 2 x L x H_kv x d_h x element bytes
    scale_bytes_per_token: int  # fp8 only: 2 x L x H_kv x 4

    @property
    def block_bytes(self) -> int:
        return self.block_size * (self.bytes_per_token + self.scale_bytes_per_token)

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_pool(geom: Geometry, kv_dtype: str, budget_bytes: int, block_size: int) -> PoolSpec:
    """How many blocks of `block_size` tokens fit in `budget_bytes`."""
    if block_size <= 0:
        raise KvchatError(f"--block-size must be a positive number of tokens, got {block_size}")
    if kv_dtype not in DTYPE_BYTES:
        raise KvchatError(f"unknown KV dtype {kv_dtype!r}; accepted: {', '.join(DTYPE_BYTES)}")
    per_token = geom.kv_bytes_per_token(kv_dtype)
    scale_per_token = 2 * geom.n_layers * geom.n_kv_heads * 4 if kv_dtype == "fp8" else 0
    block_bytes = block_size * (per_token + scale_per_token)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise KvchatError(
            f"--kv-budget of {budget_bytes} bytes is too small for one block: a block of {block_size} "
            f"tokens takes {block_bytes} bytes on this model")
    return PoolSpec(num_blocks, block_size, kv_dtype, per_token, scale_per_token)


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
