"""Argument types and flag groups shared by every subcommand, and the engine settings and
sampling they map to. Imports nothing of kvchat but the engine, so any module (the CLI,
the bench, the app's launcher) may use it without an import circle."""
from __future__ import annotations

import argparse
import math
from typing import overload

from kvchat.engine.geometry import KV_DTYPES, MODEL_DTYPES   # torch-free: the flags parse before torch loads

SUPPRESS = argparse.SUPPRESS


class UsageError(Exception):
    """A bad flag or file: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's default prints usage + exits 2; keep it to one line
        raise UsageError(f"{self.prog}: {message}")


def int_at_least(name: str, minimum: int, maximum: int = 2**62):
    """An argparse type: a whole number in [minimum, maximum], with a message naming the flag."""
    want = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    if maximum < 2**62:
        want += f" up to {maximum:,}"

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}")
        return value
    return parse


def positive_int(name: str, maximum: int = 2**62):
    return int_at_least(name, 1, maximum)


def float_in(name: str, lo: float, hi: float, lo_open: bool = False):
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open); nan and inf
    (which float() accepts) are refused."""
    want = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}") from None
        if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
            raise argparse.ArgumentTypeError(f"{name} must be {want}, got {text!r}")
        return value
    return parse


def nonneg_float(name: str, hi: float = 1e6):
    return float_in(name, 0.0, hi)


def _defaults(top: bool, **values):
    """Flags appear on the main parser and again on each subcommand. On a subcommand their
    default is SUPPRESS, so `kvchat --kv-budget 1GiB ask ...` keeps the value given before
    the subcommand instead of silently resetting it."""
    return values if top else {k: SUPPRESS for k in values}


def add_model_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    g = p.add_argument_group("model and cache")
    g.add_argument("--model", "-m", **_defaults(top, default=None),
                   help="alias (llama-3.1-8b, llama-3.1-8b-instruct, llama-3.1-70b, llama-2-7b, smollm2-135m), "
                        "an HF-format directory, or a .gguf file; default: the bundled SmolLM2-135M-Instruct")
    g.add_argument("--random-weights", action="store_true", **_defaults(top, default=False),
                   help="the model's geometry with random weights: no download, for cache and latency experiments")
    g.add_argument("--device", **_defaults(top, default="auto"), help="auto, cpu, cuda, cuda:N (default auto)")
    g.add_argument("--dtype", choices=MODEL_DTYPES, **_defaults(top, default="auto"),
                   help="model dtype (default: bf16 on CUDA and on CPUs with AVX512-BF16, else fp32)")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, **_defaults(top, default="auto"),
                   help="KV cache storage dtype (default: the model dtype)")
    g.add_argument("--kv-budget", **_defaults(top, default=None),
                   help="KV pool size in bytes, e.g. 512MiB, 2GiB (default: from free memory)")
    g.add_argument("--block-size", type=positive_int("--block-size", 4096), **_defaults(top, default=16),
                   help="tokens per KV block (default 16)")
    g.add_argument("--threads", type=positive_int("--threads", 1024), **_defaults(top, default=None),
                   help="CPU threads for torch (default: torch's choice)")
    add_server_args(p, top)


def add_server_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    """Attach to a running vLLM server instead of loading the model here (issue 10)."""
    g = p.add_argument_group("a vLLM server instead of the local engine")
    g.add_argument("--server", metavar="URL", **_defaults(top, default=None),
                   help="an OpenAI-compatible vLLM base URL, e.g. http://127.0.0.1:8000 (/v1 optional); "
                        "API key from KVCHAT_API_KEY or OPENAI_API_KEY")
    g.add_argument("--kv-events", metavar="tcp://HOST:PORT", **_defaults(top, default=None),
                   help="with --server: the server's KV-event stream (its --kv-events-config endpoint), "
                        "for the block map")
    g.add_argument("--kv-replay", metavar="tcp://HOST:PORT", **_defaults(top, default=None),
                   help="with --kv-events: the server's replay endpoint (its --kv-events-config "
                        "replay_endpoint), for the blocks stored before kvchat subscribed and any batch lost")
    g.add_argument("--timeouts", metavar="NAME=S,...", **_defaults(top, default=None),
                   help="with --server: how long to wait, in seconds: connect (3), answer (10: a plain request), "
                        "first-token (300), gap (60: between a reply's events), total (1800: a whole reply); "
                        "e.g. --timeouts first-token=600,gap=120")
    g.add_argument("--geometry", metavar="ALIAS", **_defaults(top, default=None),
                   help="with --server: the served model's geometry (llama-3.1-8b, llama-3.1-70b, ...) when "
                        "its name is not in kvchat's table; or give --model PATH to a copy of its config.json")


