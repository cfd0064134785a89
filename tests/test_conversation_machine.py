"""Several conversations in one tiny pool on the bundled model, driven in random order by
hypothesis: sending (some cancelled mid-reply), sending on several at once (their replies
read in turn, so they share steps, start and finish mid-batch, and preempt each other when
the pool runs out), resetting, closing, changing cap, policy, cache mode and the KV dtype.
After every rule, and after every event of a shared send, the pool's bookkeeping must add
up; every reply must be what a fresh recomputation of its history gives, and when all
conversations close no block stays held."""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvchat.engine import CapExceeded, Engine, EngineConfig, KvchatError, SamplingParams, TokenEvent, TurnStats

POOL_BLOCKS = 12      # fp32, 16 tokens a block: two or three short conversations fill it
MESSAGES = ("Hi there.", "Name a fruit.", "Why is the sky blue?", "Count to five.", "Say yes.")
# about 70 tokens: two of these and their replies do not fit the pool together, so sent at
# once one is preempted and recomputed
LONG = ("Here are my notes from the trip: we left at dawn, crossed two rivers and a long ridge, "
        "camped by a lake under the pines, cooked beans, watched the stars, and walked back the "
        "next day through rain and mud. Tell me what to pack next time.")
# The most a reply token's dense logit may sit below the dense maximum: a near-tie the cache's
# rounding may flip. A cache read wrongly (another text's block, a stale table) misses by far more.
NEAR_TIE = {"fp32": 0.05, "bf16": 0.5, "fp8": 1.5}


@pytest.fixture(scope="module")
def tiny_engine():
    eng = Engine(EngineConfig(dtype="fp32", kv_budget=POOL_BLOCKS * 16 * 46080, block_size=16))
    assert eng.spec.num_blocks == POOL_BLOCKS
    return eng


