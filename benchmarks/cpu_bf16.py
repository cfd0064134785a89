"""Is bf16 good enough, and faster, to be the CPU default? bf16 weights and a bf16 KV cache
against fp32 on the bundled model, on a text no one tuned on (a licence from
/usr/share/common-licenses, GPL-3 unless given).

    python benchmarks/cpu_bf16.py [--text FILE] [--tokens 2048] [--context 1024] [--steps 16] [--rounds 5]
                                  [--decode-steps 128] [--fp8-levels native,x86-64-v4]

Quality, over `--tokens` tokens of the text (a chunked prefill through the paged cache, so every
chunk attends to the stored cache): greedy agreement (argmax equal to fp32's), mean |logit
difference| against fp32, and perplexity of the text and its ratio to fp32's.
Decode quality: `--decode-steps` teacher-forced decode steps after `--context` tokens, the
one-row products the C GEMV takes (bf16 weights: vdpbf16ps where the CPU has AVX512-BF16),
against fp32: greedy agreement, logit differences, the next-token NLL's difference.
`--fp8-levels` adds decode rows of fp32 weights over an fp8 cache, one per C build level named
(engine/native_build.py): on a CPU with AVX512-BF16, `native` takes the fp8 attention in bf16
(queries and p rounded), `x86-64-v4` in fp32 (every e4m3 value widened exactly).
Speed: decode ms/token at `--context` tokens and the prefill of those tokens (one chunk) in
tokens/s, every configuration in this one process, taken in turn round after round so that a
changing load touches each alike; the median over rounds (of each round's median, for decode),
with the 1-minute load before and after.

The rule (issue 13): bf16 becomes the CPU default only if its perplexity is within 1% of
fp32's and it decodes faster.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvchat, not an installed one

from kvchat.engine import Engine, EngineConfig, compute, native  # noqa: E402
from kvchat.engine.kv_cache import KVPool, plan_pool  # noqa: E402
from kvchat.engine.model import Step  # noqa: E402

# (weights, cache); the fp16 cache beside bf16's: the same bytes, another rounding
CONFIGS = (("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "fp16"), ("bf16", "bf16"), ("bf16", "fp32"))
CHUNK = 1024


def pool_for(engine, kv_dtype: str, tokens: int) -> tuple[KVPool, torch.Tensor]:
    g = engine.geometry
    spec = plan_pool(g, kv_dtype, 2 * (tokens + 64) * g.kv_bytes_per_token(kv_dtype), 16)
    return KVPool(g, spec, engine.device), torch.arange(spec.num_blocks, dtype=torch.int32)


def text_logits(model, engine, ids: list[int], kv_dtype: str) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position, prefilled in chunks through the cache."""
    pool, table = pool_for(engine, kv_dtype, len(ids))
    out = []
    for c0 in range(0, len(ids), CHUNK):
        chunk = ids[c0:c0 + CHUNK]
        pos = torch.arange(c0, c0 + len(chunk))
        out.append(model.forward(torch.tensor(chunk), pos, Step(table, pos, c0, False), pool, last_only=False))
    return torch.cat(out)


def decode_logits(model, engine, ids: list[int], kv_dtype: str, context: int, steps: int) -> torch.Tensor:
    """(steps, vocab) logits of teacher-forced decode steps after a `context`-token prefill:
    the decode path (one row a step: the C GEMV, bf16 or fp32), which text_logits' chunks do not take."""
    pool, table = pool_for(engine, kv_dtype, context + steps)
    pos = torch.arange(context)
    model.forward(torch.tensor(ids[:context]), pos, Step(table, pos, 0, False), pool)
    out = []
    for p in range(context, context + steps):
        out.append(model.forward(torch.tensor([ids[p]]), torch.tensor([p]), Step(table, torch.tensor([p]), p, True,
                                                                              runs=((0, pool.spec.num_blocks),)), pool)[0])
    return torch.stack(out)


def decode_quality(dec: dict, ids: list[int], context: int) -> None:
    ref = dec["fp32", "fp32"]
    target = torch.tensor(ids[context + 1:context + 1 + ref.shape[0]])
    print(f"\nDecode steps after {context} tokens, teacher-forced ({ref.shape[0]} steps: the one-row products)"
          "\n\n| weights | KV cache | greedy agreement with fp32 | mean abs logit diff | max abs logit diff "
          "| next-token NLL | its difference to fp32 |\n|---|---|---:|---:|---:|---:|---:|")

    def nll(lg: torch.Tensor) -> float:
        n = min(lg.shape[0], target.shape[0])
        return float(-torch.log_softmax(lg[:n].float(), -1).gather(1, target[:n, None]).mean())
    for (w, kv), lg in dec.items():
        d = (lg - ref).abs()
        agree = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"| {w} | {kv} | {agree:.2%} | {float(d.mean()):.4f} | {float(d.max()):.3f} | {nll(lg):.4f} "
              f"| {nll(lg) - nll(ref):+.4f} |", flush=True)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    target = torch.tensor(ids[1:])[:, None]
    return float((-torch.log_softmax(logits[:-1].float(), -1).gather(1, target)).mean().exp())


