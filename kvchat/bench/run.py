"""`kvchat bench`: decode latency, TTFT and KV bytes against context length, next to the peers.

For each context length C and each run, on one deterministic C-token history (a system
prompt, then numbered notes the model is asked to repeat, so that it keeps talking):

  kvchat, KV cache   turn 1: prefill the C tokens, then N timed decode steps;
                     turn 2: a short follow-up, TTFT with the history's blocks reused;
                     reset_cache(), then the same turn 2 again: TTFT recomputing everything.
  kvchat, cache off  turn 1 with every step recomputing the whole sequence
                     (only up to --skip-nocache-above, over --nocache-tokens steps).
  kvchat, fp8 KV     turn 1 and turn 2 with the pool rebuilt as float8 e4m3 plus scales.
  transformers       `generate` on the same turn-1 ids, then on the same turn-2 ids.
  llama.cpp          the same, when llama-cpp-python is installed, on the GGUF files --llama-cpp
                     names: F32 or BF16 exports of the safetensors kvchat loads (gguf_export.py;
                     by default the one in kvchat's own precision) and the bundled Q4_1 file.

The engine is driven only through its public API (Engine, Conversation.send, TurnStats).
The history is built in history.py, the peers run in peers.py, and statistics, tables, JSON
and plots are in report.py.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.engine.errors import KvchatError

from . import floor as bench_floor
from . import peers as bench_peers
from . import report as bench_report
from .flags import output_path, parse_contexts, parse_llama_cpp
from .history import FOLLOW_UP, SYSTEM, history
from .machine import busy_note, checkout_commit, gpu_name, load_average
from .report import Series, Timing
from ..cli.args import UsageError, add_model_args, int_at_least, positive_int

if TYPE_CHECKING:
    from .server_peer import VllmPeer

DEFAULT_CONTEXTS = (256, 1024, 4096)
NEXT_TURN_MARGIN = 64   # positions the follow-up turn adds beyond the reply

METHOD = {
    "decode": "per-token latency of each decode step after the first token: kvchat's TokenEvent.latency_ms; "
              "transformers: the gaps between its generate() streamer calls (its own loop, DynamicCache); "
              "llama.cpp: the gaps between tokens yielded by Llama.generate",
    "prefill": "first turn's prompt forward: kvchat PrefillEvent.prefill_ms over computed tokens; transformers "
               "from the streamer's prompt call to its first token",
    "ttft": "next turn after the history: kvchat with prefix reuse, and after reset_cache() (full recomputation); "
            "transformers and llama.cpp re-prefilling the whole re-rendered chat",
    "statistics": "decode: median, p10, p90 over every timed step of every run; prefill and TTFT: median over runs",
}


# ---- arguments -----------------------------------------------------------------------------
MAX_RUNS = 1000          # a median over more says nothing new; each run is minutes on a CPU

def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="decode latency, TTFT and KV bytes against context length, "
                                            "next to transformers and llama.cpp")
    add_model_args(p)
    p.add_argument("--contexts", default=",".join(map(str, DEFAULT_CONTEXTS)),
                   help="comma-separated history lengths in tokens (default 256,1024,4096)")
    p.add_argument("--new-tokens", type=positive_int("--new-tokens"), default=32,
                   help="timed decode steps per turn (default 32)")
    p.add_argument("--runs", type=positive_int("--runs", MAX_RUNS), default=3,
                   help=f"repetitions; figures are medians (default 3, at most {MAX_RUNS})")
    p.add_argument("--json", default=None, metavar="FILE", help="write the full record as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a PNG plot")
    p.add_argument("--no-peers", action="store_true", help="measure kvchat only (no transformers, no llama.cpp)")
    p.add_argument("--no-llama-cpp", action="store_true",
                   help="skip the llama.cpp peer even when llama-cpp-python is installed (its spinning threads "
                        "crawl on a machine whose cores are busy)")
    p.add_argument("--llama-cpp", default=None, metavar="FILES",
                   help="the GGUF files llama.cpp runs, comma-separated from f32, bf16 (exports of the weights kvchat "
                        "loads, cached beside them) and q4_1 (the bundled 4-bit file); default: the export in "
                        "kvchat's --dtype, and q4_1")
    p.add_argument("--skip-nocache-above", type=int_at_least("--skip-nocache-above", 0), default=1024, metavar="N",
                   help="run the cache-off baseline only for contexts up to N tokens (default 1024; 0: never)")
    p.add_argument("--nocache-tokens", type=positive_int("--nocache-tokens"), default=8,
                   help="timed steps for the cache-off baseline (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated history text (default 0)")
    p.add_argument("--busy", type=positive_int("--busy"), default=None, metavar="N",
                   help="instead of the table: decode at the first context alone and beside N busy processes, "
                        "round after round, and report the slowdown (median and p90)")
    p.add_argument("--batch", default=None, metavar="B,B,...",
                   help="batch sizes, e.g. 1,2,4,8,16: measure conversations decoding together instead "
                        "(aggregate tokens/s against B and context, beside the roofline; kvchat/bench/batch.py)")
    return p


@dataclass(slots=True)
class BenchConfig:
    contexts: tuple[int, ...]
    new_tokens: int
    runs: int
    json_path: Path | None
    plot_path: Path | None
    peers: bool
    llama_cpp: bool
    nocache_max: int
    nocache_tokens: int
    seed: int
    llama_cpp_files: tuple[str, ...] | None = None    # --llama-cpp; None: chosen by the engine's dtype

    @classmethod
    def from_args(cls, args) -> BenchConfig:
        files = getattr(args, "llama_cpp", None)
        if files is not None:
            if args.no_llama_cpp or args.no_peers:
                raise UsageError(f"--llama-cpp {files!r} with --{'no-peers' if args.no_peers else 'no-llama-cpp'}: "
                                 "choose one")
            files = parse_llama_cpp(files)
        return cls(parse_contexts(args.contexts), args.new_tokens, args.runs,
                   output_path("--json", args.json), output_path("--plot", args.plot, ".png"),
                   not args.no_peers, not args.no_llama_cpp, args.skip_nocache_above, args.nocache_tokens, args.seed,
                   files)

    def command(self, args) -> str:
        parts = ["kvchat", "bench", "--contexts", ",".join(map(str, self.contexts)),
                 "--new-tokens", str(self.new_tokens), "--runs", str(self.runs)]
        for flag in ("model", "device", "dtype", "kv_dtype", "threads"):
            value = getattr(args, flag, None)
            if value not in (None, "auto"):
                parts += [f"--{flag.replace('_', '-')}", str(value)]
        if args.random_weights:
            parts.append("--random-weights")
        if not self.peers:
            parts.append("--no-peers")
        elif not self.llama_cpp:
            parts.append("--no-llama-cpp")
        elif self.llama_cpp_files:
            parts += ["--llama-cpp", ",".join(self.llama_cpp_files)]
        if getattr(args, "server", None):
            parts += ["--server", args.server]
        return " ".join(parts)


# ---- driving the engine ---------------------------------------------------------------------
def finish(events):
    """Run a turn to its end; return its TurnStats."""
    from kvchat.engine import TurnStats
    stats = None
    for ev in events:
        if isinstance(ev, TurnStats):
            stats = ev
    return stats


class Bench:
    """The measurement loop. Built before anything is printed, so that a history the
    template cannot fit is refused in one line."""

    def __init__(self, cfg: BenchConfig, engine) -> None:
        self.cfg, self.engine = cfg, engine
        self.hf: bench_peers.HFPeer | None = None           # the peers, when measured
        self.llama: dict[str, bench_peers.LlamaCppPeer] = {}   # series key -> peer, one per GGUF file
        self.server: VllmPeer | None = None                 # a vLLM server (--server)
        self.probe: bench_floor.BandwidthProbe | None = None   # sampled before each context
        self.base_kv = engine.kv_dtype
        self.fit = fit = usable_history(engine, cfg)
        self.cut = {ctx: fit for ctx in cfg.contexts if ctx > fit}  # contexts shortened to fit
        # the first run's histories now (a context too short for the template is refused before
        # any measurement); later runs' when they come, so many runs start at once
        self._first = {ctx: self.history_of(ctx, 0) for ctx in cfg.contexts}
        self.t0 = time.perf_counter()

    def history_of(self, ctx: int, run: int) -> tuple[str, list[int]]:
        return history(self.engine.render, self.engine.tokenizer, min(ctx, self.fit),
                       self.cfg.seed + 1000 * run + ctx)

    def say(self, text: str) -> None:
        print(f"kvchat bench [{time.perf_counter() - self.t0:6.0f}s] {text}", file=sys.stderr, flush=True)

    def ours(self, text: str, steps: int, s: Series, next_turn: str, mode: str = "cache") -> list[int] | None:
        """Turn 1 (timed prefill and decode); with next_turn 'reuse' or 'both', turn 2 with
        reuse, and with 'both' turn 2 again after reset_cache(). Returns turn 2's ids."""
        from kvchat.engine import SamplingParams
        eng = self.engine
        conv = eng.new_conversation(system_prompt=SYSTEM)
        try:
            if mode == "off":
                conv.set_mode("off")
            first = finish(conv.send(text, SamplingParams(max_tokens=steps + 1)))
            s.add(Timing(first.computed_tokens, first.prefill_ms, first.ttft_ms, first.decode_ms))
            if first.reused_tokens:
                s.note(f"turn 1 reused {first.reused_tokens} cached tokens; its prefill is not a full one")
            if len(first.decode_ms) < steps:
                s.note(f"the reply stopped ({first.stop_reason}) after {len(first.decode_ms)} of {steps} timed steps")
            if mode == "cache":
                c = first.cache
                s.kv = {"tokens_held": c.tokens_held, "bytes_per_token": c.bytes_per_token,
                        "bytes_used": c.bytes_used, "bytes_allocated": c.bytes_allocated,
                        "blocks_used": c.blocks_used, "block_size": c.block_size,
                        "scale_bytes": c.tokens_held * (c.scale_bytes_per_token or 0)}   # of bytes_used
            if next_turn == "none":
                return None
            second = finish(conv.send(FOLLOW_UP, SamplingParams(max_tokens=1)))
            s.ttft_reuse_ms.append(second.ttft_ms)
            s.next_turn = {"prompt_tokens": second.prompt_tokens, "reused_tokens": second.reused_tokens,
                           "computed_tokens": second.computed_tokens}
            ids = conv.render(conv.messages[:-1])
            if next_turn == "both":
                conv.reset_cache()
                again = finish(conv.regenerate(SamplingParams(max_tokens=1)))
                s.ttft_reset_ms.append(again.ttft_ms)
            return ids
        finally:
            conv.reset_cache()       # forget its blocks, so no later turn 1 reuses them
            eng.close_conversation(conv)

    def peer(self, peer, ids1: list[int], ids2: list[int] | None, steps: int, s: Series) -> None:
        s.add(peer.generate(ids1, steps))
        if ids2 is not None:
            s.ttft_reset_ms.append(peer.generate(ids2, 0).ttft_ms)

    def context(self, ctx: int, run: int, steps: int, row: dict[str, Series], warmup: bool = False) -> None:
        cfg, eng = self.cfg, self.engine
        text, ids1 = self._first.pop(ctx) if run == 0 and ctx in self._first else self.history_of(ctx, run)
        tag = f"context {ctx}, " + ("warm-up:" if warmup else f"run {run + 1}/{cfg.runs}:")
        s = row.setdefault("kvchat", Series())
        if ctx in self.cut:
            s.note(f"history cut to {self.cut[ctx]:,} tokens, so that the timed reply and the next turn fit in "
                   f"the model's {eng.geometry.max_position:,} positions")
        ids2 = self.ours(text, steps, s, "both")
        self.say(f"{tag} kvchat          prefill {s.prefill_ms[-1]:8.0f} ms, decode {_med(s.decode_ms[-steps:])} "
                 f"ms/token, next turn {s.ttft_reuse_ms[-1]:.0f} ms reusing / {s.ttft_reset_ms[-1]:.0f} ms after reset")
        for key, peer in (("transformers", self.hf), *self.llama.items()):
            if peer is None:
                continue
            p = row.setdefault(key, Series())
            self.peer(peer, ids1, ids2, steps, p)
            self.say(f"{tag} {peer.name:<15} prefill {p.prefill_ms[-1]:8.0f} ms, decode {_med(p.decode_ms[-steps:])} "
                     f"ms/token, next turn {p.ttft_reset_ms[-1]:.0f} ms re-prefilling")
        if self.server is not None:
            v = row.setdefault("vllm", Series())
            self.server.measure(ids1, ids2, steps, v)
            self.say(f"{tag} vLLM server     TTFT {v.prefill_ms[-1]:8.0f} ms, decode {_med(v.decode_ms[-steps:])} "
                     f"ms/token, next turn {_med(v.ttft_reuse_ms[-1:])} ms with its prefix cache / "
                     f"{_med(v.ttft_reset_ms[-1:])} ms after reset")
        if self.base_kv != "fp8":
            f = row.setdefault("kvchat_fp8", Series())
            try:
                eng.set_kv_dtype("fp8")
                self.ours(text, steps, f, "reuse")
                self.say(f"{tag} kvchat fp8      prefill {f.prefill_ms[-1]:8.0f} ms, decode "
                         f"{_med(f.decode_ms[-steps:])} ms/token")
            except Exception as err:  # reported in the row: an fp8 failure must not lose the run
                f.note(f"fp8 KV cache failed: {type(err).__name__}: {err}")
                self.say(f"{tag} kvchat fp8      failed: {type(err).__name__}: {err}")
            finally:
                eng.set_kv_dtype(self.base_kv)
        if ctx <= cfg.nocache_max:
            n = min(steps, cfg.nocache_tokens)
            o = row.setdefault("kvchat_nocache", Series())
            self.ours(text, n, o, "none", mode="off")
            self.say(f"{tag} kvchat off      decode {_med(o.decode_ms[-n:])} ms/token")
        else:
            row.setdefault("kvchat_nocache", Series()).note(
                f"skipped: above --skip-nocache-above {cfg.nocache_max} (each step recomputes all {ctx}+ tokens)")

    def measure(self) -> dict[int, dict[str, Series]]:
        cfg = self.cfg
        self.say(f"warming up (context {cfg.contexts[0]}, 2 steps; discarded)")
        self.context(cfg.contexts[0], 0, 2, {}, warmup=True)
        results: dict[int, dict[str, Series]] = {ctx: {} for ctx in cfg.contexts}
        for run in range(cfg.runs):  # runs outermost, so slow drift on a shared machine hits every context
            for ctx in cfg.contexts:
                if self.probe is not None:
                    self.probe.sample()
                self.context(ctx, run, cfg.new_tokens, results[ctx])
        return {ctx: {k: row[k] for k in bench_report.SERIES if k in row} for ctx, row in results.items()}


