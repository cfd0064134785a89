"""Our Llama over the paged cache against transformers' LlamaForCausalLM on the same weights
(the bundled SmolLM2-135M-Instruct, fp32). Tolerance: relative error (max |ours - theirs| /
max |theirs|) under 1e-3 for prefill and for each of 32 decode steps."""
from __future__ import annotations

import torch

from kvchat.engine import SamplingParams
from kvchat.engine.kv_cache import KVPool, plan_pool
from kvchat.engine.model import Step

REL_TOL = 1e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def prompt_ids(engine, text="Write two sentences about the sea."):
    conv = engine.new_conversation()
    ids = conv.render([{"role": "user", "content": text}])
    engine.close_conversation(conv)
    return ids


def fresh_pool(engine, block_size: int, shuffle: bool, seed: int = 0):
    g = engine.geometry
    spec = plan_pool(g, "fp32", 256 * block_size * g.kv_bytes_per_token("fp32"), block_size)
    pool = KVPool(g, spec, engine.device)
    pool.data.normal_()  # garbage everywhere: only written slots may influence the output
    ids = torch.randperm(spec.num_blocks, generator=torch.Generator().manual_seed(seed)) if shuffle \
        else torch.arange(spec.num_blocks)
    return pool, ids.to(torch.int32)


def run_paged(engine, ids: list[int], block_size: int, shuffle: bool, decode_tokens: list[int]):
    """Prefill `ids`, then feed `decode_tokens` one at a time; returns (prefill logits (T, V),
    decode logits (n, V))."""
    model = engine.model
    pool, table = fresh_pool(engine, block_size, shuffle)

    def slots(p0, p1):
        pos = torch.arange(p0, p1)
        return table.long()[pos // block_size] * block_size + pos % block_size

    t = len(ids)
    pre = model.forward(torch.tensor(ids), torch.arange(t), Step(table, slots(0, t), 0, False), pool,
                        last_only=False)
    outs = []
    for i, tok in enumerate(decode_tokens):
        p = t + i
        outs.append(model.forward(torch.tensor([tok]), torch.tensor([p]), Step(table, slots(p, p + 1), p, True),
                                  pool)[0])
    return pre, torch.stack(outs) if outs else None


def test_prefill_and_32_decode_steps_match_transformers(engine, hf_model):
    ids = prompt_ids(engine)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                output_logits=True, return_dict_in_generate=True, use_cache=True)
        ref_prefill = hf_model(torch.tensor([ids])).logits[0]                 # (T, V)
    ref_tokens = ref.sequences[0, len(ids):].tolist()
    ref_steps = torch.stack([s[0] for s in ref.logits])                       # (32, V): step i predicts token i
    pre, dec = run_paged(engine, ids, 16, shuffle=True, decode_tokens=ref_tokens[:-1])
    assert rel_err(pre, ref_prefill) < REL_TOL
    ours = torch.cat([pre[-1:], dec])                                         # (32, V)
    errs = [rel_err(ours[i], ref_steps[i]) for i in range(32)]
    assert max(errs) < REL_TOL, f"worst decode step error {max(errs):.2e} at step {errs.index(max(errs))}"


def test_greedy_reply_tokens_identical_to_transformers(engine, hf_model):
    text = "What is the capital of France?"
    ids = prompt_ids(engine, text)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    conv = engine.new_conversation()
    try:
        events = list(conv.send(text, SamplingParams(max_tokens=24)))
    finally:
        engine.close_conversation(conv)
    ours = [e.token_id for e in events if type(e).__name__ == "TokenEvent" and e.token_id >= 0]
    stops = conv.stop_ids()
    ref_until_stop = []
    for t in ref:
        if t in stops:
            break
        ref_until_stop.append(t)
    assert ours == ref_until_stop
    assert "Paris" in events[-1].reply


def test_block_sizes_1_16_32_give_the_same_logits_as_a_dense_pass(engine):
    ids = prompt_ids(engine, "Count from one to ten, in words, slowly.")
    extra = [engine.tokenizer.encode(" one two three", add_special_tokens=False)][0][:3]
    dense = engine.model.forward_dense(torch.tensor(ids + extra), last_only=False)   # (T+3, V)
    for bs in (1, 16, 32):
        pre, dec = run_paged(engine, ids, bs, shuffle=True, decode_tokens=extra)
        assert rel_err(pre, dense[: len(ids)]) < REL_TOL, f"block size {bs}: prefill"
        assert rel_err(dec, dense[len(ids):]) < REL_TOL, f"block size {bs}: decode"


def test_prefill_in_chunks_over_a_cached_prefix_matches_one_pass(engine):
    """Prefill over a cached prefix (what a reused turn does) equals prefilling it all at once."""
    ids = prompt_ids(engine, "Tell me about the history of the printing press in Europe.")
    model = engine.model
    pool, table = fresh_pool(engine, 16, shuffle=True, seed=3)

    def slots(p0, p1):
        pos = torch.arange(p0, p1)
        return table.long()[pos // 16] * 16 + pos % 16

    split = 32  # a block-aligned prefix, as prefix reuse leaves it
    model.forward(torch.tensor(ids[:split]), torch.arange(split), Step(table, slots(0, split), 0, False), pool)
    rest = model.forward(torch.tensor(ids[split:]), torch.arange(split, len(ids)),
                         Step(table, slots(split, len(ids)), split, False), pool, last_only=False)
    dense = model.forward_dense(torch.tensor(ids), last_only=False)
    assert rel_err(rest, dense[split:]) < REL_TOL
