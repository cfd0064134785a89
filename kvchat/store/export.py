"""`/save` and ctrl+s: a conversation's transcript as Markdown and its telemetry as JSON Lines,
written privately and never over an existing file unless asked."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
import time
from pathlib import Path

from ..text import stats_line
from .history import History
from .records import TurnRecord


def export(base: Path, history: History, turns: list[TurnRecord], model: str,
           overwrite: bool = False) -> tuple[Path, Path]:
    """Write base.md (the transcript: every message, the ones drop-oldest dropped marked, each
    reply with its own turn's stats line) and base.jsonl (one telemetry record per turn),
    mode 0600. An existing file is kept unless `overwrite` (/save!); a symlink is never
    followed; a directory is refused (so `/save /etc` never writes /etc.md). Raises OSError
    with strerror saying which."""
    if base.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file name, e.g. DIR/chat", str(base))
    if base.suffix in (".md", ".jsonl"):
        base = base.with_suffix("")
    md, jl = base.with_name(base.name + ".md"), base.with_name(base.name + ".jsonl")
    for f in (md, jl):
        if f.is_symlink():
            raise OSError(errno.ELOOP, "is a symbolic link, which kvchat does not write through", str(f))
        if f.exists() and not overwrite:
            raise FileExistsError(errno.EEXIST, f"{f} exists; /save! FILE overwrites it", str(f))
        if f.exists() and not f.is_file():
            raise OSError(errno.EINVAL, f"{f} is not a regular file", str(f))
    md.parent.mkdir(parents=True, exist_ok=True)
    parts = [f"# kvchat conversation\n\nmodel: {model} · saved {time.strftime('%Y-%m-%d %H:%M')}\n"]
    for i, m in enumerate(history.messages):     # regenerated and edited turns stay in the telemetry
        title = {"system": "System", "user": "You", "assistant": "Assistant"}.get(m["role"], m["role"])
        if history.is_dropped(i):
            title += " (dropped by drop-oldest: the model no longer saw it)"
        parts.append(f"## {title}\n\n{m['content']}\n")
        s = history.reply_record(i)
        if s is not None:
            parts.append(f"*{stats_line(s)}*\n")
    _write_private(md, "\n".join(parts), overwrite)
    _write_private(jl, "".join(json.dumps(s.to_dict(), ensure_ascii=False) + "\n" for s in turns), overwrite)
    return md, jl


def _write_private(path: Path, text: str, overwrite: bool) -> None:
    """Write a regular file readable by its owner only, all or nothing: the text goes to a
    temporary file beside it first, so a full disk leaves neither a partial file nor, with
    overwrite, a truncated old one. Without overwrite, os.link refuses an existing name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")   # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)   # replaces a name, never writes through a link
        else:
            os.link(tmp, path)      # FileExistsError if the name appeared meanwhile
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
