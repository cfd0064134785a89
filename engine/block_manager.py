"""The block manager: which pool blocks hold what. Pure Python, no torch.

Every block is in exactly one state:
- free: on the free list, content meaningless;
- active: referenced by one or more sequences (ref_count > 0);
- cached: unreferenced but still indexed, reusable by a later prefix match, evicted
  least-recently-used first when the pool needs room.

The manager acts on sequences (engine/sequence.py), as nano-vllm's does: `match_prefix`
starts one on the longest indexed prefix of its text, `allocate` adds fresh blocks,
`append` records tokens written into them and indexes each block they fill, `evict` and
`truncate` cut blocks out (sink-window), `free` drops them all.

The prefix index keys each *full* block by a hash of its parent's chain id and its own
token ids. A chain id names one exact prefix: a block gets its parent's chain id plus its
tokens, and shares a chain id with another block only when both hold the same tokens after
the same chain. A hit is verified against the tokens kept with the block and against its
recorded parent (the chain id of the block just matched), so by induction the whole matched
prefix is the text asked for: a hash collision can cost a reuse but never returns a block
computed after other tokens.

A match walks a chain from its head, so a block is worth caching only while every block
before it is indexed too. Two rules keep it so (vLLM's block pool does the first):
a sequence's blocks are released deepest first, so within a chain the least recently used
end is its tail, and eviction eats chains from the tail; and a block that leaves the index
takes every indexed block after it along (cached ones go to the free list), unless a held
copy of the same prefix (a "twin": the same text computed twice, e.g. by two requests in one
step) takes its place. So every cached block can still match (`reachable`).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence as Tokens
from dataclasses import dataclass

from .errors import PoolExhausted
from .sequence import Sequence
from .telemetry import CACHED, HELD, OTHER, PARTIAL, REUSED, SHARED

ROOT = 0  # the chain id before the first block
HashFn = Callable[[int, tuple[int, ...]], int]


def chain_hash(parent: int, token_ids: tuple[int, ...]) -> int:
    """Index key of a full block: its parent's chain id and its own tokens."""
    return hash((parent, token_ids))


RUN = 4  # blocks in a group: a sequence starts its blocks in a fully free group (FreeBlocks)


