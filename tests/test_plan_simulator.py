"""The planner's scheduler simulation against small cases computed by hand, and its fast path
(many decode steps at once) against the step-by-step path on random workloads.

The hand-computed cases time each step with `Linear`: a fixed cost plus a cost per token
computed. That rule is not the planner's roofline (tests/test_plan_model.py checks that one
against its formula); it is simple enough that every TTFT, token time and preemption below
can be worked out on paper, which is what these tests check the scheduler against.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvchat.plan.metrics import tpot
from kvchat.plan.request import SchedulerConfig
from kvchat.plan.simulator import Simulator
from kvchat.plan.workload import Trace, Turn, UserTrace

MS = 1e-3


class Linear:
    """Step time = `fixed` + `per_token` x tokens computed in the step (seconds); a request
    reaches the scheduler `request` seconds after it is sent."""

    def __init__(self, fixed: float = 1 * MS, per_token: float = 0.1 * MS, request: float = 0.0) -> None:
        self.fixed, self.per_token, self.request = fixed, per_token, request

    def seconds(self, tokens, logit_rows, rows, kv_read, pairs, chunks=0) -> float:
        return self.fixed + self.per_token * tokens


def user(uid, start, turns, history=(), long=False):
    return UserTrace(uid, start, tuple(history), tuple(Turn(*t) for t in turns), long)


def simulate(users, system=0, timer=None, **cfg):
    cfg.setdefault("num_blocks", 1000)
    cfg.setdefault("max_len", min(4096, cfg["num_blocks"] * cfg.get("block_size", 16)))
    sim = Simulator(Trace(system, tuple(users)), SchedulerConfig(**cfg), timer or Linear())
    res = sim.run()
    sim.pool.check()
    assert sim.pool.num_used == 0            # every block came back
    return res, sim


def by_user(res):
    return {(r.user, r.turn): r for r in res.records}


@pytest.mark.parametrize("fast", [True, False])
def test_one_user_prefills_then_decodes_one_token_a_step(fast):
    # 100 prompt tokens: one step of 1 + 10 ms -> the first token at 11 ms; then 4 decode
    # steps of 1.1 ms each -> the fifth token at 15.4 ms.
    res, _ = simulate([user(0, 0.5, [(100, 5, 0.0)])], fast_forward=fast)
    (r,) = res.records
    assert r.ttft == pytest.approx(11 * MS)
    assert r.e2e == pytest.approx(15.4 * MS)
    assert tpot(r) == pytest.approx(1.1 * MS)
    assert sorted(v for v, n in res.itl for _ in range(n)) == pytest.approx([1.1 * MS] * 4)
    assert (r.output, r.preemptions, res.preemptions, res.steps) == (5, 0, 0, 5)
    assert res.end == pytest.approx(0.5 + 15.4 * MS)


@pytest.mark.parametrize("fast", [True, False])
def test_two_users_in_a_small_pool_the_newest_is_preempted_and_recomputed(fast):
    # 10 blocks of 4 tokens. A (t=0) and B (t=0.1 ms) each send 16 tokens and want 12 back.
    #  step 1  A prefills 16 (4 blocks)                    2.6 ms  A's token 1
    #  step 2  A decodes (5th block); B prefills 16 (4)     5.3 ms  A 2, B 1 (TTFT 5.2 ms)
    #  step 3  B takes the last free block                  6.5, then 7.7, 8.9 ms: A 5, B 4
    #  step 6  A needs a 6th block: none free, so the newest (B) is preempted: its 5 blocks
    #          go back; A alone                            10.0 ms, then 1.1 ms a step
    #  step 12 A's 12th token at 16.6 ms: A finishes, its 7 blocks go back
    #  step 13 B recomputes 16 + 4 = 20 tokens (19 computed before: 19 recomputed) 19.6 ms,
    #          then 7 steps of 1.1 ms: its 12th token at 27.3 ms (arrived at 0.1 ms)
    res, _ = simulate([user(0, 0.0, [(16, 12, 0.0)]), user(1, 0.1 * MS, [(16, 12, 0.0)])],
                      num_blocks=10, block_size=4, max_len=40, prefix_caching=False, fast_forward=fast)
    a, b = by_user(res)[0, 0], by_user(res)[1, 0]
    assert (a.ttft, a.e2e, a.preemptions) == (pytest.approx(2.6 * MS), pytest.approx(16.6 * MS), 0)
    assert (b.ttft, b.e2e, b.preemptions, b.recomputed) == (pytest.approx(5.2 * MS), pytest.approx(27.2 * MS), 1, 19)
    assert (res.preemptions, res.recomputed) == (1, 19)
    gaps = sorted(v for v, n in res.itl for _ in range(n))
    assert gaps[-1] == pytest.approx(19.6 * MS - 8.9 * MS)     # B's wait across its preemption


@pytest.mark.parametrize("fast", [True, False])
def test_a_preempted_request_finds_its_own_blocks_in_the_prefix_cache(fast):
    # As above with prefix caching on. B's 4 full blocks (its 16 prompt tokens) stay cached when
    # it is preempted; A's 7th block (step 10) evicts the least recently freed of them, block 3,
    # so B resumes on 3 cached blocks (12 tokens) and computes 8: step 13 takes 1.8 ms (18.4
    # ms), its 12th token at 26.1 ms, and it recomputed 7 of the 19 tokens it had.
    res, sim = simulate([user(0, 0.0, [(16, 12, 0.0)]), user(1, 0.1 * MS, [(16, 12, 0.0)])],
                        num_blocks=10, block_size=4, max_len=40, prefix_caching=True, fast_forward=fast)
    b = by_user(res)[1, 0]
    assert (b.e2e, b.preemptions, b.recomputed) == (pytest.approx(26.0 * MS), 1, 7)
    # evicted: B's block 3 (step 10); A's block 5 (step 13, B's 2 new blocks: A's unhashed last
    # block, then block 5); A's blocks 4 and 3 as B grows past 20 and 24 tokens
    assert sim.pool.evictions == 4


@pytest.mark.parametrize("fast", [True, False])
def test_a_shared_system_prompt_is_computed_once(fast):
    # A 32-token system prompt (2 blocks of 16). A sends 16 tokens at t=0: 48 computed, TTFT
    # 1 + 4.8 ms. B arrives at 1 s, after A finished: the 2 system blocks are cached, so B
    # computes only its own 16 tokens: TTFT 1 + 1.6 ms. A's second turn (after 2 s of thought)
    # is 32 + 18 + 16 = 66 tokens; its first 3 blocks (48 tokens) are cached: it computes 18.
    res, _ = simulate([user(0, 0.0, [(16, 2, 0.0), (16, 2, 2.0)]), user(1, 1.0, [(16, 2, 0.0)])],
                      system=32, fast_forward=fast)
    r = by_user(res)
    assert (r[0, 0].ttft, r[0, 0].cached) == (pytest.approx(5.8 * MS), 0)
    assert (r[1, 0].ttft, r[1, 0].cached) == (pytest.approx(2.6 * MS), 32)
    assert (r[0, 1].prompt, r[0, 1].cached, r[0, 1].ttft) == (66, 48, pytest.approx(2.8 * MS))


def test_without_prefix_caching_the_system_prompt_is_computed_every_time():
    res, _ = simulate([user(0, 0.0, [(16, 2, 0.0)]), user(1, 1.0, [(16, 2, 0.0)])], system=32,
                      prefix_caching=False)
    assert [(r.cached, r.ttft) for r in res.records] == [(0, pytest.approx(5.8 * MS))] * 2


def test_drop_oldest_drops_whole_segments_and_the_rewritten_history_is_recomputed():
    # cap 64: the first turn is 48 + 6 = 54 tokens (with its 10-token reply, 64: it fits). The
    # second would be 48 + 16 + 20 + reply 10 = 94 > 64, so the 48-token segment goes: the
    # prompt is 16 + 20 = 36 tokens at new positions, and none of it is cached.
    res, _ = simulate([user(0, 0.0, [(6, 10, 0.0), (20, 10, 1.0)], history=(48,))], cap=64, policy="drop-oldest")
    first, second = by_user(res)[0, 0], by_user(res)[0, 1]
    assert (first.prompt, second.prompt, second.cached) == (54, 36, 0)


def test_stop_refuses_a_turn_past_the_cap_and_the_conversation_ends():
    res, _ = simulate([user(0, 0.0, [(40, 10, 0.0), (40, 10, 1.0)])], cap=64, policy="stop")
    assert [(r.turn, r.output) for r in res.records] == [(0, 10)]     # 40 + 10 fits; 40 + 10 + 40 does not
    assert res.refused == [(0, 1, 90)]


def test_a_reply_stops_at_the_cap():
    res, _ = simulate([user(0, 0.0, [(60, 10, 0.0)])], cap=64, policy="stop")
    assert res.records[0].output == 4


def test_sink_window_holds_at_most_its_window_and_keeps_it_cached_across_turns():
    # window 64: a 100-token prompt holds 64 tokens (4 blocks of 16); the next turn reuses
    # the window up to its new message and computes the 20 new tokens.
    res, sim = simulate([user(0, 0.0, [(100, 10, 0.0), (20, 10, 1.0)])], cap=64, policy="sink-window")
    first, second = by_user(res)[0, 0], by_user(res)[0, 1]
    assert (first.prompt, second.prompt, second.cached) == (64, 64, 32)
    assert max(s[1] for s in res.samples) == 4


def test_the_token_budget_chunks_a_long_prefill_and_decodes_go_first():
    # budget 64: A's 150-token prompt takes 64 + 64 + 22 over three steps; B arrives
    # while A prefills and is admitted with the budget left over.
    res, _ = simulate([user(0, 0.0, [(150, 3, 0.0)]), user(1, 0.5 * MS, [(10, 3, 0.0)])], max_batched_tokens=64)
    a, b = by_user(res)[0, 0], by_user(res)[1, 0]
    assert a.ttft == pytest.approx((7.4 + 7.4 + 1 + 0.1 * 32) * MS)   # step 3: A's 22 and B's 10
    assert b.ttft == pytest.approx(a.ttft - 0.5 * MS)


def test_the_sequence_limit_queues_the_rest():
    res, _ = simulate([user(i, 0.0, [(10, 5, 0.0)]) for i in range(3)], max_seqs=2)
    first_done = min(r.e2e for r in res.records)
    waited = [r for r in res.records if r.ttft > first_done]
    assert len(waited) == 1                       # the third starts only when one of the two finished


# ---- the fast path ----------------------------------------------------------------------------
turns = st.lists(st.tuples(st.integers(1, 80), st.integers(1, 40), st.floats(0.0, 0.05)), min_size=1, max_size=3)
users = st.lists(st.tuples(st.floats(0.0, 0.05), turns, st.integers(0, 120)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(users=users, blocks=st.integers(16, 60), system=st.sampled_from([0, 8, 20]), caching=st.booleans(),
       budget=st.sampled_from([16, 64, 4096]), policy=st.sampled_from(["stop", "drop-oldest", "sink-window"]),
       engine=st.booleans())
# found by a fresh clone's make test: user 3's next turn arrives as its reply ends, and the fast
# path's look at whether it could be admitted handed its held history back to the cache before
# the step's decode rows took their blocks, so one of them evicted a block of it (124 cached
# tokens where the step-by-step run found 128)
@example(users=[(0.0, [(1, 1, 0.0)], 0), (0.0, [(1, 1, 0.0)], 0), (0.03125, [(4, 9, 0.0), (2, 40, 0.03125)], 5),
                (0.03125, [(2, 8, 0.0), (1, 19, 0.0)], 111),
                (0.046875, [(1, 1, 0.048828125), (1, 1, 0.005859375), (1, 1, 0.0)], 71),
                (0.0, [(2, 1, 0.02734375), (4, 7, 0.0), (39, 40, 0.0234375)], 41)],
         blocks=50, system=8, caching=True, budget=4096, policy="stop", engine=True)
def test_decode_stretches_give_the_same_run_as_single_steps(users, blocks, system, caching, budget, policy, engine):
    """Random users in small pools (preemptions included): the fast path's records, gaps,
    counters and final clock equal the step-by-step run's, in vLLM's order and in kvchat's
    engine's (idle histories held between turns)."""
    trace = [user(i, s, [(n, r, think) for n, r, think in t], history=(h,) if h else ()) for i, (s, t, h) in
             enumerate(users)]
    out = []
    for fast in (True, False):
        res, _ = simulate(trace, system=system, num_blocks=blocks, block_size=4, max_len=blocks * 4,
                          prefix_caching=caching, max_batched_tokens=budget, cap=48 if policy != "stop" else None,
                          policy=policy, fast_forward=fast, decode_first=engine, timer=Linear(1 * MS, 0.013 * MS))
        out.append(res)
    fast, slow = out
    key = lambda r: (r.user, r.turn)      # noqa: E731
    assert sorted(fast.records, key=key) == sorted(slow.records, key=key)
    assert (fast.steps, fast.preemptions, fast.recomputed, fast.evictions, fast.refused) == \
        (slow.steps, slow.preemptions, slow.recomputed, slow.evictions, slow.refused)
    assert fast.end == slow.end
    expand = lambda itl: sorted(v for v, n in itl for _ in range(n))   # noqa: E731
    assert expand(fast.itl) == expand(slow.itl)


