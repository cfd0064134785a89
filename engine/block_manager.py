"""The block manager: which pool blocks hold what. Pure Python, no torch.

Every block is in exactly one state:
- free: on the free list, content meaningless;
- active: referenced by one or more sequences (ref_count > 0);
- cached: unreferenced but still indexed by its content hash, reusable by a later
  prefix match, evicted least-recently-used first when the pool needs room.

The prefix index keys each *full* block by a hash chained from its parent block's key and
its own token ids, so a key names the whole prefix up to that block. A hit is verified
against the token ids stored with the block, so a hash collision can cost a reuse but never
returns a block holding other tokens.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import PoolExhausted

ROOT_KEY = 0
HashFn = Callable[[int, tuple[int, ...]], int]


def chain_hash(parent_key: int, token_ids: tuple[int, ...]) -> int:
    """Key of a full block: its parent's key and its own tokens."""
    return hash((parent_key, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None          # set once the block is full and indexed
    parent_key: int = ROOT_KEY
    token_ids: tuple[int, ...] = ()  # kept with the key to verify hits


class BlockManager:
    """Free list (lowest id first, so a fresh sequence gets contiguous blocks), reference
    counts, and an LRU of cached blocks behind a verified prefix index."""

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = chain_hash) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # a heap
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, indexed; oldest first
        self._index: dict[int, int] = {}  # key -> block id
        self.evictions = 0  # cached blocks reclaimed for new content, since start

    # ---- queries -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_active(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free + self.num_cached

    def state(self, block_id: int) -> str:
        b = self.blocks[block_id]
        if b.ref_count > 0:
            return "active"
        return "cached" if block_id in self._cached else "free"

    def cached_ids(self):
        """A view of the cached block ids (no copy)."""
        return self._cached.keys()

    # ---- prefix reuse -----------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Take a reference on the longest chain of indexed full blocks that begins
        `token_ids`, and return their ids. Only whole blocks match."""
        bs = self.block_size
        parent = ROOT_KEY
        matched: list[int] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            key = self.hash_fn(parent, chunk)
            block_id = self._index.get(key)
            if block_id is None:
                break
            b = self.blocks[block_id]
            if b.token_ids != chunk or b.parent_key != parent:  # a collision: not our tokens
                break
            matched.append(block_id)
            parent = key
        for block_id in matched:
            self._ref(block_id)
        return matched

    def key_of(self, block_id: int) -> int | None:
        return self.blocks[block_id].key

    # ---- allocation -------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with one reference each: free ones first (lowest id), then the
        least recently used cached ones, whose index entries are dropped."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"KV pool exhausted: {n} blocks needed, {self.num_free} free and {self.num_cached} "
                f"evictable of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                block_id = heapq.heappop(self._free)
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._unindex(block_id)
                self.evictions += 1
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def commit(self, block_id: int, parent_key: int, token_ids: Sequence[int]) -> int:
        """Index a block that just became full with `token_ids` after the prefix named by
        `parent_key`. Returns the block's key, which is the parent key of the next block.
        If another block already holds this prefix, the index keeps the older one."""
        chunk = tuple(token_ids)
        if len(chunk) != self.block_size:
            raise ValueError(f"only full blocks are indexed: got {len(chunk)} of {self.block_size} tokens")
        b = self.blocks[block_id]
        if b.ref_count <= 0:
            raise ValueError(f"block {block_id} is not held; commit it while a sequence references it")
        key = self.hash_fn(parent_key, chunk)
        if b.key is not None:
            self._unindex(block_id)
        b.key, b.parent_key, b.token_ids = key, parent_key, chunk
        self._index.setdefault(key, block_id)
        return key

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. An unreferenced indexed block becomes cached
        (most recently used); an unindexed one goes back on the free list."""
        for block_id in block_ids:
            b = self.blocks[block_id]
            if b.ref_count <= 0:
                raise ValueError(f"block {block_id} released more often than it was referenced")
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.key is not None and self._index.get(b.key) == block_id:
                    self._cached[block_id] = None
                else:
                    self._clear(block_id)
                    heapq.heappush(self._free, block_id)

    def forget(self, block_ids: Sequence[int]) -> None:
        """Release blocks and also drop them from the prefix index, so their content is not
        reused (a cache reset)."""
        for block_id in block_ids:
            self.release([block_id])
            if block_id in self._cached:
                del self._cached[block_id]
                self._unindex(block_id)
                heapq.heappush(self._free, block_id)

    def evict_all_cached(self) -> int:
        n = len(self._cached)
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._unindex(block_id)
            heapq.heappush(self._free, block_id)
        return n

    # ---- internals ----------------------------------------------------------------------
    def _ref(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            self._cached.pop(block_id, None)
        b.ref_count += 1

    def _unindex(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.key is not None and self._index.get(b.key) == block_id:
            del self._index[b.key]
        self._clear(block_id)

    def _clear(self, block_id: int) -> None:
        b = self.blocks[block_id]
        b.key, b.parent_key, b.token_ids = None, ROOT_KEY, ()
