"""`/plan` in the app: `kvchat plan`'s simulation of many users on hardware you may not have,
its answer in the transcript beside `/whatif`'s arithmetic.

Two forms: the short one, `/plan [MODEL] [GPU] [USERS]` (`/plan 70b h100-sxm 64`), and any of
the command's own flags (`/plan --model 70b --pool 15GB --users 8 --long 30000`), parsed by
the command's parser so that both say the same about bad input. The modes that write files or
run users for real (--json, --plot, --validate, --calibrate...) stay with the command. The
simulation runs after the current turn, in a worker, as the backend's operations do.
"""
from __future__ import annotations

import argparse
from typing import NoReturn

from kvchat.engine.errors import KvchatError

from ..cli.args import UsageError
from ..commands import CommandError
from ..text import plural, short_alias

USAGE = ("usage: /plan [MODEL] [GPU] [USERS], or kvchat plan's flags; e.g. /plan 8b h100-sxm 64, "
         "/plan --model 70b --pool 15GB --users 8 --long 30000")
# what the command does that the transcript cannot show: files written, users run for real
COMMAND_ONLY = ("--json", "--plot", "--save-trace", "--calibrate", "--write-calibration", "--validate", "--server",
                "--scenario", "--list-gpus")


class _Parser(argparse.ArgumentParser):
    """kvchat plan's parser, raising instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise CommandError(f"/plan: {message}; {USAGE}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:   # -h
        raise CommandError(USAGE + " (kvchat plan --help lists every flag)")


def flags(words: list[str]) -> list[str]:
    """The short form's words as the command's flags: a number is the users, a row of the
    hardware table (or cpu) the GPU, anything else the model (70b, 8b: the known aliases)."""
    from kvchat.plan.hardware import CPU, TABLE
    out: list[str] = []
    lead = 0
    while lead < len(words) and not words[lead].startswith("-"):
        lead += 1
    if lead > 3:
        raise CommandError(USAGE)
    for word in words[:lead]:
        key = word.strip().lower().replace("_", "-")
        if word.replace(",", "").isdigit():
            out += ["--users", word.replace(",", "")]
        elif key == CPU or key in TABLE:
            out += ["--gpu", key]
        else:
            out += ["--model", short_alias(word)]
    return out + words[lead:]


def parse(words: list[str]) -> argparse.Namespace:
    from kvchat.plan.command import add_parser
    given = flags(words)
    refused = sorted({w.split("=")[0] for w in given if w.split("=")[0] in COMMAND_ONLY})
    if refused:
        raise CommandError(f"/plan: {', '.join(refused)} run from the shell (kvchat plan {refused[0]} ...): "
                           "the transcript shows a plan's figures, it writes no files and runs no users")
    top = _Parser(prog="/plan", add_help=False)
    add_parser(top.add_subparsers(dest="command", parser_class=_Parser))
    return top.parse_args(["plan", *given])


def run_plan_lines(args: argparse.Namespace) -> str:
    """The simulation, as the transcript shows it: what was simulated, the latency percentiles,
    the throughput, the preemptions and the pool. Blocks (a few seconds for many users)."""
    from kvchat.plan.options import plan_config
    from kvchat.plan.planner import run_plan
    from kvchat.plan.report import setup_lines, story_lines
    try:
        p = run_plan(plan_config(args))
    except UsageError as err:          # the command's one-line refusals, as the app's errors
        raise KvchatError(f"/plan: {err}") from None
    s = p.summary
    lines = [f"/plan: a simulation of a vLLM-like server (not a measurement); {plural(s['requests'], 'request')} "
             f"in {s['duration_s']:,.1f} s simulated", *setup_lines(p)[:3]]
    lines.append(f"{'':<5}" + "".join(f" {q:>11}" for q in ("p50", "p90", "p99")))
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        st = s.get(key)
        if st is not None:
            lines.append(f"{label:<5}" + "".join(f" {_ms(st[q]):>11}" for q in ("p50", "p90", "p99")))
    out = f"output {s['output_throughput']:,.1f} tok/s"
    if "goodput" in s:
        out += f" · goodput {s['goodput']:,.2f} req/s ({s['good_requests']:,} of {s['requests']:,} within the SLO)"
    lines.append(out)
    lines.append(f"preemptions {s['preemptions']:,} · recomputed tokens {s['recomputed_tokens']:,}")
    lines += story_lines(p)
    lines += [f"note: {n}" for n in p.notes]
    lines.append("kvchat plan with the same flags prints the full report, the step-time constants and a chart")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value / 1000:,.2f} s" if value >= 1000 else f"{value:,.1f} ms"
