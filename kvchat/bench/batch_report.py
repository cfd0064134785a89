"""What `kvchat bench --batch` measured: the rows of its JSON record (the schema the planner
calibrates from), the table, the targets, and the plots. No torch here.

One row per (kv_dtype, context, batch):
    step_ms {median, p10, p90, n}   decode-only steps with every user in them
    per_user_ms_per_token           = the median step (each user gets one token a step)
    aggregate_tok_s                 = batch x 1000 / step_ms
    run_step_ms                     each run's median step (None where no step held every user)
    gain                            over batch 1 at the same kv_dtype and context: the median over
                                    runs of each run's B x batch 1's step / this step (in a run a
                                    context's batch sizes take turns, blocks of steps: batch.py); without a run
                                    of each, aggregate_tok_s over batch 1's
    gain_runs, step_ratio           each run's gain; the median over runs of this step / batch 1's
    weight_bytes                    read once per step
    cache_bytes_per_step            K/V (and fp8 scale) bytes attention read, mean over those steps
    context_tokens_per_step         cached tokens those steps read, over every user
    bytes_per_step, measured_gb_s   weights + cache, and that over the step time
    roofline {memory_ms, compute_ms, step_ms, tok_s, gain}
    ours_over_roofline              aggregate_tok_s / roofline tok_s
    peers {name: {step_ms, aggregate_tok_s, gain}}   transformers, vllm (when measured)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .report import median, rnd, spread

GAIN_AT_256 = 6.0          # batch 8 at 256 tokens: aggregate tokens/s at least 6x batch 1's
STEP_AT_256 = 1.5          # ... with the step at most 1.5x batch 1's
ROOF_AT_4096 = 1.2         # batch 8 at 4096: the gain within 1.2x of the roofline's gain
FP8_GAIN = 1.4             # ... and the fp8 cache's gain at least 1.4x the fp32 cache's


def med(xs: list[float]) -> float:
    m = median(xs)
    return float("nan") if m is None else m


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def record(points, meta: dict[str, Any]) -> dict[str, Any]:
    rows = [_row(p, meta) for p in points]
    one = {(r["kv_dtype"], r["context"]): r for r in rows if r["batch"] == 1}
    for r in rows:
        base = one.get((r["kv_dtype"], r["context"]))
        pairs = [(a, b) for a, b in zip(base["run_step_ms"], r["run_step_ms"]) if a and b] if base else []
        r["gain_runs"] = [rnd(r["batch"] * a / b, 3) for a, b in pairs]
        if pairs:
            r["gain"] = rnd(median(r["gain_runs"]), 3)
            r["step_ratio"] = rnd(median([b / a for a, b in pairs]), 3)
        else:
            r["gain"] = rnd(r["aggregate_tok_s"] / base["aggregate_tok_s"], 3) if base and r["aggregate_tok_s"] else None
            r["step_ratio"] = rnd(r["step_ms"]["median"] / base["step_ms"]["median"], 3) \
                if base and r["step_ms"]["median"] and base["step_ms"]["median"] else None
        roof, roof1 = r["roofline"], base["roofline"] if base else None
        roof["gain"] = rnd(roof["tok_s"] / roof1["tok_s"], 3) if roof1 else None
        for name, peer in r["peers"].items():
            b = base["peers"].get(name) if base else None
            peer["gain"] = rnd(peer["aggregate_tok_s"] / b["aggregate_tok_s"], 3) if b else None
    return {**meta, "rows": rows}


def _row(p, meta: dict[str, Any]) -> dict[str, Any]:
    step = median(p.step_ms)
    weights = meta["weight_bytes"]
    cache = _mean(p.cache_bytes)
    per_token = meta["cache_bytes_per_token"][p.kv_dtype]
    held = p.batch * (p.context + meta["new_tokens"] / 2)           # tokens read a step, mid-reply
    memory_ms = (weights + held * per_token) / (meta["bandwidth"]["gb_s"] * 1e9) * 1000
    flops = 2 * meta["matmul_params"] * p.batch + meta["attention_flops_per_token"] * held
    compute_ms = flops / (meta["gemm_gflop_s"] * 1e9) * 1000
    roof_ms = max(memory_ms, compute_ms)
    agg = 1000 * p.batch / step if step else None
    peers = {}
    for name, times in p.peers.items():
        m = median(times)
        peers[name] = {"step_ms": spread(times), "aggregate_tok_s": rnd(1000 * p.batch / m, 2) if m else None}
    return {
        "kv_dtype": p.kv_dtype, "context": p.context, "batch": p.batch, "step_ms": spread(p.step_ms),
        "run_step_ms": [rnd(x) for x in p.run_ms],
        "per_user_ms_per_token": rnd(step), "aggregate_tok_s": rnd(agg, 2), "weight_bytes": weights,
        "cache_bytes_per_step": round(cache), "context_tokens_per_step": round(_mean(p.context_tokens)),
        "bytes_per_step": round(weights + cache),
        "measured_gb_s": rnd((weights + cache) / (step / 1000) / 1e9, 2) if step else None,
        "roofline": {"memory_ms": rnd(memory_ms, 4), "compute_ms": rnd(compute_ms, 4), "step_ms": rnd(roof_ms, 4),
                     "tok_s": rnd(1000 * p.batch / roof_ms, 2)},
        "ours_over_roofline": rnd(agg / (1000 * p.batch / roof_ms), 3) if agg else None,
        "peers": peers, "notes": list(p.notes), "step_ms_samples": [round(x, 3) for x in p.step_ms],
    }


def write_json(path: Path, rec: dict[str, Any]) -> None:
    path.write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")


# ---- the table and the targets ---------------------------------------------------------------
def _f(x, fmt: str = ",.1f", unit: str = "") -> str:
    return "–" if x is None else f"{format(x, fmt)}{unit}"


def markdown(rec: dict[str, Any]) -> str:
    m, bw = rec["model"], rec["bandwidth"]
    turns = f" (batch sizes taking turns, {rec['block_steps']} steps each)" if rec.get("block_steps") else ""
    lines = [f"## {m['model']} ({m['dtype']}, {m['device']}, {rec['threads']} threads): {rec['new_tokens']} decode "
             f"steps x {rec['runs']} run(s) per point{turns}; read bandwidth {bw['gb_s']} GB/s, GEMM "
             f"{rec['gemm_gflop_s']} GFLOP/s (measured in this run)", "",
             "| KV | context | B | step ms | ms/token per user | aggregate tok/s | gain (runs) | roofline tok/s (gain) "
             "| of roofline | MB/step (cache) | GB/s | transformers tok/s (gain) | vLLM tok/s (gain) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rec["rows"]:
        roof = r["roofline"]
        peer = [f"{_f(p['aggregate_tok_s'])} ({_f(p['gain'], '.2f', 'x')})" if p else "–"
                for p in (r["peers"].get("transformers"), r["peers"].get("vllm"))]
        lines.append(
            f"| {r['kv_dtype']} | {r['context']:,} | {r['batch']} | {_f(r['step_ms']['median'])} | "
            f"{_f(r['per_user_ms_per_token'])} | {_f(r['aggregate_tok_s'])} | {_gain(r)} | "
            f"{_f(roof['tok_s'])} ({_f(roof['gain'], '.2f', 'x')}) | {_f(r['ours_over_roofline'], '.0%')} | "
            f"{r['bytes_per_step'] / 1e6:,.0f} ({r['cache_bytes_per_step'] / 1e6:,.0f}) | {_f(r['measured_gb_s'])} | "
            f"{peer[0]} | {peer[1]} |")
    notes = sorted({n for r in rec["rows"] for n in r["notes"]})
    return "\n".join(lines + [""] + [f"- {n}" for n in rec["notes"] + notes])


def _gain(r: dict[str, Any]) -> str:
    """the gain, and the range of the runs' own where there are several"""
    runs = r.get("gain_runs") or []
    return _f(r["gain"], ".2f", "x") + (f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else "")