@pytest.mark.parametrize("fast", [True, False])
def test_kvchats_engine_order_admits_a_prompt_only_when_its_whole_prompt_fits(fast):
    # kvchat's engine (decode_first): 4 blocks of 4 tokens, a budget of 4. A (t=0) sends 4
    # tokens and wants 6 back; B (t=0.1 ms) sends 12 and wants 1.
    #  step 1     A prefills 4 (1 block)                     1.4 ms   A's token 1
    #  steps 2-6  A decodes (its 2nd block at step 2, its 3rd at step 6); B needs 3 blocks for
    #             its whole prompt and at most 2 are free: it waits. 1.1 ms a step: A's 6th
    #             token at 6.9 ms, A finishes and its 3 blocks go back
    #  steps 7-9  B alone, chunks of 4: 1.4 ms each, its first token at 11.1 ms (TTFT 11.0)
    # vLLM's order admits B's first chunk at step 2 instead, and B, short of a block, yields.
    users = [user(0, 0.0, [(4, 6, 0.0)]), user(1, 0.1 * MS, [(12, 1, 0.0)])]
    kw = dict(num_blocks=4, block_size=4, max_len=16, max_batched_tokens=4, prefix_caching=False, fast_forward=fast)
    res, _ = simulate(users, decode_first=True, **kw)
    a, b = by_user(res)[0, 0], by_user(res)[1, 0]
    assert (a.ttft, a.e2e) == (pytest.approx(1.4 * MS), pytest.approx(6.9 * MS))
    assert (b.ttft, b.e2e) == (pytest.approx(11.0 * MS), pytest.approx(11.0 * MS))
    assert (res.preemptions, res.steps) == (0, 9)
    vllm, _ = simulate(users, **kw)
    assert vllm.preemptions >= 1



