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

from kvchat.engine.geometry import KV_DTYPES
from kvchat.engine.policy import POLICIES

from .keys import PANELS
from .store.files import FileRefused, read_text

MAX_LOAD_BYTES = 1 << 20
# what runs before the model has loaded, by key id and command name: the App's help, themes and
# quitting, and the panels' layout; everything else acts on a conversation and waits for it
BEFORE_LOAD = frozenset({"help", "quit", "theme", "panel", "toggle_panels", "next_panel"})


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


def token_count(name: str, text: str, alternative: str = "") -> int:
    """A positive whole number of tokens (1,024 and 1_024 read as 1024)."""
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise CommandError(f"/{name} needs a whole number of tokens{alternative}, got {text!r}") from None
    if value <= 0:
        raise CommandError(f"/{name} must be a positive number of tokens, got {value}")
    return value


def _cap(args, _themes) -> int | None:
    text = _one("cap", "/cap N (tokens) or /cap off", args)
    if text.lower() in ("off", "none"):
        return None
    return token_count("cap", text, " or 'off'")


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


def _edit(args, _themes) -> int | str | None:
    if not args:
        return None
    text = _one("edit", "/edit [N] (your message N, from 1; default the last) or /edit off", args)
    if text.lower() == "off":
        return "off"
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"/edit needs the number of one of your messages (1 = the first) or 'off', "
                           f"got {text!r}") from None
    if value <= 0:
        raise CommandError(f"/edit needs a message number from 1 up, got {value}")
    return value


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
    return _save_path("save", args[0]) if args else None


def _overwrite_path(args, _themes) -> Path:
    return _save_path("save!", _one("save!", "/save! FILE (overwrites FILE.md and FILE.jsonl)", args))


def _save_path(name: str, text: str) -> Path:
    """Where /save writes: FILE.md and FILE.jsonl. A name ending in / means a directory,
    never a file beside it (so `/save /etc/` is not /etc.md)."""
    if not text.strip() or text.endswith(("/", "/.", "/..")) or text in (".", ".."):
        raise CommandError(f"/{name} {text!r}: give a file name (kvchat adds .md and .jsonl), e.g. /{name} notes/chat")
    return Path(text).expanduser()


def _float(name: str, low: float, high: float | None, low_open: bool, what: str):
    def parse(args, _themes) -> float:
        text = _one(name, f"/{name} X ({what})", args)
        try:
            value = float(text)
        except ValueError:
            raise CommandError(f"/{name} needs a number ({what}), got {text!r}") from None
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise CommandError(f"/{name} must be {what}, got {value:g}")
        return value
    return parse


def _seed(args, _themes) -> int | None:
    text = _one("seed", "/seed N | off", args)
    if text.lower() in ("off", "none", "random"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"/seed needs a whole number or 'off', got {text!r}") from None
    if value < 0:
        raise CommandError(f"/seed must be 0 or more, got {value}")
    return value


def _system(text: str) -> str:
    """The raw rest of the line (quotes and apostrophes kept); empty removes the prompt."""
    return text.strip()


RAW = {"system": _system}     # commands whose argument is the rest of the line, unsplit


def _whatif(args, _themes) -> tuple[str | None, ...]:
    """MODEL TOKENS, then a bare number of users and / or a budget with its unit (in either order)."""
    if len(args) not in (2, 3, 4):
        raise CommandError("usage: /whatif MODEL TOKENS [USERS] [BUDGET], e.g. /whatif 70b 30000 15GB or "
                           "/whatif 8b 8192 16")
    return tuple(args) if len(args) > 2 else (args[0], args[1], None)


def _words(args, _themes) -> list[str]:
    """The words as typed (the command checks them: /plan's short form and flags)."""
    return list(args)


MAX_CROWD = 64


def _crowd(args, _themes) -> str | tuple[int, bool]:
    usage = f"usage: /crowd N [long] (1 to {MAX_CROWD} simulated users) or /crowd off"
    if len(args) == 1 and args[0].lower() == "off":
        return "off"
    if not 1 <= len(args) <= 2 or (len(args) == 2 and args[1].lower() != "long"):
        raise CommandError(usage)
    try:
        n = int(args[0])
    except ValueError:
        raise CommandError(f"/crowd needs a number of users from 1 to {MAX_CROWD} or 'off', got {args[0]!r}") from None
    if not 1 <= n <= MAX_CROWD:
        raise CommandError(f"/crowd takes 1 to {MAX_CROWD} simulated users, got {n}")
    return n, len(args) == 2


