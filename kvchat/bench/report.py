"""What `kvchat bench` measured, summarised: statistics, the Markdown tables, the JSON
record, the PNG plot and the in-terminal plot.

The data: `Timing` is one generation's clock readings (ours or a peer's); `Series` gathers
the timings of one mode or peer at one context length over every run. Decode figures are
the median and p10/p90 over every timed step of every run; prefill and TTFT figures are the
median over runs. No torch here: the numbers arrive as plain floats.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The series a run can hold, in table and legend order: key -> label.
SERIES = {
    "kvchat": "kvchat, KV cache",
    "kvchat_nocache": "kvchat, cache off",
    "kvchat_fp8": "kvchat, fp8 KV cache",
    "transformers": "transformers generate",
    "llama_cpp_f32": "llama.cpp F32 (same weights)",
    "llama_cpp_bf16": "llama.cpp BF16 (same weights)",
    "llama_cpp": "llama.cpp Q4_1 (4-bit file)",
    "vllm": "vLLM server",
}
LLAMA_CPP_SERIES = ("llama_cpp_f32", "llama_cpp_bf16", "llama_cpp")
DECODE_TARGET = 0.5       # our decode ms/token <= 0.5 x transformers', at 1k and 4k
PREFILL_TARGET = 1.0      # our prefill tokens/s >= transformers', at 1k and 4k
REUSE_TARGET = 30.0       # transformers re-prefill TTFT / ours with reuse >= 30, after 4k
FLOOR_TARGET = 2.0        # our decode ms/token <= 2 x the memory floor, at 4k
FP8_TARGET = 1.1          # fp8-cache decode ms/token <= 1.1 x the fp32 cache's, at 4k


@dataclass(frozen=True, slots=True)
class Timing:
    """One generation: the prompt forward, the first token, and each timed decode step."""
    prompt_tokens: int
    prefill_ms: float              # the prompt's forward pass (and, for ours, rendering and block claims)
    ttft_ms: float                 # from the call to the first token
    decode_ms: tuple[float, ...]   # one per decode step after the first token


@dataclass(slots=True)
class Series:
    """One mode or peer at one context length, over every run."""
    decode_ms: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    prefill_tokens: int = 0
    ttft_reuse_ms: list[float] = field(default_factory=list)   # the next turn, reusing the cached history
    ttft_reset_ms: list[float] = field(default_factory=list)   # the next turn, recomputing the whole history
    kv: dict[str, int] = field(default_factory=dict)           # bytes held after the first turn
    next_turn: dict[str, int] = field(default_factory=dict)    # the follow-up's prompt, reused and computed tokens
    notes: list[str] = field(default_factory=list)             # skipped, failed, stopped early

    def add(self, t: Timing) -> None:
        self.decode_ms.extend(t.decode_ms)
        self.prefill_ms.append(t.prefill_ms)
        self.prefill_tokens = t.prompt_tokens

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    @property
    def decode(self) -> float | None:
        return median(self.decode_ms)

    @property
    def prefill_tok_s(self) -> float | None:
        ms = median(self.prefill_ms)
        return 1000.0 * self.prefill_tokens / ms if ms else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "decode_ms": spread(self.decode_ms), "prefill_ms": spread(self.prefill_ms),
            "prefill_tokens": self.prefill_tokens, "prefill_tok_s": rnd(self.prefill_tok_s),
            "ttft_reuse_ms": spread(self.ttft_reuse_ms), "ttft_reset_ms": spread(self.ttft_reset_ms),
            "kv": dict(self.kv), "next_turn": dict(self.next_turn), "notes": list(self.notes),
            "decode_ms_samples": [round(x, 3) for x in self.decode_ms],
        }


# ---- statistics ----------------------------------------------------------------------------
def percentile(xs: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float | None:
    return percentile(xs, 50)


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": rnd(median(xs)), "p10": rnd(percentile(xs, 10)), "p90": rnd(percentile(xs, 90)), "n": len(xs)}


def rnd(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# ---- summary and targets ------------------------------------------------------------------
def summarise(results: dict[int, dict[str, Series]], floor: dict[str, Any] | None = None,
              same_weights: str | None = None) -> dict[str, dict[str, float | None]]:
    """The ratios the targets name, keyed by context length as a string. `floor` is the
    run's memory floor (see `floors`); without it `floor_ratio` stays empty. `same_weights`:
    the llama.cpp series on kvchat's own weights in its precision, for
    decode_ratio_vs_llama_cpp (kvchat's decode ms/token over that column's)."""
    out: dict[str, dict[str, float | None]] = {
        "decode_ratio_vs_hf": {}, "prefill_ratio_vs_hf": {}, "reuse_ttft_speedup_vs_hf": {},
        "floor_ratio": {}, "fp8_ratio_vs_fp32": {}, "decode_ratio_vs_llama_cpp": {}}
    floor_ms = {row["context"]: row for row in floors(results, floor)} if floor else {}
    for ctx, row in results.items():
        ours, hf, fp8 = row.get("kvchat"), row.get("transformers"), row.get("kvchat_fp8")
        key = str(ctx)
        if ours is not None and ctx in floor_ms:
            out["floor_ratio"][key] = rnd(ratio(ours.decode, floor_ms[ctx]["floor_ms"]), 4)
        if ours is not None and fp8 is not None and fp8.decode_ms:
            out["fp8_ratio_vs_fp32"][key] = rnd(ratio(fp8.decode, ours.decode), 4)
        same = row.get(same_weights) if same_weights else None
        if ours is not None and same is not None and same.decode_ms:
            out["decode_ratio_vs_llama_cpp"][key] = rnd(ratio(ours.decode, same.decode), 4)
        if ours is None or hf is None:
            continue
        out["decode_ratio_vs_hf"][key] = rnd(ratio(ours.decode, hf.decode), 4)
        out["prefill_ratio_vs_hf"][key] = rnd(ratio(ours.prefill_tok_s, hf.prefill_tok_s), 4)
        out["reuse_ttft_speedup_vs_hf"][key] = rnd(ratio(median(hf.ttft_reset_ms), median(ours.ttft_reuse_ms)), 4)
    return out


def floors(results: dict[int, dict[str, Series]], floor: dict[str, Any]) -> list[dict[str, Any]]:
    """Per context: the bytes one decode step reads (weights, and the cache at the mean
    length of the timed steps) and the floor, those bytes over the measured bandwidth.
    floor: {"gb_s", "weight_bytes", "new_tokens"}."""
    rows = []
    bw = floor["gb_s"] * 1e9 / 1000        # bytes per ms
    for ctx, row in results.items():
        out: dict[str, Any] = {"context": ctx, "weight_bytes": floor["weight_bytes"]}
        for key, name in (("kvchat", "cache"), ("kvchat_fp8", "fp8_cache")):
            kv = row[key].kv if key in row else {}
            if not kv:
                continue
            per_token = kv["bytes_per_token"]          # fp8's scales included, as every kvchat figure
            mean_tokens = kv["tokens_held"] - floor["new_tokens"] / 2   # the timed steps' mean length
            out[f"{name}_bytes"] = int(per_token * mean_tokens)
            out[f"{name}_floor_ms" if name != "cache" else "floor_ms"] = rnd(
                (floor["weight_bytes"] + out[f"{name}_bytes"]) / bw)
        if "floor_ms" in out:
            rows.append(out)
    return rows


def targets(summary: dict[str, dict[str, float | None]], kv_dtype: str = "fp32") -> list[dict[str, Any]]:
    """The issue's targets, checked wherever the run has the context they name. kv_dtype: the
    run's own cache, which fp8's is measured against (the summary's fp8_ratio_vs_fp32 keeps its
    name from when that was always fp32)."""
    checks = []
    for key, value in summary["decode_ratio_vs_hf"].items():
        if int(key) >= 1024:
            checks.append(_check(f"decode ms/token at {key} <= {DECODE_TARGET} x transformers", value,
                                 value is not None and value <= DECODE_TARGET))
    for key, value in summary["prefill_ratio_vs_hf"].items():
        if int(key) >= 1024:
            checks.append(_check(f"prefill tokens/s at {key} >= transformers'", value,
                                 value is not None and value >= PREFILL_TARGET))
    for key, value in summary["reuse_ttft_speedup_vs_hf"].items():
        if int(key) >= 4096:
            checks.append(_check(f"TTFT with reuse after {key} >= {REUSE_TARGET:g} x faster than re-prefill",
                                 value, value is not None and value >= REUSE_TARGET))
    for key, value in summary.get("floor_ratio", {}).items():
        if int(key) >= 4096:
            checks.append(_check(f"decode ms/token at {key} <= {FLOOR_TARGET:g} x the memory floor", value,
                                 value is not None and value <= FLOOR_TARGET))
    for key, value in summary.get("fp8_ratio_vs_fp32", {}).items():
        if int(key) >= 4096:
            checks.append(_check(f"fp8-cache decode at {key} <= {FP8_TARGET:g} x the {kv_dtype} cache's", value,
                                 value is not None and value <= FP8_TARGET))
    return checks


def _check(name: str, value: float | None, met: bool) -> dict[str, Any]:
    return {"target": name, "value": value, "met": met}


# ---- Markdown ------------------------------------------------------------------------------
def _ms(xs: list[float], with_spread: bool = True) -> str:
    m = median(xs)
    if m is None:
        return "–"
    if not with_spread or len(xs) < 2:
        return f"{m:.1f}"
    return f"{m:.1f} ({percentile(xs, 10):.1f}–{percentile(xs, 90):.1f})"


def _missing(s: Series | None) -> str:
    return "failed" if s is not None and any("failed" in n for n in s.notes) else "skipped"


def _x(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}×"


def _mib(n: int | None) -> str:
    return "–" if not n else f"{n / 2**20:.1f} MiB"


def label(key: str, meta: dict[str, Any] | None = None) -> str:
    """A series' name; a llama.cpp column names its file's precision as the file itself says."""
    files = ((meta or {}).get("llama_cpp") or {}).get("files", {})
    prec = files.get(key, {}).get("precision")
    if key not in LLAMA_CPP_SERIES or not prec or prec == "?":
        return SERIES[key]
    if key != "llama_cpp":
        return f"llama.cpp {prec} (same weights)"
    bits = re.match(r"I?Q(\d+)", prec)       # Q4_1, Q8_0, IQ2_XS: quantized to that many bits
    return f"llama.cpp {prec} ({bits[1]}-bit file)" if bits else f"llama.cpp {prec} (its own file)"


def markdown(results: dict[int, dict[str, Series]], meta: dict[str, Any], summary: dict) -> str:
    runs, steps = meta["runs"], meta["new_tokens"]
    keys = [k for k in SERIES if any(k in row for row in results.values())]
    same = summary.get("decode_ratio_vs_llama_cpp") or {}
    extra = " kvchat ÷ llama.cpp (same weights) |" if same else ""
    lines = [f"Decode, ms/token: median (p10–p90) over {runs} run(s) × {steps} tokens; "
             f"cache off over {runs} run(s) × {meta['nocache_tokens']} tokens",
             "", "| context | " + " | ".join(label(k, meta) for k in keys) + " | kvchat ÷ transformers |" + extra,
             "|---:|" + "---:|" * (len(keys) + 1 + bool(same))]
    for ctx, row in results.items():
        cells = [_ms(row[k].decode_ms) if k in row and row[k].decode_ms else _missing(row.get(k)) for k in keys]
        lines.append(f"| {ctx} | " + " | ".join(cells) + f" | {_x(summary['decode_ratio_vs_hf'].get(str(ctx)))} |"
                     + (f" {_x(same.get(str(ctx)))} |" if same else ""))

    lines += ["", f"New turn after the history, TTFT ms (median of {runs} run(s)); prefill tokens/s of the first turn",
              "", "| context | kvchat TTFT, prefix reuse | kvchat TTFT, after reset | transformers TTFT, re-prefill "
              "| reuse speed-up | kvchat prefill tok/s | transformers prefill tok/s | prefill ratio |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for ctx, row in results.items():
        ours, hf = row.get("kvchat", Series()), row.get("transformers", Series())
        k = str(ctx)
        pf_ours = f"{ours.prefill_tok_s:,.0f}" if ours.prefill_tok_s else "–"
        pf_hf = f"{hf.prefill_tok_s:,.0f}" if hf.prefill_tok_s else "–"
        lines.append(f"| {ctx} | {_ms(ours.ttft_reuse_ms, False)} | {_ms(ours.ttft_reset_ms, False)} | "
                     f"{_ms(hf.ttft_reset_ms, False)} | {_x(summary['reuse_ttft_speedup_vs_hf'].get(k), 1)} | "
                     f"{pf_ours} | {pf_hf} | {_x(summary['prefill_ratio_vs_hf'].get(k))} |")

    if any("vllm" in row for row in results.values()):
        lines += ["", "vLLM server (--server), timed at the client: TTFT ms of the new turn (median)", "",
                  "| context | with its prefix cache | tokens it reused | after /reset_prefix_cache |", "|---:|---:|---:|---:|"]
        for ctx, row in results.items():
            v = row.get("vllm", Series())
            lines.append(f"| {ctx} | {_ms(v.ttft_reuse_ms, False)} | {v.next_turn.get('reused_tokens', '–')} | "
                         f"{_ms(v.ttft_reset_ms, False)} |")

    bpt = meta["model"]["kv_bytes_per_token"]
    lines += ["", f"KV bytes held after the first turn ({bpt:,} B/token in {meta['model']['kv_dtype']}; "
              "fp8 adds one fp32 scale per token and KV head)", "",
              "| context | tokens held | bytes used | bytes allocated (whole blocks) | fp8 bytes used (of it scales) |",
              "|---:|---:|---:|---:|---:|"]
    for ctx, row in results.items():
        kv = row.get("kvchat", Series()).kv
        fp8 = row.get("kvchat_fp8", Series()).kv
        fp8_cell = f"{fp8['bytes_used']:,} ({fp8['scale_bytes']:,})" if fp8 else "–"
        lines.append(f"| {ctx} | {kv.get('tokens_held', 0):,} | {kv.get('bytes_used', 0):,} ({_mib(kv.get('bytes_used'))}) "
                     f"| {kv.get('bytes_allocated', 0):,} | {fp8_cell} |")

    lines += floor_table(results, meta, summary)

    notes = [f"- {ctx}, {label(k, meta)}: {n}" for ctx, row in results.items() for k, s in row.items() for n in s.notes]
    notes += [f"- {n}" for n in meta.get("notes", [])]
    if notes:
        lines += ["", "Notes:"] + notes
    return "\n".join(lines)


def _mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.0f} MB"


def floor_table(results: dict[int, dict[str, Series]], meta: dict[str, Any], summary: dict) -> list[str]:
    floor = meta.get("floor")
    if not floor:
        return []
    bw = floor["bandwidth"]
    per_token = meta["model"]["kv_bytes_per_token"]
    lines = ["", f"The memory floor: one decode step reads every weight and the whole cache once; at the read "
             f"bandwidth measured in this run ({bw['gb_s']:.1f} GB/s, the median of {len(bw['samples_ms'])} "
             f"sums ({bw.get('reader', 'torch.sum')}) over a {bw['buffer_bytes'] / 2**20:,.0f} MiB buffer taken before, between and after the "
             f"contexts; fastest {bw['fastest_gb_s']:.1f}, slowest {bw['slowest_gb_s']:.1f} GB/s) "
             f"that takes at least the floor. The cache read equals the weight read at "
             f"{floor['weight_bytes'] / per_token:,.0f} tokens ({meta['model']['kv_dtype']}).", "",
             "| context | weights read | cache read | floor ms | kvchat ms | kvchat ÷ floor | transformers ÷ floor "
             f"| fp8 cache read | fp8 floor ms | kvchat fp8 ms | fp8 ÷ floor | fp8 ÷ {meta['model']['kv_dtype']} cache |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f in floors(results, {**floor, "gb_s": bw["gb_s"], "new_tokens": meta["new_tokens"]}):
        ctx = f["context"]
        row = results[ctx]
        ours, hf, fp8 = (row.get(k) for k in ("kvchat", "transformers", "kvchat_fp8"))
        hf_x = ratio(hf.decode, f["floor_ms"]) if hf is not None else None
        fp8_ms = fp8.decode if fp8 is not None else None
        lines.append(f"| {ctx} | {_mb(f['weight_bytes'])} | {_mb(f.get('cache_bytes'))} | {f['floor_ms']:.1f} | "
                     f"{_ms(ours.decode_ms, False) if ours else '–'} | {_x(summary['floor_ratio'].get(str(ctx)))} | "
                     f"{_x(hf_x)} | {_mb(f.get('fp8_cache_bytes'))} | "
                     f"{'–' if f.get('fp8_cache_floor_ms') is None else format(f['fp8_cache_floor_ms'], '.1f')} | "
                     f"{'–' if fp8_ms is None else format(fp8_ms, '.1f')} | "
                     f"{_x(ratio(fp8_ms, f.get('fp8_cache_floor_ms')))} | "
                     f"{_x(summary['fp8_ratio_vs_fp32'].get(str(ctx)))} |")
    return lines


def target_lines(checks: list[dict[str, Any]]) -> str:
    return "\n".join(f"- {'met' if c['met'] else 'MISSED'}: {c['target']} (measured "
                     f"{'–' if c['value'] is None else format(c['value'], '.3g')})" for c in checks)


# ---- JSON ------------------------------------------------------------------------------------
def record(results: dict[int, dict[str, Series]], meta: dict[str, Any], summary: dict) -> dict[str, Any]:
    return {
        **meta,
        "contexts": {str(ctx): {k: s.to_dict() for k, s in row.items()} for ctx, row in results.items()},
        "summary": summary,
        "targets": targets(summary, meta["model"]["kv_dtype"]),
    }


def write_json(path: Path, rec: dict[str, Any]) -> None:
    path.write_text(json.dumps(rec, indent=2) + "\n", encoding="utf-8")


# ---- plots -----------------------------------------------------------------------------------
def _lines(results: dict[int, dict[str, Series]]):
    """(key, contexts, decode medians, p10s, p90s) for each series that has decode data."""
    for key in SERIES:
        pts = [(ctx, row[key]) for ctx, row in results.items() if key in row and row[key].decode_ms]
        if pts:
            yield (key, [c for c, _ in pts], [s.decode for _, s in pts],
                   [percentile(s.decode_ms, 10) for _, s in pts], [percentile(s.decode_ms, 90) for _, s in pts])


def write_png(path: Path, results: dict[int, dict[str, Series]], meta: dict[str, Any]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    for key, xs, ys, lo, hi in _lines(results):
        line, = ax1.plot(xs, ys, marker="o", label=label(key, meta))
        ax1.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    ax1.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per token",
            title=f"decode: median, p10–p90 band\n{meta['runs']} run(s) × {meta['new_tokens']} tokens "
                  f"(cache off: × {meta['nocache_tokens']})")
    ttft = [("kvchat", "ttft_reuse_ms", "kvchat, prefix reuse"), ("kvchat", "ttft_reset_ms", "kvchat, after reset"),
            ("transformers", "ttft_reset_ms", "transformers, re-prefill")]
    ttft += [(k, "ttft_reset_ms", f"{label(k, meta)}, re-prefill") for k in LLAMA_CPP_SERIES]
    for key, attr, name in ttft:
        pts = [(ctx, median(getattr(row[key], attr))) for ctx, row in results.items()
               if key in row and getattr(row[key], attr)]
        if pts:
            ax2.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name)
    ax2.set(xscale="log", yscale="log", xlabel="history (tokens)", ylabel="ms",
            title=f"TTFT of the next turn\nmedian of {meta['runs']} run(s)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(results), [str(c) for c in results])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = meta["model"]
    fig.suptitle(f"{m['model']} · {m['dtype']} on {m['device']} · {meta['threads']} thread(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def terminal_plot(results: dict[int, dict[str, Series]], meta: dict[str, Any], width: int = 72) -> str:
    """Decode ms/token against context, drawn in text (plotext), for the terminal."""
    title = f"decode ms/token vs context (median of {meta['runs']} run(s) × {meta['new_tokens']} tokens)"
    try:
        import plotext as plt
    except ImportError:
        return sparklines(results, title)
    plt.clear_figure()
    plt.theme("clear")
    plt.plotsize(width, 18)
    markers = itertools.cycle("ox+*#")
    for key, xs, ys, _, _ in _lines(results):
        plt.plot(xs, ys, label=label(key, meta), marker=next(markers))
    plt.xscale("log")
    plt.xticks(list(results), [str(c) for c in results])
    plt.title(title)
    return plt.uncolorize(plt.build())


def sparklines(results: dict[int, dict[str, Series]], title: str) -> str:
    bars = "▁▂▃▄▅▆▇█"
    all_ys = [y for _, _, ys, _, _ in _lines(results) for y in ys]
    top = max(all_ys, default=1.0)
    out = [title]
    for key, _, ys, _, _ in _lines(results):
        spark = "".join(bars[min(len(bars) - 1, int(y / top * (len(bars) - 1)))] for y in ys)
        out.append(f"{SERIES[key]:<24} {spark}  " + " ".join(f"{y:.1f}" for y in ys))
    return "\n".join(out)
