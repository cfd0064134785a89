"""What a plan prints and writes: the setup with every constant and its source, the results
in `vllm bench serve`'s layout, the pool's story, what the simulation cannot know, and the
same as one JSON record."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..text import plural
from .planner import PlanResult, bytes_per_token_text, weights_text

CANNOT_KNOW = (
    "the network, the HTTP server, tokenisation and detokenisation (TTFT here starts when the scheduler sees a "
    "request)",
    "kernels the roofline does not describe: attention's real efficiency at each length, fused or split kernels, "
    "CUDA-graph padding, sampling cost; each is folded into the efficiencies and the per-step overhead",
    "speculative decoding, mixture-of-experts routing, pipeline parallelism, multi-node links",
    "what a cap, drop-oldest or sink-window does to the answers' quality, and fp8's accuracy",
    "memory beyond the weights and the pool (activations, graphs, fragmentation): a default reserve stands for it",
    "people: when they send, how long they read and how long they write are the workload's distributions, not "
    "measurements",
)


def _v(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def setup_lines(p: PlanResult) -> list[str]:
    c, cfg = p.costs, p.config
    g = cfg.geometry
    from .options import NO_SEQ_LIMIT
    engine = " in kvchat's engine's order (every decode row first, then prompt chunks)" if cfg.hardware.measured else ""
    seqs = "no limit on the sequences" if cfg.max_seqs >= NO_SEQ_LIMIT else f"at most {plural(cfg.max_seqs, 'sequence')}"
    lines = [
        f"model     {g.name}: {g.n_layers} layers, {g.n_heads} query / {g.n_kv_heads} KV heads of {g.head_dim}; "
        f"weights {weights_text(c, cfg.dtype)}; KV {bytes_per_token_text(c, cfg.kv_dtype)}",
        f"hardware  {cfg.gpus}" + (f" (tensor parallel {cfg.tp})" if cfg.tp > 1 else ""),
        f"pool      {p.pool.bytes / 1e9:,.2f} GB = {p.pool.num_blocks:,} blocks of {p.pool.block_size} = "
        f"{p.pool.tokens:,} tokens; {p.pool.source}",
        f"scheduler token budget {cfg.max_batched_tokens:,} per step{engine}, {seqs} "
        f"running, chunked prefill, prefix caching {'on' if cfg.prefix_caching else 'off'}, newest-first "
        "preemption with recompute; "
        f"longest request {p.sched.max_len:,} tokens; cap "
        f"{f'{cfg.cap:,} ({cfg.policy})' if cfg.cap else 'none'}",
        f"workload  {cfg.workload.describe() if cfg.trace is None else f'a trace of {len(p.trace.users)} users'} "
        f"({p.trace.turns:,} turns)",
    ]
    return lines


def constants_lines(p: PlanResult) -> list[str]:
    out = ["step time = overhead + rows x row overhead + max(weights/(B x e_w), linear FLOPs/(F x e_f)) "
           "+ max(KV bytes/(B x e_kv), attention FLOPs/(F_a x e_a))" + (" + all-reduce" if p.config.tp > 1 else "")]
    for name, const in p.model.constants():
        out.append(f"  {name:<34} {const.text():>14}   {const.source}")
    return out


def bench_lines(s: dict[str, Any], title: str) -> list[str]:
    """The layout of `vllm bench serve`'s result block."""
    def row(label: str, value: str) -> str:
        return f"{label:<40}{value:>12}"

    def section(name: str, key: str, label: str) -> list[str]:
        st = s.get(key)
        if st is None:
            return []
        out = [f"{name:-^52}"]
        out.append(row(f"Mean {label} (ms):", _v(st["mean"])))
        out += [row(f"{'Median' if q == 'p50' else q.upper()} {label} (ms):", _v(st[q])) for q in ("p50", "p90", "p99")]
        return out

    out = [f"{' ' + title + ' ':=^52}",
           row("Successful requests:", f"{s['requests']:,}"),
           row("Benchmark duration (s):", _v(s["duration_s"])),
           row("Total input tokens:", f"{s['input_tokens']:,}"),
           row("  of them from the prefix cache:", f"{s['cached_prompt_tokens']:,}"),
           row("Total generated tokens:", f"{s['output_tokens']:,}"),
           row("Request throughput (req/s):", _v(s["request_throughput"])),
           row("Output token throughput (tok/s):", _v(s["output_throughput"])),
           row("Total Token throughput (tok/s):", _v(s["total_token_throughput"]))]
    if "goodput" in s:
        slo = ", ".join(f"{k} {v:g} ms" for k, v in s["slo_ms"].items())
        out.append(row("Request goodput (req/s):", _v(s["goodput"])))
        out.append(f"  ({s['good_requests']:,} of {s['requests']:,} requests within {slo})")
    out += section("Time to First Token", "ttft_ms", "TTFT")
    out += section("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT")
    out += section("Inter-token Latency", "itl_ms", "ITL")
    out += section("End-to-end Latency", "e2el_ms", "E2EL")
    out += [f"{'Preemption':-^52}",
            row("Requests preempted:", f"{s['preempted_requests']:,}"),
            row("Preemptions:", f"{s['preemptions']:,}"),
            row("Recomputed tokens:", f"{s['recomputed_tokens']:,}"),
            "=" * 52]
    return out


