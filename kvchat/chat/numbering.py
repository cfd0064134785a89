"""A conversation's number (the conversation bar's, `/switch N`'s, "conversation 3 is
replying") kept across `--resume`.

Numbers are given in the order conversations open, and closing one leaves a gap: at a quit
the open ones may be 2 and 5. `--resume` used to number them again from 1 in the order it
reopened them (the last used first), so conversation 5 came back as 1. Each conversation's log
keeps the number it was given as a "number" event (written with `mark`, so the chat browser's
"last used" stays as it was), and `--resume` gives each conversation it reopens that number
again, unless one already open has it. Reopening a single conversation from the chat browser
gives it the next number, as opening one does.

The store's `restore` does not read this event (the numbers are the chat screen's, not the
conversation's), so it is read here: only the log's lines that name it are parsed.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..store.log import ConversationLog

EVENT = "number"
NEEDLE = f'"event": "{EVENT}"'       # as json.dumps writes the record
MAX_NUMBER = 10**6


def saved_number(path: Path) -> int | None:
    """The number the conversation last had (its log's last "number" event), or None: a log
    from before numbers were kept, or a value kvchat would not have written."""
    found = None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if NEEDLE not in line:
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:       # a torn line: restore() names it; here it is only skipped
                    continue
                value = rec.get("value") if isinstance(rec, dict) and rec.get("event") == EVENT else None
                if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_NUMBER:
                    found = value
    except OSError:
        return None
    return found


def remember(log: ConversationLog, number: int, saved: int | None = None) -> None:
    """Keep `number` in the log, unless it is the one already kept (`saved`)."""
    if number != saved:
        log.mark(EVENT, value=number)
