"""The simulated KV pool: fixed-size blocks, reference counts, and a prefix cache evicted
least-recently-used first, as vLLM v1's block pool keeps them.

Blocks hold no tokens here, only what decides who may use them: a reference count and, once
full, a key naming their content. Every block with no reference waits in one free queue:
never-used blocks at its head, then freed blocks in the order they were freed (a sequence's
blocks go in reverse, so its tail goes first). Allocation takes from the head; a block that
still carried a key is then evicted from the prefix index. A prefix hit takes a cached
block back out of the queue wherever it sits.

A key is (owner, epoch, index): owner -1 for the system prompt every user shares (so its
blocks are one chain for all), else the user. Within a user, the key of block i stands for
the whole chain before it, because a user's tokens only grow (epoch changes when the
history is rewritten, by drop-oldest).
"""
from __future__ import annotations

from collections import OrderedDict

Key = tuple[int, int, int]


class Block:
    __slots__ = ("ref", "key")

    def __init__(self) -> None:
        self.ref = 0
        self.key: Key | None = None


class BlockPool:
    def __init__(self, num_blocks: int, caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.caching = caching
        self.blocks = [Block() for _ in range(num_blocks)]
        self.free_q: OrderedDict[Block, None] = OrderedDict((b, None) for b in self.blocks)
        self.index: dict[Key, Block] = {}
        self.cached_free = 0      # blocks in the free queue that still carry a key (evictable cache)
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: never used, freed, or cached and unreferenced."""
        return len(self.free_q)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_q)

    # ---- prefix cache ------------------------------------------------------------------------
    def match(self, keys: list[Key]) -> list[Block]:
        """The longest run of cached blocks for `keys`, in order (stops at the first miss)."""
        out: list[Block] = []
        if not self.caching:
            return out
        get = self.index.get
        for key in keys:
            block = get(key)
            if block is None:
                break
            out.append(block)
        return out

    @staticmethod
    def taken_from_free(hits: list[Block]) -> int:
        """How many of `hits` sit in the free queue: touching them takes them out of it."""
        return sum(1 for b in hits if b.ref == 0)

    def touch(self, hits: list[Block]) -> None:
        for b in hits:
            if b.ref == 0:
                del self.free_q[b]
                self.cached_free -= 1
            b.ref += 1

    def cache(self, block: Block, key: Key) -> None:
        """A block just became full: index it, unless a block with the same content already is."""
        if self.caching and block.key is None and key not in self.index:
            self.index[key] = block
            block.key = key

    # ---- allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[Block]:
        """n blocks from the head of the free queue; the caller checked num_free."""
        out = []
        q = self.free_q
        for _ in range(n):
            b, _ = q.popitem(last=False)
            if b.key is not None:
                del self.index[b.key]
                b.key = None
                self.cached_free -= 1
                self.evictions += 1
            b.ref = 1
            out.append(b)
        return out

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each; the unreferenced join the queue's tail, the
        sequence's last block first."""
        q = self.free_q
        for b in reversed(blocks):
            b.ref -= 1
            if b.ref == 0:
                q[b] = None
                if b.key is not None:
                    self.cached_free += 1

    def drop(self, blocks: list[Block]) -> None:
        """Free the blocks and take those left unreferenced out of the index, to the queue's
        head: a preempted idle history (idle.py), whose blocks the engine frees without
        keeping them cached."""
        self.free(blocks)
        q = self.free_q
        for b in blocks:
            if b.ref == 0:
                if b.key is not None:
                    del self.index[b.key]
                    b.key = None
                    self.cached_free -= 1
                q.move_to_end(b, last=False)

    def check(self) -> None:
        """Every invariant, for the tests: the queue holds exactly the unreferenced blocks,
        the index exactly the keyed blocks, and the evictable count matches."""
        if any(b.ref for b in self.free_q) or any(b.ref < 0 for b in self.blocks):
            raise AssertionError("a referenced block sits in the free queue, or a count went negative")
        if sum(1 for b in self.blocks if b.ref == 0) != len(self.free_q):
            raise AssertionError("an unreferenced block is missing from the free queue")
        if any(b.key != k for k, b in self.index.items()) or sum(1 for b in self.blocks if b.key) != len(self.index):
            raise AssertionError("the index and the blocks' keys disagree")
        if sum(1 for b in self.free_q if b.key is not None) != self.cached_free:
            raise AssertionError("the evictable count is off")
