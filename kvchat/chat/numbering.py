"""A conversation's number (the conversation bar's, `/switch N`'s, "conversation 3 is
replying") kept across `--resume`.

Numbers are given in the order conversations open, and closing one leaves a gap: at a quit
the open ones may be 2 and 5. `--resume` used to number them again from 1 in the order it
reopened them (the last used first), so conversation 5 came back as 1. Each conversation's log
keeps the number it was given as a "number" event (written with `mark`, so the chat browser's
"last used" stays as it was), and `--resume` gives each conversation it reopens that number
again, unless one already open has it. Reopening a single conversation from the chat browser
gives it the next number, as opening one does.

`restore` reads the last one back as `Restored.number` (None: a log from before numbers were
kept, or a value kvchat would not have written).
"""
from __future__ import annotations

from ..store.log import ConversationLog

EVENT = "number"


def remember(log: ConversationLog, number: int, saved: int | None = None) -> None:
    """Keep `number` in the log, unless it is the one already kept (`saved`)."""
    if number != saved:
        log.mark(EVENT, value=number)
