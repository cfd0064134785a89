"""The draft's cost, beside the input before it is sent: the tokens the message will add to
the cache and their bytes (tokens x the backend's bytes per token; the chat template adds a
few more). Counting tokenizes the whole draft, so it runs at most every DELAY seconds while
the user types, and once more when typing pauses."""
from __future__ import annotations

import time

from textual.timer import Timer

from kvchat.engine.units import human_bytes

from ..backends.protocol import Backend
from ..text import plural
from ..widgets.chat_input import ChatInput

DELAY = 0.25


def label(tokens: int | None, bytes_per_token: int | None) -> str:
    """'12 tokens · 270 KiB of cache', or '' for an empty draft or an unknown count."""
    if not tokens:
        return ""
    size = f" · {human_bytes(tokens * bytes_per_token)} of cache" if bytes_per_token else ""
    return f"draft: {plural(tokens, 'token')}{size}"


class DraftCounter:
    """Counts what `field` holds with `backend` (None until the model loads), in its title."""

    def __init__(self, field: ChatInput, delay: float = DELAY) -> None:
        self.field = field
        self.backend: Backend | None = None
        self.delay = delay
        self.counted_at = 0.0
        self.timer: Timer | None = None
        self.counts = 0                  # how many times it tokenized (the throttle's test reads it)

    def changed(self) -> None:
        """The draft changed: count now if the last count is old enough, else once it pauses."""
        if self.timer is not None:
            self.timer.stop()
            self.timer = None
        if not self.field.text or time.monotonic() - self.counted_at >= self.delay:
            self.count()
        else:
            self.timer = self.field.set_timer(self.delay, self.count)

    def count(self) -> None:
        self.timer = None
        self.counted_at = time.monotonic()
        field, backend = self.field, self.backend
        if not field.is_attached:        # the app closed while the timer waited
            return
        text = field.text
        if backend is None or not text.strip() or text.lstrip().startswith("/") and not text.lstrip().startswith("//"):
            field.border_title = ""
            return
        self.counts += 1
        field.border_title = label(backend.count_tokens(text), backend.info().bytes_per_token)
