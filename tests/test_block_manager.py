"""The block manager under random operation sequences (hypothesis), against a simple model
of what each sequence holds. No torch: these run in milliseconds."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.engine.block_manager import ROOT_KEY, BlockManager
from kvchat.engine.errors import PoolExhausted

BS = 4


class Sequences(RuleBasedStateMachine):
    """Sequences claim prefixes, allocate, fill and commit blocks, and release, like
    conversations do. A tiny vocabulary and a deliberately weak hash make collisions common."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, hash_fn=lambda parent, toks: (parent * 31 + sum(toks)) % 7)
        self.seqs: dict[int, tuple[list[int], list[int], list[int]]] = {}  # id -> (blocks, keys, tokens)
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def start(self, tokens):
        matched = self.bm.match_prefix(tokens)
        # a hit is never a block holding other tokens
        for i, b in enumerate(matched):
            assert self.bm.blocks[b].token_ids == tuple(tokens[i * BS:(i + 1) * BS])
        need = -(-len(tokens) // BS) - len(matched)
        try:
            fresh = self.bm.allocate(need)
        except PoolExhausted:
            assert not self.bm.can_allocate(need)
            self.bm.release(matched)
            return
        blocks = matched + fresh
        keys = [self.bm.key_of(b) for b in matched]
        held = tokens[: len(matched) * BS]
        # "compute" the rest and index each block that becomes full
        held = list(tokens)
        for i in range(len(matched), len(tokens) // BS):
            keys.append(self.bm.commit(blocks[i], keys[-1] if keys else ROOT_KEY, held[i * BS:(i + 1) * BS]))
        self.seqs[self.next_id] = (blocks, keys, held)
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def end(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks, _, _ = self.seqs.pop(sid)
        self.bm.release(blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def reset(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks, _, _ = self.seqs.pop(sid)
        self.bm.forget(blocks)

    @invariant()
    def states_partition_the_pool(self):
        bm = self.bm
        free = sum(bm.state(b) == "free" for b in range(bm.num_blocks))
        active = sum(bm.state(b) == "active" for b in range(bm.num_blocks))
        cached = sum(bm.state(b) == "cached" for b in range(bm.num_blocks))
        assert free + active + cached == bm.num_blocks
        assert (free, active, cached) == (bm.num_free, bm.num_active, bm.num_cached)

    @invariant()
    def reference_counts_match_the_sequences(self):
        want = [0] * self.bm.num_blocks
        for blocks, _, _ in self.seqs.values():
            for b in blocks:
                want[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == want

    def teardown(self):
        for blocks, _, _ in self.seqs.values():
            self.bm.release(blocks)
        assert self.bm.num_active == 0, "blocks leaked after every sequence ended"
        assert self.bm.num_free + self.bm.num_cached == self.bm.num_blocks


TestSequences = Sequences.TestCase
TestSequences.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_double_release_is_refused():
    bm = BlockManager(4, BS)
    (b,) = bm.allocate(1)
    bm.release([b])
    with pytest.raises(ValueError, match="released more often"):
        bm.release([b])


def test_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(3, BS)
    chains = [[i] * BS for i in range(3)]
    for toks in chains:  # three one-block sequences, ended in order 0, 1, 2
        (b,) = bm.allocate(1)
        bm.commit(b, ROOT_KEY, toks)
        bm.release([b])
    assert bm.num_cached == 3 and bm.num_free == 0
    # touch chain 0 again: now 1 is the least recently used
    reused = bm.match_prefix(chains[0])
    bm.release(reused)
    (b,) = bm.allocate(1)
    assert bm.match_prefix(chains[1]) == [], "the LRU block (chain 1) should have been evicted"
    assert bm.evictions == 1
    assert len(bm.match_prefix(chains[0])) == 1 and len(bm.match_prefix(chains[2])) == 1


@given(st.lists(st.integers(0, 50), min_size=BS, max_size=8 * BS), st.lists(st.integers(0, 50), min_size=BS,
                                                                             max_size=8 * BS))
@settings(max_examples=200, deadline=None)
def test_a_constant_hash_never_returns_wrong_tokens(a, b):
    """Every key collides; a match must still hold exactly the requested tokens."""
    bm = BlockManager(32, BS, hash_fn=lambda parent, toks: 42)
    blocks = bm.allocate(-(-len(a) // BS))
    key = ROOT_KEY
    for i in range(len(a) // BS):
        key = bm.commit(blocks[i], key, a[i * BS:(i + 1) * BS])
    bm.release(blocks)
    got = bm.match_prefix(b)
    for i, blk in enumerate(got):
        assert list(bm.blocks[blk].token_ids) == b[i * BS:(i + 1) * BS]


def test_fresh_blocks_come_lowest_id_first_so_tables_start_contiguous():
    bm = BlockManager(8, BS)
    assert bm.allocate(3) == [0, 1, 2]
    bm.release([1])
    assert bm.allocate(2) == [1, 3]


def test_allocating_past_the_pool_raises_with_counts():
    bm = BlockManager(2, BS)
    bm.allocate(2)
    with pytest.raises(PoolExhausted, match="1 blocks needed, 0 free and 0 evictable of 2"):
        bm.allocate(1)