def add_sampling_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int("--max-tokens", 10_000_000), **_defaults(top, default=None),
                   help="most tokens per reply (default: 512 in the chat, 256 headless)")
    g.add_argument("--temperature", type=nonneg_float("--temperature", 100.0), **_defaults(top, default=0.0),
                   help="0 is greedy (default)")
    g.add_argument("--top-k", type=positive_int("--top-k", 10_000_000), **_defaults(top, default=None))
    g.add_argument("--top-p", type=float_in("--top-p", 0.0, 1.0, lo_open=True), **_defaults(top, default=1.0))
    g.add_argument("--seed", type=int_at_least("--seed", 0, 2**63 - 1), **_defaults(top, default=None))
    g.add_argument("--system", **_defaults(top, default=None), help="system prompt")
    g.add_argument("--no-cache", action="store_true", **_defaults(top, default=False),
                   help="recompute the whole sequence at every step (the baseline the KV cache avoids)")


def add_cap_args(p: argparse.ArgumentParser, top: bool = False) -> None:
    p.add_argument("--cap", type=positive_int("--cap", 2**31 - 1), **_defaults(top, default=None), help="context cap in tokens")
    p.add_argument("--policy", **_defaults(top, default="stop"), help="cap policy: stop, drop-oldest, sink-window")


def engine_config(args):
    from kvchat.engine import EngineConfig
    return EngineConfig(model=args.model, random_weights=args.random_weights, device=args.device,
                        dtype=args.dtype, kv_dtype=args.kv_dtype, kv_budget=args.kv_budget,
                        block_size=args.block_size, seed=args.seed or 0)


def sampling(args, default_max: int = 256):
    from kvchat.engine import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p,
                          seed=args.seed, max_tokens=args.max_tokens or default_max)


@overload
def utf8_text(what: str, text: str) -> str: ...
@overload
def utf8_text(what: str, text: None) -> None: ...


def utf8_text(what: str, text: str | None) -> str | None:
    """Text from argv or a file as a str that encodes: bytes that were not UTF-8 reach Python
    as lone surrogates, which a tokenizer cannot take."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        ch = text[err.start]
        try:
            bad = f"byte 0x{ch.encode('utf-8', 'surrogateescape').hex()}"   # argv's undecodable bytes
        except UnicodeEncodeError:
            bad = f"lone surrogate U+{ord(ch):04X}"                         # a JSON \\ud800 escape
        raise UsageError(f"{what} is not valid UTF-8 text ({bad} at character {err.start}); give UTF-8 text") \
            from None
    return text


def check_start(args, source, device, kv_dtype: str) -> int | None:
    """Everything about the flags that can be checked against the model before it loads:
    the pool plan, the CUDA kernels' limits, the cap against the context window and the
    sink-window minimum, the policy name, and the system prompt's text. Returns the cap to
    use: --cap, or the model's context window, so a prompt longer than the model can take
    is refused in one line by the stop policy (or handled by the policy chosen)."""
    from kvchat.engine.geometry import cuda_limits
    from kvchat.engine.policy import make_policy
    from kvchat.engine.pool_spec import plan_pool
    geom = source.geometry
    if getattr(args, "kv_budget", None):
        from kvchat.engine.units import parse_bytes
        plan_pool(geom, kv_dtype, parse_bytes(args.kv_budget), args.block_size)
    if device.type == "cuda":
        cuda_limits(geom, args.block_size)
    utf8_text("--system", getattr(args, "system", None))
    policy = make_policy(getattr(args, "policy", "stop"))
    cap = getattr(args, "cap", None)
    if cap is not None and cap > geom.max_position and not source.random_weights:
        raise UsageError(f"--cap {cap} is past {source.name}'s context window of {geom.max_position:,} tokens; "
                         f"accepted: 1 to {geom.max_position:,}")
    if policy.streaming and cap is not None:
        from kvchat.engine.streaming import DEFAULT_SINK_TOKENS, check_window_cap
        check_window_cap(cap, DEFAULT_SINK_TOKENS, args.block_size)
    return cap if cap is not None else geom.max_position


def check_server_flags(args) -> bool:
    """True for a --server run; --kv-events and --geometry make sense only with one."""
    if getattr(args, "server", None):
        return True
    for flag, value in (("--kv-events", getattr(args, "kv_events", None)), ("--kv-replay", getattr(args, "kv_replay", None)),
                        ("--geometry", getattr(args, "geometry", None)),
                        ("--timeouts", getattr(args, "timeouts", None))):
        if value:
            raise UsageError(f"{flag} needs --server URL (it describes a vLLM server)")
    return False
