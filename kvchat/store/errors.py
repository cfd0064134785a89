"""errors.log: where a bug's traceback goes, beside the conversations. The app cannot print it
(stderr would tear the screen) and the command line prints one line instead; both write here
and say where it went."""
from __future__ import annotations

import time
import traceback

from .log import data_dir


def log_error(err: BaseException) -> str:
    """Append err's traceback, under a time stamp; returns the log's path, or why it could not
    be written."""
    try:
        path = data_dir() / "errors.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
            traceback.print_exception(type(err), err, err.__traceback__, file=fh)
    except OSError as log_err:
        return f"nowhere: cannot write the log ({log_err.strerror})"
    return str(path)
