"""The seeds' scenario: the question both texts end on, answered by simulation.

"You serve Llama 3.1 70B in BF16. After the weights, about 15 GB of GPU memory is left for
the KV cache pool. One user's conversation grows to 30,000 tokens of history. Soon other
users see a longer time to first token and lower throughput, and the scheduler logs show
preemptions. Roughly how much of the pool does that one user hold, and what would you
change first?"

The arithmetic first (2 x 80 x 8 x 128 x 2 B = 327,680 B per token; 30,000 tokens = 9.8 GB,
two thirds of 15 GB), then one simulated row per remedy the text names, on the same users:
an fp8 cache, a per-request cap, prefix caching, more GPUs, fp8 weights, and the first
three together. The hardware: two H100 SXM at tensor parallel 2 (160 GB; 141 GB of bf16
weights), with the pool the text sets, 15 GB. "More GPUs" and "fp8 weights" keep the memory
per GPU that the baseline implies (weights + pool per GPU) and give the pool what they free.
"""
from __future__ import annotations

from pathlib import Path

from kvchat.engine.geometry import KNOWN

from .hardware import TABLE
from .planner import PlanResult, run_plan

SEEDS_MODEL, SEEDS_GPU, SEEDS_TP = "llama-3.1-70b", "h100-sxm", 2
SEEDS_POOL = 15 * 10**9
SEEDS_LONG = 30_000
SEEDS_CAP = 8192
SEEDS_DEFAULTS = {"users": 12, "context": "1000-4000", "message": "50-150", "reply": "150-400", "turns": "4",
                  "think": "exp:5s", "ramp": "5s"}
SEEDS_SYSTEM = 1000


def arithmetic() -> list[str]:
    g = KNOWN[SEEDS_MODEL]
    per = g.kv_bytes_per_token("bf16")
    held = per * SEEDS_LONG
    fp8 = g.kv_bytes_per_token("fp8") * SEEDS_LONG
    return [f"one token: 2 x {g.n_layers} x {g.n_kv_heads} x {g.head_dim} x 2 B = {per:,} B; {SEEDS_LONG:,} tokens "
            f"= {held / 1e9:.2f} GB, {held / SEEDS_POOL:.0%} of a {SEEDS_POOL / 1e9:.0f} GB pool "
            f"({SEEDS_POOL // per:,} tokens in all, {SEEDS_POOL // per - SEEDS_LONG:,} left for everyone else)",
            f"in an fp8 cache the same chat is {fp8 / 1e9:.2f} GB ({fp8 / SEEDS_POOL:.0%}), and the pool holds "
            f"{SEEDS_POOL // (per // 2):,} tokens"]


def rows(args) -> list[tuple[str, dict]]:
    """(label, PlanConfig changes) per row, on the baseline the args describe."""
    g = KNOWN[SEEDS_MODEL]
    from .step_time import model_costs
    w16 = model_costs(g, "bf16", "bf16", SEEDS_TP, False).weight_bytes_total
    w8 = model_costs(g, "fp8", "bf16", SEEDS_TP, False).weight_bytes_total
    per_gpu = (w16 + SEEDS_POOL) / SEEDS_TP          # what the baseline uses of each GPU
    tp4_pool = int(4 * per_gpu - w16)
    return [
        ("as the text sets it: bf16 cache, no cap, no prefix cache", {}),
        ("fp8 KV cache", {"kv_dtype": "fp8"}),
        (f"cap {SEEDS_CAP:,} tokens per request (drop-oldest)", {"cap": SEEDS_CAP, "policy": "drop-oldest"}),
        ("prefix caching on", {"prefix_caching": True}),
        (f"4 GPUs (tp 4): pool {tp4_pool / 1e9:.0f} GB", {"tp": 4, "pool_bytes": tp4_pool}),
        (f"fp8 weights: pool {(SEEDS_POOL + w16 - w8) / 1e9:.0f} GB", {"dtype": "fp8",
                                                                        "pool_bytes": int(SEEDS_POOL + w16 - w8)}),
        ("fp8 cache + cap + prefix caching", {"kv_dtype": "fp8", "cap": SEEDS_CAP, "policy": "drop-oldest",
                                              "prefix_caching": True}),
    ]


