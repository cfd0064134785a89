"""The `kvchat` command: the chat app by default, and headless `ask`, `replay`, `info`, `bench`.

Every bad input ends with one line on stderr naming the problem and what is accepted, and
exit status 2; never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_USAGE = 2


class UsageError(Exception):
    """A bad flag or file: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage + exits 2; keep it to one line
        raise UsageError(f"{self.prog}: {message}")


def int_at_least(name: str, minimum: int):
    """An argparse type: a whole number >= minimum, with a message naming the flag."""
    want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}")
        return value
    return parse


def positive_int(name: str):
    return int_at_least(name, 1)


def nonneg_float(name: str):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {text!r}")
        return value
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", "-m", default=None,
                   help="alias (llama-3.1-8b, llama-3.1-8b-instruct, llama-3.1-70b, llama-2-7b, smollm2-135m), "
                        "an HF-format directory, or a .gguf file; default: the bundled SmolLM2-135M-Instruct")
    g.add_argument("--random-weights", action="store_true",
                   help="the model's geometry with random weights: no download, for cache and latency experiments")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"),
                   help="model dtype (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--kv-dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16", "fp8"),
                   help="KV cache storage dtype (default: the model dtype)")
    g.add_argument("--kv-budget", default=None,
                   help="KV pool size in bytes, e.g. 512MiB, 2GiB (default: from free memory)")
    g.add_argument("--block-size", type=positive_int("--block-size"), default=16,
                   help="tokens per KV block (default 16)")
    g.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="CPU threads for torch (default: torch's choice)")


def add_sampling_args(p: argparse.ArgumentParser, default_max: int = 256) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int("--max-tokens"), default=default_max)
    g.add_argument("--temperature", type=nonneg_float("--temperature"), default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=positive_int("--top-k"), default=None)
    g.add_argument("--top-p", type=nonneg_float("--top-p"), default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence at every step (the baseline the KV cache avoids)")


def build_parser() -> Parser:
    p = Parser(prog="kvchat", description="Chat with a local Llama model and watch its KV cache.")
    add_model_args(p)
    add_sampling_args(p, default_max=512)
    p.add_argument("--theme", default=None, help="dark, light, high-contrast (remembered)")
    p.add_argument("--resume", action="store_true", help="reopen the last conversation")
    p.add_argument("--cap", type=positive_int("--cap"), default=None, help="context cap in tokens")
    p.add_argument("--policy", default="stop", help="cap policy: stop, drop-oldest, sink-window")
    sub = p.add_subparsers(dest="command", parser_class=Parser)

    ask = sub.add_parser("ask", help="one turn, headless")
    add_model_args(ask)
    add_sampling_args(ask)
    ask.add_argument("message")
    ask.add_argument("--json", action="store_true", help="print one JSON object with the turn's telemetry")

    replay = sub.add_parser("replay", help="run a JSON list of user messages as one conversation")
    add_model_args(replay)
    add_sampling_args(replay)
    replay.add_argument("file", help="a JSON list of messages, or a list of such lists (interleaved conversations)")
    replay.add_argument("--json", action="store_true")
    replay.add_argument("--cap", type=positive_int("--cap"), default=None)
    replay.add_argument("--policy", default="stop")

    info = sub.add_parser("info", help="model geometry and KV bytes per token; needs no weights")
    add_model_args(info)
    info.add_argument("--json", action="store_true")

    try:
        from . import bench
    except ImportError:
        bench = None
    if bench is not None and hasattr(bench, "add_parser"):
        bench.add_parser(sub, add_model_args)
    return p


# ---- commands ------------------------------------------------------------------------------
def engine_config(args):
    from kvchat.engine import EngineConfig
    return EngineConfig(model=args.model, random_weights=args.random_weights, device=args.device,
                        dtype=args.dtype, kv_dtype=args.kv_dtype, kv_budget=args.kv_budget,
                        block_size=args.block_size, seed=args.seed or 0)


def sampling(args):
    from kvchat.engine import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p,
                          seed=args.seed, max_tokens=args.max_tokens)


def load_engine(args, quiet: bool = False):
    """Validate everything that can be checked cheaply before saying "loading"."""
    from kvchat.engine import Engine
    from kvchat.engine.weights import resolve
    from kvchat.engine.engine import pick_device, pick_dtypes
    from kvchat.engine.kv_cache import plan_pool
    cfg = engine_config(args)
    src = resolve(cfg.model, cfg.random_weights)
    _, kv_dtype = pick_dtypes(cfg, pick_device(cfg.device))
    if cfg.kv_budget:
        plan_pool(src.geometry, kv_dtype, cfg.kv_budget, cfg.block_size)
    if not quiet:
        print(f"loading {src.name} ...", file=sys.stderr, flush=True)
    return Engine(cfg, source=src)


def run_turn(conv, text: str, sp, stream) -> dict:
    from kvchat.engine import TokenEvent, TurnStats
    stats = None
    for ev in conv.send(text, sp):
        if isinstance(ev, TokenEvent) and stream is not None:
            stream.write(ev.text)
            stream.flush()
        elif isinstance(ev, TurnStats):
            stats = ev
    if stream is not None:
        stream.write("\n")
    return stats.summary()


def cmd_ask(args) -> int:
    sp = sampling(args)
    engine = load_engine(args, quiet=args.json)
    conv = engine.new_conversation(system_prompt=args.system)
    if args.no_cache:
        conv.set_mode("off")
    record = run_turn(conv, args.message, sp, None if args.json else sys.stdout)
    if args.json:
        print(json.dumps(record))
    return 0


