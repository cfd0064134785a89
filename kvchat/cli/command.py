"""The `kvchat` command: the chat app by default, and headless `ask`, `replay`, `info`, `bench`, `plan`, `crowd`.

Every bad input ends with one line on stderr naming the problem and what is accepted, and
exit status 2; never a traceback. Text that kvchat did not write (a reply, a model's or a
server's name, an error from a server, a path) is printed through `text.shown`: inert to the
terminal, secrets redacted; `--json` prints it exact, escaped by the JSON encoder.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .args import (Parser, UsageError, add_cap_args, add_model_args, add_sampling_args, check_server_flags, check_start, engine_config, positive_int, sampling, utf8_text)
from ..store.files import FileRefused, read_text
from ..text import STOP_WORDS, command_remedies, inert, shown

EXIT_USAGE = 2


def build_parser() -> Parser:
    p = Parser(prog="kvchat", description="Chat with a local Llama model and watch its KV cache.")
    add_model_args(p, top=True)
    add_sampling_args(p, top=True)
    add_cap_args(p, top=True)
    p.add_argument("--theme", default=None, help="dark, light, high-contrast (remembered)")
    p.add_argument("--resume", action="store_true", help="reopen the last conversation")
    p.set_defaults(func=cmd_chat)
    sub = p.add_subparsers(dest="command", parser_class=Parser)

    ask = sub.add_parser("ask", help="one turn, headless")
    add_model_args(ask)
    add_sampling_args(ask)
    ask.add_argument("message")
    ask.add_argument("--json", action="store_true", help="print one JSON object with the turn's telemetry")
    ask.set_defaults(func=cmd_ask)

    replay = sub.add_parser("replay", help="run a JSON list of user messages as one conversation")
    add_model_args(replay)
    add_sampling_args(replay)
    add_cap_args(replay)
    replay.add_argument("file", help="a JSON list of messages, or a list of such lists (interleaved conversations)")
    replay.add_argument("--json", action="store_true")
    replay.set_defaults(func=cmd_replay)

    info = sub.add_parser("info", help="model geometry, KV bytes per token, what-if sizing; needs no weights")
    add_model_args(info)
    info.add_argument("--tokens", type=positive_int("--tokens"), default=None,
                      help="what if a conversation holds N tokens: its cache, and its share of --kv-budget")
    info.add_argument("--users", type=positive_int("--users"), default=1,
                      help="with --tokens: that many such conversations at once (default 1)")
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    from ..bench.run import add_parser as add_bench   # argparse only: the bench's heavy imports wait for run()
    add_bench(sub).set_defaults(func=cmd_bench)
    from ..plan.command import add_parser as add_plan  # argparse only: the simulation loads in run()
    add_plan(sub).set_defaults(func=cmd_plan)
    from ..crowd.command import add_parser as add_crowd  # argparse only: the engine loads in run()
    add_crowd(sub).set_defaults(func=cmd_crowd)
    return p


# ---- commands ------------------------------------------------------------------------------
def load_backend(args, quiet: bool = False):
    """Validate everything that can be checked cheaply before saying "loading"."""
    if check_server_flags(args):
        from ..backends.vllm import VllmBackend
        backend = VllmBackend.from_flags(args)
        if not quiet:
            print(shown(f"attached to {backend.model.name} at {backend.api.url}"), file=sys.stderr, flush=True)
        return backend
    from kvchat.engine import preflight

    from ..backends.local import LocalBackend
    cfg = engine_config(args)
    checked = preflight(cfg)
    args.cap = check_start(args, checked.source, checked.device, checked.kv_dtype)
    if not quiet:
        print(shown(f"loading {checked.source.name} ..."), file=sys.stderr, flush=True)
    return LocalBackend.load(cfg, checked=checked)


CUT = ("cut", "timeout")    # stop reasons of a reply that did not arrive whole


def run_turn(chat, text: str, sp, stream) -> dict:
    from kvchat.engine import KvchatError, TokenEvent, TurnStats
    stats = None
    for ev in chat.send(text, sp):
        if isinstance(ev, TokenEvent) and stream is not None:
            stream.write(inert(ev.text))
            stream.flush()
        elif isinstance(ev, TurnStats):
            stats = ev
    if stream is not None:
        stream.write("\n")
    if stats is None:
        raise KvchatError("the backend ended the turn without its stats")
    return stats.summary()


def said_cut(record: dict) -> bool:
    """Say on stderr that a reply arrived cut (the reply so far was printed and kept)."""
    if record.get("stop_reason") not in CUT:
        return False
    print(f"kvchat: the reply is incomplete: {STOP_WORDS[record['stop_reason']]}", file=sys.stderr)
    return True


def cmd_ask(args) -> int:
    if not utf8_text("the message", args.message).strip():
        raise UsageError("empty message: give the text to send, e.g. kvchat ask \"What is a KV cache?\"")
    sp = sampling(args)
    backend = load_backend(args, quiet=args.json)
    chat = backend.open(system=args.system, cap=args.cap, mode="off" if args.no_cache else "cache")
    record = run_turn(chat, args.message, sp, None if args.json else sys.stdout)
    if args.json:
        print(json.dumps(record))
    return EXIT_USAGE if said_cut(record) else 0


MAX_REPLAY_BYTES = 64 * 2**20


def _replay_message(path: str, where: str, m) -> str:
    """One replay message: a string, or {"role": "user", "content": "..."}."""
    if isinstance(m, dict):
        if m.get("role", "user") != "user" or not isinstance(m.get("content"), str):
            raise UsageError(f"replay file {path!r}: {where} needs \"role\": \"user\" and a string \"content\"; "
                             f"accepted: a string or {{\"role\": \"user\", \"content\": \"...\"}}")
        m = m["content"]
    if not isinstance(m, str):
        raise UsageError(f"replay file {path!r}: {where} is {type(m).__name__}; accepted: a string or "
                         "{\"role\": \"user\", \"content\": \"...\"}")
    if not utf8_text(f"replay file {path!r}: {where}", m).strip():
        raise UsageError(f"replay file {path!r}: {where} is empty; give the text to send")
    return m


def read_replay(path: str) -> list[list[str]]:
    try:
        data = json.loads(read_text(Path(path), MAX_REPLAY_BYTES))
    except FileRefused as err:
        raise UsageError(f"replay file {path!r}: {err}; expected a UTF-8 JSON file holding a list of user "
                         "messages") from None
    except RecursionError:
        raise UsageError(f"replay file {path!r} is nested too deeply; expected a list of user messages") from None
    except ValueError as err:
        raise UsageError(f"replay file {path!r} is not valid JSON ({err}); expected a list of user messages") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"replay file {path!r}: expected a non-empty JSON list of strings (one conversation) "
                         "or a list of such lists (interleaved conversations)")
    convs = data if all(isinstance(c, list) for c in data) else [data]
    out = []
    for ci, conv in enumerate(convs):
        if not conv:
            raise UsageError(f"replay file {path!r}: conversation {ci + 1} is empty; give at least one message")
        tag = f"conversation {ci + 1}, " if len(convs) > 1 else ""
        out.append([_replay_message(path, f"{tag}message {i + 1}", m) for i, m in enumerate(conv)])
    return out


def cmd_replay(args) -> int:
    """Each conversation's messages in order. Several conversations on the local engine run
    at once, one thread each, so their replies share the engine's steps (each record's
    step_sequences says how many conversations every token's step carried); a backend that
    takes one reply at a time gets them interleaved, turn 1 of each, then turn 2, ..."""
    convs_msgs = read_replay(args.file)
    sp = sampling(args)
    backend = load_backend(args, quiet=args.json)
    mode = "off" if args.no_cache else "cache"
    convs = [backend.open(system=args.system, cap=args.cap, policy=args.policy, mode=mode) for _ in convs_msgs]
    tagged = len(convs) > 1
    if tagged and backend.capabilities.concurrent_turns:
        records = _replay_together(convs, convs_msgs, sp, args.json)
    else:
        records = []
        for turn in range(max(len(m) for m in convs_msgs)):  # interleave: turn 1 of every conversation, then 2, ...
            for ci, (conv, msgs) in enumerate(zip(convs, convs_msgs)):
                if turn >= len(msgs):
                    continue
                if not args.json:
                    print(f"{f'[{ci + 1}] ' if tagged else ''}> {inert(msgs[turn])}")
                rec = run_turn(conv, msgs[turn], sp, None if args.json else sys.stdout)
                rec["conversation"] = ci
                records.append(rec)
                if not args.json:
                    print(_replay_line(rec, ""))
    cut = sum(said_cut(rec) for rec in records) > 0     # each cut reply said once, on stderr
    if args.json:
        print(json.dumps(records))
    return EXIT_USAGE if cut else 0


def _replay_together(convs, convs_msgs, sp, quiet: bool) -> list[dict]:
    """One thread per conversation, its turns in order; records ordered as the interleaved
    run orders them (by turn, then conversation). The first error ends the command."""
    import threading
    records, errors, lock = [], [], threading.Lock()

    def talk(ci: int) -> None:
        try:
            for msg in convs_msgs[ci]:
                rec = run_turn(convs[ci], msg, sp, None)
                rec["conversation"] = ci
                with lock:
                    records.append(rec)
                    if not quiet:
                        print(f"[{ci + 1}] > {inert(msg)}\n[{ci + 1}] {inert(rec['reply'])}\n"
                              f"{_replay_line(rec, f'[{ci + 1}] ')}",
                              flush=True)
        except BaseException as err:  # noqa: BLE001  (re-raised in the main thread, one line)
            errors.append(err)

    threads = [threading.Thread(target=talk, args=(ci,), daemon=True) for ci in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(records, key=lambda r: (r["turn"], r["conversation"]))


def _replay_line(rec: dict, tag: str) -> str:
    shared = rec.get("step_sequences") or []
    batch = f", steps shared by up to {max(shared)} conversations" if shared and max(shared) > 1 else ""
    reused, computed = (("unknown" if rec[k] is None else rec[k]) for k in ("reused_tokens", "computed_tokens"))
    return (f"{tag}  turn {rec['turn']}: prompt {rec['prompt_tokens']} tokens, reused {reused}, "
            f"computed {computed}, generated {rec['generated_tokens']}, "
            f"TTFT {rec['ttft_ms']:.0f} ms, KV {_n(rec['kv_bytes_used'])} B used / "
            f"{_n(rec['kv_bytes_allocated'])} B allocated in {_n(rec['blocks_used'])} blocks{batch}")


def _n(value) -> str:
    return f"{value:,}" if value is not None else "unknown"


def cmd_info(args) -> int:
    if check_server_flags(args):
        return server_info(args)
    from kvchat.engine.geometry import DTYPE_BYTES
    from kvchat.engine.pool_spec import plan_pool
    from kvchat.engine.sizing import step_reads, what_if
    from kvchat.engine.sources import resolve
    from kvchat.engine.units import human_bytes, parse_bytes
    src = resolve(args.model or "smollm2-135m", geometry_only=True)  # config.json or a GGUF header: nothing else read
    g = src.geometry
    dtype = args.dtype if args.dtype != "auto" else "bf16"  # the native dtype of every Llama in the table
    kv = args.kv_dtype if args.kv_dtype != "auto" else dtype
    per_token = g.kv_bytes_per_token(kv)
    budget = parse_bytes(args.kv_budget) if args.kv_budget else None
    reads = step_reads(g, dtype, kv, g.max_position)
    out: dict[str, Any] = {"model": src.name, "n_layers": g.n_layers, "hidden": g.hidden, "n_heads": g.n_heads,
           "n_kv_heads": g.n_kv_heads, "head_dim": g.head_dim, "intermediate": g.intermediate,
           "vocab_size": g.vocab_size, "max_position": g.max_position, "kv_dtype": kv,
           "kv_bytes_per_token": per_token, "formula": g.formula(kv), "params": g.param_count(),
           "weight_bytes": g.param_count() * DTYPE_BYTES[dtype], "dtype": dtype, "source": g.source,
           "step_weight_bytes": reads.weight_bytes, "cache_equals_weights_at_tokens": reads.crossover_tokens}
    if budget:
        spec = plan_pool(g, kv, budget, args.block_size)
        out.update(kv_budget=budget, block_size=args.block_size, num_blocks=spec.num_blocks,
                   tokens_that_fit=spec.capacity_tokens)
    if args.tokens:
        w = what_if(g, kv, args.tokens, args.users, budget, args.block_size)
        out["what_if"] = {"tokens": w.tokens, "users": w.users, "bytes_needed": w.bytes_needed,
                          "scale_bytes_per_token": w.scale_bytes_per_token, "budget": w.budget,
                          "share_of_budget": w.share, "users_that_fit": w.users_that_fit}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{inert(out['model'])}: {g.n_layers} layers, {g.n_heads} query / {g.n_kv_heads} KV heads of {g.head_dim}, "
          f"hidden {g.hidden}, {out['params'] / 1e9:.2f} B parameters ({human_bytes(out['weight_bytes'])} in {dtype})")
    print(f"KV bytes per token ({kv}): {out['formula']} -> {per_token:,} B ({human_bytes(per_token)})")
    others = ", ".join(f"{d} {g.kv_bytes_per_token(d):,} B" for d in ("fp32", "bf16", "fp8") if d != kv)
    print(f"  in other KV dtypes: {others}")
    for s in sorted({1024, 8192, 32768, g.max_position}):
        print(f"  {s:>7,} tokens: {human_bytes(per_token * s)}")
    print(f"Each decode step reads every weight ({human_bytes(reads.weight_bytes)}) and the whole cache: the cache "
          f"read equals the weight read at {reads.crossover_tokens:,} tokens of context")
    if "tokens_that_fit" in out:
        print(f"--kv-budget {args.kv_budget}: {out['num_blocks']:,} blocks of {args.block_size} tokens = "
              f"{out['tokens_that_fit']:,} tokens")
    if args.tokens:
        from ..text import what_if_line
        print(what_if_line(w))
    return 0


def server_info(args) -> int:
    """`kvchat info --server URL`: the served model's geometry and the server's pool, from its
    /v1/models and /metrics; what it cannot tell is null and named in `unavailable`."""
    from kvchat.engine.units import human_bytes

    from ..backends.vllm import VllmBackend
    backend = VllmBackend.from_flags(args)
    try:
        info, snap, cache = backend.info(), backend.snapshot(), backend.metrics.cache
    finally:
        backend.shutdown()
    g = info.geometry
    out: dict[str, Any] = {"model": info.model, "server": info.device, "max_position": info.max_position, "dtype": info.dtype,
           "kv_dtype": info.kv_dtype, "kv_bytes_per_token": info.bytes_per_token,
           "formula": g.formula(info.kv_dtype) if g is not None and info.bytes_per_token else None,
           "geometry_source": backend.geometry_source, "block_size": cache.block_size,
           "num_blocks": cache.num_blocks, "kv_cache_size_tokens": cache.size_tokens,
           "cache_dtype": cache.cache_dtype, "kv_capacity_bytes": snap.capacity_bytes,
           "kv_cache_usage": snap.server.usage, "prefix_hit_rate": snap.server.prefix_hit_rate}
    if g is not None:
        out.update(n_layers=g.n_layers, n_heads=g.n_heads, n_kv_heads=g.n_kv_heads, head_dim=g.head_dim)
    out["unavailable"] = sorted(k for k, v in out.items() if v is None)
    if args.json:
        print(json.dumps(out))
        return 0
    print(shown(f"{info.model} on {info.device}: vLLM, context {_n(info.max_position)} tokens, weights {info.dtype}, "
                f"cache {info.kv_dtype}"))
    if info.bytes_per_token is None:
        print(shown(f"KV bytes per token: unknown ({backend.geometry_source if g is None else 'cache element size unknown; give --kv-dtype'})"))
    else:
        print(shown(f"KV bytes per token ({info.kv_dtype}): {out['formula']} -> {info.bytes_per_token:,} B "
                    f"({human_bytes(info.bytes_per_token)}); geometry from {backend.geometry_source}"))
    print(f"pool: {_n(cache.num_blocks)} blocks of {_n(cache.block_size)} tokens = {_n(cache.size_tokens)} tokens"
          + (f" = {human_bytes(snap.capacity_bytes)}" if snap.capacity_bytes else "")
          + (f", {snap.server.usage:.0%} in use" if snap.server.usage is not None else ""))
    return 0


def cmd_chat(args) -> int:
    from .launch import run_chat
    return run_chat(args)


def cmd_bench(args) -> int:
    from ..bench.run import run
    return run(args)


def cmd_plan(args) -> int:
    from ..plan.command import run
    return run(args)


def cmd_crowd(args) -> int:
    from ..crowd.command import run
    return run(args, load_backend)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input: one line on stderr, status 2. An internal error: one
    line, status 1, its traceback in errors.log beside the conversations."""
    from kvchat.engine.errors import KvchatError

    from ..store.log import StoreError
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        if args.func is not cmd_chat and (sys.stdout is None or sys.stdout.closed):
            raise UsageError("stdout is closed, so there is nowhere to print; redirect it (> FILE or > /dev/null)")
        if getattr(args, "threads", None):
            import torch
            torch.set_num_threads(args.threads)
        code = args.func(args)
        if sys.stdout is not None:
            sys.stdout.flush()
        return code
    except (UsageError, KvchatError, StoreError) as err:
        line = command_remedies(shown(" ".join(str(err).split())), flags=args is not None and args.func is cmd_replay)
        print(line if line.startswith("kvchat") else f"kvchat: {line}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader went away (`| head -c 10`): stop quietly, and keep Python's exit-time
        # flush of stdout from raising the same error again
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print("kvchat: output closed early (broken pipe); stopped", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130
    except Exception as err:   # a bug: one line here, the traceback in the error log
        from ..store.errors import log_error
        where = log_error(err)
        print(f"kvchat: internal error ({type(err).__name__}: {shown(' '.join(str(err).split()))[:200]}); "
              f"details in {shown(where)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