class FreeBlocks:
    """The free list, handed out so that each sequence's blocks lie in runs.

    The CPU's decode attention reads a sequence's blocks through its table; a block (one KV
    head's 16 rows, 4 KB in fp32) is too short a read for the hardware to stream, so blocks in
    random order took 1.5x the time of one ascending run, and two sequences taking alternate
    blocks 1.3x, while runs of 4 blocks in random order took 1.05x (30 layers at 4,096 tokens,
    README). So the pool is cut into groups of RUN blocks, and a sequence's next block is:
    - the block after its last one, when that is free and in the same group or starts a group
      that is wholly free (so, while a wholly free group is left, no sequence cuts into a
      group another one started);
    - else the first block of the lowest wholly free group;
    - else the lowest free block.
    A fresh sequence in a fresh pool gets blocks 0, 1, 2, ... as before. Free flags and counts
    are bytearrays, searched with bytearray.find: C speed, no heap.
    """

    def __init__(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.free = bytearray(b"\x01") * num_blocks                   # 1: free
        groups = -(-num_blocks // RUN)
        self.size = bytes(min(RUN, num_blocks - g * RUN) for g in range(groups))
        self.left = bytearray(self.size)                              # free blocks per group
        self.whole = bytearray(b"\x01") * groups                      # 1: every block of the group free
        self.count = num_blocks

    def __len__(self) -> int:
        return self.count

    def push(self, block_id: int) -> None:
        if self.free[block_id]:
            raise ValueError(f"block {block_id} freed twice")
        self.free[block_id] = 1
        self.count += 1
        g = block_id // RUN
        self.left[g] += 1
        if self.left[g] == self.size[g]:
            self.whole[g] = 1

    def pop(self, after: int | None) -> int:
        """A free block for a sequence whose last block is `after` (None: it holds none)."""
        nxt = -1 if after is None else after + 1
        if not (0 <= nxt < self.n and self.free[nxt] and (nxt % RUN or self.whole[nxt // RUN])):
            g = self.whole.find(1)
            nxt = g * RUN if g >= 0 else self.free.find(1)
        if nxt < 0:
            raise IndexError("no free block")
        self.free[nxt] = 0
        self.count -= 1
        g = nxt // RUN
        self.left[g] -= 1
        self.whole[g] = 0
        return nxt


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: int | None = None           # set once the block is full and committed
    chain: int = ROOT                # the exact prefix up to this block (ROOT: none)
    parent: int = ROOT               # the chain id of the block before it
    token_ids: tuple[int, ...] = ()  # kept with the key to verify hits


class BlockManager:
    """Free list (in runs, so that each sequence's blocks mostly lie in order: FreeBlocks),
    reference counts, and an LRU of cached blocks behind a verified prefix index."""

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = chain_hash) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeBlocks(num_blocks)
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, indexed; oldest first
        self._index: dict[int, int] = {}  # key -> block id
        self._by_chain: dict[int, int] = {}          # chain id -> its indexed block
        self._children: dict[int, set[int]] = {}     # chain id -> indexed blocks whose parent it is
        self._twins: dict[int, set[int]] = {}        # chain id -> held, unindexed copies of its block
        self._next_chain = ROOT + 1
        self.evictions = 0  # cached blocks reclaimed for new content, since start
        self.stranded = 0   # cached blocks dropped because a block before them left the index

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
        """A view of the cached block ids, least recently used first (no copy)."""
        return self._cached.keys()

    def cached_prefix(self, token_ids: Tokens[int]) -> int:
        """How many leading full blocks of `token_ids` a match would reuse; takes nothing."""
        return len(self._longest_match(token_ids))

    def reachable(self, block_id: int) -> bool:
        """Whether a match from a chain head can still reach this indexed block: every chain
        before it has an indexed block."""
        b = self.blocks[block_id]
        if b.key is None or self._index.get(b.key) != block_id:
            return False
        parent = b.parent
        while parent != ROOT:
            up = self._by_chain.get(parent)
            if up is None:
                return False
            parent = self.blocks[up].parent
        return True

    def block_map(self, tables, focus: Sequence | None = None) -> bytearray:
        """One state code per pool block (telemetry's FREE, CACHED, SHARED, OTHER, and for
        `focus`'s own blocks REUSED, PARTIAL, HELD): the block map the panels draw.
        `tables`: the block tables of every sequence holding blocks. O(cached + held), not
        O(pool): a GPU pool can have 100k blocks."""
        codes = bytearray(self.num_blocks)  # all FREE
        for block_id in self._cached:
            codes[block_id] = CACHED
        for table in tables:
            for block_id in table:
                codes[block_id] = SHARED if self.blocks[block_id].ref_count > 1 else OTHER
        if focus is not None:
            bs, held = self.block_size, len(focus.tokens)
            for i, block_id in enumerate(focus.block_table):
                if codes[block_id] == SHARED:
                    continue
                codes[block_id] = (REUSED if i < focus.reused_blocks else PARTIAL if (i + 1) * bs > held
                                   else HELD)
        return codes

    # ---- acting on sequences ----------------------------------------------------------
    def match_prefix(self, seq: Sequence, token_ids: Tokens[int]) -> int:
        """Start the empty `seq` on the longest verified chain of indexed full blocks that
        begins `token_ids`, taking a reference on each. Returns the tokens matched."""
        if seq.block_table:
            raise ValueError("match_prefix starts an empty sequence; free it first")
        matched = self._longest_match(token_ids)
        for block_id in matched:
            self._ref(block_id)
        seq.block_table = matched
        seq.chains = [self.blocks[b].chain for b in matched]
        seq.tokens = list(token_ids[:len(matched) * self.block_size])
        seq.logical = list(seq.tokens)
        seq.reused_blocks = len(matched)
        seq.private = False
        seq.write_table()
        return len(seq.tokens)

    def allocate(self, seq: Sequence, n: int) -> None:
        """Add n fresh blocks to the end of seq: free ones first (the block after its last one
        where it can, FreeBlocks), then the least recently used cached ones, whose index
        entries are dropped."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"KV pool exhausted: {n} blocks needed, {self.num_free} free and {self.num_cached} "
                f"evictable of {self.num_blocks}")
        start = len(seq.block_table)
        for _ in range(n):
            if self._free:
                block_id = self._free.pop(seq.block_table[-1] if seq.block_table else None)
            else:
                block_id, _ = self._cached.popitem(last=False)
                self._unindex(block_id)
                self.evictions += 1
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
        seq.write_table(start)

    def append(self, seq: Sequence, token_ids: Tokens[int]) -> None:
        """Record tokens just written after seq's last one, and index every block they
        filled (a private sequence is never indexed)."""
        if len(seq.tokens) + len(token_ids) > len(seq.block_table) * self.block_size:
            raise ValueError(f"{len(token_ids)} more tokens do not fit the sequence's {len(seq.block_table)} blocks")
        seq.tokens.extend(token_ids)
        seq.logical.extend(token_ids)
        if seq.private:
            return
        bs = self.block_size
        while len(seq.chains) < len(seq.tokens) // bs:
            i = len(seq.chains)
            parent = seq.chains[-1] if seq.chains else ROOT
            seq.chains.append(self._commit(seq.block_table[i], parent, seq.tokens[i * bs:(i + 1) * bs]))

    def free(self, seq: Sequence, keep_index: bool = True) -> int:
        """Drop every reference seq holds and empty it; returns how many blocks it held.
        With keep_index, its full blocks stay cached for prefix reuse; without, they leave
        the index too (a reset)."""
        n = len(seq.block_table)
        deepest_first = seq.block_table[::-1]   # the chain's tail becomes least recently used
        if keep_index:
            self._release(deepest_first)
        else:
            self._forget(deepest_first)
        seq.block_table, seq.chains, seq.tokens, seq.logical = [], [], [], []
        seq.reused_blocks = 0
        seq.private = False
        return n

    def evict(self, seq: Sequence, first: int, n: int) -> None:
        """Cut n full blocks out of seq from block index `first`, with their tokens. The
        blocks after them no longer sit at their text positions, so seq becomes private."""
        bs = self.block_size
        if first < 0 or n < 0 or (first + n) * bs > len(seq.tokens):
            raise ValueError(f"cannot evict blocks {first}..{first + n - 1} of a sequence with "
                             f"{len(seq.tokens) // bs} full blocks")
        self._forget(seq.block_table[first:first + n])
        del seq.block_table[first:first + n]
        del seq.tokens[first * bs:(first + n) * bs]
        seq.chains = []
        seq.private = True
        seq.write_table(first)

    def truncate(self, seq: Sequence, n_tokens: int) -> None:
        """Drop the last n_tokens tokens of a private seq, and the blocks left empty."""
        if not seq.private:
            raise ValueError("only a private sequence is cut in place: indexed blocks may be shared")
        if not 0 <= n_tokens <= len(seq.tokens):
            raise ValueError(f"cannot drop {n_tokens} of {len(seq.tokens)} tokens")
        del seq.tokens[len(seq.tokens) - n_tokens:]
        del seq.logical[len(seq.logical) - n_tokens:]
        keep = -(-len(seq.tokens) // self.block_size)
        self._forget(seq.block_table[keep:])
        del seq.block_table[keep:]

    def evict_all_cached(self) -> int:
        n = len(self._cached)
        while self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._unindex(block_id)
            self._free.push(block_id)
        return n

    # ---- internals ----------------------------------------------------------------------
    def _longest_match(self, token_ids: Tokens[int]) -> list[int]:
        bs = self.block_size
        parent = ROOT
        matched: list[int] = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            block_id = self._index.get(self.hash_fn(parent, chunk))
            if block_id is None or not self._holds(block_id, parent, chunk):
                break  # a miss, or a collision: not our tokens after our prefix
            matched.append(block_id)
            parent = self.blocks[block_id].chain
        return matched

    def _holds(self, block_id: int, parent: int, chunk: tuple[int, ...]) -> bool:
        b = self.blocks[block_id]
        return b.token_ids == chunk and b.parent == parent

    def _commit(self, block_id: int, parent: int, token_ids: Tokens[int]) -> int:
        """Index a held block that just became full with `token_ids` after the chain
        `parent`; returns its chain id. If another block already holds this prefix, the
        index keeps the older one and this block shares its chain id."""
        chunk = tuple(token_ids)
        b = self.blocks[block_id]
        if len(chunk) != self.block_size or b.ref_count <= 0:
            raise ValueError(f"block {block_id}: only a held, full block is committed")
        if b.key is not None:
            self._unindex(block_id)
        if parent != ROOT and parent not in self._by_chain:
            # the prefix before it left the index: no match can reach this block, so it is
            # not indexed (its release frees it); it still names its prefix for the next block
            chain, self._next_chain = self._next_chain, self._next_chain + 1
            b.chain, b.parent = chain, parent
            return chain
        key = self.hash_fn(parent, chunk)
        same = self._index.get(key)
        if same is not None and self._holds(same, parent, chunk):
            chain = self.blocks[same].chain
            self._twins.setdefault(chain, set()).add(block_id)
        else:
            chain, self._next_chain = self._next_chain, self._next_chain + 1
        b.key, b.chain, b.parent, b.token_ids = key, chain, parent, chunk
        if same is None:
            self._index[key] = block_id
            self._by_chain[chain] = block_id
            self._children.setdefault(parent, set()).add(block_id)
        return chain

    def _release(self, block_ids: Tokens[int]) -> None:
        """Drop one reference from each block. An unreferenced indexed block becomes cached
        (most recently used); an unindexed one goes back on the free list."""
        for block_id in block_ids:
            b = self.blocks[block_id]
            if b.ref_count <= 0:
                raise ValueError(f"block {block_id} released more often than it was referenced")
            b.ref_count -= 1
            if b.ref_count == 0:
                if self._indexed(block_id):
                    self._cached[block_id] = None
                else:
                    self._clear(block_id)
                    self._free.push(block_id)

    def _forget(self, block_ids: Tokens[int]) -> None:
        """Release blocks and drop the unreferenced ones from the prefix index too."""
        for block_id in block_ids:
            self._release([block_id])
            if block_id in self._cached:
                del self._cached[block_id]
                self._unindex(block_id)
                self._free.push(block_id)

    def _ref(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            self._cached.pop(block_id, None)
        b.ref_count += 1

    def _indexed(self, block_id: int) -> bool:
        b = self.blocks[block_id]
        return b.key is not None and self._index.get(b.key) == block_id

    def _unindex(self, block_id: int) -> None:
        """Take a block out of the index. A held twin takes its place; without one, every
        indexed block after it can no longer match and leaves the index too (cached ones to
        the free list, held ones when their sequence releases them). A held block keeps its
        tokens (it is still a sequence's); an unreferenced one is cleared."""
        b, key = self.blocks[block_id], self.blocks[block_id].key
        if key is not None and self._index.get(key) == block_id:
            twins = self._twins.get(b.chain)
            if twins and (b.parent == ROOT or b.parent in self._by_chain):
                heir = twins.pop()
                if not twins:
                    del self._twins[b.chain]
                self._index[key] = self._by_chain[b.chain] = heir
                siblings = self._children[b.parent]
                siblings.discard(block_id)
                siblings.add(heir)
            else:
                self._twins.pop(b.chain, None)   # copies after a gone prefix cannot match either
                del self._index[key]
                del self._by_chain[b.chain]
                others = self._children.get(b.parent)
                if others is not None:
                    others.discard(block_id)
                    if not others:
                        del self._children[b.parent]
                for child in sorted(self._children.pop(b.chain, ())):
                    self._strand(child)
        if b.ref_count > 0:
            self._untwin(block_id)
            b.key = None
        else:
            self._clear(block_id)

    def _strand(self, block_id: int) -> None:
        """A block after one that left the index: it can no longer match."""
        self._unindex(block_id)
        if block_id in self._cached:
            del self._cached[block_id]
            self._free.push(block_id)
            self.stranded += 1

    def _untwin(self, block_id: int) -> None:
        chain = self.blocks[block_id].chain
        twins = self._twins.get(chain)
        if twins is not None and block_id in twins:
            twins.discard(block_id)
            if not twins:
                del self._twins[chain]

    def _clear(self, block_id: int) -> None:
        self._untwin(block_id)
        b = self.blocks[block_id]
        b.key, b.chain, b.parent, b.token_ids = None, ROOT, ROOT, ()
