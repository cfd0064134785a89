"""The user's settings file: the remembered theme and key rebindings.

<config dir>/settings.json, for example:
    {"theme": "light", "keys": {"reset_cache": "ctrl+e", "cap_down": "f3,ctrl+down"}}
Key ids are listed on the help screen (F1). A bad file stops kvchat with one line naming
the file and the problem, before the UI starts.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from textual.keys import Keys

from ..keys import KEY_IDS, KEYS
from .files import FileRefused, cannot_write, read_text

MAX_SETTINGS_BYTES = 2**20

CONFIG_ENV = "KVCHAT_CONFIG_DIR"


class SettingsError(Exception):
    """The settings file is unreadable or holds a bad value; str() is one line."""


def config_path() -> Path:
    from platformdirs import user_config_dir
    return Path(os.environ.get(CONFIG_ENV) or user_config_dir("kvchat")) / "settings.json"


MODIFIERS = ("ctrl", "alt", "shift", "meta", "super", "hyper")
NAMED_KEYS = frozenset(k.value for k in Keys if "+" not in k.value and not k.value.startswith("<")) - {"ctrl-at"}
RESERVED = frozenset({"enter", "return", "tab", "shift+tab", "backspace", "delete", "left", "right", "up", "down",
                      "home", "end", "ctrl+c", "ctrl+v"})   # the message input's own editing keys


def check_key_name(key_id: str, name: str) -> None:
    """A Textual key name: modifiers joined by + to a named key (f5, pageup, escape) or to a
    single character; not one of the input's own editing keys."""
    *mods, base = name.lower().split("+")
    if not base or any(m not in MODIFIERS for m in mods) or not (
            base in NAMED_KEYS or (len(base) == 1 and base.isprintable() and mods)):
        raise SettingsError(f"key {name!r} for {key_id!r} is not a key name; accepted: modifiers "
                            f"({'+, '.join(MODIFIERS)}+) and a key, e.g. ctrl+e, alt+x, f6, ctrl+pageup")
    if name.lower() in RESERVED:
        raise SettingsError(f"key {name!r} for {key_id!r} is the message input's own key; use ctrl+, alt+ or a "
                            "function key")


@dataclass(slots=True)
class Settings:
    theme: str | None = None
    keys: dict[str, str] = field(default_factory=dict)   # key id -> Textual key names, comma-separated

    def __post_init__(self) -> None:
        if self.theme is not None and not isinstance(self.theme, str):
            raise SettingsError(f"'theme' must be a theme name, got {self.theme!r}")
        if not isinstance(self.keys, dict):
            raise SettingsError(f"'keys' must map key ids to keys, got {self.keys!r}")
        for key_id, keys in self.keys.items():
            if key_id not in KEY_IDS:
                raise SettingsError(f"unknown key id {key_id!r} in 'keys'; accepted: {', '.join(KEY_IDS)}")
            if not isinstance(keys, str) or not keys.strip():
                raise SettingsError(f"keys for {key_id!r} must be a string like 'ctrl+e' or 'f3,ctrl+down'")
            for k in keys.split(","):
                k = k.strip()
                if len(k) == 1 and k.isprintable():
                    raise SettingsError(f"key {k!r} for {key_id!r} is a printable character, which the "
                                        "message input would take; use ctrl+, alt+ or a function key")
                check_key_name(key_id, k)
        taken: dict[str, str] = {}
        for key in sorted(KEYS, key=lambda k: k.id in self.keys):   # defaults first: a rebinding is the culprit
            for name in self.keys.get(key.id, key.keys).split(","):
                name = name.strip()
                if name in taken:
                    raise SettingsError(f"key {name!r} for {key.id!r} is already {taken[name]!r}'s key; pick "
                                        f"another, or rebind {taken[name]!r} as well")
                taken[name] = key.id


def load(path: Path | None = None) -> Settings:
    path = path or config_path()
    if not os.path.lexists(path):
        return Settings()
    try:
        data = json.loads(read_text(path, MAX_SETTINGS_BYTES))
    except FileRefused as err:
        raise SettingsError(f"settings file {path}: {err}") from None
    except RecursionError:
        raise SettingsError(f"settings file {path}: nested too deeply; expected a JSON object like "
                            "{\"theme\": \"dark\"}") from None
    except ValueError as err:
        raise SettingsError(f"settings file {path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise SettingsError(f"settings file {path}: expected a JSON object like {{\"theme\": \"dark\"}}")
    unknown = set(data) - {"theme", "keys"}
    if unknown:
        raise SettingsError(f"settings file {path}: unknown setting {sorted(unknown)[0]!r}; accepted: theme, keys")
    try:
        return Settings(**data)
    except SettingsError as err:
        raise SettingsError(f"settings file {path}: {err}") from None


def save(settings: Settings, path: Path | None = None) -> None:
    """Remember `settings.theme`, reloading the file first so that key bindings edited in it
    while kvchat runs are kept. Written atomically under a unique temporary name, so a crash
    mid-write never leaves a broken file and two processes saving never share a temp file.
    A file that is not valid now (being edited) is not overwritten: OSError says so."""
    path = path or config_path()
    try:
        on_disk = load(path)
    except SettingsError as err:
        raise OSError(errno.EINVAL, f"not saved, the file is not valid now ({err})", str(path)) from None
    merged = Settings(theme=settings.theme, keys={**settings.keys, **on_disk.keys})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:     # say which folder to fix, not only "File exists"
        raise OSError(err.errno, cannot_write(path, err, CONFIG_ENV), str(path)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(merged), indent=2) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    settings.keys = merged.keys
