"""The scheduler under random arrivals, steps, cancellations and closes (hypothesis), in a
pool small enough that requests preempt each other, against each request run alone.

The model is a fake, and the docstring of FakeModel says why and what it still checks: every
row's token goes into a dict "pool" at the slot the scheduler's tables give it, and the
next token is a hash of the text read back through the sequence's table up to its context
length. So a wrong block table, slot, length, prefix match, preemption or recomputation
reads a wrong text and yields a wrong token, and the reply differs from the request's reply
alone in a large pool. No torch model: thousands of steps run in seconds.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvchat.engine.block_manager import BlockManager
from kvchat.engine.errors import KvchatError, TurnCancelled
from kvchat.engine.request import Request
from kvchat.engine.sampler import Sampler, SamplingParams
from kvchat.engine.scheduler import Scheduler
from kvchat.engine.sequence import Sequence
from kvchat.engine.telemetry import REQUEST_STATES

BS = 4
VOCAB = 23
EOS = 0
GREEDY = SamplingParams()


class FakeModel:
    """Stands in for the runner and the model, because the real model takes from tens of
    milliseconds to seconds a step on this machine and this machine needs thousands of steps.
    It writes each row's token at the row's slot and computes the next token from the text
    it reads back through the sequence's block table, so it checks everything the scheduler
    decides (tables, slots, lengths, reuse, preemption, recomputation) but not the numerics
    (tests/test_batching.py does those on the real model)."""

    def __init__(self) -> None:
        self.pool: dict[int, int] = {}     # slot -> token written there

    def run(self, plan) -> tuple[torch.Tensor, int, int]:
        picks, context = [], 0
        for req in plan.decode:
            seq, pos = req.seq, len(req.seq)
            self.pool[seq.slot(pos)] = req.tokens[-1]
            picks.append(self.next_token([self.pool[seq.slot(p)] for p in range(pos + 1)]))
            context += pos + 1
        for req, start, n in plan.chunks:
            seq, p0 = req.seq, len(req.seq)
            for i, t in enumerate(req.tokens[start:start + n]):
                self.pool[seq.slot(p0 + i)] = t
            picks.append(self.next_token([self.pool[seq.slot(p)] for p in range(p0 + n)]))
            context += p0 + n
        for req in plan.dense:
            picks.append(self.next_token(req.tokens if req.generated else req.prompt))
        logits = torch.zeros(len(picks), VOCAB)
        logits[torch.arange(len(picks)), torch.tensor(picks, dtype=torch.long)] = 1.0
        return logits, context, 1

    @staticmethod
    def next_token(text: list[int]) -> int:
        h = 7
        for t in text:
            h = (h * 31 + t + 1) % 1_000_003
        return h % VOCAB


def make_request(sched: Scheduler, seq: Sequence, prompt: list[int], max_tokens: int, limit: int,
                 sink: int | None, mode: str, chunk: int) -> Request:
    return Request(sched.next_id(), seq, list(prompt), Sampler(GREEDY, torch.device("cpu")), max_tokens,
                   frozenset({EOS}), limit, "cap", time.perf_counter(), mode=mode, sink_tokens=sink,
                   chunk_size=chunk, cancel=threading.Event())


def step(sched: Scheduler, model: FakeModel) -> bool:
    t0 = time.perf_counter()
    plan = sched.schedule()
    if plan is None:
        return False
    logits, context, forwards = model.run(plan)
    sched.postprocess(plan, logits, t0, context, forwards)
    return True


def alone(prompt, max_tokens, limit, sink, mode, chunk) -> tuple[list[int], str]:
    """The reply the request gets alone in a pool it cannot fill."""
    sched, model = Scheduler(BlockManager(400, BS), token_budget=8), FakeModel()
    seq = Sequence(BS)
    sched.attach(seq)
    req = make_request(sched, seq, prompt, max_tokens, limit, sink, mode, chunk)
    sched.add(req)
    while not req.finished:
        assert step(sched, model)
    assert req.error is None, req.error
    return req.tokens[len(prompt):], req.stop_reason


class Crowd(RuleBasedStateMachine):
    """Up to four conversations, each with at most one request at a time, in a 9-block pool
    with a step budget of 6 tokens."""

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(BlockManager(9, BS), token_budget=6)
        self.model = FakeModel()
        self.seqs: list[Sequence] = []
        self.requests: list[tuple[Request, tuple]] = []   # each with the arguments it was made from

    @initialize()
    def two_conversations(self):
        for _ in range(2):
            self.open()

    @precondition(lambda self: len(self.seqs) < 4)
    @rule()
    def open(self):
        seq = Sequence(BS)
        self.seqs.append(seq)
        self.sched.attach(seq)

    @precondition(lambda self: any(s not in self.sched.current for s in self.seqs))
    @rule(data=st.data(), prompt=st.lists(st.integers(1, VOCAB - 1), min_size=2, max_size=30),
          max_tokens=st.integers(1, 16), kind=st.sampled_from(("plain", "plain", "capped", "window", "off")),
          chunk=st.sampled_from((3, 8, 512)))
    def submit(self, data, prompt, max_tokens, kind, chunk):
        seq = data.draw(st.sampled_from([s for s in self.seqs if s not in self.sched.current]))
        if kind == "window" and seq.block_table and not seq.private:
            kind = "plain"      # a window starts its sequence private; keep the draw simple
        if kind != "window" and seq.private:
            self.sched.blocks.free(seq, keep_index=False)   # as Conversation.set_policy does
        limit, sink, mode = {"plain": (1000, None, "cache"), "capped": (len(prompt) + 3, None, "cache"),
                             "window": (20, 4, "cache"), "off": (1000, None, "off")}[kind]
        if kind == "capped" and len(prompt) >= limit:
            return
        args = (prompt, max_tokens, limit, sink, mode, chunk)
        req = make_request(self.sched, seq, *args)
        self.sched.add(req)
        self.requests.append((req, args))
        event(f"submit {kind}")

    @precondition(lambda self: sum(s not in self.sched.current for s in self.seqs) >= 2)
    @rule(data=st.data())
    def crowd(self, data):
        """Every idle conversation asks at once, with prompts long enough that their replies
        cannot all fit: some wait, some are preempted and recomputed."""
        for seq in [s for s in self.seqs if s not in self.sched.current]:
            if seq.private:
                self.sched.blocks.free(seq, keep_index=False)
            prompt = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=8, max_size=14))
            args = (prompt, 12, 1000, None, "cache", data.draw(st.sampled_from((4, 512))))
            req = make_request(self.sched, seq, *args)
            self.sched.add(req)
            self.requests.append((req, args))

    @rule(n=st.integers(1, 8))
    def run_steps(self, n):
        for _ in range(n):
            if not step(self.sched, self.model):
                break
            self.check_books()
            self.check_finished()

    @precondition(lambda self: any(not r.finished for r, _ in self.requests))
    @rule(data=st.data(), now=st.integers(0, 3))
    def cancel(self, data, now):
        if now:     # most draws let the request run on: cancelling everything would hide the rest
            return
        req = data.draw(st.sampled_from([r for r, _ in self.requests if not r.finished]))
        req.cancel.set()

    @precondition(lambda self: any(not r.finished and r.generated for r, _ in self.requests))
    @rule(data=st.data())
    def reader_stops(self, data):
        """A reader cancels having seen k tokens while steps ran ahead of it (Conversation cuts)."""
        req = data.draw(st.sampled_from([r for r, _ in self.requests if not r.finished and r.generated]))
        self.sched.cut(req, data.draw(st.integers(0, req.generated)))
        self.check_books()
        self.check_finished()

    @precondition(lambda self: len(self.seqs) > 1 and any(s in self.sched.current for s in self.seqs))
    @rule(data=st.data())
    def crowd_user_leaves(self, data):
        """A crowd user stopped mid-turn (kvchat/crowd/driver.py): its cancel is set, the next
        step ends its request, and its conversation closes; the others go on."""
        seq = data.draw(st.sampled_from([s for s in self.seqs if s in self.sched.current]))
        req = self.sched.current[seq]
        req.cancel.set()
        step(self.sched, self.model)
        self.check_finished()
        self.sched.detach(seq)
        self.sched.blocks.free(seq, keep_index=True)
        self.seqs.remove(seq)
        event("a crowd user left mid-turn")

    @precondition(lambda self: len(self.seqs) > 1)
    @rule(data=st.data())
    def close(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.sched.detach(seq)
        self.sched.blocks.free(seq, keep_index=True)
        self.seqs.remove(seq)

    # ---- checks -----------------------------------------------------------------------------------
    def check_books(self) -> None:
        bm = self.sched.blocks
        held = [0] * bm.num_blocks
        for seq in self.seqs:
            for b in seq.block_table:
                held[b] += 1
            assert len(seq.block_table) >= -(-len(seq) // BS)
        assert [b.ref_count for b in bm.blocks] == held, "every reference is a sequence's"
        assert bm.num_free + bm.num_active + bm.num_cached == bm.num_blocks
        for b in bm.cached_ids():
            assert bm.reachable(b)

    def check_finished(self) -> None:
        for req, args in self.requests:
            if req.finished:
                self._check(req, args)
        self.requests = [(r, a) for r, a in self.requests if not r.finished]

    def _check(self, req: Request, args: tuple) -> None:
        got = req.tokens[len(req.prompt):]
        if req.preempted:
            event("a request was preempted and recomputed")
        if isinstance(req.error, TurnCancelled) or req.stop_reason == "cancelled":
            event("cancelled in its prefill" if req.error else "cancelled mid-reply")
            want, _ = alone(*args)
            assert want[:len(got)] == got, "a cancelled reply is the start of the reply alone"
            return
        if req.error is not None:
            assert isinstance(req.error, KvchatError) and "KV pool full" in str(req.error), req.error
            event("refused: the pool cannot hold it")
            return
        want, reason = alone(*args)
        assert (got, req.stop_reason) == (want, reason), f"batched {got} ({req.stop_reason}), alone {want} ({reason})"

    @invariant()
    def books_add_up(self):
        self.check_books()

    @invariant()
    def the_snapshot_lists_every_conversation_once(self):
        """What the crowd panel draws: one row per attached conversation, in a known state,
        holding the blocks its table holds."""
        views = self.sched.snapshot().conversations
        assert len(views) == len(self.seqs)
        assert sorted(v.blocks_held for v in views) == sorted(s.num_blocks for s in self.seqs)
        assert all(v.state in REQUEST_STATES for v in views)

    def teardown(self):
        for _ in range(500):
            if not step(self.sched, self.model):
                break
            self.check_finished()
        self.check_finished()
        assert not self.sched.busy, "every request finishes (no livelock)"
        event(f"preemptions in the run: {min(self.sched.preemptions, 3)}{'+' if self.sched.preemptions >= 3 else ''}")
        for seq in list(self.seqs):
            self.sched.detach(seq)
            self.sched.blocks.free(seq, keep_index=True)
        bm = self.sched.blocks
        assert bm.num_active == 0 and all(b.ref_count == 0 for b in bm.blocks), "blocks leaked"


TestCrowd = Crowd.TestCase
TestCrowd.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                              suppress_health_check=list(HealthCheck))


def test_a_decoding_request_gets_a_row_in_every_step_while_a_long_prompt_prefills():
    """The fairness rule: a long prompt is cut to the step's budget beside the decode rows,
    so the conversation already replying is never left out of a step."""
    sched, model = Scheduler(BlockManager(200, BS), token_budget=8), FakeModel()
    a, b = Sequence(BS), Sequence(BS)
    sched.attach(a)
    sched.attach(b)
    talker = make_request(sched, a, [3, 4, 5], 40, 1000, None, "cache", 512)
    sched.add(talker)
    step(sched, model)
    assert talker.generated == 1
    long = make_request(sched, b, list(range(1, 20)) * 5, 2, 1000, None, "cache", 512)
    sched.add(long)
    while long.generated == 0:
        before = talker.generated
        assert step(sched, model)
        last = sched.recent[-1]
        assert last.decode_rows == 1 and last.prefill_tokens <= 8 - 1
        assert talker.generated == before + 1 or talker.finished
    assert long.generated == 1 and not talker.finished


def test_a_lone_prompt_takes_its_own_chunk_past_the_steps_budget():
    """The engine's lone chunk (engine/sizing.py: 2,048 for the bundled model in bf16, against a
    shared step's 512): a prompt alone goes in chunks of its request's size, not the budget's."""
    sched, model = Scheduler(BlockManager(200, BS), token_budget=8), FakeModel()
    seq = Sequence(BS)
    sched.attach(seq)
    req = make_request(sched, seq, list(range(1, 20)) * 4, 3, 1000, None, "cache", 32)
    sched.add(req)
    while req.generated == 0:
        assert step(sched, model)
    assert [r.prefill_tokens for r in sched.recent] == [32, 32, 12]
    while step(sched, model):
        pass
    assert (req.tokens[76:], req.stop_reason) == alone(req.prompt, 3, 1000, None, "cache", 32)


