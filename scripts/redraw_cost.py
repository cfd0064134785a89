"""What drawing the panels costs the decode steps it measures: the real app, headless
(Textual's Pilot), on the real engine and the bundled model, regenerating the same reply
(greedy: the same tokens at the same positions) with the panels hidden (F6) and shown,
and shown with the old behaviour (the worker does not wait for the UI to draw each batch).

    python scripts/redraw_cost.py [--tokens 96] [--rounds 3]

Prints the median and p90 decode step per condition, each against "hidden" measured in the
same run, and the load average (on a shared machine the figures move with it).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN, DRAWN, FREE = "panels hidden", "panels shown", "panels shown, no wait (before)"
PROMPT = "Tell a long story about a lighthouse keeper and a storm, in many short sentences."


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


async def measure(tokens: int, rounds: int, size: tuple[int, int]) -> dict[str, list[float]]:
    from kvchat.chat import worker
    from kvchat.app.shell import AppOptions, KvChatApp
    from kvchat.backends.local import LocalBackend
    from kvchat.engine import Engine, EngineConfig
    from kvchat.engine.sampler import SamplingParams

    backend = LocalBackend(Engine(EngineConfig(kv_budget="64MiB")))
    app = KvChatApp(lambda: backend, AppOptions(model="bundled", sampling=SamplingParams(max_tokens=tokens)))
    steps: dict[str, list[float]] = {HIDDEN: [], DRAWN: [], FREE: []}

    async def until(cond, what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {what}")
            await pilot.pause(0.02)

    async def turn(text: str) -> None:
        n = len(app.chat_screen.session.turns)
        app.query_one("#input").load_text(text)
        await pilot.press("enter")
        await until(lambda: len(app.chat_screen.session.turns) > n and app.chat_screen.jobs.busy is None, f"the reply to {text!r}")

    async with app.run_test(size=size) as pilot:
        await until(lambda: app.chat_screen.conversations.session is not None and app.chat_screen.jobs.busy is None
                     and app.chat_screen.conversations.session.snapshot is not None, "the load")
        await turn(PROMPT)                                  # warm up; later turns regenerate this reply
        order = [HIDDEN, DRAWN, FREE]
        for r in range(rounds):
            for cond in order[r % 3:] + order[:r % 3]:     # rotated, so a load trend hits each alike
                app.chat_screen.query_one("#panels").display = cond != HIDDEN
                worker.DRAW_BETWEEN_STEPS = cond != FREE
                await turn("/regen")
                steps[cond].extend(app.chat_screen.session.turns[-1].decode_ms)
        worker.DRAW_BETWEEN_STEPS = True
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96, help="reply tokens per turn")
    parser.add_argument("--rounds", type=int, default=3, help="turns per condition, interleaved")
    args = parser.parse_args()
    os.environ.setdefault("KVCHAT_DATA_DIR", tempfile.mkdtemp(prefix="kvchat-bench-"))
    os.environ.setdefault("KVCHAT_CONFIG_DIR", tempfile.mkdtemp(prefix="kvchat-bench-"))
    load0 = os.getloadavg()
    steps = asyncio.run(measure(args.tokens, args.rounds, (160, 48)))
    load1 = os.getloadavg()
    base_med, base_p90 = statistics.median(steps[HIDDEN]), p90(steps[HIDDEN])
    print(f"decode step, ms ({args.rounds} interleaved turns of up to {args.tokens} tokens each; "
          f"load average {load0[0]:.1f} before, {load1[0]:.1f} after, on {os.cpu_count()} CPUs)")
    print(f"{'condition':<32}{'steps':>7}{'median':>9}{'vs hidden':>11}{'p90':>9}{'vs hidden':>11}")
    for cond, xs in steps.items():
        med, q = statistics.median(xs), p90(xs)
        print(f"{cond:<32}{len(xs):>7}{med:>9.1f}{med / base_med - 1:>+11.1%}{q:>9.1f}{q / base_p90 - 1:>+11.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
