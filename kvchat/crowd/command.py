"""`kvchat crowd`: simulated users chatting in one pool, headless, for a while; the table of
what each number of users got, per-user turn records and per-step totals in --json, and
the figures drawn against the number of users with --plot.

    kvchat crowd --users 8 --minutes 2 [--long] --json FILE [--plot FILE.png]
    kvchat crowd --users 1,2,4,8 --minutes 1 --kv-budget 64MiB --json sweep.json --plot sweep.png

argparse only at import: the engine loads when the command runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli.args import UsageError, add_model_args, float_in, positive_int
from ..text import command_remedies

MAX_USERS = 64     # as kvchat/crowd/driver.py (not imported here: it pulls the engine in)


def user_counts(text: str) -> tuple[int, ...]:
    """--users: a number, or numbers with commas (one run each)."""
    want = f"--users must be a number of users from 1 to {MAX_USERS}, or several with commas (1,2,4,8)"
    try:
        counts = tuple(int(p) for p in text.replace(" ", "").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{want}, got {text!r}") from None
    if not counts or any(not 1 <= n <= MAX_USERS for n in counts):
        raise argparse.ArgumentTypeError(f"{want}, got {text!r}")
    return counts


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("crowd", help="simulated users chatting in one pool for a while: throughput, TTFT, "
                                            "preemptions, per user and per step")
    add_model_args(p)
    p.add_argument("--users", type=user_counts, required=True, metavar="N[,N...]",
                   help=f"simulated users (1 to {MAX_USERS}); several with commas run one after another")
    p.add_argument("--minutes", type=float_in("--minutes", 0.0, 600.0, lo_open=True), required=True,
                   help="how long each run lasts")
    p.add_argument("--long", action="store_true", help="user 1 pastes a long report and adds to it every turn")
    p.add_argument("--long-words", type=positive_int("--long-words", 100_000), default=1500,
                   help="words of the long user's first text (default 1500, about 2,000 tokens)")
    p.add_argument("--think", type=float_in("--think", 0.0, 3600.0), default=2.0,
                   help="mean seconds between a reply and the user's next message (default 2)")
    p.add_argument("--reply-tokens", type=positive_int("--reply-tokens", 100_000), default=48,
                   help="most tokens per reply (default 48)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write each run's summary, per-user turn records and per-step totals")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw tokens/s and TTFT percentiles against the number of users (PNG, and the terminal)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _check_out(flag: str, path: str | None, suffix: str | None = None) -> None:
    if path is None:
        return
    target = Path(path)
    if suffix is not None and target.suffix.lower() != suffix:
        raise UsageError(f"{flag} {path!r}: give a {suffix} file name")
    if target.is_dir():
        raise UsageError(f"{flag} {path!r} is a directory; give a file name")
    if not target.parent.exists() if str(target.parent) else False:
        raise UsageError(f"{flag} {path!r}: the folder {str(target.parent)!r} does not exist")


def run(args, load_backend) -> int:
    """`load_backend(args, quiet)`: the CLI's (cli/command.py), passed down so this room
    does not import the command that imports it."""
    _check_out("--json", args.json)
    _check_out("--plot", args.plot, ".png")
    from .driver import CrowdConfig
    from .plot import png, terminal
    from .report import run_crowd, table
    configs = [CrowdConfig(users=n, long=args.long, think_s=args.think, reply_tokens=args.reply_tokens,
                           long_words=args.long_words, seed=i) for i, n in enumerate(args.users)]
    backend = load_backend(args, quiet=args.quiet)
    runs = []
    try:
        for cfg in configs:
            if not args.quiet:
                print(f"kvchat crowd: {cfg.users} users for {args.minutes:g} min ...", file=sys.stderr, flush=True)
            runs.append(run_crowd(backend, cfg, 60.0 * args.minutes,
                                  None if args.quiet else lambda t: _progress(t)))
    finally:
        backend.shutdown()
    print(table(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [r.to_dict() for r in runs]}, indent=1) + "\n",
                                   encoding="utf-8")
    if args.plot:
        png(runs, args.plot)
        print(terminal(runs))
    late = [r.config.users for r in runs if not r.stopped_in_time]
    if late:
        print(f"kvchat crowd: a user of the {late} run was still in a step 5 s after the stop", file=sys.stderr)
    return 0


def _progress(t) -> None:
    what = f"refused: {command_remedies(t.error, flags=False)}" if t.error else f"{t.prompt_tokens:,} + {t.generated_tokens} tokens, TTFT {t.ttft_ms} ms"
    print(f"  user {t.user + 1} turn {t.turn + 1}: {what}", file=sys.stderr, flush=True)
