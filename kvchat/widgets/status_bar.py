"""The top line: the model and its settings on the left, the last setting changed (a note)
in the middle, what kvchat is doing on the right; a warning (random weights) before all."""
from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from ..text import fit_segments, inert


RANDOM_WEIGHTS_SHORT = "random weights: gibberish by design"
RANDOM_WEIGHTS_TINY = "random weights"      # where the long form would push out the cap and the policy
KEPT = 3          # the settings' segments a narrow line keeps before a long warning: model, cap, policy


class StatusBar(Widget):
    DEFAULT_CSS = "StatusBar { height: 1; background: $panel; padding: 0 1; }"

    info: reactive[str] = reactive("kvchat")
    """model · device · dtypes · cache mode"""
    state: reactive[str] = reactive("starting")
    """loading 1.2 s, ready, replying, ..."""
    note: reactive[str] = reactive("")
    """the last setting changed: "cap 2,048 tokens", "theme light", ..."""
    warning: reactive[str] = reactive("")
    """what the user must not miss: "random weights: gibberish by design\""""

    def show_settings(self, info, state, number: int, open_chats: int, sampling: str) -> None:
        """The model and the focused conversation's settings (a BackendInfo and a ChatState)."""
        cap = f"cap {state.cap:,}" if state.cap else "no cap"
        # numbers stay with their conversations (/switch N): after a close, "of N" would lie
        chat = f"chat {number} · {open_chats} open · " if open_chats > 1 else ""
        # a narrow terminal keeps the first segments: the cap and the policy, which the user
        # changes, before what changes only with a restart (issue 26: cut at 80x24)
        self.info = (f"{info.model} · {cap} · {state.policy} · {chat}KV {info.kv_dtype} · "
                     f"cache {'on' if state.mode == 'cache' else 'off'} · {info.device} · {info.dtype} · {sampling}")
        self.warning = RANDOM_WEIGHTS_SHORT if info.random_weights else ""

    def render(self) -> Text:
        """One line laid out by hand: the warning, the settings (whole segments only), the
        note if there is room for it, and the state on the right. A served model's name and
        a server's URL are in the settings: all of it is drawn inert."""
        width = self.content_size.width or 200
        state = fit_segments(inert(self.state), max(width - 12, 8))
        kept = " · ".join(inert(self.info).split(" · ")[:KEPT])
        shown = self.warning
        if shown == RANDOM_WEIGHTS_SHORT and cell_len(shown) + cell_len(kept) + cell_len(state) + 2 > width:
            shown = RANDOM_WEIGHTS_TINY
        warning = f"{shown} " if shown else ""
        room = width - cell_len(warning) - cell_len(state) - 1
        note = inert(self.note) if self.note else ""
        # the note answers what the user just did (ctrl+y's copy, a cap): the settings' tail
        # gives way to it, all but their first segment (a long settings line hid every note)
        info = fit_segments(inert(self.info), room - cell_len(note) - 3 if note else room)
        note = fit_segments(note, room - cell_len(info) - 3) if note else ""
        if note and cell_len(note) > room - cell_len(info) - 3:
            note = ""                      # no room even for its first segment: the log keeps it
            info = fit_segments(inert(self.info), room)      # and the settings keep their room
        line = Text(no_wrap=True, overflow="crop")
        if warning:
            line.append(shown, style="bold reverse").append(" ")
        line.append(info, style="bold")
        gap = width - cell_len(warning) - cell_len(info) - cell_len(state)
        if note:
            pad = gap - cell_len(note) - 1
            line.append(" " * max(pad, 2)).append(note, style="italic").append(" ")
        else:
            line.append(" " * max(gap, 1))
        line.append(state)
        return line
