"""The block manager under random operation sequences (hypothesis), against a simple model
of what each sequence holds and what each block was computed after. No torch: these run
in milliseconds."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvchat.engine.block_manager import RUN, BlockManager, FreeBlocks, chain_hash
from kvchat.engine.errors import PoolExhausted
from kvchat.engine.sequence import Sequence

BS = 4


def weak_hash(parent: int, toks: tuple[int, ...]) -> int:
    """Collides all the time, across parents and within them."""
    return (parent * 31 + sum(toks)) % 7


class Sequences(RuleBasedStateMachine):
    """Sequences start on a matched prefix, allocate, grow token by token, share blocks,
    lose middle blocks (sink-window), end and reset, as conversations do. A tiny vocabulary
    and a deliberately weak hash make collisions common.

    The model: `computed_after[b]` is the whole text up to and including block b, recorded
    when b was filled, so a match is checked against the prefix each block was computed
    after, not only its own tokens."""

    NUM_BLOCKS = 12
    VOCAB = 2
    hash_fn = staticmethod(weak_hash)

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS, hash_fn=self.hash_fn)
        self.seqs: dict[int, Sequence] = {}
        self.computed_after: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    # ---- helpers: each checks the LRU order the operation must leave ----------------------
    def _allocate(self, seq: Sequence, n: int) -> bool:
        before = list(self.bm.cached_ids())
        free = self.bm.num_free
        if not self.bm.can_allocate(n):
            with pytest.raises(PoolExhausted):
                self.bm.allocate(seq, n)
            return False
        start = seq.num_blocks
        self.bm.allocate(seq, n)
        fresh = seq.block_table[start:]
        after = list(self.bm.cached_ids())
        # the least recently used go first; cached blocks after an evicted one go with it
        assert after == [b for b in before if b in set(after)]
        if n > free:
            assert before[0] in fresh, "evicted the least recently used first"
        for b in fresh:
            self.computed_after.pop(b, None)
        return True

    def _write(self, seq: Sequence, tokens: list[int]) -> None:
        start = len(seq)
        self.bm.append(seq, tokens)
        for i in range(start // BS, len(seq) // BS):
            if not seq.private:
                self.computed_after[seq.block_table[i]] = tuple(seq.tokens[:(i + 1) * BS])
        if not seq.private:
            assert len(seq.chains) == len(seq) // BS, "every full block is committed"

    def _start(self, tokens: list[int]) -> Sequence | None:
        seq = Sequence(BS)
        before = list(self.bm.cached_ids())
        n = self.bm.match_prefix(seq, tokens[:-1])  # as a turn does: one token is left to compute
        matched = list(seq.block_table)
        assert n == len(matched) * BS and seq.tokens == tokens[:n]
        for i, b in enumerate(matched):  # the whole matched prefix, not block by block
            assert self.computed_after[b] == tuple(tokens[:(i + 1) * BS]), f"block {b} was computed after other text"
        assert list(self.bm.cached_ids()) == [b for b in before if b not in matched]
        if not self._allocate(seq, seq.blocks_needed(len(tokens))):
            self.bm.free(seq)
            return None
        self._write(seq, tokens[n:])
        self.seqs[self.next_id] = seq
        self.next_id += 1
        return seq

    def _pick(self, data, ok=lambda s: True) -> int:
        return data.draw(st.sampled_from(sorted(k for k, s in self.seqs.items() if ok(s))))

    # ---- rules ------------------------------------------------------------------------------
    @rule(data=st.data())
    def start(self, data):
        self._start(data.draw(st.lists(st.integers(0, self.VOCAB), min_size=1, max_size=20)))

    @precondition(lambda self: any(not s.private and len(s) > BS for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        """A second sequence on the same text shares its full blocks."""
        source = self.seqs[self._pick(data, lambda s: not s.private and len(s) > BS)]
        extra = data.draw(st.lists(st.integers(0, self.VOCAB), max_size=6))
        text = source.tokens + extra
        seq = self._start(text)
        if seq is not None:
            self.check_fork(seq, min(len(source) // BS, (len(text) - 1) // BS))

    def check_fork(self, seq: Sequence, shareable: int) -> None:
        pass  # with a weak hash an older colliding block may hold the index entry

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def grow(self, data):
        """A decode step: a block when the token starts one, then the token."""
        seq = self.seqs[self._pick(data)]
        token = data.draw(st.integers(0, self.VOCAB))
        if seq.blocks_needed(len(seq) + 1) and not self._allocate(seq, 1):
            return
        self._write(seq, [token])
        assert seq.num_blocks == -(-len(seq) // BS)

    @precondition(lambda self: any(len(s) >= 3 * BS for s in self.seqs.values()))
    @rule(data=st.data())
    def evict_middle(self, data):
        seq = self.seqs[self._pick(data, lambda s: len(s) >= 3 * BS)]
        gone = seq.block_table[1]
        held = self.bm.blocks[gone].ref_count
        self.bm.evict(seq, 1, 1)
        assert seq.private and gone not in seq.block_table
        assert self.bm.state(gone) == ("active" if held > 1 else "free")

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def end(self, data):
        """Shared blocks stay active for their other holders; the rest become cached (if
        indexed and still reachable from their chain's head) or free, deepest first, so the
        chain's head is the most recently used and eviction eats a chain from its tail."""
        seq = self.seqs.pop(self._pick(data))
        before = list(self.bm.cached_ids())
        refs = {b: self.bm.blocks[b].ref_count for b in seq.block_table}
        table = list(seq.block_table)
        self.bm.free(seq)
        for b in table:
            assert self.bm.blocks[b].ref_count == refs[b] - 1
            if refs[b] > 1:
                assert self.bm.state(b) == "active"
        after = list(self.bm.cached_ids())
        assert after[:len(before)] == before
        assert after[len(before):] == [b for b in reversed(table) if self.bm.state(b) == "cached"]
        assert len(seq) == seq.num_blocks == 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def reset(self, data):
        seq = self.seqs.pop(self._pick(data))
        before = list(self.bm.cached_ids())
        self.bm.free(seq, keep_index=False)
        after = list(self.bm.cached_ids())
        # a reset caches nothing; cached blocks after one it dropped from the index go too
        assert after == [b for b in before if b in set(after)], "a reset caches nothing"

    # ---- invariants ---------------------------------------------------------------------------
    @invariant()
    def states_partition_the_pool(self):
        bm = self.bm
        states = [bm.state(b) for b in range(bm.num_blocks)]
        assert (states.count("free"), states.count("active"), states.count("cached")) == \
            (bm.num_free, bm.num_active, bm.num_cached)
        assert states.count("active") == sum(b.ref_count > 0 for b in bm.blocks)

    @invariant()
    def reference_counts_match_the_sequences(self):
        want = [0] * self.bm.num_blocks
        for seq in self.seqs.values():
            for b in seq.block_table:
                want[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == want

    @invariant()
    def every_cached_block_can_still_match(self):
        """After any eviction (LRU reclaim, sink-window cuts, resets), a cached block is
        reachable from its chain's head: matching the text it was computed after reuses it."""
        for b in self.bm.cached_ids():
            assert self.bm.reachable(b), f"cached block {b} is stranded: a block before it left the index"
            text = self.computed_after[b]
            assert self.bm.cached_prefix(text) == len(text) // BS

    @invariant()
    def only_full_committed_blocks_are_shared(self):
        for b in self.bm.blocks:
            if b.ref_count > 1:
                assert len(b.token_ids) == BS and b.block_id in self.computed_after

    def teardown(self):
        for seq in self.seqs.values():
            self.bm.free(seq)
        assert self.bm.num_active == 0, "blocks leaked after every sequence ended"
        assert self.bm.num_free + self.bm.num_cached == self.bm.num_blocks


class RealHashSequences(Sequences):
    """The same rules with the engine's own hash and a larger vocabulary: a fork then
    reuses every full block of its source's text."""
    VOCAB = 50
    hash_fn = staticmethod(chain_hash)

    def check_fork(self, seq: Sequence, shareable: int) -> None:
        assert seq.reused_blocks >= shareable, "a fork reuses every full block of its source's text"


TestSequences = Sequences.TestCase
TestSequences.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestRealHashSequences = RealHashSequences.TestCase
TestRealHashSequences.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def filled(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = Sequence(BS)
    bm.allocate(seq, -(-len(tokens) // BS))
    bm.append(seq, tokens)
    return seq


def test_a_hit_must_follow_the_block_just_matched_not_an_equal_parent_hash():
    """With a hash that ignores the parent, B computed after A has the key that B after C
    would have; a match of C then B must stop after C."""
    bm = BlockManager(4, BS, hash_fn=lambda parent, toks: sum(toks))
    a, c, b = [1, 0, 0, 0], [0, 2, 0, 0], [2, 2, 2, 2]
    bm.free(filled(bm, a + b))            # A then B, cached
    bm.free(filled(bm, c))                # C, cached under its own key
    probe = Sequence(BS)
    assert bm.match_prefix(probe, c + b) == BS, "C matches, B (computed after A) does not"
    assert bm.blocks[probe.block_table[0]].token_ids == tuple(c)


def test_a_block_computed_twice_shares_its_chain_so_its_successors_still_match():
    """A prompt whose last block is already cached computes it again (one token is always
    left to compute); the blocks after it must still be found after the cached copy."""
    bm = BlockManager(8, BS)
    first = filled(bm, list(range(8)))
    bm.free(first)
    again = Sequence(BS)
    assert bm.match_prefix(again, list(range(8))[:-1]) == BS
    bm.allocate(again, 2)
    bm.append(again, list(range(4, 12)))   # the second block again, then a third
    bm.free(again)
    probe = Sequence(BS)
    assert bm.match_prefix(probe, list(range(12))) == 3 * BS


def test_double_release_is_refused():
    bm = BlockManager(4, BS)
    seq = filled(bm, [1])
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(ValueError, match="released more often"):
        bm.free(seq)


def test_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(3, BS)
    chains = [[i] * BS for i in range(3)]
    for toks in chains:  # three one-block sequences, ended in order 0, 1, 2
        bm.free(filled(bm, toks))
    assert bm.num_cached == 3 and bm.num_free == 0
    # touch chain 0 again: now 1 is the least recently used
    touch = Sequence(BS)
    bm.match_prefix(touch, chains[0])
    bm.free(touch)
    bm.allocate(Sequence(BS), 1)
    assert bm.cached_prefix(chains[1]) == 0, "the LRU block (chain 1) should have been evicted"
    assert bm.evictions == 1
    assert bm.cached_prefix(chains[0]) == 1 and bm.cached_prefix(chains[2]) == 1


@given(st.lists(st.integers(0, 50), min_size=BS, max_size=8 * BS), st.lists(st.integers(0, 50), min_size=BS,
                                                                             max_size=8 * BS))
@settings(max_examples=200, deadline=None)
def test_a_constant_hash_never_returns_wrong_tokens(a, b):
    """Every key collides; a match must still hold exactly the requested tokens."""
    bm = BlockManager(32, BS, hash_fn=lambda parent, toks: 42)
    bm.free(filled(bm, a))
    seq = Sequence(BS)
    n = bm.match_prefix(seq, b)
    assert n == 0 or seq.tokens == b[:n] == a[:n]


def test_fresh_blocks_come_lowest_id_first_so_tables_start_contiguous():
    bm = BlockManager(8, BS)
    seq = Sequence(BS)
    bm.allocate(seq, 3)
    assert seq.block_table == [0, 1, 2]
    bm.evict(filled_tokens(bm, seq, 3 * BS), 1, 1)
    other = Sequence(BS)
    bm.allocate(other, 2)
    assert other.block_table == [4, 5]       # a wholly free group, not the holes at 1 and 3
    third = Sequence(BS)
    bm.allocate(third, 3)
    assert third.block_table == [1, 3, 6]    # no wholly free group left: the lowest free blocks


def test_sequences_taking_blocks_in_turn_each_get_runs_not_alternate_blocks():
    """Decoding together, sequences cross block boundaries in turn; each keeps to its own
    group of RUN blocks; while a wholly free group remains, no sequence cuts into a group
    another one started."""
    assert RUN == 4
    bm = BlockManager(16, BS)
    a, b = Sequence(BS), Sequence(BS)
    for _ in range(5):
        bm.allocate(a, 1)
        bm.allocate(b, 1)
    assert a.block_table == [0, 1, 2, 3, 8]
    assert b.block_table == [4, 5, 6, 7, 12]
    c = Sequence(BS)
    bm.allocate(c, 2)                          # groups 2 and 3 are started: the lowest free
    assert c.block_table == [9, 10]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 23), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 22)), max_size=80))