@pytest.mark.parametrize("fast", [True, False])
def test_kvchats_engine_keeps_an_idle_history_held_and_preempts_it_first(fast):
    # kvchat's engine (decode_first): blocks of 4 tokens. A (t=0) sends 8 and wants 4 back:
    # a prefill of 1.8 ms, 3 decodes of 1.1 ms, done at 5.1 ms holding 3 blocks (11 tokens
    # computed, 2 full blocks), which it keeps while idle (history 12 tokens). B (t=1 s) sends 8
    # and wants 10: it holds 2 blocks, then 3 (9 tokens), 4 (13); its 9th decode (17 tokens)
    # needs a 5th. A 6-block pool fits A's idle history and B's turn until then: there B's
    # block comes from preempting idle A (its 3 blocks freed and uncached), not from B
    # yielding; B ends at 1 s + 1.8 + 9 x 1.1 = 11.7 ms. A's second turn (2 s after its reply)
    # is 12 + 4 = 16 tokens, none cached: it computes 16 (TTFT 2.6 ms), 12 of them recomputed.
    users = [user(0, 0.0, [(8, 4, 0.0), (4, 2, 2.0)]), user(1, 1.0, [(8, 10, 0.0)])]
    kw = dict(block_size=4, max_len=24, max_batched_tokens=64, fast_forward=fast)
    res, _ = simulate(users, num_blocks=6, decode_first=True, **kw)
    r = by_user(res)
    assert (r[0, 0].e2e, r[1, 0].e2e, r[1, 0].preemptions) == (pytest.approx(5.1 * MS), pytest.approx(11.7 * MS), 0)
    assert (r[0, 1].prompt, r[0, 1].cached, r[0, 1].ttft, r[0, 1].recomputed) == (16, 0, pytest.approx(2.6 * MS), 12)
    assert (res.preemptions, res.recomputed) == (1, 12)
    # 8 blocks hold both: A's second turn finds its 2 full blocks (8 tokens) and computes 8
    res, _ = simulate(users, num_blocks=8, decode_first=True, **kw)
    r = by_user(res)
    assert (r[0, 1].cached, r[0, 1].ttft, res.preemptions, res.recomputed) == (8, pytest.approx(1.8 * MS), 0, 0)
    # vLLM frees A's blocks into the cache when its reply ends: B takes them without a preemption
    res, _ = simulate(users, num_blocks=6, **kw)
    assert res.preemptions == 0


