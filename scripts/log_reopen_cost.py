"""What reopening a large conversation log costs: the log read back (store/log.py `restore`,
one pass through store/log_records.py) and its transcript drawn (widgets/transcript.py
`show_history`, headless), each timed, with the process's peak RSS.

    python scripts/log_reopen_cost.py [--mib 97] [--reply-chars 300000]

The log is written to a temporary folder the way kvchat writes it (a start record, then per
turn the user's message, the reply and the turn's record with one latency per token), with
replies of --reply-chars characters (a mix of prose, code and a table) until it is --mib MiB.
The hostile tester's case (issue 27): a 97 MB log took 151 s to reopen.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_log(path: Path, mib: float, reply_chars: int) -> int:
    """A log of about `mib` MiB; returns its number of turns."""
    from long_reply_cost import prose, table

    reply = (prose(reply_chars // 2) + "\n\n" + table(reply_chars // 80))[:reply_chars]
    tokens = reply_chars // 4
    turns = 0
    with path.open("w", encoding="utf-8") as f:
        f.write(json.dumps({"type": "start", "time": time.time(), "model": "smollm2-135m", "system": None,
                            "cap": None, "policy": "stop", "mode": "cache"}) + "\n")
        while f.tell() < mib * 2**20:
            turns += 1
            prompt = 20 + turns * (tokens + 30)
            f.write(json.dumps({"type": "message", "role": "user", "content": f"question {turns}, at length please"}) + "\n")
            f.write(json.dumps({"type": "message", "role": "assistant", "content": reply}) + "\n")
            f.write(json.dumps({"type": "turn", "turn": turns, "prompt_tokens": prompt, "reused_tokens": prompt - 30,
                                "computed_tokens": 30, "generated_tokens": tokens, "ttft_ms": 40.0, "prefill_ms": 35.0,
                                "decode_ms": [round(10 + (i % 7) * 0.1, 2) for i in range(tokens)],
                                "positions": list(range(prompt, prompt + tokens)), "stop_reason": "eos",
                                "reply": reply, "mode": "cache", "kv_dtype": "fp32", "policy": "stop"}) + "\n")
    return turns


async def draw(history) -> float:
    from textual.app import App, ComposeResult

    from kvchat.widgets.transcript import Transcript

    class Host(App):
        def compose(self) -> ComposeResult:
            yield Transcript()

    app = Host()
    async with app.run_test(size=(140, 60)) as pilot:
        t0 = time.perf_counter()
        await app.query_one(Transcript).show_history(history)
        await pilot.pause()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=97.0)
    ap.add_argument("--reply-chars", type=int, default=300_000)
    ap.add_argument("--no-draw", action="store_true", help="time the read only")
    args = ap.parse_args()
    if args.mib <= 0 or args.reply_chars <= 0:
        ap.error("--mib and --reply-chars must be positive")
    from kvchat.store.log import restore

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.jsonl"
        turns = write_log(path, args.mib, args.reply_chars)
        size = path.stat().st_size
        t0 = time.perf_counter()
        restored = restore(path)
        read_s = time.perf_counter() - t0
        print(f"log: {size / 2**20:.1f} MiB, {turns} turns of {args.reply_chars:,}-character replies")
        print(f"read back (restore):  {read_s:.2f} s, {len(restored.messages)} messages, "
              f"{len(restored.problems)} problems")
        if not args.no_draw:
            print(f"transcript drawn:     {asyncio.run(draw(restored.history)):.2f} s")
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    with open("/proc/loadavg") as f:
        print("load average:", " ".join(f.read().split()[:3]))


if __name__ == "__main__":
    main()