def baseline(args):
    from .options import plan_config, workload
    for k, v in SEEDS_DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.system_prompt == 0:
        args.system_prompt = SEEDS_SYSTEM
    return plan_config(args, geometry=KNOWN[SEEDS_MODEL], hardware=TABLE[SEEDS_GPU], tp=SEEDS_TP, dtype="bf16",
                       max_batched_tokens=args.max_batched_tokens or 8192, max_seqs=args.max_seqs or 1024,
                       kv_dtype="bf16", pool_bytes=SEEDS_POOL, prefix_caching=False, cap=None, policy="stop",
                       workload=workload(args, SEEDS_LONG))


def table(results: list[tuple[str, PlanResult]]) -> list[str]:
    out = [f"{'':<57}{'pool':>7}{'long':>6}{'TTFT of the others, s':>24}{'TPOT ms':>14}{'preemp-':>9}{'recomputed':>12}"
           f"{'output':>8}{'goodput':>9}",
           f"{'':<57}{'tokens':>7}{'share':>6}{'p50':>8}{'p90':>8}{'p99':>8}{'p50':>7}{'p90':>7}{'tions':>9}"
           f"{'tokens':>12}{'tok/s':>8}{'req/s':>9}"]
    for label, p in results:
        o = p.others or p.summary
        t, tp = o["ttft_ms"], p.summary["tpot_ms"]
        out.append(f"{label[:56]:<57}{p.pool.tokens / 1000:>6.0f}k{p.story['long_user_peak_share']:>6.0%}"
                   f"{_s(t['p50']):>8}{_s(t['p90']):>8}{_s(t['p99']):>8}{_n(tp['p50']):>7}{_n(tp['p90']):>7}"
                   f"{p.summary['preemptions']:>9,}{p.summary['recomputed_tokens']:>12,}"
                   f"{p.summary['output_throughput']:>8,.0f}{p.summary.get('goodput', 0):>9.2f}")
    return out


def _s(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms / 1000:,.2f}"


def _n(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def run_scenario(args, json_path: Path | None, plot_path: Path | None) -> int:
    from ..cli.args import UsageError
    if args.scenario.strip().lower() != "seeds":
        raise UsageError(f"unknown --scenario {args.scenario!r}; accepted: seeds")
    from .report import CANNOT_KNOW, constants_lines, record, setup_lines, write_json
    base = baseline(args)
    results = []
    for label, changes in rows(args):
        results.append((label, run_plan(base.variant(label=label, **changes))))
    first = results[0][1]
    print("kvchat plan --scenario seeds: the texts' question, simulated (a vLLM-like server, not a measurement)")
    for line in arithmetic():
        print(line)
    for line in setup_lines(first) + constants_lines(first):
        print(line)
    print()
    print("\n".join(table(results)))
    print("long share: the most of the pool's blocks the long user held at once; TTFT of the other users; TPOT, "
          "preemptions, throughput and goodput (--slo " + (args.slo or "none") + ") over everyone")
    notes: dict[str, list[str]] = {}
    for label, p in results:
        for note in p.notes:
            notes.setdefault(note, []).append(label.split(":")[0])
    for note, labels in notes.items():
        print(f"note ({'; '.join(labels) if len(labels) < len(results) else 'every row'}): {note}")
    print()
    print("what the simulation cannot know:")
    for line in CANNOT_KNOW:
        print(f"  - {line}")
    if json_path is not None:
        write_json(json_path, {"format": "kvchat-plan-scenario/1", "scenario": "seeds", "arithmetic": arithmetic(),
                               "rows": [dict(record(p), label=label) for label, p in results]})
    if plot_path is not None:
        from .plot import write_png
        write_png(plot_path, first)
    return 0
