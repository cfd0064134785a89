"""Prefix reuse across turns, on the bundled model: each turn reuses every full block of
what the previous turn left in the cache, and computes the same logits as a cold start."""
from __future__ import annotations

import pytest
import torch

from kvchat.engine import SamplingParams, TurnStats

MESSAGES = ["My name is Ada and I like sailing.", "What is a good first boat?", "What is my name?"]


def run_turn(conv, text, max_tokens=20):
    return [e for e in conv.send(text, SamplingParams(max_tokens=max_tokens)) if isinstance(e, TurnStats)][0]


def decode_one(engine, seq, token: int) -> torch.Tensor:
    """One decode step of `token` after what `seq` holds, straight through the model (no
    scheduler): logits (vocab,)."""
    from kvchat.engine.model import Step
    with engine.lock:
        pos = len(seq)
        engine.blocks.allocate(seq, seq.blocks_needed(pos + 1))
        step = Step(seq.table, torch.tensor([seq.slot(pos)]), pos, decode=True, runs=seq.runs)
        logits = engine.model.forward(torch.tensor([token]), torch.tensor([pos]), step, engine.pool)[0]
        engine.blocks.append(seq, [token])
    return logits


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_each_turn_reuses_every_full_block_the_previous_turn_left(engine):
    engine.blocks.evict_all_cached()  # nothing left behind by other tests' conversations
    conv = engine.new_conversation()
    assert engine.conversations == [conv]
    bs = engine.spec.block_size
    try:
        held_before: list[int] = []
        for k, text in enumerate(MESSAGES):
            stats = run_turn(conv, text)
            ids = conv.render(conv.messages[:-1])  # this turn's prompt
            shared = common_prefix(held_before, ids[:-1])
            assert stats.reused_tokens == (shared // bs) * bs, f"turn {k + 1}"
            assert stats.computed_tokens == stats.prompt_tokens - stats.reused_tokens
            if k > 0:
                # the previous turn's tokens reappear in this prompt, so almost all of it is reused
                assert stats.reused_tokens >= (len(held_before) // bs - 1) * bs
                assert stats.computed_tokens < stats.prompt_tokens / 2
            held_before = list(conv.seq.tokens)
            assert stats.cache.tokens_held == len(conv.seq.tokens)
            assert stats.cache.bytes_used == len(conv.seq.tokens) * engine.bytes_per_token
            assert stats.cache.bytes_allocated == len(conv.block_table) * bs * engine.bytes_per_token
    finally:
        engine.close_conversation(conv)


def test_reused_turn_logits_equal_a_cold_recomputation(engine):
    warm = engine.new_conversation()
    try:
        for text in MESSAGES[:2]:
            run_turn(warm, text)
        stats = run_turn(warm, MESSAGES[2], max_tokens=4)
        assert stats.reused_tokens > 0
        warm_logits = warm.last_logits.clone()
        ids = warm.render(warm.messages[:-1])
    finally:
        engine.close_conversation(warm)
    cold = engine.model.forward_dense(torch.tensor(ids))[0]
    assert float((warm_logits - cold).abs().max() / cold.abs().max()) < 1e-3
    assert int(warm_logits.argmax()) == int(cold.argmax())


def test_reset_cache_makes_the_next_turn_recompute_everything(engine):
    conv = engine.new_conversation()
    try:
        run_turn(conv, MESSAGES[0])
        assert conv.tokens_held > 0
        conv.reset_cache()
        assert conv.tokens_held == 0 and engine.snapshot(conv).bytes_used == 0
        stats = run_turn(conv, MESSAGES[1])
        assert stats.reused_tokens == 0
        assert stats.computed_tokens == stats.prompt_tokens
    finally:
        engine.close_conversation(conv)


def test_cancelling_mid_reply_keeps_the_cache_consistent(engine):
    import threading
    conv = engine.new_conversation()
    cancel = threading.Event()
    try:
        n = 0
        stats = None
        for ev in conv.send("Write a long story about a lighthouse keeper.", SamplingParams(max_tokens=200),
                            cancel=cancel):
            if isinstance(ev, TurnStats):
                stats = ev
            elif type(ev).__name__ == "TokenEvent":
                n += 1
                if n == 5:
                    cancel.set()
        assert stats.stop_reason == "cancelled"
        assert stats.generated_tokens == 5
        assert conv.messages[-1]["role"] == "assistant" and conv.messages[-1]["content"] == stats.reply
        # every held token has its K/V in the cache: one more decode step over it gives the
        # logits of a dense recomputation of the same tokens
        probe = engine.tokenizer.encode(" Then", add_special_tokens=False)[0]
        cold = engine.model.forward_dense(torch.tensor(conv.seq.tokens + [probe]))[0]
        warm = decode_one(engine, conv.seq, probe)
        assert float((warm - cold).abs().max() / cold.abs().max()) < 1e-3
    finally:
        engine.close_conversation(conv)


def test_a_turn_that_fails_before_its_first_token_leaves_no_orphan_message(engine):
    from kvchat.engine import KvchatError
    conv = engine.new_conversation()
    try:
        run_turn(conv, MESSAGES[0], max_tokens=4)
        before = [dict(m) for m in conv.messages]
        huge = "word " * 5000  # more than the 64 MiB pool holds (~1,450 tokens), under the model max (8,192)
        with pytest.raises(KvchatError, match="KV pool full"):
            list(conv.send(huge, SamplingParams(max_tokens=4)))
        assert conv.messages == before
        follow = run_turn(conv, MESSAGES[1], max_tokens=4)
        assert follow.turn == 2
    finally:
        engine.close_conversation(conv)


def test_a_turn_renders_its_history_once_and_the_kept_rendering_is_exact(engine, monkeypatch):
    """The policy's fit and the request both need the turn's token ids; the template runs once
    (the whole history each time: it grows with the conversation), and what is given back is
    what a fresh rendering gives."""
    conv = engine.new_conversation("You are brief.")
    calls: list[int] = []
    render = engine.render
    monkeypatch.setattr(engine, "render", lambda messages: calls.append(len(messages)) or render(messages))
    try:
        run_turn(conv, MESSAGES[0], max_tokens=4)
        assert calls == [2]                                    # system + user, rendered once
        run_turn(conv, MESSAGES[1], max_tokens=4)
        assert calls == [2, 4]
        kept = conv.render(conv.messages)                      # changed since (the reply): rendered afresh
        assert calls == [2, 4, 5] and kept == render(conv.messages)
        kept.append(-1)                                        # a caller's list is its own
        assert conv.render(conv.messages) == render(conv.messages) and calls == [2, 4, 5]
    finally:
        engine.close_conversation(conv)