class Chats(RuleBasedStateMachine):
    def __init__(self, engine: Engine):
        super().__init__()
        self.eng = engine
        for conv in list(engine.conversations):
            engine.close_conversation(conv)
        engine.set_kv_dtype("fp32")
        self.convs = []

    def _pick(self, data):
        return data.draw(st.sampled_from(self.convs))

    @initialize()
    def two_conversations(self):
        self.convs = [self.eng.new_conversation(), self.eng.new_conversation(cap=64, policy="sink-window")]

    @precondition(lambda self: len(self.convs) < 3)
    @rule()
    def open(self):
        self.convs.append(self.eng.new_conversation())

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def close(self, data):
        conv = self._pick(data)
        self.convs.remove(conv)
        self.eng.close_conversation(conv)

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), text=st.sampled_from(MESSAGES), max_tokens=st.integers(1, 4))
    def send(self, data, text, max_tokens):
        self._send(data, text, max_tokens, None)

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), text=st.sampled_from(MESSAGES), cancel_after=st.integers(1, 2))
    def send_and_cancel(self, data, text, cancel_after):
        self._send(data, text, 4, cancel_after)

    def _send(self, data, text, max_tokens, cancel_after):
        conv = self._pick(data)
        before = [dict(m) for m in conv.messages]
        cancel = threading.Event()
        events = []
        try:
            for ev in conv.send(text, SamplingParams(max_tokens=max_tokens), cancel=cancel):
                events.append(ev)
                if cancel_after is not None and sum(isinstance(e, TokenEvent) for e in events) == cancel_after:
                    cancel.set()
        except KvchatError as err:  # CapExceeded, or a history the whole pool cannot hold
            assert isinstance(err, CapExceeded) or "KV pool full" in str(err)
            if not events:
                assert conv.messages == before, "a refused turn leaves the conversation as it was"
            return
        stats = events[-1]
        for what, n in (("preempted", stats.preempted), ("reused", stats.reused_tokens),
                        ("evicted", stats.evicted_blocks), ("reclaimed", stats.reclaimed_blocks), ("cancelled", stats.stop_reason == "cancelled"),
                        (f"{stats.kv_dtype} {stats.mode} {stats.policy}", 1)):
            if n:
                event(f"a turn: {what}")
        assert isinstance(stats, TurnStats) and stats.reply == conv.messages[-1]["content"]
        if cancel_after is not None and stats.generated_tokens > cancel_after:
            raise AssertionError(f"cancelled after {cancel_after} tokens, generated {stats.generated_tokens}")
        self.check_reply(conv, stats, [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0])

    @precondition(lambda self: len(self.convs) >= 2)
    @rule(data=st.data(), texts=st.lists(st.sampled_from(MESSAGES + (LONG, LONG)), min_size=2, max_size=3),
          max_tokens=st.integers(2, 6), cancel_one=st.booleans())
    def send_together(self, data, texts, max_tokens, cancel_one):
        """Replies on up to three conversations, started one event apart and read in turn."""
        convs = data.draw(st.permutations(self.convs))[:len(texts)]
        pending = list(zip(convs, texts))
        live: list[list] = []    # [conv, generator, events, cancel, before, cancel after]
        while pending or live:
            if pending:
                conv, text = pending.pop(0)
                cancel = threading.Event()
                before = [dict(m) for m in conv.messages]
                try:
                    gen = conv.send(text, SamplingParams(max_tokens=max_tokens), cancel=cancel)
                except KvchatError as err:    # CapExceeded: refused before anything starts
                    assert isinstance(err, CapExceeded) and conv.messages == before
                    continue
                live.append([conv, gen, [], cancel, before, 1 if cancel_one and not live else None])
            for entry in list(live):
                conv, gen, events, cancel, before, cancel_after = entry
                try:
                    ev = next(gen)
                except StopIteration:
                    live.remove(entry)
                    self.finish(conv, events, before, cancel_after)
                    continue
                except KvchatError as err:
                    live.remove(entry)
                    assert "KV pool full" in str(err) or isinstance(err, CapExceeded), err
                    if not any(isinstance(e, TokenEvent) for e in events):
                        assert conv.messages == before, "a refused turn leaves the conversation as it was"
                    continue
                events.append(ev)
                if cancel_after is not None and sum(isinstance(e, TokenEvent) for e in events) == cancel_after:
                    cancel.set()
                self.blocks_add_up()
        event(f"sent together: {len(texts)}")

    def finish(self, conv, events, before, cancel_after) -> None:
        stats = events[-1]
        assert isinstance(stats, TurnStats) and stats.reply == conv.messages[-1]["content"]
        if stats.preempted:
            event("a shared send: preempted")
        if stats.recomputed_tokens:
            event("a shared send: recomputed")
        if cancel_after is not None:
            assert stats.generated_tokens <= cancel_after
        self.check_reply(conv, stats, [e.token_id for e in events if isinstance(e, TokenEvent) and e.token_id >= 0])

    def check_reply(self, conv, stats: TurnStats, reply: list[int]) -> None:
        """Each reply token is the one a dense recomputation of the whole history (no cache)
        picks, up to a near-tie; teacher-forced, so one forward pass checks them all."""
        if conv.streaming and conv.evicted_tokens:
            return  # sink-window's cache is no longer the text's: no recomputation gives it
        prompt = conv.render(conv.messages[:-1])
        assert len(prompt) == stats.prompt_tokens
        ids = torch.tensor(prompt + reply[:-1])
        logits = self.eng.model.forward_dense(ids, last_only=False)[len(prompt) - 1:]   # (len(reply), vocab)
        chosen = logits.gather(1, torch.tensor(reply)[:, None])[:, 0]
        gap = logits.max(-1).values - chosen
        tol = NEAR_TIE[stats.kv_dtype] if stats.mode == "cache" else NEAR_TIE["fp32"]
        assert float(gap.max()) <= tol, (f"reply tokens {reply} sit {gap.tolist()} below a fresh recomputation's "
                                         f"best ({stats.kv_dtype}, reused {stats.reused_tokens}, "
                                         f"preempted {stats.preempted}, recomputed {stats.recomputed_tokens})")

    @precondition(lambda self: self.convs)
    @rule(data=st.data())
    def reset(self, data):
        conv = self._pick(data)
        conv.reset_cache()
        assert conv.tokens_held == 0

    @precondition(lambda self: self.convs)
    @rule(data=st.data(), setting=st.sampled_from(("cap", "policy", "mode")))
    def change(self, data, setting):
        """A new cap (a sink-window cap too small is refused), policy or cache mode."""
        conv = self._pick(data)
        if setting == "cap":
            cap = data.draw(st.sampled_from((None, None, 32, 64, 96, 160)))
            try:
                conv.set_cap(cap)
            except KvchatError:
                assert conv.policy.streaming and cap < 48
                return
            assert conv.cap == cap
        elif setting == "policy":
            name = data.draw(st.sampled_from(("stop", "drop-oldest", "sink-window")))
            try:
                conv.set_policy(name)
            except KvchatError:
                assert name == "sink-window" and conv.cap < 48
                return
            assert conv.policy.name == name
        else:
            mode = data.draw(st.sampled_from(("cache", "off")))
            conv.set_mode(mode)
            assert mode == "cache" or conv.tokens_held == 0

    @rule(kv_dtype=st.sampled_from(("fp32", "fp8", "bf16")))
    def set_kv_dtype(self, kv_dtype):
        self.eng.set_kv_dtype(kv_dtype)
        assert all(c.tokens_held == 0 for c in self.convs)

    @invariant()
    def blocks_add_up(self):
        with self.eng.lock:
            self._blocks_add_up()

    def _blocks_add_up(self):
        bm = self.eng.blocks
        states = [bm.state(b) for b in range(bm.num_blocks)]
        free, active, cached = (states.count(s) for s in ("free", "active", "cached"))
        assert free + active + cached == bm.num_blocks
        assert (free, active, cached) == (bm.num_free, bm.num_active, bm.num_cached)
        held = [0] * bm.num_blocks
        for conv in self.eng.conversations:
            for b in conv.block_table:
                held[b] += 1
        assert [b.ref_count for b in bm.blocks] == held, "every reference is a conversation's"
        assert all(bm.reachable(b) for b in bm.cached_ids()), "a cached block that can no longer match"

    @invariant()
    def each_cache_fits_its_tokens(self):
        bs = self.eng.spec.block_size
        for conv in self.convs:
            assert len(conv.block_table) == -(-conv.tokens_held // bs)
            if conv.mode == "off":
                assert conv.tokens_held == 0
            if conv.streaming:         # the window: the cap, or the model's maximum without one
                assert conv.tokens_held <= conv.limit

    def teardown(self):
        for conv in self.convs:
            self.eng.close_conversation(conv)
        bm = self.eng.blocks
        assert bm.num_active == 0 and all(b.ref_count == 0 for b in bm.blocks), "blocks leaked"
        assert bm.num_free + bm.num_cached == bm.num_blocks


def test_conversations_in_a_tiny_pool_keep_the_books_and_their_replies(tiny_engine):
    run_state_machine_as_test(lambda: Chats(tiny_engine), settings=settings(
        max_examples=6, stateful_step_count=16, deadline=None, suppress_health_check=list(HealthCheck)))
