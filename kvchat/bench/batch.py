"""`kvchat bench --batch 1,2,4,8,16`: many conversations decoding in the same steps.

For each KV dtype (the model's, and fp8), each context C and each batch size B: B users,
each with its own C-token history (the bench's numbered notes, a different seed each),
decode `--new-tokens` tokens together, every step one row per user (Engine.requests, EOS
ignored). The figures are the steps with B decode rows and no prompt chunk: their median
time (one user's ms/token), and B tokens over it (the aggregate).

The gain of B over batch 1 is a ratio of two points, on a host whose speed can move a
quarter within a minute (session 27: batch 1 at 256 tokens 14.1 ms a step in one pass, 17.8
in the next, batch 8 22.4 in both; session 29: batch 1 at 4,096 tokens 18-28 ms from run to
run of the same bench). So the batch sizes of a context take turns over the same cached users:
the largest batch's histories are prefilled once, then blocks of BLOCK steps run with the
first B users decoding and the rest held (Engine.hold), every batch size in turn, in
ascending order, then descending (a steady drift tilts neither), until each has its steps.
Each run does this afresh, and a gain is the median over runs of each run's own ratio
(batch_report.py).

Beside them, measured in the same run:
- the roofline: a decode step must read every weight once and each user's cache once,
  (weights + B x (C + N/2) x bytes per token) over the read bandwidth sampled before,
  between and after the points (floor.BandwidthProbe); and it must do 2 x weights x B
  multiply-adds plus attention's 4 x L x H x d x C x B, over the GEMM rate timed here:
  the step can take no less than the larger of the two;
- transformers `generate` on the same B histories as one left-padded batch, timed between
  its streamer calls;
- a vLLM server (--server URL, e.g. the CPU server of scripts/setup-vllm.sh) sent the same
  token ids as B concurrent streams, timed at the client.

Tables, JSON and plots are in batch_report.py.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvchat.engine.errors import KvchatError
from kvchat.engine.request import DECODE

from . import batch_report as report
from . import floor as bench_floor
from .flags import output_path, parse_contexts
from .history import history
from .machine import busy_note, checkout_commit, gpu_name, load_average

if TYPE_CHECKING:      # the peers import transformers and torch: only when measured
    from .peers import HFPeer
    from .server_peer import VllmPeer

MARGIN = 64          # positions past the history and the timed tokens
BLOCK = 4            # steps of one batch size before the next takes its turn


@dataclass(slots=True)
class Point:
    """One (KV dtype, context, batch) measurement, over every run."""
    kv_dtype: str
    context: int
    batch: int
    step_ms: list[float] = field(default_factory=list)      # decode-only steps with every user in them
    run_ms: list[float | None] = field(default_factory=list)   # each run's median of them, in run order
    cache_bytes: list[int] = field(default_factory=list)    # what those steps' attention read
    context_tokens: list[int] = field(default_factory=list)
    peers: dict[str, list[float]] = field(default_factory=dict)   # peer -> its step times (ms)
    notes: list[str] = field(default_factory=list)


def parse_batches(text: str) -> tuple[int, ...]:
    from ..cli.args import UsageError
    try:
        values = sorted({int(p) for p in text.split(",")})
    except ValueError:
        raise UsageError(f"--batch {text!r}: expected comma-separated batch sizes, e.g. 1,2,4,8,16") from None
    if not values or values[0] <= 0 or values[-1] > 256:
        raise UsageError(f"--batch {text!r}: batch sizes from 1 to 256, e.g. 1,2,4,8,16")
    return tuple(values)


def gemm_gflops(seconds: float = 0.5, device=None, dtype=None) -> float:
    """The rate of a large matrix product here: the compute bound's denominator. On the CPU
    in fp32; on a GPU in the model's dtype (its matrix units), timed between synchronizations."""
    import torch
    device = torch.device(device or "cpu")
    cuda = device.type == "cuda"
    m = 8192 if cuda else 1024                    # a GPU needs a large product to fill its units
    a = torch.randn(m, 2 * m, device=device, dtype=dtype if cuda and dtype else torch.float32)
    b = torch.randn(2 * m, m, device=device, dtype=a.dtype)
    sync = bench_floor.device_sync(device)
    a @ b
    sync()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
        sync()
    return n * 2 * m * 2 * m * m / (time.perf_counter() - t0) / 1e9


