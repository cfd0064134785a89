"""Many conversations in one step, on the bundled model: a batched forward gives each row the
logits of its sequence alone, and conversations replying together (threads, or generators
read in turn) get the greedy tokens each gets alone, through arrivals and finishes
mid-batch, cancellations and preemptions. Tolerance as tests/test_model_reference.py:
max |diff| / max |logit| < 1e-3."""
from __future__ import annotations

import threading

import pytest
import torch

from kvchat.engine import Engine, EngineConfig, SamplingParams, TokenEvent, TurnStats
from kvchat.engine.kv_cache import KVPool, plan_pool
from kvchat.engine.model import Batch, Chunk, Step

REL_TOL = 1e-3
MESSAGES = ("Name three rivers in Europe.", "Why is the sky blue?", "Count to five.", "List four fruits.")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def text_ids(engine, n: int, skip: int = 0) -> list[int]:
    from pydoc_data.topics import topics  # the stdlib's own long English text
    text = "\n\n".join(topics[k] for k in sorted(topics))
    return engine.tokenizer.encode(text[8 * skip: 8 * (skip + n + 50)])[:n]


def test_a_batch_forward_gives_each_row_the_logits_of_its_sequence_alone(engine):
    """Three sequences decode one token each and two others prefill a chunk, in one forward
    over a pool with shuffled tables: each decode row's logits and each chunk's last row's
    are those of the same step run alone."""
    model, bs = engine.model, 16
    spec = plan_pool(engine.geometry, "fp32", 64 * bs * engine.geometry.kv_bytes_per_token("fp32"), bs)
    pool = KVPool(engine.geometry, spec, engine.device)
    order = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(5)).tolist()
    lens = [40, 75, 130, 17, 60]                         # cached before the step: 3 decoders, 2 prefills
    new = [1, 1, 1, 23, 9]                               # tokens each feeds in the step
    texts = [text_ids(engine, n + k, skip=100 * i) for i, (n, k) in enumerate(zip(lens, new))]
    tables, slots = [], []
    for i, n in enumerate(lens):
        owned = order[10 * i:10 * (i + 1)]
        tables.append(torch.tensor(owned + [0] * (spec.num_blocks - 10), dtype=torch.int32))
        slots.append(lambda a, b, o=owned: [o[p // bs] * bs + p % bs for p in range(a, b)])
        model.forward(torch.tensor(texts[i][:n]), torch.arange(n), Step(tables[i], torch.tensor(slots[i](0, n)), 0, False),
                      pool)
    alone = []
    for i, (n, k) in enumerate(zip(lens, new)):
        step = Step(tables[i], torch.tensor(slots[i](n, n + k)), n, decode=k == 1)
        alone.append(model.forward(torch.tensor(texts[i][n:n + k]), torch.arange(n, n + k), step, pool)[-1])
    ids, pos, flat = [], [], []
    for i, (n, k) in enumerate(zip(lens, new)):
        ids += texts[i][n:n + k]
        pos += list(range(n, n + k))
        flat += slots[i](n, n + k)
    batch = Batch(torch.tensor(flat), max(pos) + 1, decode=3, block_tables=torch.stack(tables[:3]),
                  context_lens=torch.tensor([n + 1 for n in lens[:3]], dtype=torch.int32), max_context=max(lens[:3]) + 1,
                  prefills=tuple(Chunk(new[i], tables[i], lens[i]) for i in (3, 4)))
    together = model.forward(torch.tensor(ids), torch.tensor(pos), batch, pool)    # (5, vocab)
    assert together.shape == (5, engine.geometry.vocab_size)
    for i in range(5):
        assert rel_err(together[i], alone[i]) < REL_TOL, f"row {i}"


def reply(conv, text, max_tokens, cancel_after=None):
    cancel = threading.Event()
    tokens, stats = [], None
    for ev in conv.send(text, SamplingParams(max_tokens=max_tokens), cancel=cancel):
        if isinstance(ev, TokenEvent) and ev.token_id >= 0:
            tokens.append(ev.token_id)
            if cancel_after is not None and len(tokens) == cancel_after:
                cancel.set()
        elif isinstance(ev, TurnStats):
            stats = ev
    return tokens, stats


def alone(engine, texts, max_tokens) -> list[list[int]]:
    out = []
    for text in texts:
        conv = engine.new_conversation()
        try:
            out.append(reply(conv, text, max_tokens)[0])
        finally:
            conv.reset_cache()
            engine.close_conversation(conv)
    return out


def test_threads_sending_at_once_share_steps_and_get_their_replies_alone(engine):
    texts = MESSAGES[:3]
    want = alone(engine, texts, 8)
    convs = [engine.new_conversation() for _ in texts]
    got: list = [None] * len(texts)
    first = engine.scheduler.steps
    start = threading.Barrier(len(texts))

    def run(i):
        start.wait()
        got[i] = reply(convs[i], texts[i], 8)

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(texts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        for c in convs:
            c.reset_cache()
            engine.close_conversation(c)
    assert [g[0] for g in got] == want
    taken = engine.scheduler.steps - first
    shared = [s for s in engine.steps()[-taken:] if s.sequences > 1]
    assert shared, "the conversations never shared a step"
    assert max(s.decode_rows for s in shared) == len(texts)
    assert all(s.weight_bytes == engine.model.step_weight_bytes for s in shared), "the weights are read once a step"


def test_replies_read_in_turn_arrive_and_finish_mid_batch_and_cancel_alone(engine):
    """One thread reads three replies in turn, starting them at different times; they have
    different lengths, so they finish mid-batch, and one is cancelled after two tokens."""
    texts, lengths = MESSAGES[1:4], (10, 4, 7)
    want = [w[:n] for w, n in zip(alone(engine, texts, 10), lengths)]
    convs = [engine.new_conversation() for _ in texts]
    cancels = [threading.Event() for _ in texts]
    gens = [None] * 3
    tokens: list[list[int]] = [[], [], []]
    stats: list = [None] * 3
    try:
        gens[0] = convs[0].send(texts[0], SamplingParams(max_tokens=lengths[0]), cancel=cancels[0])
        tick = 0
        while any(s is None for s in stats):
            tick += 1
            if tick == 3:
                gens[1] = convs[1].send(texts[1], SamplingParams(max_tokens=lengths[1]), cancel=cancels[1])
            if tick == 5:
                gens[2] = convs[2].send(texts[2], SamplingParams(max_tokens=lengths[2]), cancel=cancels[2])
            for i, gen in enumerate(gens):
                if gen is None or stats[i] is not None:
                    continue
                ev = next(gen)
                if isinstance(ev, TurnStats):
                    stats[i] = ev
                elif isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    tokens[i].append(ev.token_id)
                    if i == 2 and len(tokens[i]) == 2:
                        cancels[i].set()
    finally:
        for c in convs:
            c.reset_cache()
            engine.close_conversation(c)
    assert tokens[0] == want[0] and tokens[1] == want[1]
    assert stats[2].stop_reason == "cancelled" and tokens[2] == want[2][:2]
    assert [s.generated_tokens for s in stats] == [len(t) for t in tokens]


def test_a_preempted_reply_is_recomputed_and_ends_as_it_would_alone(engine):
    """Two long histories in a 12-block pool: both fit when they start, but their replies
    outgrow the pool, so the newer is preempted mid-reply, waits, recomputes its text and
    finishes with the tokens it gets alone."""
    tiny = Engine(EngineConfig(dtype="fp32", kv_budget=12 * 16 * 46080, block_size=16))
    texts = [engine.tokenizer.decode(text_ids(engine, 60, skip=1000 * i)) + " Go on." for i in range(2)]
    want = alone(engine, texts, 24)
    convs = [tiny.new_conversation() for _ in texts]
    gens = [c.send(t, SamplingParams(max_tokens=24)) for c, t in zip(convs, texts)]
    tokens: list[list[int]] = [[], []]
    stats: list = [None, None]
    while any(s is None for s in stats):
        for i, gen in enumerate(gens):
            if stats[i] is None:
                ev = next(gen)
                if isinstance(ev, TurnStats):
                    stats[i] = ev
                elif isinstance(ev, TokenEvent) and ev.token_id >= 0:
                    tokens[i].append(ev.token_id)
    assert tokens == want
    assert tiny.preemptions >= 1 and stats[1].preempted >= 1 and stats[1].recomputed_tokens > 0
    for c in convs:
        tiny.close_conversation(c)
    assert tiny.blocks.num_active == 0


@pytest.mark.parametrize("kv", ["fp8"])
def test_the_scheduler_snapshot_and_step_records_describe_a_shared_step(engine, kv):
    """A snapshot between steps names every conversation with its state and its blocks, and
    the last step's record counts the rows and the cache bytes read, fp8 scales included."""
    eng = Engine(EngineConfig(dtype="fp32", kv_dtype=kv, kv_budget="16MiB"))
    a, b = eng.new_conversation(), eng.new_conversation()
    ga = a.send("Name a colour.", SamplingParams(max_tokens=6))
    gb = b.send("Name a fruit.", SamplingParams(max_tokens=6))
    while not isinstance(next(ga), TokenEvent):
        pass
    while not isinstance(next(gb), TokenEvent):
        pass
    snap = eng.scheduler_snapshot()
    views = {v.conversation: v for v in snap.conversations}
    assert set(views) == {a.id, b.id} and snap.running == 2
    for conv in (a, b):
        v = views[conv.id]
        assert v.state == "running" and v.blocks_held == conv.seq.num_blocks and v.context_tokens == conv.tokens_held
        assert v.ttft_ms is not None and v.ms_per_token is not None
    last = snap.last_step
    assert last.decode_rows == 2 and last.sequences == 2
    per_token = eng.spec.bytes_per_token + eng.spec.scale_bytes_per_token
    assert last.cache_bytes == last.context_tokens * per_token and eng.spec.scale_bytes_per_token > 0
    cache = eng.snapshot(a)
    assert cache.owners == (a.id, b.id)
    assert {cache.owner_of(x) for x in a.block_table} <= {a.id, b.id} and cache.owner_of(b.block_table[-1]) == b.id
    for gen in (ga, gb):
        gen.close()
    assert [v.state for v in eng.scheduler_snapshot().conversations] == ["idle", "idle"]
    for conv in (a, b):
        eng.close_conversation(conv)


def test_a_held_request_takes_no_row_keeps_its_cache_and_ends_as_it_would_alone(engine):
    """Three prompts through Engine.requests: once each is past its prompt, holds change who
    decodes step by step. Every step has exactly the rows not held; a held request's tokens
    and blocks stay as they were; each ends with the greedy tokens it gets alone."""
    prompts = [text_ids(engine, n, skip=300 * i) for i, n in enumerate((37, 70, 52))]
    want = [g.tokens for g in (engine.generate([p], SamplingParams(max_tokens=9), ignore_eos=True)[0][0]
                               for p in prompts)]
    pattern = [(0,), (0, 1, 2), (2,), (1, 2), (0, 1, 2), (1,), (0, 2), (0, 1, 2), (0, 1, 2), (1, 2), (0, 1, 2),
               (0, 1, 2), (0, 1, 2), (0, 1, 2)]
    with engine.requests(prompts, SamplingParams(max_tokens=9), ignore_eos=True) as reqs:
        while not all(r.phase == "decode" for r in reqs):
            engine.hold([r for r in reqs if r.phase == "decode"])
            assert engine.step() is not None
        assert [r.generated for r in reqs] == [1, 1, 1]
        for active in pattern:
            live = [i for i in active if not reqs[i].finished]
            if not live:
                continue
            engine.hold(reqs)
            engine.hold([reqs[i] for i in live], False)
            before = [(len(r.tokens), r.seq.num_blocks, list(r.seq.block_table)) for r in reqs]
            rec = engine.step()
            assert rec.decode_rows == len(live) and not rec.prefill_tokens
            for i, r in enumerate(reqs):
                if i not in live:
                    assert (len(r.tokens), r.seq.num_blocks, list(r.seq.block_table)) == before[i]
                else:
                    assert len(r.tokens) == before[i][0] + 1 or r.finished
        assert all(r.finished for r in reqs)
        got = [tuple(r.tokens[len(r.prompt):]) for r in reqs]
    assert got == want
    assert engine.blocks.num_active == 0
