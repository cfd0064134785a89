"""Reading a file kvchat did not write (a model's config.json, its weights' headers, a GGUF, a
file a user names): a regular file only, never more than a limit.

A FIFO would block the reader for ever and a device would read without end, so the type is
checked before anything reads: with os.stat for a file another library opens (the tokenizer,
the weights), and on the descriptor itself, opened without waiting, for what kvchat reads.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


class FileRefused(Exception):
    """The file cannot be used; str() is one line without the file's name (callers add it)."""


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory, where a file is expected"
    return "is not a regular file (a FIFO, device or socket)"


def check_regular(path: Path) -> None:
    """FileRefused unless `path` is (a link to) a regular file; stat never waits on a FIFO."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileRefused("no such file") from None
    except OSError as err:
        raise FileRefused(f"cannot open ({err.strerror or err})") from None
    why = _kind(st.st_mode)
    if why:
        raise FileRefused(why)


def _open(path: Path) -> int:
    """A read-only descriptor on `path`, opened without waiting: O_NONBLOCK makes opening a
    FIFO with no writer return at once instead of waiting for one."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileRefused("no such file") from None
    except IsADirectoryError:
        raise FileRefused("is a directory, where a file is expected") from None
    except OSError as err:
        raise FileRefused(f"cannot open ({err.strerror or err})") from None


def read_bytes(path: Path, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them."""
    fd = _open(path)
    try:
        st = os.fstat(fd)
        why = _kind(st.st_mode)
        if why:
            raise FileRefused(why)
        if st.st_size > limit:
            raise FileRefused(f"{st.st_size:,} bytes is over the {limit:,}-byte limit")
        chunks, size = [], 0
        while size <= limit:                    # the file may grow after fstat
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise FileRefused(f"over the {limit:,}-byte limit")
        return b"".join(chunks)
    except OSError as err:
        raise FileRefused(f"cannot read ({err.strerror or err})") from None
    finally:
        os.close(fd)


def open_regular(path: Path):
    """A binary file object on the regular file at `path`, opened without waiting."""
    fd = _open(path)
    why = _kind(os.fstat(fd).st_mode)
    if why:
        os.close(fd)
        raise FileRefused(why)
    return os.fdopen(fd, "rb")


def read_text(path: Path, limit: int) -> str:
    """The UTF-8 text of the regular file at `path`, at most `limit` bytes."""
    data = read_bytes(path, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileRefused(f"not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})") from None
