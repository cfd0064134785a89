"""Before and after, in one process: decode steps of the bundled model through another
checkout's engine (`--before`, e.g. main's `engine/` folder) and this checkout's, on the same
weights, the same pool and the same tokens, taken in turn round after round so that a
changing load touches both alike.

    python benchmarks/cpu_decode_ab.py --before /path/to/other/checkout/engine \
        [--contexts 1024,4096,8192] [--kv fp32,fp8] [--steps 8] [--rounds 5] [--threads 2] [--dtype fp32] \
        [--shuffle]

Prints, per context and KV dtype, the median over rounds of each round's median ms/step for
both, their ratio, and the 1-minute load before and after.

With --loop, the whole turn loop instead of the model's forward: a conversation of each
engine replies to the same prompt (a history of about `context` tokens) and the time between
its TokenEvents, as a reader sees them, is the figure: the scheduler, runner and sampling
of one step included (the batching issue's "B = 1 within 2%" check).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's kvchat, not an installed one

from kvchat.engine import Engine, EngineConfig, compute  # noqa: E402
from kvchat.engine.kv_cache import KVPool, plan_pool  # noqa: E402
from kvchat.engine.model import Step  # noqa: E402


def load_engine_package(folder: Path, name: str = "before_engine"):
    """Another checkout's engine/ folder as a package of its own name."""
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[str(folder)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def one_run(step_cls, table: torch.Tensor) -> dict:
    """The Step argument that says "the table is one ascending run", in either version's
    spelling (runs since the pool's head-major layout, first_block before)."""
    if "runs" in step_cls.__dataclass_fields__:
        return {"runs": ((0, table.numel()),)}
    return {"first_block": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="another checkout's engine/ folder")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--kv", default="fp32,fp8")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="model weights: auto, fp32, bf16 (EngineConfig.dtype)")
    ap.add_argument("--loop", action="store_true", help="time the engines' turn loops, not the forward")
    ap.add_argument("--shuffle", action="store_true",
                    help="the cache's blocks in a random order, as in a pool many conversations have used "
                         "(default: one ascending run, as in a fresh pool)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.loop:
        return loop_ab(args)
    load0 = os.getloadavg()[0]
    eng = Engine(EngineConfig(kv_budget="16MiB", dtype=args.dtype))
    m, g = eng.model, eng.geometry
    before_pkg = load_engine_package(args.before.resolve())
    from importlib import import_module
    bmodel = import_module("before_engine.model")
    old = bmodel.Llama(g, m.embed, m.layers, m.norm, m.lm_head)
    if m.act_dtype != old.act_dtype and hasattr(old, "fp32_rows"):
        old.fp32_rows()        # bf16 weights, fp32 rows: the same setup as this checkout's engine
    contexts = [int(c) for c in args.contexts.split(",")]
    kvs = args.kv.split(",")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, g.vocab_size, (max(contexts) + args.steps,), generator=gen)
    print(f"# decode ms/step, before ({args.before}) and after ({ROOT}), {args.threads} threads, "
          f"{str(m.lm_head.dtype).replace('torch.', '')} weights, torch {torch.__version__}", flush=True)
    rows = []
    for kv in kvs:
        for c in contexts:
            spec = plan_pool(g, kv, 2 * (c + args.steps + 16) * g.kv_bytes_per_token(kv), 16)
            pool = KVPool(g, spec, eng.device)
            table = torch.arange(spec.num_blocks, dtype=torch.int32)
            if args.shuffle:
                table = torch.randperm(spec.num_blocks, generator=gen).to(torch.int32)
            bs = spec.block_size

            def slots(pos: torch.Tensor) -> torch.Tensor:
                return table[pos // bs].long() * bs + pos % bs

            def hint(step_cls) -> dict:
                return {} if args.shuffle else one_run(step_cls, table)
            with torch.inference_mode():
                m.forward(ids[:c], torch.arange(c), Step(table, slots(torch.arange(c)), 0, False), pool)
            times = {"before": [], "after": []}
            for _ in range(args.rounds):
                for name, model, step_cls in (("before", old, bmodel.Step), ("after", m, Step)):
                    xs = []
                    with torch.inference_mode():
                        for p in range(c, c + args.steps):  # rewrites the same rows each round
                            t0 = time.perf_counter()
                            model.forward(ids[p:p + 1], torch.tensor([p]),
                                          step_cls(table, slots(torch.tensor([p])), p, True, **hint(step_cls)), pool)
                            xs.append((time.perf_counter() - t0) * 1000)
                    times[name].append(statistics.median(xs))
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            rows.append((kv, c, b, a))
            print(f"{kv} {c}: before {b:.1f} ms ({', '.join(f'{x:.0f}' for x in times['before'])}), "
                  f"after {a:.1f} ms ({', '.join(f'{x:.0f}' for x in times['after'])})", flush=True)
    print(f"\n1-minute load {load0:.1f} before, {os.getloadavg()[0]:.1f} after\n\n"
          "| KV cache | context | before ms/step | after ms/step | after ÷ before |\n|---|---:|---:|---:|---:|")
    for kv, c, b, a in rows:
        print(f"| {kv} | {c} | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    return 0



def loop_ab(args) -> int:
    """Token-to-token time of a reply through each engine's own Conversation.send."""
    load0 = os.getloadavg()[0]
    before_pkg = load_engine_package(args.before.resolve())
    from importlib import import_module
    engines = {"before": import_module("before_engine.engine").Engine(
        import_module("before_engine.engine").EngineConfig(kv_budget="256MiB", dtype=args.dtype)),
        "after": Engine(EngineConfig(kv_budget="256MiB", dtype=args.dtype))}
    sampling = {"before": import_module("before_engine.sampler").SamplingParams,
                "after": import_module("kvchat.engine.sampler").SamplingParams}
    del before_pkg
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[k] for k in sorted(topics))
    tok = engines["after"].tokenizer
    print(f"# token-to-token ms of a reply, before ({args.before}) and after ({ROOT}), {args.threads} threads",
          flush=True)
    rows = []
    for c in [int(x) for x in args.contexts.split(",")]:
        history = tok.decode(tok.encode(text[: 6 * c])[:c]) + "\n\nSummarise the text above at length."
        times = {"before": [], "after": []}
        for _ in range(args.rounds):
            for name, eng in engines.items():
                conv = eng.new_conversation()
                try:
                    stamps = []
                    for ev in conv.send(history, sampling[name](max_tokens=args.steps + 2)):
                        if type(ev).__name__ == "TokenEvent" and ev.token_id >= 0:
                            stamps.append(time.perf_counter())
                finally:
                    conv.reset_cache()
                    eng.close_conversation(conv)
                gaps = [(b - a) * 1000 for a, b in zip(stamps[1:], stamps[2:])]
                times[name].append(statistics.median(gaps) if gaps else float("nan"))
        b, a = statistics.median(times["before"]), statistics.median(times["after"])
        rows.append(("loop", c, b, a))
        print(f"context ~{c}: before {b:.1f} ms, after {a:.1f} ms", flush=True)
    print(f"\n1-minute load {load0:.1f} before, {os.getloadavg()[0]:.1f} after\n\n"
          "| turn loop | context | before ms/token | after ms/token | after ÷ before |\n|---|---:|---:|---:|---:|")
    for kind, c, b, a in rows:
        print(f"| {kind} | {c} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
    return 0


if __name__ == "__main__":
    # all of it on the engine's compute thread, where the engines' steps run: one OpenMP pool
    # in the process (a second one, on this thread, slows both: engine/compute.py)
    raise SystemExit(compute.run(main))
