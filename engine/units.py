"""Byte sizes: parsing what users type (`512MiB`, `2GiB`, `1e9`) and printing them back."""
from __future__ import annotations

import math
import re

from .errors import KvchatError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
MAX_BYTES = 2**60   # 1 EiB: a size past this is a typo, and past int64 torch cannot allocate it anyway


def parse_bytes(text: str | int) -> int:
    """'512MiB' -> 536870912. Raises KvchatError naming the accepted forms."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise KvchatError(
                f"cannot read size {text!r}: use a number of bytes with an optional unit "
                "(B, KiB, MiB, GiB, TiB, KB, MB, GB), e.g. 512MiB or 2GiB")
        number = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number > MAX_BYTES:
            raise KvchatError(f"size {text!r} is beyond any machine; accepted: up to {MAX_BYTES // 2**50} PiB")
        value = int(number)
    if isinstance(value, bool) or value <= 0:
        raise KvchatError(f"size {text!r} must be positive")
    if value > MAX_BYTES:
        raise KvchatError(f"size {text!r} is beyond any machine; accepted: up to {MAX_BYTES // 2**50} PiB")
    return value


def human_bytes(n: float) -> str:
    """Binary units, three significant figures: 131072 -> '128 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.3g} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
