"""Soak run: several conversations take many turns, round-robin, in one pool too small for
all of them, so cached blocks are evicted and idle conversations preempted and recomputed.

    python scripts/soak.py [--conversations 8] [--turns 50] [--pool-blocks 48] [--max-tokens 6]

Prints blocks leaked after every conversation closes (must be 0), bookkeeping violations
seen after any turn (must be 0), preemptions, recomputed tokens, evictions, and the time
per turn over the first rounds against the last ones. Exits 1 if anything leaked.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvchat.engine import CapExceeded, Engine, EngineConfig, SamplingParams, TurnStats
from kvchat.engine.sources import resolve

PROMPTS = ("Name a fruit.", "Why is the sky blue?", "Count to five.", "What is a noun?", "Say something kind.",
           "Give me a word that rhymes with cat.", "What is two plus two?", "Name a river.",
           "What colour is grass?", "Tell me a short fact about the sea.", "What do bees make?",
           "Name a planet.")
POLICIES = (("drop-oldest", 256), ("sink-window", 128), ("drop-oldest", 192), ("stop", 512))


def bookkeeping_errors(eng: Engine) -> list[str]:
    """What does not add up between the block manager and the conversations' tables."""
    bm = eng.blocks
    states = [bm.state(b) for b in range(bm.num_blocks)]
    errors = []
    counts = tuple(states.count(s) for s in ("free", "active", "cached"))
    if counts != (bm.num_free, bm.num_active, bm.num_cached) or sum(counts) != bm.num_blocks:
        errors.append(f"states {counts} vs counters {(bm.num_free, bm.num_active, bm.num_cached)}")
    held = [0] * bm.num_blocks
    for conv in eng.conversations:
        for b in conv.block_table:
            held[b] += 1
    if [b.ref_count for b in bm.blocks] != held:
        errors.append("reference counts differ from the conversations' tables")
    return errors


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=50, help="turns per conversation")
    ap.add_argument("--pool-blocks", type=int, default=48, help="pool size in blocks of 16 fp32 tokens")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=5, help="rounds averaged for the start and end times")
    ap.add_argument("--minutes", type=float, default=None, help="stop after the round that passes this time")
    args = ap.parse_args(argv)
    bpt = resolve(None, False).geometry.kv_bytes_per_token("fp32")
    eng = Engine(EngineConfig(kv_dtype="fp32", kv_budget=args.pool_blocks * 16 * bpt, block_size=16))
    convs = [eng.new_conversation(cap=cap, policy=policy)
             for policy, cap in (POLICIES[i % len(POLICIES)] for i in range(args.conversations))]
    print(f"soak: {args.conversations} conversations x {args.turns} turns, pool {eng.spec.num_blocks} blocks of "
          f"{eng.spec.block_size} tokens ({eng.spec.capacity_tokens} tokens), max {args.max_tokens} tokens a reply")
    sp = SamplingParams(max_tokens=args.max_tokens)
    round_s: list[float] = []
    stats: list[TurnStats] = []
    refused = violations = 0
    t_start = time.perf_counter()
    for r in range(args.turns):
        t0 = time.perf_counter()
        for i, conv in enumerate(convs):
            try:
                stats.append([e for e in conv.send(PROMPTS[(r * 5 + i) % len(PROMPTS)], sp)][-1])
            except CapExceeded:
                refused += 1
            errors = bookkeeping_errors(eng)
            violations += len(errors)
            for e in errors:
                print(f"  round {r + 1}, conversation {i + 1}: {e}")
        round_s.append((time.perf_counter() - t0) / len(convs))
        print(f"  round {r + 1}: {round_s[-1] * 1000:.0f} ms a turn, {eng.preemptions} preemptions so far", flush=True)
        if args.minutes is not None and time.perf_counter() - t_start > 60 * args.minutes:
            print(f"  stopped after {r + 1} of {args.turns} rounds: --minutes {args.minutes} passed")
            break
    total_s = time.perf_counter() - t_start
    held = {id(c): c.tokens_held for c in convs}
    for conv in convs:
        eng.close_conversation(conv)
    leaked = eng.blocks.num_active + sum(b.ref_count for b in eng.blocks.blocks)
    k = min(args.rounds, len(round_s))
    start, end = statistics.mean(round_s[:k]), statistics.mean(round_s[-k:])
    rows = [
        ("turns", f"{len(stats)} in {len(round_s)} rounds ({refused} refused by a cap)"),
        ("blocks leaked after all closed", f"{leaked}"),
        ("bookkeeping violations", f"{violations}"),
        ("preemptions", f"{eng.preemptions} (turn stats: {sum(s.preempted for s in stats)})"),
        ("recomputed tokens", f"{sum(s.recomputed_tokens for s in stats)}"),
        ("cached blocks evicted (LRU)", f"{eng.blocks.evictions}"),
        ("sink-window blocks evicted", f"{sum(c.evicted_tokens for c in convs) // eng.spec.block_size}"),
        ("reused / computed prompt tokens", f"{sum(s.reused_tokens for s in stats)} / "
                                            f"{sum(s.computed_tokens for s in stats)}"),
        ("tokens held at the end", f"{sum(held.values())}"),
        (f"time per turn, first {k} rounds", f"{start * 1000:.0f} ms"),
        (f"time per turn, last {k} rounds", f"{end * 1000:.0f} ms ({end / start:.2f}x)"),
        ("decode ms/token, first / last round", f"{_decode_ms(stats[:len(convs)]):.1f} / {_decode_ms(stats[-len(convs):]):.1f}"),
        ("wall time", f"{total_s:.0f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 1 if leaked or violations else 0


def _decode_ms(stats: list[TurnStats]) -> float:
    ms = [x for s in stats for x in s.decode_ms]
    return statistics.median(ms) if ms else 0.0


if __name__ == "__main__":
    sys.exit(main())
