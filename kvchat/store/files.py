"""Reading a file a user names (`/load FILE`, `kvchat replay FILE`) or kvchat keeps (a log, the
settings, open.json): a regular file only, never more than a limit, UTF-8. The one reader is
the engine's (kvchat/engine/files.py), which model files go through too."""
from __future__ import annotations

from kvchat.engine.files import FileRefused, check_regular, read_bytes, read_text

__all__ = ["FileRefused", "check_regular", "read_bytes", "read_text"]
