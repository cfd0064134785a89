"""Reading a file a user names (`/load FILE`, `kvchat replay FILE`) or kvchat keeps (a log, the
settings, open.json): a regular file only, never more than a limit, UTF-8. The one reader is
the engine's (kvchat/engine/files.py), which model files go through too."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from kvchat.engine.files import FileRefused, check_regular, read_bytes, read_text

__all__ = ["FileRefused", "cannot_write", "check_regular", "read_bytes", "read_text"]


def cannot_write(path: Path, err: OSError, env: str) -> str:
    """Why kvchat cannot write `path`, naming what to fix: its folder when the folder is the
    problem (missing and impossible to create, not a folder, not writable), and the variable
    `env` that moves it."""
    folder = path.parent
    reason = err.strerror or str(err)
    if not folder.is_dir():
        return (f"the folder {folder} does not exist and cannot be made ({reason}); set {env} to a "
                "writable folder")
    if not os.access(folder, os.W_OK) or err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"the folder {folder} is not writable ({reason}); fix its permissions or set {env} elsewhere"
    return f"{path}: {reason}"
