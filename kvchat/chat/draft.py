"""The draft's cost, beside the input before it is sent: the tokens the message will add to
the prompt and their bytes of cache (tokens x the backend's bytes per token). That is the
typed text and the chat template's tokens around a user turn, as the turn's stats will count
them (a 2-token "hi there" adds 13 on the bundled model), and before the first reply the
template's start and the system prompt too; the label says which part is which. Counting
tokenizes the whole draft, so it runs at most every DELAY seconds while the user types, and
once more when typing pauses."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from textual.timer import Timer

from kvchat.engine.units import human_bytes

from ..backends.protocol import Backend
from ..text import plural
from ..widgets.chat_input import ChatInput

if TYPE_CHECKING:
    from .conversations import Conversations

DELAY = 0.25


def label(typed: int | None, tokens: int | None, bytes_per_token: int | None, system: bool = False) -> str:
    """'draft: 13 tokens (2 typed + 11 chat template) · 585 KiB of cache', or '' for an empty
    draft or an unknown count; `tokens` None (the template's part unknown): the typed ones;
    `system`: the first message, which carries the conversation's system prompt."""
    if not typed:
        return ""
    if tokens is None:
        return f"draft: {plural(typed, 'token')} typed (the chat template adds more)"
    size = f" · {human_bytes(tokens * bytes_per_token)} of cache" if bytes_per_token else ""
    rest = "chat template and system prompt" if system else "chat template"
    return f"draft: {plural(tokens, 'token')} ({typed:,} typed + {tokens - typed:,} {rest}){size}"


class DraftCounter:
    """Counts what `field` holds with `backend` (None until the model loads) as a message of the
    conversation in focus, in its title."""

    def __init__(self, field: ChatInput, conversations: Conversations, delay: float = DELAY) -> None:
        self.field = field
        self.conversations = conversations
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
        session = self.conversations.session
        chat = session.chat if session is not None else None
        tokens = chat.message_tokens(text) if chat is not None else None
        messages = session.state.messages if session is not None else ()
        system = bool(messages) and all(m["role"] == "system" for m in messages)     # the first message carries it
        field.border_title = label(backend.count_tokens(text), tokens, backend.info().bytes_per_token, system)