def _med(xs: list[float]) -> str:
    m = bench_report.median(xs)
    return "–" if m is None else f"{m:6.1f}"


# ---- the command -----------------------------------------------------------------------------
def check_fits(engine, cfg: BenchConfig) -> None:
    """Contexts up to the model's positions are measured (the longest with its history cut so
    that the timed reply and the next turn still fit); longer ones are refused."""
    g = engine.geometry
    limit = min(g.max_position, engine.spec.capacity_tokens)
    if max(cfg.contexts) > limit or usable_history(engine, cfg) <= 0:
        what = (f"{g.name} has {g.max_position} positions" if g.max_position <= engine.spec.capacity_tokens
                else f"the KV pool holds {engine.spec.capacity_tokens} tokens (raise --kv-budget)")
        raise KvchatError(f"--contexts {max(cfg.contexts)} with --new-tokens {cfg.new_tokens} needs about "
                          f"{max(cfg.contexts) + cfg.new_tokens + NEXT_TURN_MARGIN} positions but {what}; use contexts "
                          f"up to {limit}")


def usable_history(engine, cfg: BenchConfig) -> int:
    """The longest history after which the timed reply and the next turn still fit."""
    limit = min(engine.geometry.max_position, engine.spec.capacity_tokens)
    return limit - cfg.new_tokens - NEXT_TURN_MARGIN


