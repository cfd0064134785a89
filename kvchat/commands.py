"""Slash commands typed in the input: parsed into a Command here, run by the app.

`parse("/cap 2048")` gives Command("cap", 2048); bad input raises CommandError with one
line naming the problem and what is accepted. Text not starting with "/" is a message,
and "//" sends a message starting with a literal "/".
"""
from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvchat.engine.engine import KV_DTYPES
from kvchat.engine.policy import POLICIES

MAX_LOAD_BYTES = 1 << 20
PANELS = ("cache", "cap", "blocks", "latency", "all")


class CommandError(Exception):
    """A malformed or unknown slash command; str() is the one-line message to show."""


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    arg: Any = None


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    usage: str
    help: str
    parse_arg: Callable[[list[str], Sequence[str]], Any] | None = None  # None: takes no argument


def _no_arg(name: str):
    def parse(args: list[str], _themes) -> None:
        if args:
            raise CommandError(f"/{name} takes no argument, got {' '.join(args)!r}")
    return parse


def _one(name: str, usage: str, args: list[str]) -> str:
    if len(args) != 1:
        raise CommandError(f"usage: {usage}")
    return args[0]


def _cap(args, _themes) -> int | None:
    text = _one("cap", "/cap N (tokens) or /cap off", args)
    if text.lower() in ("off", "none"):
        return None
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise CommandError(f"/cap needs a whole number of tokens or 'off', got {text!r}") from None
    if value <= 0:
        raise CommandError(f"/cap must be a positive number of tokens, got {value}")
    return value


def _choice(name: str, accepted: Sequence[str], aliases: dict[str, str] | None = None):
    def parse(args, _themes) -> str:
        text = _one(name, f"/{name} {'|'.join(accepted)}", args).lower()
        text = (aliases or {}).get(text, text)
        if text not in accepted:
            raise CommandError(f"unknown {name} {args[0]!r}; accepted: {', '.join(accepted)}")
        return text
    return parse


def _number(name: str, optional: bool):
    def parse(args, _themes) -> int | None:
        usage = f"/{name} [N]" if optional else f"/{name} N"
        if optional and not args:
            return None
        text = _one(name, f"{usage} (a conversation's number, as /list shows)", args)
        try:
            value = int(text)
        except ValueError:
            raise CommandError(f"/{name} needs a conversation's number (see /list), got {text!r}") from None
        if value <= 0:
            raise CommandError(f"/{name} needs a conversation's number from 1 up (see /list), got {value}")
        return value
    return parse


def _theme(args, themes: Sequence[str]) -> str:
    text = _one("theme", f"/theme {'|'.join(themes)}", args)
    if text not in themes:
        raise CommandError(f"unknown theme {text!r}; accepted: {', '.join(themes)}")
    return text


def _path(args, _themes) -> Path:
    return Path(_one("load", "/load FILE", args)).expanduser()


def _optional_path(args, _themes) -> Path | None:
    if len(args) > 1:
        raise CommandError("usage: /save [FILE] (quote a name with spaces)")
    return Path(args[0]).expanduser() if args else None


def _whatif(args, _themes) -> tuple[str, str, str | None]:
    if len(args) not in (2, 3):
        raise CommandError("usage: /whatif MODEL TOKENS [BUDGET], e.g. /whatif 70b 30000 15GB")
    return args[0], args[1], (args[2] if len(args) == 3 else None)


COMMANDS: dict[str, Spec] = {s.name: s for s in (
    Spec("help", "/help", "show keys and commands", _no_arg("help")),
    Spec("reset", "/reset", "free this conversation's cache; the next turn prefills everything", _no_arg("reset")),
    Spec("cap", "/cap N | off", "set the context cap in tokens (takes effect at once)", _cap),
    Spec("policy", f"/policy {'|'.join(POLICIES)}", "what happens when a turn would pass the cap",
         _choice("policy", tuple(POLICIES))),
    Spec("load", "/load FILE", "send a text file's content as a message", _path),
    Spec("save", "/save [FILE]", "write FILE.md (transcript) and FILE.jsonl (telemetry)", _optional_path),
    Spec("theme", "/theme NAME", "switch theme (remembered)", _theme),
    Spec("cache", "/cache on|off", "keep the KV cache, or recompute everything each token",
         _choice("cache", ("on", "off"))),
    Spec("kv", f"/kv {'|'.join(KV_DTYPES)}", "rebuild the KV pool in another dtype", _choice("kv", KV_DTYPES)),
    Spec("panel", f"/panel {'|'.join(PANELS)}", "hide or show a telemetry panel", _choice("panel", PANELS)),
    Spec("new", "/new", "open another conversation in the same pool (the others stay open)", _no_arg("new")),
    Spec("switch", "/switch N", "show conversation N (its transcript and panels)", _number("switch", False)),
    Spec("close", "/close [N]", "close conversation N (default: this one); it stays saved", _number("close", True)),
    Spec("list", "/list", "list the open conversations: turns, tokens cached, cap, policy", _no_arg("list")),
    Spec("regen", "/regen", "generate the last reply again", _no_arg("regen")),
    Spec("whatif", "/whatif MODEL TOKENS [BUDGET]", "the KV cache a conversation of TOKENS takes on MODEL (bf16)",
         _whatif),
    Spec("quit", "/quit", "quit", _no_arg("quit")),
)}


def parse(text: str, themes: Sequence[str] = ()) -> Command | None:
    """None for an ordinary message; a Command; or CommandError."""
    stripped = text.strip()
    if not stripped.startswith("/") or stripped.startswith("//"):
        return None
    try:
        words = shlex.split(stripped[1:])
    except ValueError as err:
        raise CommandError(f"cannot read {stripped!r}: {err}") from None
    if not words:
        raise CommandError("empty command; type /help for the list")
    name, args = words[0].lower(), words[1:]
    spec = COMMANDS.get(name)
    if spec is None:
        raise CommandError(f"unknown command /{name}; accepted: {', '.join('/' + n for n in COMMANDS)}")
    return Command(name, spec.parse_arg(args, themes) if spec.parse_arg else None)


def message_text(text: str) -> str:
    """The message to send for input that is not a command ('//x' sends '/x')."""
    stripped = text.strip()
    return stripped[1:] if stripped.startswith("//") else text


def read_message_file(path: Path) -> str:
    """A /load file's text, or CommandError naming what is wrong with it."""
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise CommandError(f"/load {path}: is a directory; give a text file")
        if size > MAX_LOAD_BYTES:
            raise CommandError(f"/load {path}: {size:,} bytes is over the {MAX_LOAD_BYTES:,}-byte limit")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CommandError(f"/load {path}: no such file") from None
    except UnicodeDecodeError:
        raise CommandError(f"/load {path}: not UTF-8 text") from None
    except OSError as err:
        raise CommandError(f"/load {path}: cannot read ({err.strerror or err})") from None
    if not text.strip():
        raise CommandError(f"/load {path}: the file is empty")
    return text
