"""Sampling and incremental detokenization, on the bundled model's tokenizer and logits."""
from __future__ import annotations

import torch

from kvchat.engine import SamplingParams, TokenEvent, TurnStats
from kvchat.engine.detokenizer import Detokenizer
from kvchat.engine.sampler import Sampler

TRICKY = "Crème brûlée 🍮 costs ¥1200 — 東京で食べた。 Done 👍🏽!"


def test_streamed_deltas_never_split_a_character_and_add_up_to_the_text(engine):
    tok = engine.tokenizer
    ids = tok.encode(TRICKY, add_special_tokens=False)
    assert len(ids) > len(TRICKY.split())  # multi-byte characters span several tokens here
    detok = Detokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TRICKY


def random_logits(seed: int) -> torch.Tensor:
    return torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * 3


def draws(seed: int, logits: torch.Tensor, n: int = 20) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed), torch.device("cpu"))
    return [int(sampler(logits)) for _ in range(n)]


def test_the_same_seed_samples_the_same_tokens_and_another_seed_differs():
    logits = random_logits(0)
    assert draws(7, logits) == draws(7, logits)
    assert draws(7, logits) != draws(8, logits)


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    cpu = torch.device("cpu")
    for seed in range(5):
        logits = random_logits(seed)
        greedy = int(logits.argmax())
        assert int(Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed), cpu)(logits)) == greedy
        assert int(Sampler(SamplingParams(temperature=1.5, top_p=1e-6, seed=seed), cpu)(logits)) == greedy


def test_top_k_only_draws_from_the_k_most_likely():
    cpu = torch.device("cpu")
    logits = random_logits(3)
    top = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=5, seed=0), cpu)
    assert {int(s(logits)) for _ in range(200)} <= top


def test_top_p_keeps_the_smallest_set_reaching_p():
    cpu = torch.device("cpu")
    logits = torch.tensor([4.0, 3.0, 2.0, 0.0, -1.0])
    probs = torch.softmax(logits, -1)  # about .66 .24 .09 .01 .004
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=0), cpu)
    drawn = {int(s(logits)) for _ in range(300)}
    assert drawn == {0, 1}, (drawn, probs)


def test_a_seeded_sampled_reply_is_reproducible(engine):
    def reply(seed):
        conv = engine.new_conversation()
        try:
            events = list(conv.send("Invent a name for a cat.", SamplingParams(temperature=0.9, top_p=0.95,
                                                                                seed=seed, max_tokens=12)))
        finally:
            engine.close_conversation(conv)
        assert isinstance(events[-1], TurnStats)
        return [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert reply(11) == reply(11)
