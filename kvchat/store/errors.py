"""errors.log: where a bug's traceback goes, beside the conversations. The app cannot print it
(stderr would tear the screen) and the command line prints one line instead; both write here
and say where it went.

A traceback quotes what kvchat was handling (a server's answer, a file's text): it is written
through `text.shown`, inert and with every secret redacted, like every line kvchat prints.
Only a regular file is appended to, never through a symlink, and opening never waits (a FIFO
named errors.log is refused at once)."""
from __future__ import annotations

import errno
import os
import stat
import time
import traceback
from pathlib import Path

from ..text import shown
from .log import data_dir


def log_error(err: BaseException, root: Path | None = None) -> str:
    """Append err's traceback, under a time stamp; returns the log's path, or why it could not
    be written."""
    text = shown("".join(traceback.format_exception(type(err), err, err.__traceback__)))
    return append_error_log(text, root)


def append_error_log(text: str, root: Path | None = None) -> str:
    """Append `text` (already made safe to show) to <data dir>/errors.log; returns where it went."""
    path = (root or data_dir()) / "errors.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as err:
        why = "not a regular file" if err.errno == errno.ENXIO else err.strerror or err   # ENXIO: a FIFO
        return f"nowhere: cannot write the error log {path} ({why})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"nowhere: {path} is not a regular file"
        os.write(fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}".encode("utf-8", errors="replace"))
    except OSError as err:
        return f"nowhere: cannot write the error log {path} ({err.strerror or err})"
    finally:
        os.close(fd)
    return str(path)
