"""The system prompt and the sampling settings, as the user changes them in the app.

`/system TEXT` replaces the focused conversation's system prompt: it is the start of every
prompt, so the cached prefix (and the block the conversations share) no longer matches and
the next turn prefills the whole history; the note says the text's tokens and how much every
prompt changes (a template's own default system prompt, which it replaces, counted).
`/temperature`, `/top-p` and `/seed` change the screen's SamplingParams, which every later
turn and F5 (regenerate) use: greedy (temperature 0) always gives the same reply, a sample
differs, and a seeded sample repeats.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvchat.engine.errors import KvchatError
from kvchat.engine.sampler import SamplingParams

from ..store.log import Restored
from ..text import plural
from .conversations import Conversations
from .host import Host


def resumed(sp: SamplingParams, restored: Restored | None) -> SamplingParams:
    """--resume: the conversation's last /temperature, /top-p and /seed, each where the
    command line left it at its default (a flag given says otherwise)."""
    saved = restored.sampling if restored is not None and restored.sampling else {}
    defaults = SamplingParams()
    keep = {k: v for k, v in saved.items() if getattr(sp, k) == getattr(defaults, k)}
    try:
        return replace(sp, **keep)
    except KvchatError:      # a hand-edited value out of range: the flags' sampling
        return sp


def describe(sp: SamplingParams) -> str:
    """'greedy', or 'temperature 0.8 · top-p 0.9 · seed 7'."""
    if sp.temperature == 0:
        return "greedy"
    parts = [f"temperature {sp.temperature:g}"]
    if sp.top_p < 1.0:
        parts.append(f"top-p {sp.top_p:g}")
    parts.append(f"seed {sp.seed}" if sp.seed is not None else "unseeded")
    return " · ".join(parts)


class Generation:
    def __init__(self, host: Host, conversations: Conversations, sampling: SamplingParams) -> None:
        self.host = host
        self.conversations = conversations
        self.sampling = sampling          # the screen's own: each turn reads it when it starts

    def set_system(self, text: str) -> None:
        host, session = self.host, self.host.session
        tokens = host.backend.count_tokens(text) if text else 0
        old = session.state.system
        others = len(self.conversations.views) > 1

        def run() -> str:
            before = session.chat.history_tokens()
            session.chat.set_system(text or None)
            session.log.event("system", value=text or None)
            after = session.chat.history_tokens()
            net = after - before if after is not None and before is not None else None
            change = "" if net is None else (f"; every prompt {net:+,} tokens" if net else
                                             "; every prompt the same length")
            if not text:
                return f"system prompt removed{change}; the next turn prefills the whole history"
            size = plural(tokens, "token") if tokens is not None else "an unknown number of tokens"
            # a template with a default system prompt of its own (the bundled model's) drops it
            # for this one: the prompt changes by the difference, not by the text's tokens
            replaced = (f", in place of {old!r}" if old else ", in place of the chat template's default one"
                        if net is not None and tokens is not None and net < tokens else "")
            shared = "; other conversations keep the old one" if others else ""
            return (f"system prompt set: {size}{replaced}{change}. "
                    f"It changes the shared prefix, so the next turn prefills the whole history{shared}")
        host.run_op("set the system prompt", run, interrupt=False)

    def set(self, name: str, value: float | None) -> None:
        """A new temperature, top_p or seed; validated by SamplingParams."""
        changes: dict[str, Any] = {name: value}     # SamplingParams checks the name and the value
        try:
            new = replace(self.sampling, **changes)
        except KvchatError as err:
            self.host.notice(str(err), error=True)
            return
        setattr(self.sampling, name, getattr(new, name))
        sp = self.sampling      # kept in the log, so --resume samples as the conversation did
        self.host.session.log.event("sampling", value={"temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed})
        note = f"sampling: {describe(self.sampling)}"
        if self.sampling.temperature == 0 and name in ("top_p", "seed"):
            note += " (top-p and seed apply once /temperature is above 0)"
        self.host.settings_changed(note + "; F5 regenerates with it")
