"""The context-cap gauge: the conversation's tokens against the cap (sink-window: the tokens its
cache holds), and the policy in force."""
from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from .panel import Panel

GAUGE_NEAR = 0.8


class CapGauge(Panel, Widget):
    """`show(tokens, cap, policy, description, max_position, evicted)`; colours from component
    classes. `evicted` counts the tokens a streaming policy (sink-window) has evicted. While
    hidden it only keeps the figures."""

    COMPONENT_CLASSES = {"capgauge--ok", "capgauge--near", "capgauge--over", "capgauge--empty"}
    DEFAULT_CSS = """
    CapGauge { height: auto; border: round $primary 50%; padding: 0 1; }
    CapGauge > .capgauge--ok { color: $success; }
    CapGauge > .capgauge--near { color: $warning; }
    CapGauge > .capgauge--over { color: $error; }
    CapGauge > .capgauge--empty { color: $foreground 20%; }
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "context cap"
        self.tokens = 0
        self.cap: int | None = None
        self.policy = "stop"
        self.description = ""
        self.max_position = 0
        self.evicted = 0

    def show(self, tokens: int, cap: int | None, policy: str, description: str = "", max_position: int = 0,
             evicted: int = 0) -> None:
        state = (tokens, cap, policy, description, max_position, evicted)
        old = (self.tokens, self.cap, self.policy, self.description, self.max_position, self.evicted)
        if state != old:
            self.tokens, self.cap, self.policy, self.description, self.max_position, self.evicted = state
            # only the policy line can change the height
            if self.drawing():
                self.refresh(layout=state[2:4] != old[2:4] or bool(state[5]) != bool(old[5]))

    def draw(self) -> None:
        self.refresh(layout=True)

    @property
    def fraction(self) -> float:
        limit = self.cap or self.max_position
        return self.tokens / limit if limit else 0.0

    def render(self) -> Text:
        limit = self.cap or self.max_position
        frac = self.fraction
        level = "over" if frac >= 1 else "near" if frac >= GAUGE_NEAR else "ok"
        width = max((self.content_region.width or 30) - 8, 8)
        filled = min(width, round(width * frac))
        out = Text()
        if self.cap is not None:
            out.append(f"{self.tokens:,} / {self.cap:,} tokens")
        else:
            out.append(f"{self.tokens:,} tokens · no cap")
            if self.max_position:
                out.append(f" (model max {self.max_position:,})", style="dim")
        out.append("\n")
        out.append("█" * filled, self.get_component_rich_style(f"capgauge--{level}"))
        out.append("░" * (width - filled), self.get_component_rich_style("capgauge--empty"))
        out.append(f" {100 * frac:3.0f}%" if limit else "")
        out.append("\npolicy ")
        out.append(self.policy, style="bold")
        if self.description:
            out.append(f": {self.description}", style="dim")
        if self.evicted:
            out.append(f"\nevicted {self.evicted:,} tokens from the middle so far", style="bold")
        elif self.policy == "sink-window" and self.cap is None:
            where = f"the model's maximum of {self.max_position:,} tokens" if self.max_position else "the model's maximum"
            out.append(f"\nno cap: it evicts at {where} (F3 or /cap N sets a smaller window)", style="dim")
        return out