def decode_round(model, engine, ids: list[int], kv_dtype: str, context: int, steps: int) -> tuple[float, float]:
    """Prefill `context` ids (one chunk, timed), then time `steps` decode steps (the table's runs
    given, as the engine gives them). Returns (prefill tokens/s, the median ms/step)."""
    pool, table = pool_for(engine, kv_dtype, context + steps)
    pos = torch.arange(context)
    t0 = time.perf_counter()
    model.forward(torch.tensor(ids[:context]), pos, Step(table, pos, 0, False), pool)
    prefill_tok_s = context / (time.perf_counter() - t0)
    times = []
    for p in range(context, context + steps):
        t0 = time.perf_counter()
        model.forward(torch.tensor([ids[p]]), torch.tensor([p]), Step(table, torch.tensor([p]), p, True,
                                                                      runs=((0, pool.spec.num_blocks),)), pool)
        times.append((time.perf_counter() - t0) * 1000)
    return prefill_tok_s, statistics.median(times)


def quality(logits: dict, text_ids: list[int]) -> None:
    ref = logits["fp32", "fp32"]
    ref_ppl = perplexity(ref, text_ids)
    print("\n| weights | KV cache | greedy agreement with fp32 | mean abs logit diff | max abs logit diff "
          "| perplexity | ratio to fp32 |\n|---|---|---:|---:|---:|---:|---:|")
    for (w, kv), lg in logits.items():
        d = (lg - ref).abs()
        agree = float((lg.argmax(-1) == ref.argmax(-1)).float().mean())
        ppl = perplexity(lg, text_ids)
        print(f"| {w} | {kv} | {agree:.2%} | {float(d.mean()):.4f} | {float(d.max()):.3f} | {ppl:.3f} "
              f"| {ppl / ref_ppl:.4f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=128, help="teacher-forced decode steps compared with fp32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-quality", action="store_true", help="only the speed section")
    ap.add_argument("--fp8-levels", default="", help="decode rows over an fp8 cache, one per C build level named")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]

    engines = {w: Engine(EngineConfig(dtype=w, kv_budget="16MiB")) for w in ("fp32", "bf16")}
    tok = engines["fp32"].tokenizer
    ids = tok.encode(Path(args.text).read_text(encoding="utf-8"), add_special_tokens=False)
    if len(ids) < max(args.tokens, args.context + args.steps):
        raise SystemExit(f"{args.text}: {len(ids)} tokens, fewer than --tokens/--context need")
    text_ids = ids[:args.tokens]

    print(f"# bf16 on the CPU against fp32: {engines['fp32'].source.name}, {args.tokens} tokens of {args.text}, "
          f"{args.threads} torch threads, torch {torch.__version__}", flush=True)
    logits = {}
    for w, kv in CONFIGS if not args.no_quality else ():
        with torch.inference_mode():
            logits[w, kv] = text_logits(engines[w].model, engines[w], text_ids, kv)
    if logits:
        quality(logits, text_ids)
        dec = {}
        for w, kv in CONFIGS:
            with torch.inference_mode():
                dec[w, kv] = decode_logits(engines[w].model, engines[w], ids, kv, args.context, args.decode_steps)
        for level in filter(None, args.fp8_levels.split(",")):
            with native.using(level) as why, torch.inference_mode():
                if not why.startswith("on:"):
                    raise SystemExit(f"--fp8-levels: {level}: {why}")
                dec["fp32", f"fp8 ({level}{', bf16 attention' if native.bf16_native() else ''})"] = decode_logits(
                    engines["fp32"].model, engines["fp32"], ids, "fp8", args.context, args.decode_steps)
        decode_quality(dec, ids, args.context)

    rounds: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    prefills: dict[tuple[str, str], list[float]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for w, kv in CONFIGS:
            with torch.inference_mode():
                tok_s, ms = decode_round(engines[w].model, engines[w], ids, kv, args.context, args.steps)
            prefills[w, kv].append(tok_s)
            rounds[w, kv].append(ms)
    base = statistics.median(rounds["fp32", "fp32"])
    base_tok_s = statistics.median(prefills["fp32", "fp32"])
    print(f"\nDecode at {args.context} tokens of context, ms/token: median over {args.rounds} rounds of each "
          f"round's median of {args.steps} steps; the prefill of those {args.context} tokens (one chunk), tokens/s: "
          f"median over the rounds (1-minute load {load0:.1f} before, {os.getloadavg()[0]:.1f} after)"
          "\n\n| weights | KV cache | ms/token | each round | ratio to fp32 | prefill tokens/s | ratio to fp32 |"
          "\n|---|---|---:|---|---:|---:|---:|")
    for (w, kv), xs in rounds.items():
        m, p = statistics.median(xs), statistics.median(prefills[w, kv])
        print(f"| {w} | {kv} | {m:.1f} | {', '.join(f'{x:.1f}' for x in xs)} | {m / base:.2f} | {p:,.0f} | "
              f"{p / base_tok_s:.2f} |")
    return 0


if __name__ == "__main__":
    # all of it on the engine's compute thread, where the engines' steps run: one OpenMP pool
    # in the process (a second one, on this thread, slows both: engine/compute.py)
    raise SystemExit(compute.run(main))
