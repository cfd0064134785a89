"""Reading a file a user names (`/load FILE`, `kvchat replay FILE`): a regular file only,
never more than a limit, UTF-8. A FIFO would block the reader forever and a device would
read without end, so the type is checked on the opened descriptor before any read."""
from __future__ import annotations

import os
import stat
from pathlib import Path


class FileRefused(Exception):
    """The file cannot be used; str() is one line without the file's name (callers add it)."""


def read_text(path: Path, limit: int) -> str:
    """The UTF-8 text of the regular file at `path`, at most `limit` bytes."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileRefused("no such file") from None
    except IsADirectoryError:
        raise FileRefused("is a directory") from None
    except OSError as err:
        raise FileRefused(f"cannot open ({err.strerror or err})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused("is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused("is not a regular file (a FIFO, device or socket)")
        if st.st_size > limit:
            raise FileRefused(f"{st.st_size:,} bytes is over the {limit:,}-byte limit")
        data = b""
        while len(data) <= limit:               # the file may grow after fstat
            chunk = os.read(fd, limit + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > limit:
            raise FileRefused(f"over the {limit:,}-byte limit")
    except OSError as err:
        raise FileRefused(f"cannot read ({err.strerror or err})") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileRefused(f"not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})") from None
