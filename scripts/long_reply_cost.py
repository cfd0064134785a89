"""What a long reply costs the UI thread: one Reply (kvchat/widgets/transcript.py) in a small
host App, headless (Textual's Pilot), fed a long reply in batches as the turn relay sends
them, then the help screen (kvchat/screens/help_screen.py) pushed as F1 does.

    python scripts/long_reply_cost.py [--case table|prose|paragraph|all] [--batch 1000]

Each case runs in its own process (so the peak RSS is that case's) and prints: the UI
thread's CPU seconds to stream the reply in and finish it, the slowest batch (wall), the
seconds until the help screen is drawn after the reply, the process's peak RSS, and the
UI CPU per batch over the first and the last tenth of the batches (a bounded cost stays
flat), and whether the widget kept the text whole. The cases:
- short: 4,000 characters of the same prose (the control: an ordinary reply);
- table: a 2,000-row Markdown table (the hostile tester's 90 s, 1.8 GB case);
- prose: 300,000 characters of paragraphs, lists and code blocks (~1,600 blocks);
- paragraph: 300,000 characters in one paragraph (one block that never ends).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ("short", "table", "prose", "paragraph")
WORDS = ("cache", "block", "token", "layer", "value", "key", "prefix", "decode", "pool", "reuse")


def table(rows: int = 2000) -> str:
    head = "| # | name | bytes | note |\n|---:|---|---:|---|\n"
    return "Here is the table:\n\n" + head + "".join(
        f"| {i} | item {i} | {i * 37 % 1000:,} | {WORDS[i % 10]} {WORDS[(i * 7) % 10]} |\n" for i in range(rows))


def prose(chars: int = 300_000) -> str:
    parts: list[str] = []
    n, i = 0, 0
    while n < chars:
        k = i % 12
        if k == 0:
            part = f"## Part {i // 12 + 1}\n\n"
        elif k == 5:
            part = "".join(f"- point {j}: the {WORDS[(i + j) % 10]} stays\n" for j in range(4)) + "\n"
        elif k == 9:
            part = "```python\n" + "".join(f"x{j} = {j} * {i}\n" for j in range(5)) + "```\n\n"
        else:
            part = " ".join(WORDS[(i * 3 + j) % 10] for j in range(50)) + f" ({i}).\n\n"
        parts.append(part)
        n += len(part)
        i += 1
    return "".join(parts)


def paragraph(chars: int = 300_000) -> str:
    out, n, i = [], 0, 0
    while n < chars:
        w = WORDS[(i * 7) % 10] + " "
        out.append(w)
        n += len(w)
        i += 1
    return "".join(out)


def text_of(case: str) -> str:
    return {"short": lambda: prose(4_000), "table": table, "prose": prose, "paragraph": paragraph}[case]()


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def measure(case: str, batch: int, size: tuple[int, int]) -> dict:
    from textual.app import App, ComposeResult

    from kvchat.screens.help_screen import HelpScreen
    from kvchat.widgets.transcript import Transcript

    class Host(App):
        def compose(self) -> ComposeResult:
            yield Transcript()

    text = text_of(case)
    rss0 = rss_mib()
    app = Host()
    async with app.run_test(size=size) as pilot:
        transcript = app.query_one(Transcript)
        await transcript.add_user("show me a long one")
        reply = await transcript.start_reply()
        await pilot.pause()
        cpu0, wall0, slowest = time.thread_time(), time.perf_counter(), 0.0
        costs: list[float] = []              # UI CPU seconds per batch
        for start in range(0, len(text), batch):
            t0, c0 = time.perf_counter(), time.thread_time()
            await reply.append(text[start:start + batch])
            await pilot.pause()              # the relay's worker waits for each batch's draw
            slowest = max(slowest, time.perf_counter() - t0)
            costs.append(time.thread_time() - c0)
        await reply.finish(None)
        await pilot.pause()
        cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
        t0 = time.perf_counter()
        app.push_screen(HelpScreen({}, "settings.json"))
        while not isinstance(app.screen, HelpScreen):
            await pilot.pause(0.01)
        await pilot.pause()                  # drawn
        help_s = time.perf_counter() - t0
        kept = reply.text == text
    tenth = max(1, len(costs) // 10)
    first, last = sum(costs[:tenth]) / tenth, sum(costs[-tenth:]) / tenth
    return {"case": case, "chars": len(text), "batches": -(-len(text) // batch), "ui_cpu_s": round(cpu, 2),
            "wall_s": round(wall, 2), "slowest_batch_s": round(slowest, 3),
            "first_ms": round(first * 1000), "last_ms": round(last * 1000), "help_s": round(help_s, 3),
            "peak_rss_mib": round(rss_mib()), "rss_before_mib": round(rss0), "text_kept": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=(*CASES, "all"), default="all")
    ap.add_argument("--batch", type=int, default=1000, help="characters per relay batch (default 1000)")
    ap.add_argument("--size", default="140x60", help="terminal size (default 140x60)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child process: print JSON
    args = ap.parse_args()
    if args.batch <= 0:
        ap.error(f"--batch must be a positive number of characters, got {args.batch}")
    w, _, h = args.size.partition("x")
    size = (int(w), int(h))
    if args.one:
        print(json.dumps(asyncio.run(measure(args.case, args.batch, size))))
        return
    cases = CASES if args.case == "all" else (args.case,)
    print(f"{'case':10} {'chars':>8} {'batches':>7} {'UI CPU s':>9} {'wall s':>8} {'slowest':>8} "
          f"{'help s':>7} {'peak RSS':>9} {'batch ms first/last tenth':>26} kept")
    for case in cases:
        out = subprocess.run([sys.executable, __file__, "--one", "--case", case, "--batch", str(args.batch),
                              "--size", args.size], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{case:10} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{case:10} {r['chars']:>8,} {r['batches']:>7} {r['ui_cpu_s']:>9.2f} {r['wall_s']:>8.2f} "
              f"{r['slowest_batch_s']:>8.3f} {r['help_s']:>7.3f} {r['peak_rss_mib']:>6} MiB "
              f"{r['first_ms']:>12} / {r['last_ms']:<11} {r['text_kept']}")
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