def run(args) -> int:
    if args.batch is not None:
        from .batch import run_batch
        return run_batch(args)
    import torch
    from kvchat.engine import Engine
    from kvchat.engine.engine import available_memory

    from ..backends.deadlines import Deadlines
    from ..cli.args import engine_config
    cfg = BenchConfig.from_args(args)
    if getattr(args, "timeouts", None):      # refused before the model loads, like every other flag
        if not getattr(args, "server", None):
            raise UsageError("--timeouts needs --server URL (it describes a vLLM server)")
        Deadlines.parse(args.timeouts)
    engine = Engine(engine_config(args))  # quietly: a bad --contexts is still refused in one line
    check_fits(engine, cfg)
    bench = Bench(cfg, engine)
    if getattr(args, "busy", None):
        return run_busy(bench, args)
    threads = torch.get_num_threads()
    d = engine.describe()
    print(f"kvchat bench: {d['model']} in {d['dtype']} on {d['device']}, KV {d['kv_dtype']}, {threads} thread(s); "
          f"contexts {', '.join(map(str, cfg.contexts))} x {cfg.runs} run(s)", file=sys.stderr, flush=True)
    notes = [f"torch threads: {threads} for kvchat and transformers (one process)"]
    if engine.device.type == "cpu":
        from kvchat.engine import native
        notes.append(f"kvchat's C kernels (engine/native.py; KVCHAT_NATIVE=0 sets them aside): {native.status()}")
        if engine.dtype_name == "bf16":
            notes.append(f"kvchat's bf16 weights: products on {native.describe_bf16()}; rows and norms in fp32, "
                         f"the cache in {engine.kv_dtype}")
    elif engine.device.type == "cuda":
        from kvchat.engine import cuda_graph
        notes.append("decode steps: " + ("one CUDA graph each, per batch-size bucket (KVCHAT_CUDA_GRAPH=0 sets "
                                         "them aside)" if cuda_graph.enabled() else "eager, kernel by kernel "
                                         "(KVCHAT_CUDA_GRAPH=0)"))
    if cfg.peers:
        bench.hf = bench_peers.HFPeer(engine.source, engine.device, engine.dtype)
        n_ctx = min(max(cfg.contexts) + 2 * cfg.new_tokens + NEXT_TURN_MARGIN, engine.geometry.max_position)
        if cfg.llama_cpp:
            if cfg.llama_cpp_files is None:
                cfg.llama_cpp_files = bench_peers.default_llama_cpp(engine.dtype_name)
            bench.llama, said = bench_peers.load_llama_cpp_files(engine.source, args.model, cfg.llama_cpp_files,
                                                                 n_ctx, threads, engine.kv_dtype)
        else:
            said = ["llama.cpp peer skipped (--no-llama-cpp)"]
        for line in said:
            notes.append(line)
            print(f"kvchat bench: {line}", file=sys.stderr, flush=True)
    else:
        notes.append("peers not measured (--no-peers)")

    if getattr(args, "server", None):
        from .server_peer import VllmPeer
        bench.server = VllmPeer.connect(args, max(cfg.contexts) + 2 * cfg.new_tokens + NEXT_TURN_MARGIN)
        notes.append(bench.server.describe())

    load0 = busy_note(notes)
    weights = bench_floor.step_weight_bytes(engine.model)
    buffer = bench_floor.probe_bytes(weights + (max(cfg.contexts) + cfg.new_tokens + NEXT_TURN_MARGIN)
                                     * engine.bytes_per_token, available_memory(engine.device))
    bench.say(f"measuring read bandwidth (sums over a {buffer / 2**20:,.0f} MiB buffer, "
              "before, between and after the contexts)")
    bench.probe = bench_floor.BandwidthProbe(buffer, engine.device)
    bench.probe.sample(5)
    try:
        results = bench.measure()
    finally:
        if bench.server is not None:
            bench.server.close()
    bench.probe.sample(5)
    bw = bench.probe.result()
    bench.probe = None  # the buffer goes
    d = bw.to_dict()
    bench.say(f"read bandwidth {bw.gb_s:.1f} GB/s (median of {len(bw.samples_ms)}; fastest {d['fastest_gb_s']:.1f}, "
              f"slowest {d['slowest_gb_s']:.1f})")

    meta = {
        "command": cfg.command(args), "model": engine.describe(), "threads": threads,
        "llama_cpp": {"files": {key: {"file": peer.gguf.name, "precision": peer.precision}
                                for key, peer in bench.llama.items()},
                      "same_weights": bench_peers.same_weights_key(engine.dtype_name, bench.llama)},
        "runs": cfg.runs, "new_tokens": cfg.new_tokens, "nocache_tokens": min(cfg.new_tokens, cfg.nocache_tokens),
        "skip_nocache_above": cfg.nocache_max, "method": METHOD, "notes": notes,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": _version(),
                     "kvchat_commit": checkout_commit()},
        "machine": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                    "load_average_before": load0, "load_average_after": load_average(), **gpu_name(engine.device)},
        "floor": {"bandwidth": bw.to_dict(), "weight_bytes": weights,
                  "method": "bytes one decode step reads (every weight once, plus the cache at the mean length of the "
                            "timed steps) over the median of timed sums (" + bw.reader + ") over a buffer larger than them, "
                            "taken before, between and after the contexts of this run"},
    }
    summary = bench_report.summarise(results, {"gb_s": bw.gb_s, "weight_bytes": weights, "new_tokens": cfg.new_tokens},
                                     meta["llama_cpp"]["same_weights"])
    try:  # the files first: minutes of measuring must survive a closed stdout (| head)
        if cfg.json_path is not None:
            bench_report.write_json(cfg.json_path, bench_report.record(results, meta, summary))
            print(f"kvchat bench: wrote {cfg.json_path}", file=sys.stderr)
        if cfg.plot_path is not None:
            bench_report.write_png(cfg.plot_path, results, meta)
            print(f"kvchat bench: wrote {cfg.plot_path}", file=sys.stderr)
    except OSError as err:
        raise KvchatError(f"cannot write the bench output: {err}") from None
    print(bench_report.markdown(results, meta, summary))
    checks = bench_report.targets(summary, meta["model"]["kv_dtype"])
    if checks:
        print("\nTargets:\n" + bench_report.target_lines(checks))
    print("\n" + bench_report.terminal_plot(results, meta))
    return 0


def run_busy(bench: Bench, args) -> int:
    """--busy N: the contention measurement (contention.py), kvchat only, at the first context."""
    from kvchat.engine import threads

    from . import contention
    ctx, busy = bench.cfg.contexts[0], args.busy
    load0 = load_average()
    row = contention.measure(bench, ctx, busy)
    s = contention.summary(row)
    print(contention.markdown(ctx, busy, s, threads.describe(), len(os.sched_getaffinity(0))
                              if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    print(f"\n1-minute load {load0} before, {load_average()} after; command: {bench.cfg.command(args)} --busy {busy}")
    return 0


def _version() -> str:
    import transformers
    return transformers.__version__
