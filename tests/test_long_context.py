"""Long prompts and the model's own limit, on the bundled model: prefill reports its
progress between chunks and stops cleanly between them; the model's maximum context is a
hard cap whichever cap the user set (refused, or the policy in force applies)."""
from __future__ import annotations

import dataclasses
import threading

import pytest

from kvchat.engine import SamplingParams, TurnStats
from kvchat.engine.errors import CapExceeded, TurnCancelled
from kvchat.engine.telemetry import PrefillEvent, PrefillProgress

LONG = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(40))


@pytest.fixture
def conv(engine):
    engine.blocks.evict_all_cached()
    c = engine.new_conversation()
    yield c
    engine.close_conversation(c)


@pytest.fixture
def small_max(engine, monkeypatch):
    """The bundled model's max is 8,192: shrink it so a test reaches it in a few hundred tokens."""
    def set_max(n: int) -> None:
        monkeypatch.setattr(engine, "geometry", dataclasses.replace(engine.geometry, max_position=n))
    return set_max


def test_prefill_yields_progress_after_each_chunk_up_to_the_tokens_it_computes(conv):
    conv.prefill_chunk_size = 64
    events = list(conv.send(LONG, SamplingParams(max_tokens=2)))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    prefill = next(e for e in events if isinstance(e, PrefillEvent))
    total = prefill.computed_tokens
    assert total > 5 * 64
    assert [p.done for p in progress] == [0, *range(64, total, 64), total]
    assert all(p.total == total for p in progress)
    assert events.index(progress[-1]) < events.index(prefill)    # all progress comes before the first token


def test_cancelling_between_chunks_keeps_the_messages_and_a_retry_reuses_the_chunks_done(conv, engine):
    conv.prefill_chunk_size = 64
    before = list(conv.messages)
    cancel = threading.Event()
    seen = []
    with pytest.raises(TurnCancelled, match="prefill stopped at 128 of"):
        for ev in conv.send(LONG, SamplingParams(max_tokens=2), cancel):
            if isinstance(ev, PrefillProgress):
                seen.append(ev.done)
                if ev.done == 128:
                    cancel.set()
            assert not isinstance(ev, PrefillEvent)
    assert seen == [0, 64, 128]
    assert conv.messages == before and conv.turns == 0
    assert engine.blocks.num_active == 0              # no block held for the unprefilled rest
    stats = [e for e in conv.send(LONG, SamplingParams(max_tokens=2)) if isinstance(e, TurnStats)][0]
    assert stats.reused_tokens == 128                  # the two chunks done stay cached
    assert conv.tokens_held == stats.prompt_tokens + len(stats.decode_ms)


def test_a_turn_past_the_models_maximum_is_refused_without_a_cap_and_says_what_helps(conv, small_max):
    small_max(200)
    with pytest.raises(CapExceeded) as err:
        conv.send(LONG)
    message = str(err.value)
    assert "the model's maximum context is 200" in message
    assert "/policy drop-oldest" in message and "new conversation" in message and "/reset" not in message
    assert conv.messages == [] and conv.cap is None


def test_a_cap_above_the_models_maximum_is_held_to_the_maximum(conv, small_max):
    small_max(200)
    conv.set_cap(4096)
    with pytest.raises(CapExceeded, match="the model's maximum context is 200"):
        conv.send(LONG)


def test_the_reply_stops_at_the_models_maximum(conv, small_max):
    text = "Count from one to fifty, one number per line."
    prompt = len(conv.render([{"role": "user", "content": text}]))
    small_max(prompt + 3)
    stats = [e for e in conv.send(text, SamplingParams(max_tokens=50)) if isinstance(e, TurnStats)][0]
    assert stats.stop_reason == "max_position"
    assert stats.prompt_tokens + stats.generated_tokens == prompt + 3
    assert conv.tokens_held <= prompt + 3


def test_drop_oldest_makes_room_under_the_models_maximum(conv, small_max):
    conv.set_policy("drop-oldest")
    [e for e in conv.send("Name a colour.", SamplingParams(max_tokens=8))]
    first_len = len(conv.render(conv.messages))
    small_max(first_len + 10)
    stats = [e for e in conv.send("Name a fruit, and say why you like it.", SamplingParams(max_tokens=8))
             if isinstance(e, TurnStats)][0]
    assert stats.dropped_messages == 2 and stats.prompt_tokens <= first_len + 10
    assert conv.messages[0]["content"] != "Name a colour."


def test_drop_oldest_leaves_room_for_the_reply(conv):
    """Issue 26: drop-oldest dropped only enough for the prompt, so the reply stopped at the cap
    a few tokens in. Here the cap is set so that dropping the oldest turn fits the prompt with
    8 tokens to spare: the reply's 16 need one more turn dropped."""
    conv.set_policy("drop-oldest")
    for text in ("Name a colour.", "Name a fruit.", "Name a river."):
        [e for e in conv.send(text, SamplingParams(max_tokens=16))]
    new = "Name a mountain, and say where it is."
    msgs = conv.messages + [{"role": "user", "content": new}]
    head = 1 if msgs[0]["role"] == "system" else 0
    one_dropped = len(conv.render(msgs[:head] + msgs[head + 2:]))
    cap = one_dropped + 8
    assert cap // 4 >= 16
    conv.set_cap(cap)
    stats = [e for e in conv.send(new, SamplingParams(max_tokens=16)) if isinstance(e, TurnStats)][0]
    assert stats.dropped_messages == 4 and stats.prompt_tokens + 16 <= cap
    assert stats.stop_reason != "cap"
