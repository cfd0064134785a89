"""Themes: `themes/NAME.tcss` stylesheets, found relative to the package.

Every theme file is loaded at start; each scopes its rules under the App class
`theme-NAME`, so switching theme is a class change on the App plus the Textual base
theme (for the built-in widgets) that the file names in a first-line comment:
    /* textual-theme: textual-light */
`themes/base.tcss` is the layout shared by all themes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from textual.theme import Theme

_PACKAGE = Path(__file__).resolve().parent.parent    # kvchat/
# installed: kvchat/themes/ (package data); source tree: the repository's themes/, beside kvchat/
SEARCH = (_PACKAGE / "themes", _PACKAGE.parent / "themes")
BASE_CSS = "base.tcss"
ORDER = ("dark", "light", "high-contrast")   # ctrl+t's cycle, as the README lists them; other files follow by name
_BASE_THEME = re.compile(r"/\*\s*textual-theme:\s*([\w-]+)\s*\*/")

HIGH_CONTRAST = Theme(
    name="kvchat-high-contrast", primary="#ffff00", secondary="#00ffff", accent="#ff00ff",
    foreground="#ffffff", background="#000000", surface="#000000", panel="#1a1a1a",
    success="#00ff00", warning="#ffff00", error="#ff5555", dark=True,
)


@dataclass(frozen=True, slots=True)
class ThemeFile:
    name: str
    path: Path
    base: str     # the Textual theme for built-in widgets

    @property
    def css_class(self) -> str:
        return f"theme-{self.name}"


def themes_dir() -> Path:
    for folder in SEARCH:
        if (folder / BASE_CSS).is_file():
            return folder
    raise FileNotFoundError(f"kvchat's themes folder is missing (looked in {', '.join(map(str, SEARCH))}); "
                            "reinstall kvchat")


def _order(path: Path) -> tuple[int, str]:
    return (ORDER.index(path.stem) if path.stem in ORDER else len(ORDER), path.stem)


def available(folder: Path | None = None) -> dict[str, ThemeFile]:
    """The theme files in ctrl+t's order: ORDER first, then any other by name."""
    folder = folder or themes_dir()
    out = {}
    for path in sorted(folder.glob("*.tcss"), key=_order):
        if path.name == BASE_CSS:
            continue
        first = path.read_text(encoding="utf-8").split("\n", 1)[0]
        m = _BASE_THEME.search(first)
        out[path.stem] = ThemeFile(path.stem, path, m.group(1) if m else "textual-dark")
    return out