class BatchBench:
    def __init__(self, args, engine) -> None:
        self.args, self.engine = args, engine
        self.batches = parse_batches(args.batch)
        self.contexts = parse_contexts(args.contexts)
        self.steps, self.runs = args.new_tokens, args.runs
        tok = engine.tokenizer
        self.histories = {(ctx, u): history(engine.render, tok, ctx, 7919 * u + ctx)[1]
                          for ctx in self.contexts for u in range(max(self.batches))}
        self.hf: HFPeer | None = None
        self.server: VllmPeer | None = None
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        print(f"kvchat bench --batch [{time.perf_counter() - self.t0:6.0f}s] {text}", file=sys.stderr, flush=True)

    def ours(self, kv: str, ctx: int, points: dict, run: int) -> None:
        """Every batch size of one context over the same users (the module's docstring)."""
        from kvchat.engine import SamplingParams
        eng, top = self.engine, max(self.batches)
        blocks = [BLOCK] * (self.steps // BLOCK) + ([self.steps % BLOCK] if self.steps % BLOCK else [])
        sampling = SamplingParams(max_tokens=decoded_steps(self.batches, self.steps) + 2)
        steps: dict[int, list] = {b: [] for b in self.batches}
        with eng.requests([self.histories[ctx, u] for u in range(top)], sampling, ignore_eos=True) as reqs:
            while not all(r.phase == DECODE for r in reqs):     # the prompts in, each user held once in
                eng.hold([r for r in reqs if r.phase == DECODE])
                if eng.step() is None or any(r.finished for r in reqs):
                    raise KvchatError(next((f"the bench's prefill failed: {r.error}" for r in reqs if r.error),
                                           "the bench's prefill stopped before every prompt was in"))
            for i, n in enumerate(blocks):
                for b in (self.batches if (run + i) % 2 == 0 else self.batches[::-1]):
                    eng.hold(reqs[:b], False)
                    eng.hold(reqs[b:])
                    steps[b] += [eng.step() for _ in range(n)]
        for b in self.batches:
            p = points[kv, ctx, b]
            full = [r for r in steps[b] if r is not None and r.decode_rows == b and not r.prefill_tokens]
            if len(full) < self.steps:
                p.notes.append(f"only {len(full)} of {self.steps} steps had all {b} users decoding")
            p.step_ms += [r.step_ms for r in full]
            p.run_ms.append(report.median([r.step_ms for r in full]))     # None when no step held them all
            p.cache_bytes += [r.cache_bytes for r in full]
            p.context_tokens += [r.context_tokens for r in full]

    def measure(self, probe) -> list[Point]:
        from kvchat.engine import SamplingParams
        eng = self.engine
        base = eng.kv_dtype
        kvs = [base] + (["fp8"] if base != "fp8" else [])
        points = {(kv, c, b): Point(kv, c, b) for kv in kvs for c in self.contexts for b in self.batches}
        self.say("warming up (batch 2, 2 steps; discarded)")
        eng.generate([self.histories[self.contexts[0], u] for u in range(2)], SamplingParams(max_tokens=3),
                     ignore_eos=True)
        for run in range(self.runs):      # runs outermost: slow drift touches every point alike
            for kv in kvs:
                if eng.kv_dtype != kv:
                    eng.set_kv_dtype(kv)
                for ctx in self.contexts:
                    probe.sample()
                    self.ours(kv, ctx, points, run)
                    self.say(f"run {run + 1}/{self.runs} {kv} context {ctx}, batches taking turns: " + ", ".join(
                        f"{b}: {report.med(points[kv, ctx, b].step_ms[-self.steps:]):.1f}" for b in self.batches)
                        + " ms/step")
                    if kv == base:    # the peers a batch size at a time, ascending, then descending next run
                        for b in (self.batches if run % 2 == 0 else self.batches[::-1]):
                            self.peers(points[kv, ctx, b], [self.histories[ctx, u] for u in range(b)], run)
        if eng.kv_dtype != base:
            eng.set_kv_dtype(base)
        return list(points.values())

    def peers(self, p: Point, prompts: list[list[int]], run: int) -> None:
        for name, peer in (("transformers", self.hf), ("vllm", self.server)):
            if peer is None:
                continue
            try:
                ms = peer.decode_batch(prompts, self.steps)
            except Exception as err:  # noqa: BLE001  (a peer's failure is noted, the run goes on)
                p.notes.append(f"{name} failed: {type(err).__name__}: {err}")
                continue
            p.peers.setdefault(name, []).extend(ms)
            self.say(f"run {run + 1}/{self.runs} {name:<12} context {p.context} batch {p.batch}: "
                     f"{report.med(ms):.1f} ms/step")


def decoded_steps(batches, steps: int) -> int:
    """The most tokens a user decodes in a context's turns: the first user is in every batch."""
    return len(batches) * steps


def budget_for(engine_cfg, geometry, batches, contexts, steps, kv_dtype: str) -> int:
    """Pool bytes for the largest batch at the longest context in the wider of the run's KV
    dtypes (its own and fp8, which keeps the bytes and so must hold the tokens in them too)."""
    tokens = max(batches) * (max(contexts) + decoded_steps(batches, steps) + MARGIN + engine_cfg.block_size)
    return tokens * max(geometry.kv_bytes_per_token(kv) + geometry.kv_scale_bytes_per_token(kv)
                        for kv in (kv_dtype, "fp8"))


def run_batch(args) -> int:
    import torch
    from kvchat.engine import Engine, preflight
    from kvchat.engine.engine import available_memory

    from ..cli.args import engine_config
    json_path, plot_path = output_path("--json", args.json), output_path("--plot", args.plot, ".png")
    batches = parse_batches(args.batch)
    contexts = parse_contexts(args.contexts)
    cfg = engine_config(args)
    checked = preflight(cfg)
    need = budget_for(cfg, checked.source.geometry, batches, contexts, args.new_tokens, checked.kv_dtype)
    if cfg.kv_budget is not None and cfg.kv_budget < need:
        raise KvchatError(f"--kv-budget {cfg.kv_budget:,} B cannot hold {max(batches)} users of "
                          f"{max(contexts):,} tokens; give at least {need:,} B or leave --kv-budget out")
    cfg.kv_budget = need
    if max(contexts) + decoded_steps(batches, args.new_tokens) + MARGIN > checked.source.geometry.max_position:
        raise KvchatError(f"--contexts {max(contexts)} with --new-tokens {args.new_tokens} for each of "
                          f"{len(batches)} batch sizes passes "
                          f"{checked.source.name}'s {checked.source.geometry.max_position:,} positions")
    engine = Engine(cfg, checked=preflight(cfg, checked.source))
    bench = BatchBench(args, engine)
    threads = torch.get_num_threads()
    notes = [f"torch threads: {threads}"]
    if engine.device.type == "cpu":
        from kvchat.engine import native
        notes.append(f"kvchat's C kernels: {native.status()}")
        if engine.dtype_name == "bf16":
            notes.append(f"kvchat's bf16 products: {native.describe_bf16()}")
    if not args.no_peers:
        from .peers import HFPeer
        bench.hf = HFPeer(engine.source, engine.device, engine.dtype)
    else:
        notes.append("transformers not measured (--no-peers)")
    if getattr(args, "server", None):
        from .server_peer import VllmPeer
        server = bench.server = VllmPeer.connect(args, max(contexts) + 2 * args.new_tokens + MARGIN)
        notes.append(server.describe())
    else:
        notes.append("vLLM not measured: give --server URL of a running vLLM server (scripts/setup-vllm.sh)")
    load0 = busy_note(notes)
    weights = engine.model.step_weight_bytes
    probe = bench_floor.BandwidthProbe(bench_floor.probe_bytes(weights, available_memory(engine.device)),
                                       engine.device)
    probe.sample(5)
    flops = gemm_gflops(device=engine.device, dtype=engine.model.dtype)
    try:
        points = bench.measure(probe)
    finally:
        if bench.server is not None:
            bench.server.close()
    probe.sample(5)
    bw = probe.result()
    g = engine.geometry
    meta = {
        "kind": "kvchat-batch-bench", "version": 1, "command": command(args), "model": engine.describe(),
        "threads": threads, "runs": args.runs, "new_tokens": args.new_tokens, "block_steps": min(BLOCK, args.new_tokens),
        "notes": notes,
        "machine": {"load_average_before": load0, "load_average_after": load_average(), "kvchat_commit": checkout_commit(),
                    **gpu_name(engine.device)},
        "bandwidth": bw.to_dict(), "gemm_gflop_s": round(flops, 2), "weight_bytes": weights,
        "matmul_params": engine.model.step_weight_bytes // engine.model.embed.element_size(),
        "attention_flops_per_token": 4 * g.n_layers * g.n_heads * g.head_dim,
        "cache_bytes_per_token": {kv: g.kv_bytes_per_token(kv) + g.kv_scale_bytes_per_token(kv)
                                  for kv in {p.kv_dtype for p in points}},
    }
    rec = report.record(points, meta)
    try:
        if json_path is not None:
            report.write_json(json_path, rec)
            print(f"kvchat bench: wrote {json_path}", file=sys.stderr)
        if plot_path is not None:
            report.write_png(plot_path, rec)
            print(f"kvchat bench: wrote {plot_path}", file=sys.stderr)
    except OSError as err:
        raise KvchatError(f"cannot write the bench output: {err}") from None
    print(report.markdown(rec))
    print("\nTargets:\n" + report.target_lines(report.targets(rec)))
    print("\n" + report.terminal_plot(rec))
    return 0


def command(args) -> str:
    parts = ["kvchat", "bench", "--batch", ",".join(map(str, parse_batches(args.batch))), "--contexts", args.contexts,
             "--new-tokens", str(args.new_tokens), "--runs", str(args.runs)]
    for flag in ("model", "device", "dtype", "kv_dtype", "threads", "server"):
        value = getattr(args, flag, None)
        if value not in (None, "auto"):
            parts += [f"--{flag.replace('_', '-')}", str(value)]
    if args.no_peers:
        parts.append("--no-peers")
    return " ".join(parts)
