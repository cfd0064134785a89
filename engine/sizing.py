"""Sizing questions answered by the formula alone (no torch, no weights): what one
conversation's cache costs against a budget, and what one decode step reads.

    bytes = 2 x L x H_kv x d_h x S x element bytes          (per sequence of S tokens)
    one decode step reads every weight once and the whole cache once, so the cache read
    equals the weight read at S = weight bytes / KV bytes per token.
"""
from __future__ import annotations

from dataclasses import dataclass

from .geometry import DTYPE_BYTES, Geometry
from .pool_spec import blocks_for


@dataclass(frozen=True, slots=True)
class WhatIf:
    """`users` conversations of `tokens` tokens each, in `kv_dtype`, against `budget` bytes."""
    model: str
    kv_dtype: str
    tokens: int
    users: int
    bytes_per_token: int          # the formula's figure
    scale_bytes_per_token: int    # fp8: one fp32 scale per token, layer, K/V and KV head
    bytes_needed: int             # users x tokens x (bytes + scale bytes) per token
    budget: int | None
    block_size: int
    users_that_fit: int | None    # whole conversations of `tokens` the budget's blocks hold

    @property
    def share(self) -> float | None:
        return self.bytes_needed / self.budget if self.budget else None

    @property
    def fits(self) -> bool | None:
        return None if self.users_that_fit is None else self.users_that_fit >= self.users


def what_if(geom: Geometry, kv_dtype: str, tokens: int, users: int = 1, budget: int | None = None,
            block_size: int = 16) -> WhatIf:
    per_token = geom.kv_bytes_per_token(kv_dtype)
    scales = geom.kv_scale_bytes_per_token(kv_dtype)
    fit = None
    if budget is not None:
        blocks = budget // (block_size * (per_token + scales))
        fit = blocks // blocks_for(tokens, block_size) if blocks else 0
    return WhatIf(geom.name, kv_dtype, tokens, users, per_token, scales, users * tokens * (per_token + scales),
                  budget, block_size, fit)


@dataclass(frozen=True, slots=True)
class StepReads:
    """The bytes one decode step reads at a context of `tokens`."""
    weight_bytes: int
    cache_bytes_per_token: int
    tokens: int

    @property
    def cache_bytes(self) -> int:
        return self.tokens * self.cache_bytes_per_token

    @property
    def cache_share(self) -> float:
        total = self.weight_bytes + self.cache_bytes
        return self.cache_bytes / total if total else 0.0

    @property
    def crossover_tokens(self) -> int:
        """The context at which the cache read equals the weight read."""
        return round(self.weight_bytes / self.cache_bytes_per_token)


def step_reads(geom: Geometry, dtype: str, kv_dtype: str, tokens: int) -> StepReads:
    per_token = geom.kv_bytes_per_token(kv_dtype) + geom.kv_scale_bytes_per_token(kv_dtype)
    return StepReads(geom.param_count() * DTYPE_BYTES[dtype], per_token, tokens)


# ---- prompt chunks -----------------------------------------------------------------------------
PREFILL_CHUNK = 8192     # CUDA: a cold prefill in one causal call takes the flash kernel; a masked chunk does not
CPU_PREFILL_CHUNK = 512  # CPU: an 8k prompt takes minutes; chunks this size report progress and can stop, and
                         # bound a step that others share (the scheduler's token budget)
CPU_LONE_CHUNK_MAX = 2048
CPU_LONE_CHUNK_FLOP = 6e11   # a lone bf16 chunk's products: about 0.3 s at AMX's 2 TFLOP/s (a Xeon, 2 cores)


def step_tokens(device: str) -> int:
    """The most prompt tokens a step that others share takes (the scheduler's token budget)."""
    return PREFILL_CHUNK if device == "cuda" else CPU_PREFILL_CHUNK


def prefill_chunk(geom: Geometry, dtype: str, device: str, native_bf16: bool) -> int:
    """The most prompt tokens a lone prompt computes in one step (a request's chunk; a step
    that others share takes at most CPU_PREFILL_CHUNK on a CPU). On a CPU a chunk is the grain
    of progress and of stopping, so it is sized by its products: bf16 weights on a CPU that
    multiplies bf16 natively (native_bf16: AVX512-BF16 or AMX) take the largest power of two
    from CPU_PREFILL_CHUNK to CPU_LONE_CHUNK_MAX whose 2 x params x tokens stay within
    CPU_LONE_CHUNK_FLOP (the bundled model: 2,048; Llama 3.1 8B: 512); other weights, or bf16
    widened to fp32 (several times slower), CPU_PREFILL_CHUNK. Larger chunks are faster: fewer
    passes over the weights and fewer merges with the prefix (the bundled model's bf16 prefill
    of 4,096 tokens on a Xeon: 1,715 ms in chunks of 512, 1,650 of 1,024, 1,460 of 2,048)."""
    n = step_tokens(device)
    if device == "cuda" or dtype != "bf16" or not native_bf16:
        return n
    while n < CPU_LONE_CHUNK_MAX and 2 * geom.param_count() * 2 * n <= CPU_LONE_CHUNK_FLOP:
        n *= 2
    return n


WORKING_MARGIN = 512 * 2**20      # activations, logits, allocator slack: measured well under this on CPU


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What loading a model takes, against what the device has free."""
    model: str
    dtype: str
    weight_bytes: int
    pool_bytes: int
    available: int
    device: str

    @property
    def needed(self) -> int:
        return self.weight_bytes + self.pool_bytes + WORKING_MARGIN

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    def refusal(self, smaller: dict[str, int]) -> str:
        """One line: the numbers, and what would fit (`smaller`: dtype -> its weight bytes)."""
        gb = lambda n: f"{n / 1e9:.1f} GB"  # noqa: E731
        alternatives = []
        for dtype, weights in [(self.dtype, self.weight_bytes), *smaller.items()]:
            room = self.available - weights - WORKING_MARGIN       # what is left for the pool
            if room < 64 * 2**20:
                continue
            flag = f"--dtype {dtype}" if dtype != self.dtype else ""
            budget = f"--kv-budget {room // 2**20:,}MiB or less" if room < self.pool_bytes else ""
            alternatives.append(" ".join(x for x in (flag, budget) if x))
        tail = f"; try {' or '.join(alternatives)}" if alternatives else "; use a smaller model or a larger machine"
        return (f"{self.model} in {self.dtype} does not fit on {self.device}: it needs about {gb(self.needed)} "
                f"({gb(self.weight_bytes)} of weights + {gb(self.pool_bytes)} KV pool + {gb(WORKING_MARGIN)} working "
                f"memory) and {gb(self.available)} is available{tail}")


def memory_plan(geom: Geometry, dtype: str, pool_bytes: int, available: int, device: str) -> MemoryPlan:
    return MemoryPlan(geom.name, dtype, geom.param_count() * DTYPE_BYTES[dtype], pool_bytes, available, device)