def test_a_preempted_request_whose_text_is_all_cached_decodes_in_the_step_that_admits_it():
    """Found by TestCrowd: two conversations ask at once in the 9-block pool; the newer is
    preempted with its text still in the prefix index, and when the other finishes its whole
    text is found cached, so it is admitted straight into its decode. That admission scheduled
    nothing, so the step came back empty while a request still waited (the state machine
    stopped there: "every request finishes (no livelock)"). Its row now goes in the same step."""
    sched, model = Scheduler(BlockManager(9, BS), token_budget=6), FakeModel()
    prompt = [17, 5, 2, 20, 19, 1, 2, 19, 17, 1, 9, 6, 4, 14]
    reqs = []
    for _ in range(2):
        seq = Sequence(BS)
        sched.attach(seq)
        reqs.append(make_request(sched, seq, prompt, 12, 1000, None, "cache", 4))
        sched.add(reqs[-1])
    for _ in range(100):
        assert step(sched, model) or not sched.busy, "a step came back empty while a request waited"
        if not sched.busy:
            break
    assert sched.preemptions == 1 and reqs[1].preempted, "the schedule this test is about"
    for req in reqs:
        assert req.finished and (req.tokens[len(prompt):], req.stop_reason) == alone(prompt, 12, 1000, None, "cache", 4)
