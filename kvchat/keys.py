"""The app's keys: one table of id, default keys, action, footer label and help text.

The ids are what the user's config file rebinds (`"keys": {"reset_cache": "ctrl+e"}`).
No default is a printable character, because the message input has focus and would take it,
and none is a key terminals or multiplexers keep for themselves: ctrl+b is tmux's prefix,
ctrl+a screen's, and ctrl+pageup/pagedown switch tabs in common emulators, so panels are F6
and conversations alt+left / alt+right (tests/app/test_tmux.py sends every default through
tmux with its prefix on ctrl+b).
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding, BindingType


@dataclass(frozen=True, slots=True)
class Key:
    id: str
    keys: str        # Textual key names, comma-separated
    label: str       # shown in the footer
    help: str        # shown on the help screen
    footer: bool = True
    app: bool = False   # the App's own action (help, themes, the palette, quitting); else the chat screen's

    @property
    def action(self) -> str:
        """The binding's action, by the key's id: `action_<id>` of the chat screen, or of the
        App (`app.<id>`)."""
        return f"app.{self.id}" if self.app else self.id


KEYS: tuple[Key, ...] = (
    Key("help", "f1", "help", "show keys and commands", app=True),
    Key("reset_cache", "ctrl+r", "reset",
        "free every block of this conversation: the next turn prefills the whole history"),
    Key("cap_down", "f3", "cap -", "lower the context cap one step"),
    Key("cap_up", "f4", "cap +", "raise the context cap one step (past the top: no cap)"),
    Key("choose_policy", "f2", "policy", "choose what happens when a turn would pass the cap"),
    Key("stop", "escape", "stop", "stop generating; the reply keeps what was generated"),
    Key("new_conversation", "ctrl+n", "new",
        "open another conversation in the same pool; the others stay open (like a server's users)"),
    Key("previous_conversation", "alt+left", "‹chat",
        "show the previous conversation (or click one in the bar above the chat)", footer=False),
    Key("next_conversation", "alt+right", "chat›", "show the next conversation",
        footer=False),
    Key("close_conversation", "f9", "close",
        "close this conversation: it stays saved, its full blocks stay cached for reuse"),
    Key("chat_browser", "ctrl+o", "chats",
        "browse saved conversations: open one again, rename, delete, search", footer=False),
    Key("edit_last", "alt+e", "edit", "edit your last message and resend it (/edit N for another)",
        footer=False),
    Key("regenerate", "f5", "regen", "drop the last reply and generate it again"),
    Key("cache_mode", "f7", "cache",
        "switch the KV cache off (recompute everything each token) or back on"),
    Key("kv_dtype", "f8", "kv", "rebuild the pool in the next KV dtype (fp32, bf16, fp16, fp8)"),
    Key("toggle_panels", "f6", "panels", "hide or show the telemetry panels"),
    Key("next_panel", "f10,alt+p", "panel›",
        "show the next telemetry panel where they are shown one at a time (or click its tab)", footer=False),
    Key("crowd", "alt+c", "crowd",
        "add 4 simulated users to this pool, chatting beside you (again: they leave); /crowd N [long] for more",
        footer=False, app=True),
    Key("save", "ctrl+s", "save", "write the transcript (Markdown) and telemetry (JSON Lines) here"),
    Key("theme", "ctrl+t", "theme", "switch to the next theme (remembered)", app=True),
    Key("palette", "ctrl+p", "palette", "search every key and command by name, and run one",
        footer=False, app=True),
    Key("copy_reply", "ctrl+y", "copy", "copy the last reply to the clipboard (the terminal's, OSC 52)",
        footer=False),
    Key("copy_code", "ctrl+g", "copy code", "copy the last reply's last code block to the clipboard",
        footer=False),
    Key("quit", "ctrl+q", "quit", "finish the reply in progress, save, and quit", app=True),
)
KEY_IDS = tuple(k.id for k in KEYS)

# the telemetry panels by name, in tab and cycle order: the tabs' labels and what /panel takes
PANELS = ("cache", "cap", "blocks", "latency")


def bindings() -> list[BindingType]:
    """The chat screen's bindings, in the table's order (the footer's): priority bindings, so
    they work while the input has focus, each bound by its id, so the settings file rebinds it
    through Textual's keymap (`App.set_keymap`). A dialog on top takes the keys: its screen
    holds none of these."""
    return [Binding(k.keys, k.action, k.label, show=k.footer, priority=True, id=k.id, tooltip=k.help)
            for k in KEYS]

