"""The pool over time, drawn: in text for the terminal (blocks in use, cached blocks above
them, the running and waiting requests as sparklines), and as a PNG (matplotlib) with the
first-token times of every request beside it."""
from __future__ import annotations

from pathlib import Path

from .planner import PlanResult

SPARK = "▁▂▃▄▅▆▇█"


def _buckets(p: PlanResult, width: int) -> list[tuple[float, float, int, int]]:
    """Per column: the mean in-use and in-use-or-cached fractions, the most running and waiting."""
    samples = p.result.samples
    n = p.pool.num_blocks
    if not samples:
        return []
    t0, t1 = samples[0][0], samples[-1][0]
    span = (t1 - t0) or 1.0
    cols: list[list[tuple[float, float, int, int]]] = [[] for _ in range(width)]
    for t, used, cached, running, waiting, _ in samples:
        i = min(width - 1, int((t - t0) / span * width))
        cols[i].append((used / n, (used + cached) / n, running, waiting))
    out, last = [], (0.0, 0.0, 0, 0)
    for col in cols:
        if col:
            last = (sum(c[0] for c in col) / len(col), sum(c[1] for c in col) / len(col),
                    max(c[2] for c in col), max(c[3] for c in col))
        out.append(last)
    return out


def terminal(p: PlanResult, width: int = 64, height: int = 8) -> str:
    cols = _buckets(p, width)
    if not cols:
        return "pool over time: no steps were simulated"
    rows = []
    for level in range(height - 1, -1, -1):          # top row first; each cell holds eighths of a row
        line = []
        for u, uc, _, _ in cols:
            eighths = min(8, max(0, round(u * height * 8) - 8 * level))
            if eighths:
                line.append(SPARK[eighths - 1])
            else:
                line.append("░" if uc * height >= level + 0.5 else " ")
        label = "100%" if level == height - 1 else " 50%" if level == height // 2 - 1 else "    "
        rows.append(f"{label} │{''.join(line)}│")
    end = p.result.samples[-1][0] - p.result.samples[0][0]
    rows.append(f"   0 └{'─' * width}┘ {end:,.0f} s")
    for name, k in (("running", 2), ("waiting", 3)):
        top = max(c[k] for c in cols) or 1
        rows.append(f"{name:>7} " + "".join(SPARK[min(7, int(c[k] / top * 7.999))] if c[k] else " " for c in cols)
                    + f"  max {max(c[k] for c in cols)}")
    head = "pool over time: █ blocks in use, ░ cached and evictable (share of the pool's blocks)"
    return "\n".join([head, *rows])


def write_png(path: Path, p: PlanResult) -> None:
    try:
        import matplotlib
    except ImportError:
        from ..cli.args import UsageError
        raise UsageError("--plot needs matplotlib (pip install matplotlib); the rest of the plan does not") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = p.result.samples
    n = p.pool.num_blocks
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    ts = [x[0] for x in s]
    ax1.fill_between(ts, [x[1] / n for x in s], step="post", alpha=0.7, label="in use")
    ax1.fill_between(ts, [x[1] / n for x in s], [(x[1] + x[2]) / n for x in s], step="post", alpha=0.3,
                     label="cached, evictable")
    if p.long is not None:
        ax1.plot(ts, [x[5] / n for x in s], drawstyle="steps-post", color="crimson", label="the long user")
    ax1.set_ylim(0, 1.02)
    ax1.set_xlabel("simulated seconds")
    ax1.set_ylabel("share of the pool's blocks")
    ax1.legend(loc="upper left", fontsize=8)
    ax1.set_title(f"pool: {p.pool.num_blocks:,} blocks of {p.pool.block_size}", fontsize=10)
    recs = p.result.records
    for long, colour, label in ((False, "tab:blue", "requests"), (True, "crimson", "the long user's")):
        pts = [(r.arrival, r.ttft * 1000) for r in recs if r.long == long]
        if pts:
            ax2.scatter([a for a, _ in pts], [t for _, t in pts], s=6, color=colour, label=label)
    ax2.set_yscale("log")
    ax2.set_xlabel("arrival, simulated seconds")
    ax2.set_ylabel("TTFT, ms")
    ax2.legend(loc="upper left", fontsize=8)
    ax2.set_title("time to first token", fontsize=10)
    fig.suptitle(f"kvchat plan (simulated): {p.config.geometry.name} on {p.config.gpus}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