def story_lines(p: PlanResult) -> list[str]:
    st = p.story
    out = [f"pool: {st['mean_in_use']:.0%} of the blocks in use on average, {st['peak_in_use']:.0%} at the peak; "
           f"{st['mean_cached_evictable']:.0%} cached and evictable on average; {st['evictions']:,} cached blocks "
           f"evicted",
           f"scheduler: {st['steps']:,} steps ({st['decode_stretches']:,} decode stretches run in one go), "
           f"{_v(st['mean_tokens_per_step'], 1)} tokens per step on average, "
           f"at most {st['peak_running']} running and {st['peak_waiting']} waiting; prefix-cache hits "
           f"{'n/a' if st['prefix_hit_rate'] is None else format(st['prefix_hit_rate'], '.0%')} of prompt tokens"]
    if p.long is not None:
        out.append(f"the long user held {st['long_user_peak_share']:.0%} of the pool at the peak "
                   f"({st['long_user_mean_share']:.0%} on average over the run)")
    return out


def print_report(p: PlanResult, terminal_plot: str | None = None) -> None:
    print("kvchat plan: a simulation of a vLLM-like server (not a measurement)")
    for line in setup_lines(p) + constants_lines(p):
        print(line)
    for note in p.notes:
        print(f"note: {note}")
    print()
    print("\n".join(bench_lines(p.summary, "Serving Benchmark Result (simulated)")))
    for title, s in (("the others", p.others), ("the long user", p.long)):
        if s is not None:
            print()
            print("\n".join(bench_lines(s, title)))
    print()
    print("\n".join(story_lines(p)))
    if terminal_plot:
        print()
        print(terminal_plot)
    print()
    print("what the simulation cannot know:")
    for line in CANNOT_KNOW:
        print(f"  - {line}")


def record(p: PlanResult, max_samples: int = 2000) -> dict[str, Any]:
    cfg, c = p.config, p.costs
    samples = p.result.samples
    step = max(1, len(samples) // max_samples)
    return {
        "format": "kvchat-plan-result/1",
        "model": cfg.geometry.name, "dtype": cfg.dtype, "kv_dtype": cfg.kv_dtype,
        "hardware": cfg.hardware.key, "hardware_name": cfg.hardware.name, "hardware_source": cfg.hardware.source,
        "tp": cfg.tp, "weight_bytes": c.weight_bytes_total, "kv_bytes_per_token": c.kv_bytes_per_token_total,
        "pool": {"bytes": p.pool.bytes, "num_blocks": p.pool.num_blocks, "block_size": p.pool.block_size,
                 "tokens": p.pool.tokens, "source": p.pool.source},
        "scheduler": {"max_batched_tokens": cfg.max_batched_tokens, "max_seqs": cfg.max_seqs,
                      "prefix_caching": cfg.prefix_caching, "max_len": p.sched.max_len, "cap": cfg.cap,
                      "policy": cfg.policy},
        "workload": cfg.workload.describe() if cfg.trace is None else "a trace",
        "constants": {name: {"value": k.value, "unit": k.unit, "source": k.source} for name, k in p.model.constants()},
        "summary": p.summary, "others": p.others, "long_user": p.long, "pool_story": p.story, "notes": p.notes,
        "occupancy": {"columns": ["t_s", "blocks_in_use", "cached_evictable", "running", "waiting", "long_user_blocks"],
                      "rows": [[round(s[0], 4), *s[1:]] for s in samples[::step]]},
        "cannot_know": list(CANNOT_KNOW),
    }


def write_json(path: Path, rec: dict[str, Any]) -> None:
    path.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
