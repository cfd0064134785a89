"""The user's settings file: the remembered theme and key rebindings.

<config dir>/settings.json, for example:
    {"theme": "light", "keys": {"reset_cache": "ctrl+e", "cap_down": "f3,ctrl+down"}}
Key ids are listed on the help screen (F1). A bad file stops kvchat with one line naming
the file and the problem, before the UI starts.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .keys import KEY_IDS

CONFIG_ENV = "KVCHAT_CONFIG_DIR"


class SettingsError(Exception):
    """The settings file is unreadable or holds a bad value; str() is one line."""


def config_path() -> Path:
    from platformdirs import user_config_dir
    return Path(os.environ.get(CONFIG_ENV) or user_config_dir("kvchat")) / "settings.json"


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


def load(path: Path | None = None) -> Settings:
    path = path or config_path()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Settings()
    except (OSError, UnicodeDecodeError) as err:
        raise SettingsError(f"settings file {path}: cannot read ({err})") from None
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
    """Write atomically, so a crash mid-write never leaves a broken file."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
