"""The bench's flags that need checking before minutes of measuring: context lengths, the
llama.cpp files and output files (shared by `kvchat bench`, `kvchat bench --batch` and `kvchat plan`)."""
from __future__ import annotations

import os
from pathlib import Path

from ..cli.args import UsageError


def parse_contexts(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"--contexts {text!r}: expected comma-separated token counts, e.g. 256,1024,4096")
    values = []
    for p in parts:
        try:
            v = int(p)
        except ValueError:
            raise UsageError(f"--contexts: {p!r} is not a whole number of tokens; e.g. 256,1024,4096") from None
        if v <= 0:
            raise UsageError(f"--contexts: {v} is not a positive number of tokens; e.g. 256,1024,4096")
        values.append(v)
    return tuple(sorted(set(values)))


LLAMA_CPP_CHOICES = ("f32", "bf16", "q4_1")


def parse_llama_cpp(text: str) -> tuple[str, ...]:
    """--llama-cpp: the GGUF files llama.cpp runs, in the table's order."""
    parts = [p.strip().lower() for p in text.split(",")]
    example = "e.g. f32,q4_1"
    if not text.strip() or any(not p for p in parts):
        raise UsageError(f"--llama-cpp {text!r}: expected comma-separated files from {', '.join(LLAMA_CPP_CHOICES)}; "
                         f"{example}")
    for p in parts:
        if p not in LLAMA_CPP_CHOICES:
            raise UsageError(f"--llama-cpp: {p!r} is not a file llama.cpp runs here; choose from "
                             f"{', '.join(LLAMA_CPP_CHOICES)}, comma-separated ({example})")
    return tuple(c for c in LLAMA_CPP_CHOICES if c in parts)


def output_path(flag: str, text: str | None, suffix: str | None = None) -> Path | None:
    """Check an output file can be written before minutes of measuring, not after."""
    if text is None:
        return None
    path = Path(text).expanduser()
    if path.is_dir():
        raise UsageError(f"{flag} {text!r} is a directory; give a file name")
    if suffix and path.suffix.lower() != suffix:
        raise UsageError(f"{flag} {text!r}: expected a {suffix} file name")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {text!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {text!r} is not writable")
    return path
