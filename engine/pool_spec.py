"""Planning the KV pool: how many blocks of how many bytes a budget holds. Plain arithmetic
(no torch), so `kvchat info` answers without loading anything."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import KvchatError
from .geometry import DTYPE_BYTES, Geometry


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
    def stored_bytes_per_token(self) -> int:
        """What one token takes in the pool: its elements and (fp8) their scales. Every figure
        kvchat shows or writes counts bytes this way, with the scales' share beside it."""
        return self.bytes_per_token + self.scale_bytes_per_token

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.stored_bytes_per_token

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
    scale_per_token = geom.kv_scale_bytes_per_token(kv_dtype)
    block_bytes = block_size * (per_token + scale_per_token)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise KvchatError(
            f"--kv-budget of {budget_bytes} bytes is too small for one block: a block of {block_size} "
            f"tokens takes {block_bytes} bytes on this model")
    return PoolSpec(num_blocks, block_size, kv_dtype, per_token, scale_per_token)
