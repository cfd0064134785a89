"""The chat app itself on the real engine, driven by Textual's Pilot: no terminal is needed, so
it runs on a machine without tmux (the GPU machine). kvchat's own flags build it exactly as
`kvchat` does (flags, preflight, settings, then the load inside the app); two turns are sent,
the second reusing the first's cached prefix, and the panels' figures are checked against the
engine's own arithmetic and written out as text.

    python benchmarks/gpu_app.py --out DIR -- --model DIR_OR_ALIAS --random-weights --max-tokens 32
    python benchmarks/gpu_app.py --out /tmp/app -- --max-tokens 8      # the bundled model on CPU

Writes DIR/app_screen.txt (the screen after each turn) and prints one JSON line of figures
and a PASS/FAIL line per check; exit status 1 if a check failed, 2 if the app never got ready.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESSAGES = ("Explain in one paragraph what a KV cache stores.", "And why does it grow with the conversation?")
SIZE = (160, 48)


def screen_text(app) -> str:
    """What the screen shows, as plain text (the compositor's lines: Textual has no text export)."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def wait_until(pilot, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        await pilot.pause(0.05)


async def drive(app, out: Path, load_timeout: float, turn_timeout: float) -> tuple[dict, list[tuple[str, bool]]]:
    from kvchat.engine.units import human_bytes
    from kvchat.widgets import BlockMap, CachePanel, LatencyPanel
    figures: dict = {}
    checks: list[tuple[str, bool]] = []
    screens = []
    t0 = time.perf_counter()
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat_screen
        await wait_until(pilot, lambda: app.failure is not None or (
            screen.conversations.session is not None and screen.jobs.busy is None
            and screen.conversations.session.snapshot is not None), load_timeout, "the model to load")
        if app.failure:
            raise RuntimeError(f"the app failed to load: {app.failure}")
        figures["ready_s"] = round(time.perf_counter() - t0, 2)
        panel = app.query_one(CachePanel)
        before_map = app.query_one(BlockMap).render().plain
        for i, text in enumerate(MESSAGES):
            n = len(screen.session.turns)
            app.query_one("#input").load_text(text)
            await pilot.press("enter")
            await wait_until(pilot, lambda: len(screen.session.turns) > n and screen.jobs.busy is None,
                             turn_timeout, f"the reply to message {i + 1}")
            await pilot.pause(0.3)   # the panels' next refresh
            stats, snap = screen.session.turns[-1], panel.snapshot
            decode = sorted(stats.decode_ms)
            figures[f"turn{i + 1}"] = dict(
                prompt_tokens=stats.prompt_tokens, reused_tokens=stats.reused_tokens,
                computed_tokens=stats.computed_tokens, generated_tokens=stats.generated_tokens,
                ttft_ms=round(stats.ttft_ms, 2), decode_ms_median=round(decode[len(decode) // 2], 3) if decode else None,
                tokens_held=snap.tokens_held, bytes_used=snap.bytes_used, bytes_per_token=snap.bytes_per_token,
                kv_dtype=snap.kv_dtype, latency_points=app.query_one(LatencyPanel).point_count)
            shown = screen_text(app)
            screens.append(f"---- after turn {i + 1} ----\n{shown}")
            checks.append((f"turn {i + 1}: bytes used = bytes/token x tokens held",
                           snap.bytes_used == snap.bytes_per_token * snap.tokens_held > 0))
            checks.append((f"turn {i + 1}: the cache panel shows the bytes used",
                           human_bytes(snap.bytes_used) in shown and f"{snap.bytes_used:,}" in shown))
            checks.append((f"turn {i + 1}: a latency point per decode step",
                           i > 0 or app.query_one(LatencyPanel).point_count == len(stats.decode_ms) > 0))
            if i == 0:
                checks.append(("turn 1: the block map changed", app.query_one(BlockMap).render().plain != before_map))
            else:
                first = figures["turn1"]
                checks.append(("turn 2: reuses turn 1's cached prefix",
                               (stats.reused_tokens or 0) >= first["prompt_tokens"] - 16 > 0))
        await pilot.press("ctrl+q")
    (out / "app_screen.txt").write_text("\n\n".join(screens) + "\n")
    return figures, checks


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--turn-timeout", type=float, default=300)
    opts = ap.parse_args(own)
    opts.out.mkdir(parents=True, exist_ok=True)
    from kvchat.cli.command import build_parser
    from kvchat.cli.launch import LaunchError, prepare
    args = build_parser().parse_args(flags)
    try:
        app = prepare(args)
    except LaunchError as err:
        print(f"gpu_app: {err}", file=sys.stderr)
        return 2
    try:
        figures, checks = asyncio.run(drive(app, opts.out, opts.load_timeout, opts.turn_timeout))
    except (TimeoutError, RuntimeError) as err:
        print(f"gpu_app: {err}", file=sys.stderr)
        return 2
    finally:
        if app.backend is not None:
            app.backend.shutdown()
    print(json.dumps(figures))
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}  app  {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