COMMANDS: dict[str, Spec] = {s.name: s for s in (
    Spec("help", "/help", "show keys and commands", _no_arg("help")),
    Spec("reset", "/reset", "free this conversation's cache; the next turn prefills everything", _no_arg("reset")),
    Spec("cap", "/cap N | off", "set the context cap in tokens (takes effect at once)", _cap),
    Spec("policy", f"/policy {'|'.join(POLICIES)}", "what happens when a turn would pass the cap",
         _choice("policy", tuple(POLICIES))),
    Spec("load", "/load FILE", "send a text file's content as a message", _path),
    Spec("save", "/save [FILE]", "write FILE.md (transcript) and FILE.jsonl (telemetry); never overwrites",
         _optional_path),
    Spec("save!", "/save! FILE", "like /save, overwriting FILE.md and FILE.jsonl if they exist", _overwrite_path),
    Spec("theme", "/theme NAME", "switch theme (remembered)", _theme),
    Spec("cache", "/cache on|off", "keep the KV cache, or recompute everything each token",
         _choice("cache", ("on", "off"))),
    Spec("kv", f"/kv {'|'.join(KV_DTYPES)}", "rebuild the KV pool in another dtype", _choice("kv", KV_DTYPES)),
    Spec("panel", f"/panel {'|'.join(PANELS)}|all", "hide or show a telemetry panel",
         _choice("panel", (*PANELS, "all"))),
    Spec("new", "/new", "open another conversation in the same pool (the others stay open)", _no_arg("new")),
    Spec("switch", "/switch N", "show conversation N (its transcript and panels)", _number("switch", False)),
    Spec("close", "/close [N]", "close conversation N (default: this one); it stays saved", _number("close", True)),
    Spec("list", "/list", "list the open conversations: turns, tokens cached, cap, policy", _no_arg("list")),
    Spec("regen", "/regen", "generate the last reply again", _no_arg("regen")),
    Spec("chats", "/chats", "browse saved conversations: open, rename, delete, search", _no_arg("chats")),
    Spec("edit", "/edit [N] | off", "edit your message N (default the last) and resend it; later ones are dropped",
         _edit),
    Spec("whatif", "/whatif MODEL TOKENS [USERS] [BUDGET]", "the KV cache USERS conversations of TOKENS take on "
         "MODEL (bf16), against its weights and a budget",
         _whatif),
    Spec("plan", "/plan [MODEL] [GPU] [USERS] [FLAGS]", "simulate USERS chatting with MODEL on GPU (kvchat plan's "
         "simulator; its flags too, e.g. --long 30000 --pool 15GB): TTFT, TPOT, preemptions, the pool", _words),
    Spec("crowd", "/crowd N [long] | off", "N simulated users chat in this pool beside you (long: one pastes a "
         "long report); the crowd panel shows each and the pool's totals; off ends them", _crowd),
    Spec("quit", "/quit", "quit", _no_arg("quit")),
    Spec("system", "/system TEXT", "set this conversation's system prompt (empty: none); shows the tokens it "
         "adds; it changes the shared prefix, so the next turn prefills from the start"),
    Spec("temperature", "/temperature X", "sampling temperature for the next replies and F5 (0: greedy)",
         _float("temperature", 0.0, None, False, "0 (greedy) or more")),
    Spec("top-p", "/top-p X", "nucleus sampling: keep the likeliest tokens up to probability X (1: off)",
         _float("top-p", 0.0, 1.0, True, "in (0, 1]")),
    Spec("seed", "/seed N | off", "seed the sampler, so a sampled reply repeats (off: a new sample each time)",
         _seed),
    Spec("model", "/model", "the model: geometry, dtypes, weights, bytes per token, pool, cost at full context",
         _no_arg("model")),
    Spec("copy", "/copy [code]", "copy the last reply (or its last code block) to the clipboard",
         lambda args, themes: _choice("copy", ("reply", "code"))(args, themes) if args else "reply"),
)}


def parse(text: str, themes: Sequence[str] = ()) -> Command | None:
    """None for an ordinary message; a Command; or CommandError."""
    stripped = text.strip()
    if is_message(stripped):
        return None
    head, _, rest = stripped[1:].partition(" ")
    if head.lower() in RAW:
        return Command(head.lower(), RAW[head.lower()](rest))
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


def is_message(text: str) -> bool:
    """Whether input is a message to send rather than a command ('//x' sends '/x')."""
    stripped = text.strip()
    return not stripped.startswith("/") or stripped.startswith("//")


def message_text(text: str) -> str:
    """The message to send for input that is not a command ('//x' sends '/x')."""
    stripped = text.strip()
    return stripped[1:] if stripped.startswith("//") else text


def read_message_file(path: Path) -> str:
    """A /load file's text, or CommandError naming what is wrong with it. Only a regular
    file is read (a FIFO would freeze the UI, a device read without end), at most 1 MiB."""
    try:
        text = read_text(path, MAX_LOAD_BYTES)
    except FileRefused as err:
        raise CommandError(f"/load {path}: {err}; give a UTF-8 text file of at most 1 MiB") from None
    if not text.strip():
        raise CommandError(f"/load {path}: the file is empty")
    return text