def read_replay(path: str) -> list[list[str]]:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"replay file {path!r} not found; give a JSON file holding a list of user messages") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"replay file {path!r} unreadable ({err.__class__.__name__}); give a UTF-8 JSON file") from None
    except ValueError as err:
        raise UsageError(f"replay file {path!r} is not valid JSON ({err}); expected a list of user messages") from None
    if isinstance(data, list) and data and all(isinstance(m, str) for m in data):
        return [data]
    if (isinstance(data, list) and data and all(isinstance(c, list) and c for c in data)
            and all(isinstance(m, str) for c in data for m in c)):
        return data
    raise UsageError(f"replay file {path!r}: expected a non-empty JSON list of strings (one conversation) "
                     "or a list of such lists (interleaved conversations)")


def cmd_replay(args) -> int:
    convs_msgs = read_replay(args.file)
    sp = sampling(args)
    engine = load_engine(args, quiet=args.json)
    convs = []
    for _ in convs_msgs:
        c = engine.new_conversation(system_prompt=args.system, cap=args.cap, policy=args.policy)
        if args.no_cache:
            c.set_mode("off")
        convs.append(c)
    records = []
    rounds = max(len(m) for m in convs_msgs)
    for turn in range(rounds):  # interleave: turn 1 of every conversation, then turn 2, ...
        for ci, (conv, msgs) in enumerate(zip(convs, convs_msgs)):
            if turn >= len(msgs):
                continue
            if not args.json:
                tag = f"[{ci + 1}] " if len(convs) > 1 else ""
                print(f"{tag}> {msgs[turn]}")
            rec = run_turn(conv, msgs[turn], sp, None if args.json else sys.stdout)
            rec["conversation"] = ci
            records.append(rec)
            if not args.json:
                print(f"  turn {rec['turn']}: prompt {rec['prompt_tokens']} tokens, reused {rec['reused_tokens']}, "
                      f"computed {rec['computed_tokens']}, generated {rec['generated_tokens']}, "
                      f"TTFT {rec['ttft_ms']:.0f} ms, KV {rec['kv_bytes_used']:,} B used / "
                      f"{rec['kv_bytes_allocated']:,} B allocated in {rec['blocks_used']} blocks")
    if args.json:
        print(json.dumps(records))
    return 0


def cmd_info(args) -> int:
    from kvchat.engine.geometry import DTYPE_BYTES
    from kvchat.engine.kv_cache import plan_pool
    from kvchat.engine.units import human_bytes, parse_bytes
    from kvchat.engine.weights import resolve
    src = resolve(args.model or "smollm2-135m", random_weights=True)  # geometry only: no weights read
    g = src.geometry
    dtype = args.dtype if args.dtype != "auto" else "bf16"  # the native dtype of every Llama in the table
    kv = args.kv_dtype if args.kv_dtype != "auto" else dtype
    per_token = g.kv_bytes_per_token(kv)
    out = {"model": src.name, "n_layers": g.n_layers, "hidden": g.hidden, "n_heads": g.n_heads,
           "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim, "intermediate": g.intermediate,
           "vocab_size": g.vocab_size, "max_position": g.max_position, "kv_dtype": kv,
           "kv_bytes_per_token": per_token, "formula": g.formula(kv), "params": g.param_count(),
           "weight_bytes": g.param_count() * DTYPE_BYTES[dtype], "dtype": dtype, "source": g.source}
    if args.kv_budget:
        spec = plan_pool(g, kv, parse_bytes(args.kv_budget), args.block_size)
        out.update(kv_budget=parse_bytes(args.kv_budget), block_size=args.block_size, num_blocks=spec.num_blocks,
                   tokens_that_fit=spec.capacity_tokens)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{out['model']}: {g.n_layers} layers, {g.n_heads} query / {g.n_kv_heads} KV heads of {g.head_dim}, "
          f"hidden {g.hidden}, {out['params'] / 1e9:.2f} B parameters ({human_bytes(out['weight_bytes'])} in {dtype})")
    print(f"KV bytes per token ({kv}): {out['formula']} -> {per_token:,} B ({human_bytes(per_token)})")
    others = ", ".join(f"{d} {g.kv_bytes_per_token(d):,} B" for d in ("fp32", "bf16", "fp8") if d != kv)
    print(f"  in other KV dtypes: {others}")
    for s in sorted({1024, 8192, 32768, g.max_position}):
        print(f"  {s:>7,} tokens: {human_bytes(per_token * s)}")
    if "tokens_that_fit" in out:
        print(f"--kv-budget {args.kv_budget}: {out['num_blocks']:,} blocks of {args.block_size} tokens = "
              f"{out['tokens_that_fit']:,} tokens")
    return 0


def cmd_chat(args) -> int:
    from .app import run_chat
    return run_chat(args)


def main(argv: list[str] | None = None) -> int:
    from kvchat.engine.errors import KvchatError
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if getattr(args, "threads", None):
            import torch
            torch.set_num_threads(args.threads)
        command = args.command or "chat"
        handler = {"chat": cmd_chat, "ask": cmd_ask, "replay": cmd_replay, "info": cmd_info}.get(command)
        if handler is None:
            from . import bench
            handler = bench.run
        return handler(args)
    except (UsageError, KvchatError) as err:
        print(f"kvchat: {err}" if not str(err).startswith("kvchat") else str(err), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
