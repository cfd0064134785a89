"""Where a new turn's time goes after a long history: the TTFT of turn 2 with its prefix
reused, profiled on the host (cProfile, the GPU synchronized at the end), run several times
on fresh histories of the same length so that first-time costs (kernel selection, plan
builds) show apart from the steady ones; then once more with cuDNN's attention set aside.

    python benchmarks/gpu_ttft.py --model DIR --random-weights --contexts 1024,8192
    python benchmarks/gpu_ttft.py --contexts 256              # the bundled model on CPU

Prints, per context and try: TTFT, its prefill and the tokens computed; then the top
functions by own time of the last try.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--kv-budget", default="24GiB")
    args = ap.parse_args(argv)
    import torch
    from kvchat.bench.history import FOLLOW_UP, SYSTEM, history
    from kvchat.bench.run import finish
    from kvchat.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model=args.model, random_weights=args.random_weights, kv_budget=args.kv_budget))
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"gpu_ttft: {engine.describe()['model']} on {engine.device}, {engine.dtype_name}")

    def turn_two(ctx: int, seed: int, profile: cProfile.Profile | None) -> str:
        text, _ = history(engine.render, engine.tokenizer, ctx, seed)
        conv = engine.new_conversation(system_prompt=SYSTEM)
        try:
            first = finish(conv.send(text, SamplingParams(max_tokens=2)))
            sync()
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            second = finish(conv.send(FOLLOW_UP, SamplingParams(max_tokens=1)))
            sync()
            wall = (time.perf_counter() - t0) * 1000
            if profile is not None:
                profile.disable()
            return (f"turn 1 prefill {first.prefill_ms:8.1f} ms ({first.computed_tokens} tokens); turn 2 TTFT "
                    f"{second.ttft_ms:7.1f} ms, prefill {second.prefill_ms or 0:7.1f} ms, {second.computed_tokens} "
                    f"computed of {second.prompt_tokens}, wall {wall:7.1f} ms")
        finally:
            conv.reset_cache()
            engine.close_conversation(conv)

    last = None
    for ctx in (int(c) for c in args.contexts.split(",")):
        for i in range(args.tries):
            prof = cProfile.Profile() if i == args.tries - 1 else None
            print(f"context {ctx} try {i + 1}: {turn_two(ctx, 100 * ctx + i, prof)}", flush=True)
            last = prof or last
        if cuda and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
            try:
                for i in range(2):
                    print(f"context {ctx} cuDNN attention off, try {i + 1}: {turn_two(ctx, 7 + i, None)}", flush=True)
            finally:
                torch.backends.cuda.enable_cudnn_sdp(True)
    if last is not None:
        out = io.StringIO()
        pstats.Stats(last, stream=out).sort_stats("tottime").print_stats(18)
        print("\n".join(line[:160] for line in out.getvalue().splitlines()[4:]))
    return 0


if __name__ == "__main__":
    from kvchat.engine import compute  # noqa: E402  (the steps' thread, as the engine's users run)
    sys.exit(compute.run(main))
