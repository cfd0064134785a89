"""The crowd panel: every conversation in the pool, one row each (the user's own first and
highlighted), and the pool's totals: aggregate tokens/s, the step's time and its bytes
(weights once + every cache, the crossover named as it happens), preemptions and
recomputed tokens per minute, the waiting queue. It draws the CrowdFigures it is given
(kvchat/crowd/figures.py); figures a backend cannot tell read n/a."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from ..crowd.figures import CrowdFigures
from ..text import crossover_line
from .block_map import owner_colour
from .panel import Panel


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}" if v >= 10 else f"{v:.1f}"


def _n(v: int | float | None, fmt: str = ",.0f") -> str:
    return "n/a" if v is None else format(v, fmt)


class CrowdPanel(Panel, Widget):
    """`show(figures)`, or `show(None)` when no crowd runs; while hidden it only keeps them."""

    COMPONENT_CLASSES = {"crowdpanel--own", "crowdpanel--cross", "crowdpanel--head"}
    DEFAULT_CSS = """
    CrowdPanel { height: auto; border: round $primary 50%; padding: 0 1; }
    CrowdPanel > .crowdpanel--own { color: $accent; text-style: bold; }
    CrowdPanel > .crowdpanel--cross { color: $warning; text-style: bold; }
    CrowdPanel > .crowdpanel--head { color: $foreground 60%; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "crowd"
        self.figures: CrowdFigures | None = None

    def show(self, figures: CrowdFigures | None) -> None:
        if figures != self.figures:
            self.figures = figures
            if self.drawing():
                self.refresh(layout=True)

    def draw(self) -> None:
        self.refresh(layout=True)

    def render(self) -> Text:
        f = self.figures
        out = Text(no_wrap=True, overflow="ellipsis")
        if f is None:
            return out.append("no crowd: /crowd N adds N simulated users to this pool", style="dim")
        wide = (self.content_region.width or 60) >= 56
        head = (f"{'who':<14}{'state':<10}{'ctx':>7}{'TTFT':>7}{'ms/t':>6}{'blk':>5}{'pool':>6}" if wide
                else f"{'who':<8}{'state':<10}{'ctx':>6}{'TTFT':>6}{'ms/t':>5}{'pool':>5}")
        out.append(head + (" ms\n" if wide else "\n"), self.get_component_rich_style("crowdpanel--head"))
        for r in f.rows:
            share = "n/a" if r.pool_share is None else f"{100 * r.pool_share:.0f}%"
            if wide:
                line = (f"{r.name:<14}{r.state:<10}{_n(r.context_tokens):>7}{_ms(r.ttft_ms):>7}"
                        f"{_ms(r.ms_per_token):>6}{_n(r.blocks_held):>5}{share:>6}")
            else:       # 40 cells: the columns layout's 44-column panel
                name = r.name.replace("user ", "u").replace(" (long)", " long")
                line = (f"{name:<8}{r.state:<10}{_n(r.context_tokens):>6}{_ms(r.ttft_ms):>6}"
                        f"{_ms(r.ms_per_token):>5}{share:>5}")
            if r.own:
                out.append(line + "\n", self.get_component_rich_style("crowdpanel--own"))
                continue
            cut = len(line) - len(line.lstrip()) + (14 if wide else 8)
            colour = owner_colour(r.conversation) if r.conversation is not None else ""
            out.append(line[:cut], colour).append(line[cut:] + "\n")
        out.append(f"{f.users} simulated · {_n(f.tokens_per_s, ',.1f')} tok/s in all · step "
                   f"{_ms(f.step_ms)}\u00a0ms over {_n(f.step_tokens)} cached tokens\n")
        out.append(crossover_line(f.weight_bytes, f.cache_bytes, f.crossover_tokens) + "\n",
                   self.get_component_rich_style("crowdpanel--cross") if f.caches_pass_weights else "")
        out.append(f"preemptions {_n(f.preemptions_per_min, ',.1f')}/min · recomputed "
                   f"{_n(f.recomputed_per_min)} tok/min · waiting {_n(f.waiting)} · running {_n(f.running)}")
        if f.own_cost is not None:
            ms, step, mine = f.own_cost
            out.append(f"\nyou: {_ms(ms)} ms/token over steps reading {step:,.0f} cached tokens in all "
                       f"(your own context {mine:,.0f})")
        if f.source != "local":
            out.append(f"\nfrom {f.source}: per-user blocks and steps n/a", style="dim")
        return out
