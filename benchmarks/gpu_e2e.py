"""Section 5 of the GPU check: end-to-end decode through the engine beside a contiguous-cache
SDPA loop and transformers' generate, with the weight-read roofline."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

from gpu_common import K, Report, Setup, TARGET_ROOFLINE_1K, free_memory, kernels_on_cpu


# ---- 5. end to end ------------------------------------------------------------------------------
def make_engine(s: Setup, budget_tokens: int):
    """The engine on random weights of the check's geometry. The tokenizer is skipped: random
    token ids need none, and the GPU machine may lack the bundled model it would load."""
    from kvchat.engine import engine as engine_mod
    from kvchat.engine.engine import Engine, EngineConfig
    from kvchat.engine.sources import ModelSource
    src = ModelSource(s.geom.name, s.geom, None, Path("."), random_weights=True)
    budget = budget_tokens * s.geom.kv_bytes_per_token("fp32" if s.dry else "bf16")
    real = engine_mod.load_tokenizer
    engine_mod.load_tokenizer = lambda src: None
    try:
        with kernels_on_cpu(s):  # the dry run's pool takes the kernels' layout ("tokens")
            return Engine(EngineConfig(model=s.geom.name, random_weights=True, kv_budget=budget,
                                       device="cpu" if s.dry else "auto", dtype="fp32" if s.dry else "auto"),
                          source=src)  # the dry run in fp32 (auto is bf16 on a CPU with AVX512-BF16)
    finally:
        engine_mod.load_tokenizer = real


def engine_decode_ms(s: Setup, engine, ctx: int, fused: bool = True, batch: int = 1) -> float:
    """Median decode step time through the engine's own loop (scheduler, runner, CUDA graph
    of the batch's bucket): `batch` prompts of ctx random tokens, each then decoding
    s.decode_steps + 3 tokens in the same steps. fused=False installs a decoder that captures
    Llama.forward itself instead."""
    import torch
    from kvchat.engine import SamplingParams, cuda_graph
    if s.device.type == "cuda":
        dec = cuda_graph.decoder_for(engine.model, engine.pool)
        if dec.fused != fused and dec.fallback is None:
            cuda_graph._DECODERS[engine.model] = cuda_graph.GraphDecoder(engine.model, engine.pool, fused=fused)
    prompts = [torch.randint(0, s.geom.vocab_size, (ctx,)).tolist() for _ in range(batch)]
    # the prompts are prefilled a step's token budget at a time, one after another: each asks for
    # enough tokens to still be decoding when the last is in (as kvchat bench --batch does)
    stagger = sum(-(-len(p) // engine.scheduler.token_budget) for p in prompts[1:])
    with kernels_on_cpu(s):
        _, steps = engine.generate(prompts, SamplingParams(max_tokens=s.decode_steps + 4 + stagger), ignore_eos=True)
    times = sorted(st.step_ms for st in steps if st.decode_rows == batch and not st.prefill_tokens)[:-3 or None]
    if not times:
        raise RuntimeError(f"no step had all {batch} sequences decoding")
    return times[len(times) // 2]


def batches(s: Setup) -> tuple[int, ...]:
    return (1, 4, 16, 64) if not s.dry else (1, 3)


def check_batched(r: Report, s: Setup, engine) -> None:
    """Aggregate decode tokens/s against the batch size at the first context: the weights are
    read once per step for all B sequences, so the step time grows far slower than B."""
    ctx = s.e2e_contexts[0]
    one = None
    for b in batches(s):
        with r.guard("e2e", f"engine batch {b} at {ctx}"):
            # batch 1 is the fused decode measured above at this context (the same call)
            ms = r.facts.get("engine_ms", {}).get(ctx) if b == 1 else None
            ms = ms or engine_decode_ms(s, engine, ctx, batch=b)
            one = one or ms
            r.row("e2e", f"engine decode, batch {b} at {ctx} (graph bucket)", f"{ms:.2f} ms/step",
                  f"{1000 * b / ms:,.0f} tok/s aggregate", f"step {ms / one:.2f}x batch 1's, "
                                                           f"{b * one / ms:.2f}x its tokens/s")


class ContiguousSDPA:
    """A plain torch decode loop over the same weights: one contiguous (hk, max_len, d) K and V
    per layer, F.scaled_dot_product_attention over the first pos+1 rows. The peer a paged
    cache has to keep up with."""

    def __init__(self, model, max_len: int) -> None:
        import torch
        g = model.geom
        self.model = model
        model.rope_tables(max_len)  # the step indexes the table directly
        shape = (g.n_layers, 1, g.n_kv_heads, max_len, g.head_dim)
        self.k = torch.randn(shape, device=model.device, dtype=model.dtype)
        self.v = torch.randn(shape, device=model.device, dtype=model.dtype)

    def step(self, ids, positions, pos: int):
        import torch
        import torch.nn.functional as F
        from kvchat.engine.model import apply_rope, rms_norm
        m, g = self.model, self.model.geom
        hq, hk, d = g.n_heads, g.n_kv_heads, g.head_dim
        with torch.inference_mode():
            cos, sin = (t[positions] for t in m.rope_tables())
            x = m.embed[ids]                                                    # (1, hidden)
            for i, layer in enumerate(m.layers):
                h = rms_norm(x, layer.attn_norm, g.norm_eps)
                q, k, v = (h @ layer.wqkv.T).split((hq * d, hk * d, hk * d), dim=-1)
                q = apply_rope(q.view(1, hq, d), cos, sin)                      # (1, hq, d)
                k = apply_rope(k.view(1, hk, d), cos, sin)
                self.k[i, 0, :, pos] = k[0]
                self.v[i, 0, :, pos] = v.view(hk, d)
                o = F.scaled_dot_product_attention(q.view(1, hq, 1, d), self.k[i, :, :, :pos + 1],
                                                   self.v[i, :, :, :pos + 1], scale=m.scale, enable_gqa=True)
                x = x + o.reshape(1, hq * d) @ layer.wo.T
                x = x + m._mlp(x, layer)
            return m._logits(x)

    def eager_ms(self, ctx: int, steps: int) -> float:
        import torch
        dev = self.model.device
        token, times = 1, []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            pos = ctx + i
            logits = self.step(torch.tensor([token], device=dev), torch.tensor([pos], device=dev), pos)
            token = int(logits.argmax())
            times.append(time.perf_counter() - t0)
        times = sorted(times[2:])
        return 1000 * times[len(times) // 2]


def hf_llama(s: Setup):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    g = s.geom
    cfg = dict(vocab_size=g.vocab_size, hidden_size=g.hidden, intermediate_size=g.intermediate,
               num_hidden_layers=g.n_layers, num_attention_heads=g.n_heads, num_key_value_heads=g.n_kv_heads,
               head_dim=g.head_dim, max_position_embeddings=g.max_position, rms_norm_eps=g.norm_eps,
               tie_word_embeddings=g.tie_embeddings, rope_theta=g.rope_theta)
    if g.rope_scaling:
        cfg["rope_scaling"] = dict(g.rope_scaling)
    config = LlamaConfig(**cfg, attn_implementation="sdpa")
    dtype = torch.float32 if s.dry else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(s.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def hf_decode_ms(s: Setup, model, ctx: int) -> float:
    """(time of generate with 1 + N new tokens - time with 1) / N: decode alone, prefill excluded."""
    import torch
    ids = torch.randint(0, s.geom.vocab_size, (1, ctx), device=s.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        s.timer.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        s.timer.sync()
        return time.perf_counter() - t0

    run(2)
    one = run(1)
    many = run(1 + s.decode_steps)
    return 1000 * (many - one) / s.decode_steps


def check_end_to_end(r: Report, s: Setup) -> None:
    import torch
    copy = r.facts.get("copy_gbps")
    engine = None
    ms_engine: dict[int, float] = {}
    with r.guard("e2e", "engine set-up"):
        t0 = time.perf_counter()
        # room for the longest context, and for the largest batch at the first without preemption
        engine = make_engine(s, max(max(s.e2e_contexts) + 4 * K,
                                    max(batches(s)) * (s.e2e_contexts[0] + 2 * s.decode_steps + 160)))
        model = engine.model
        r.facts["weight_bytes"] = model.weight_bytes
        read = model.weight_bytes - (model.embed.nbytes if model.lm_head is not model.embed else 0)
        r.facts["weights_read"] = read
        r.row("e2e", f"engine: {s.geom.name}, random weights, {engine.dtype_name}",
              f"{model.weight_bytes / 1e9:.2f} GB weights",
              f"{read / 1e9:.2f} GB read per token", f"set-up {time.perf_counter() - t0:.1f} s")
    if engine is None:
        return
    del model  # the engine holds it; freeing the engine below must free the weights
    kv_per_token = s.geom.kv_bytes_per_token("fp32" if s.dry else "bf16")
    for ctx in s.e2e_contexts:
        label = f"{ctx // K}k" if ctx >= K else str(ctx)
        with r.guard("e2e", f"engine decode {label}"):
            ms = engine_decode_ms(s, engine, ctx)
            ms_engine[ctx] = ms
            verdict, peer = "", ""
            if copy:
                roof_w = r.facts["weights_read"] / copy / 1e6
                roof_all = (r.facts["weights_read"] + ctx * kv_per_token) / copy / 1e6
                peer = f"roofline {roof_w:.2f} ms (+KV {roof_all:.2f})"
                verdict = f"{roof_w / ms:.0%} of weight roofline"
                if ctx == 1 * K:
                    hit = roof_w / ms >= TARGET_ROOFLINE_1K
                    verdict += f" {'PASS' if hit else 'FAIL'} (>= {TARGET_ROOFLINE_1K:.0%})"
            dec = None
            with contextlib.suppress(Exception):
                from kvchat.engine import cuda_graph
                dec = cuda_graph._DECODERS.get(engine.model)
            if dec is not None and dec.fallback:
                verdict += f" (fused step fell back: {dec.fallback[:60]})"
            r.row("e2e", f"engine decode {label} (fused graph + kernels)", f"{ms:.2f} ms/token", peer, verdict)
            if s.device.type != "cuda":   # no graph on the CPU: the same path again, so not run
                continue
            with r.guard("e2e", f"engine decode {label}, unfused graph"):
                plain = engine_decode_ms(s, engine, ctx, fused=False)
                r.row("e2e", f"engine decode {label}, graph of Llama.forward", f"{plain:.2f} ms/token",
                      "unfused: norms, RoPE, silu in torch", f"fusion saves {plain - ms:.2f} ms/token")
    r.facts["engine_ms"] = ms_engine
    check_batched(r, s, engine)

    with r.guard("e2e", "torch SDPA contiguous cache"):
        sdpa = ContiguousSDPA(engine.model, max(s.e2e_contexts) + s.decode_steps + 8)
        for ctx in s.e2e_contexts:
            label = f"{ctx // K}k" if ctx >= K else str(ctx)
            with r.guard("e2e", f"torch SDPA contiguous {label}"):
                eager = sdpa.eager_ms(ctx, s.decode_steps)
                dev = engine.device
                ids, pos_t = torch.tensor([1], device=dev), torch.tensor([ctx], device=dev)
                graphed = s.timer.graph_ms([lambda: sdpa.step(ids, pos_t, ctx)], reps=s.decode_steps)
                mine = ms_engine.get(ctx)
                r.row("e2e", f"torch SDPA contiguous {label}", f"{eager:.2f} ms/token eager",
                      f"{graphed:.2f} ms graph-captured", f"engine {eager / mine:.2f}x as fast as eager, "
                      f"{graphed / mine:.2f}x as graphed" if mine else "")
        del sdpa
    engine.pool = None
    del engine
    free_memory()

    with r.guard("e2e", "transformers generate"):
        t0 = time.perf_counter()
        hf = hf_llama(s)
        r.row("e2e", "transformers LlamaForCausalLM (random, sdpa)", f"set-up {time.perf_counter() - t0:.1f} s", "", "")
        for ctx in s.e2e_contexts:
            label = f"{ctx // K}k" if ctx >= K else str(ctx)
            with r.guard("e2e", f"transformers generate {label}"):
                ms = hf_decode_ms(s, hf, ctx)
                mine = ms_engine.get(ctx)
                verdict = ""
                if mine:
                    verdict = f"{'PASS' if mine < ms else 'FAIL'}: engine {ms / mine:.2f}x as fast"
                r.row("e2e", f"transformers generate {label}", f"{ms:.2f} ms/token", "DynamicCache, sdpa", verdict)
                r.facts.setdefault("hf_ms", {})[ctx] = ms
        del hf
