"""Copying a reply, or its last code block, from the keyboard.

Textual's `App.copy_to_clipboard` writes the text as an OSC 52 sequence, which the terminal
(and tmux with `set -g set-clipboard on`) puts on the system clipboard: it works over ssh,
with no clipboard library. macOS Terminal ignores OSC 52; iTerm2, kitty, WezTerm, Alacritty,
Windows Terminal, foot and GNOME's VTE (0.76+) take it.
"""
from __future__ import annotations

import re

from ..text import plural
from ..widgets.transcript import Transcript

FENCE = re.compile(r"^ {0,3}(```+|~~~+)[^\n]*\n(.*?)^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)
OPEN_FENCE = re.compile(r"^ {0,3}(```+|~~~+)[^\n]*\n(.*)\Z", re.MULTILINE | re.DOTALL)


def last_code_block(markdown: str) -> str | None:
    """The body of the last fenced code block (an unclosed last fence counts: a stopped
    reply), or None."""
    closed = list(FENCE.finditer(markdown))
    tail = markdown[closed[-1].end():] if closed else markdown
    unclosed = OPEN_FENCE.search(tail)
    if unclosed is not None:
        return unclosed.group(2).rstrip("\n")
    return closed[-1].group(2).rstrip("\n") if closed else None


def to_copy(transcript: Transcript, what: str) -> tuple[str | None, str]:
    """what: "reply" or "code". (the text to copy, the line that says what went to the
    clipboard), or (None, the error line) when there is nothing to copy."""
    reply = transcript.last_reply()
    text = reply.text.strip() if reply is not None else ""
    if not text:
        return None, "nothing to copy: this conversation has no reply yet"
    if what == "code":
        code = last_code_block(text)
        if code is None:
            return None, "nothing to copy: the last reply has no code block (/copy copies the whole reply)"
        text = code
    lines = text.count("\n") + 1
    return text, (f"copied the last {'code block' if what == 'code' else 'reply'} "
                  f"({plural(lines, 'line')}, {len(text):,} characters) to the clipboard")