def _how(r: dict[str, Any]) -> str:
    n = len(r.get("gain_runs") or [])
    return f"median of {n} runs' own ratios" if n > 1 else "one run" if n else "ratio of the medians"


def _at(rec, kv: str, ctx: int, b: int) -> dict[str, Any] | None:
    return next((r for r in rec["rows"] if (r["kv_dtype"], r["context"], r["batch"]) == (kv, ctx, b)), None)


def targets(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """The batching issue's targets, for the points this run measured."""
    base = rec["model"]["kv_dtype"]
    out = []
    r8, r1 = _at(rec, base, 256, 8), _at(rec, base, 256, 1)
    if r8 and r1 and r8["gain"]:
        out.append({"target": f"batch 8 at 256 tokens: aggregate tokens/s >= {GAIN_AT_256}x batch 1's",
                    "value": r8["gain"], "met": r8["gain"] >= GAIN_AT_256, "how": _how(r8)})
        step = r8["step_ratio"]
        out.append({"target": f"batch 8 at 256 tokens: step time <= {STEP_AT_256}x batch 1's", "value": step,
                    "met": step <= STEP_AT_256, "how": _how(r8)})
    r8 = _at(rec, base, 4096, 8)
    if r8 and r8["gain"] and r8["roofline"]["gain"]:
        share = r8["roofline"]["gain"] / r8["gain"]
        out.append({"target": f"batch 8 at 4096 tokens: the roofline's gain over ours <= {ROOF_AT_4096}",
                    "value": share, "met": share <= ROOF_AT_4096, "how": _how(r8)})
    f8 = _at(rec, "fp8", 4096, 8)
    if r8 and f8 and r8["gain"] and f8["gain"] and base != "fp8":
        share = f8["gain"] / r8["gain"]
        out.append({"target": f"batch 8 at 4096 tokens: the fp8 cache's gain >= {FP8_GAIN}x the {base} cache's",
                    "value": share, "met": share >= FP8_GAIN, "how": f"the two gains' ratio, each the {_how(f8)}"})
    for r in rec["rows"]:
        v = r["peers"].get("vllm")
        if v and v["aggregate_tok_s"] and r["aggregate_tok_s"]:
            out.append({"target": f"{r['kv_dtype']} context {r['context']} batch {r['batch']}: aggregate tokens/s "
                                  f">= the vLLM server's ({v['aggregate_tok_s']:.1f})",
                        "value": r["aggregate_tok_s"] / v["aggregate_tok_s"],
                        "met": r["aggregate_tok_s"] >= v["aggregate_tok_s"]})
    return out


def target_lines(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return "- none measured (they need batch 1 and 8 at contexts 256 and 4096)"
    return "\n".join(f"- {'met' if c['met'] else 'MISSED'}: {c['target']} (measured {c['value']:.3g}"
                     + (f"; {c['how']})" if c.get("how") else ")") for c in checks)


# ---- plots ------------------------------------------------------------------------------------
def _series(rec: dict[str, Any]):
    """(kv, context, batches, ours, roofline) per line of the plot."""
    keys = sorted({(r["kv_dtype"], r["context"]) for r in rec["rows"]})
    for kv, ctx in keys:
        rows = sorted((r for r in rec["rows"] if (r["kv_dtype"], r["context"]) == (kv, ctx)), key=lambda r: r["batch"])
        yield kv, ctx, [r["batch"] for r in rows], [r["aggregate_tok_s"] for r in rows], \
            [r["roofline"]["tok_s"] for r in rows]


def write_png(path: Path, rec: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = sorted({r["kv_dtype"] for r in rec["rows"]})
    fig, axes = plt.subplots(1, len(kvs), figsize=(5.5 * len(kvs), 4.2), dpi=90, squeeze=False)
    for ax, kv in zip(axes[0], kvs):
        for k, ctx, bs, ours, roof in _series(rec):
            if k != kv:
                continue
            line, = ax.plot(bs, ours, marker="o", label=f"{ctx:,} tokens")
            ax.plot(bs, roof, linestyle="--", color=line.get_color(), alpha=0.7)
        ax.set(xscale="log", yscale="log", xlabel="conversations in the batch (B)", ylabel="aggregate tokens/s",
               title=f"{kv} cache: measured (solid), roofline (dashed)")
        batches = sorted({r["batch"] for r in rec["rows"]})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, title="context")
    m = rec["model"]
    fig.suptitle(f"{m['model']} · {m['dtype']} on {m['device']} · {rec['threads']} thread(s) · "
                 f"{rec['bandwidth']['gb_s']} GB/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def terminal_plot(rec: dict[str, Any], width: int = 72) -> str:
    """Aggregate tokens/s against B, one line per context (the model's KV dtype), roofline as dots."""
    base = rec["model"]["kv_dtype"]
    title = f"aggregate tokens/s vs batch ({base} cache; '.' the roofline)"
    try:
        import plotext as plt
    except ImportError:
        return "\n".join([title] + [f"{ctx:>6}: " + " ".join(f"B{b}={y:.0f}" for b, y in zip(bs, ys) if y)
                                    for kv, ctx, bs, ys, _ in _series(rec) if kv == base])
    plt.clear_figure()
    plt.theme("clear")
    plt.plotsize(width, 18)
    markers = iter("ox+*#@")
    batches = sorted({r["batch"] for r in rec["rows"]})
    for kv, ctx, bs, ys, roof in _series(rec):
        if kv != base:
            continue
        plt.plot(bs, [y or 0 for y in ys], label=f"{ctx} tokens", marker=next(markers, "o"))
        plt.plot(bs, roof, marker=".")
    plt.xscale("log")
    plt.yscale("log")
    plt.xticks(batches, [str(b) for b in batches])
    plt.title(title)
    return plt.uncolorize(plt.build())