@pytest.mark.parametrize("fast", [True, False])
def test_a_prompt_preempts_idle_histories_only_when_that_admits_it(fast):
    # 6 blocks of 4. A (t=0, 8 tokens, 4 back) holds 3 blocks idle from 5.1 ms. B (t=1 s)
    # sends 16 (4 blocks for its whole prompt; 3 free): preempting idle A makes room, so B is
    # admitted at once (TTFT 2.6 ms) and A's second turn recomputes its 12 history tokens.
    users = [user(0, 0.0, [(8, 4, 0.0), (4, 2, 2.0)]), user(1, 1.0, [(16, 2, 0.0)])]
    res, _ = simulate(users, num_blocks=6, block_size=4, max_len=24, decode_first=True, fast_forward=fast)
    r = by_user(res)
    assert (r[1, 0].ttft, r[0, 1].cached, r[0, 1].recomputed, res.preemptions) == (pytest.approx(2.6 * MS), 0, 12, 1)


def test_kvchats_engine_order_gives_a_lone_prompt_its_chunk_and_a_shared_step_the_budget():
    """decode_first with prefill_chunk past the budget (the engine's lone chunk, engine/sizing.py):
    A's 150-token prompt, alone, takes 128 + 22 in two steps; B's 60-token prompt, arriving
    while A decodes, shares A's steps and takes what the budget of 32 leaves (31 + 29)."""
    res, sim = simulate([user(0, 0.0, [(150, 8, 0.0)]), user(1, 14.0 * MS, [(60, 2, 0.0)])], decode_first=True,
                        max_batched_tokens=32, prefill_chunk=128, fast_forward=False)
    a, b = by_user(res)[0, 0], by_user(res)[1, 0]
    assert a.ttft == pytest.approx((1 + 12.8 + 1 + 2.2) * MS)          # two steps: 128, then 22 tokens
    # B arrives at 14 ms, during A's step 2 (13.8 to 17 ms): then steps of A's row + B's 31,
    # A's row + B's 29 (B's first token), 1 + 3.2 ms and 1 + 3.0 ms
    assert b.ttft == pytest.approx((17.0 + 4.2 + 4.0) * MS - 14.0 * MS)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SchedulerConfig(num_blocks=10, max_len=100, prefill_chunk=0)
