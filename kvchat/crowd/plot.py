"""The headless runs drawn against the number of users: aggregate tokens/s (what batching
buys) and the TTFT percentiles (what the crowd costs each user), as bars in the terminal
and as a PNG (matplotlib)."""
from __future__ import annotations

from .report import CrowdRun

BAR = "█"


def terminal(runs: list[CrowdRun], width: int = 40) -> str:
    sums = [r.summary() for r in runs]
    lines = []
    for title, key, unit in (("aggregate tokens/s", "tokens_per_s", "tok/s"), ("TTFT p90", "ttft_p90_ms", "ms")):
        top = max((s[key] or 0.0 for s in sums), default=0.0) or 1.0
        lines.append(f"{title} against users")
        for s in sums:
            v = s[key]
            bar = BAR * max(1, round(width * v / top)) if v else ""
            lines.append(f"  {s['users']:>3} {bar} {'n/a' if v is None else f'{v:,.1f} {unit}'}")
    return "\n".join(lines)


def png(runs: list[CrowdRun], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        from ..cli.args import UsageError
        raise UsageError("--plot needs matplotlib (pip install matplotlib); the rest of the run does not") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sums = [r.summary() for r in runs]
    users = [s["users"] for s in sums]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=90)
    ax1.plot(users, [s["tokens_per_s"] for s in sums], marker="o")
    ax1.set_xlabel("simulated users")
    ax1.set_ylabel("aggregate reply tokens/s")
    ax1.set_title("throughput: one step serves every user", fontsize=10)
    for key, label in (("ttft_p50_ms", "p50"), ("ttft_p90_ms", "p90"), ("ttft_p99_ms", "p99")):
        pts = [(u, s[key]) for u, s in zip(users, sums) if s[key] is not None]
        ax2.plot([u for u, _ in pts], [v for _, v in pts], marker="o", label=label)
    ax2.set_xlabel("simulated users")
    ax2.set_ylabel("time to first token, ms")
    ax2.set_title("what the crowd costs each user", fontsize=10)
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(users)
    fig.suptitle("kvchat crowd (measured)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