def test_the_free_list_hands_out_each_free_block_once_and_keeps_its_counts(n, ops):
    """Against a plain set: every pop returns a free block, a block after `after` when that
    one is free in a group it may take, and the per-group counts agree with the flags."""
    free, fb = set(range(n)), FreeBlocks(n)
    for take, x in ops:
        if take and free:
            after = x if x < n and x not in free else None
            got = fb.pop(after)
            assert got in free
            nxt = None if after is None else after + 1
            if nxt is not None and nxt in free and (nxt % RUN or all(i in free for i in range(nxt, min(nxt + RUN, n)))):
                assert got == nxt
            free.discard(got)
        elif not take and x < n and x not in free:
            fb.push(x)
            free.add(x)
        assert len(fb) == len(free)
        for g in range(-(-n // RUN)):
            members = range(g * RUN, min(g * RUN + RUN, n))
            assert fb.left[g] == sum(i in free for i in members)
            assert fb.whole[g] == all(i in free for i in members)
    if free:
        with pytest.raises(ValueError):
            fb.push(min(free))


def filled_tokens(bm: BlockManager, seq: Sequence, n: int) -> Sequence:
    bm.append(seq, list(range(n)))
    return seq


def test_allocating_past_the_pool_raises_with_counts():
    bm = BlockManager(2, BS)
    bm.allocate(Sequence(BS), 2)
    with pytest.raises(PoolExhausted, match="1 blocks needed, 0 free and 0 evictable of 2"):
        bm.allocate(Sequence(BS), 1)


def test_eviction_takes_a_cached_chain_from_its_tail_so_its_head_still_matches():
    """Issue 26, item 5: eight full blocks of one text, cached; three blocks for another
    sequence take the two free ones and evict one. The deepest block goes, so seven blocks
    still match (head first, they evicted the chain's head and none matched)."""
    bm = BlockManager(10, BS)
    text = list(range(8 * BS))
    bm.free(filled(bm, text))
    assert bm.num_cached == 8 and bm.cached_prefix(text) == 8
    bm.allocate(Sequence(BS), 3)
    assert bm.evictions == 1
    assert bm.cached_prefix(text) == 7
    assert bm.num_cached == 7 and all(bm.reachable(b) for b in bm.cached_ids())


def test_blocks_after_a_cut_are_not_counted_as_cached():
    """A sink-window cut drops a middle block from the index: the blocks after it can never
    match again, so when their sequence ends they are freed, not cached."""
    bm = BlockManager(8, BS)
    seq = filled(bm, list(range(5 * BS)))
    bm.evict(seq, 1, 1)
    bm.free(seq)
    assert bm.num_cached == 1 and bm.num_free == 7
    assert bm.cached_prefix(list(range(5 * BS))) == 1


def test_a_held_copy_of_an_evicted_block_keeps_its_chain_matching():
    """Two sequences compute the same text (two requests in one step): the second's blocks
    are twins of the first's. When the first's cached copy is evicted, the held twin takes
    its place in the index, so the chain after it still matches."""
    bm = BlockManager(6, BS)
    text = list(range(3 * BS))
    first = filled(bm, text[:BS])                # block 0 of the text, indexed
    second = filled(bm, text)                    # the same block again (a twin), then two more
    bm.free(first)                               # the indexed copy is cached
    bm.allocate(Sequence(BS), 3)                 # the 2 free blocks, then evicts the cached copy
    assert bm.evictions == 1
    bm.free(second)
    assert bm.cached_prefix(text) == 3
