"""What the keys and slash commands do: the user's experiments on the cache.

A mixin of KvChatApp; every method runs on the UI thread and acts on the focused
conversation (opening, switching and closing conversations are in conversations.py).
Anything that takes engine.lock (reset, cache mode, KV dtype) goes through `run_op`, which
runs it in a worker after the current turn; settings the engine reads without the lock
(cap, policy) change at once, even mid-reply.
"""
from __future__ import annotations

import time
from pathlib import Path

from kvchat.engine.engine import KV_DTYPES
from kvchat.engine.errors import KvchatError
from kvchat.engine.policy import POLICIES

from . import settings as settings_mod
from .commands import Command, CommandError, read_message_file
from .store import export
from .widgets import HelpScreen, PolicyPicker

MIN_CAP = 64


def next_cap(cap: int | None, max_position: int, up: bool) -> int | None:
    """Caps step by powers of two below the model's context; above them is "no cap" (the
    model's own limit)."""
    steps = [1 << i for i in range(MIN_CAP.bit_length() - 1, 40) if (1 << i) < max_position]
    if up:
        return None if cap is None else next((s for s in steps if s > cap), None)
    current = max_position if cap is None else cap
    lower = [s for s in steps if s < current]
    return lower[-1] if lower else cap


class ChatActions:
    # ---- keys -------------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap(), str(self.settings_path)))

    def action_reset_cache(self) -> None:
        session = self.session

        def run() -> str:
            n = session.conv.reset_cache()
            session.log.event("reset_cache", blocks=n)
            return f"cache reset: freed {n} blocks; the next turn prefills the whole history"
        self.run_op("reset the cache", run)

    def action_cap_down(self) -> None:
        self.set_cap(next_cap(self.session.conv.cap, self.engine.geometry.max_position, up=False))

    def action_cap_up(self) -> None:
        self.set_cap(next_cap(self.session.conv.cap, self.engine.geometry.max_position, up=True))

    def action_choose_policy(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self.set_policy(name)
        self.push_screen(PolicyPicker(self.session.conv.policy.name), chosen)

    def action_stop(self) -> None:
        if self.busy == "reply":
            self.cancel.set()
            self.status("stopping…")
            if self.turn_session is not self.session:
                self.notice(f"stopping conversation {self.turn_session.number}'s reply")

    def action_regenerate(self) -> None:
        conv = self.session.conv
        if self.session in self.waiting:
            self.notice("this conversation's turn is still queued", error=True)
            return
        if self.busy == "reply" and self.turn_session is self.session:
            self.cancel.set()        # regenerate the reply in progress once it has stopped
        elif not conv.messages or conv.messages[-1]["role"] != "assistant":
            self.notice("nothing to regenerate: the conversation has no reply yet", error=True)
            return
        self.start_turn(None)

    def action_cache_mode(self) -> None:
        self.set_mode("off" if self.session.conv.mode == "cache" else "cache")

    def action_kv_dtype(self) -> None:
        order = [d for d in KV_DTYPES if d != "auto"]
        current = self.engine.kv_dtype
        self.set_kv_dtype(order[(order.index(current) + 1) % len(order)] if current in order else order[0])

    def action_toggle_panels(self) -> None:
        panels = self.part("#panels")
        panels.display = not panels.display
        self.panels_forced = True

    def action_save(self) -> None:
        self.save_to(None)

    def action_theme(self) -> None:
        names = list(self.themes)
        self.set_theme(names[(names.index(self.theme_name) + 1) % len(names)])

    def action_quit(self) -> None:
        self.quit_when_idle()

    # ---- settings --------------------------------------------------------------------------
    def set_cap(self, cap: int | None) -> None:
        session = self.session
        try:
            session.conv.set_cap(cap)
        except KvchatError as err:     # e.g. below sink-window's least window
            self.notice(str(err), error=True)
            return
        session.log.event("cap", value=cap)
        self.update_gauge()
        self.update_status()
        held = self.snapshot.tokens_held if self.snapshot else 0
        note = f"cap {cap:,} tokens" if cap else "no cap"
        if cap and held > cap:
            name = session.conv.policy.name
            then = "is refused" if name == "stop" else f"makes room by {name}"
            note += f"; {held - cap:,} tokens over, so the next turn {then}"
        self.notice(note)

    def set_policy(self, name: str) -> None:
        """At once when idle; during a job after it, since leaving sink-window drops the
        cache under engine.lock."""
        session = self.session

        def apply() -> str:
            session.conv.set_policy(name)
            session.log.event("policy", value=name)
            return f"policy {name}: {POLICIES[name].description}"
        if self.busy is not None:
            self.run_op(f"switch to policy {name}", apply, interrupt=False)
            return
        try:
            note = apply()
        except KvchatError as err:     # e.g. a cap below sink-window's least window
            self.notice(str(err), error=True)
            return
        self.update_gauge()
        self.update_status()
        self.notice(note)

    def set_mode(self, mode: str) -> None:
        session = self.session

        def run() -> str:
            session.conv.set_mode(mode)
            session.log.event("mode", value=mode)
            return ("cache off: every token recomputes the whole sequence" if mode == "off"
                    else "cache on: the next turn prefills the history once, then reads the cache")
        self.run_op(f"switch the cache {'off' if mode == 'off' else 'on'}", run)

    def set_kv_dtype(self, kv: str) -> None:
        def run() -> str:
            self.engine.set_kv_dtype(kv)
            for session in self.sessions:      # the pool is every conversation's
                session.log.event("kv_dtype", value=self.engine.kv_dtype)
            chats = "every conversation's cache" if len(self.sessions) > 1 else "the cache"
            return (f"KV pool rebuilt in {self.engine.kv_dtype}: {self.engine.bytes_per_token:,} B per token; "
                    f"{chats} dropped, the next turn recomputes its history")
        self.run_op(f"rebuild the pool in {kv}", run)

    def set_theme(self, name: str) -> None:
        self.apply_theme(name)
        self.settings.theme = name
        try:
            settings_mod.save(self.settings, self.settings_path)
        except OSError as err:
            self.notice(f"theme {name} (not remembered: cannot write {self.settings_path}: {err.strerror})",
                        error=True)
            return
        self.notice(f"theme {name}")

    def save_to(self, path: Path | None) -> None:
        path = path or Path.cwd() / f"kvchat-{time.strftime('%Y%m%d-%H%M%S')}"
        session = self.session
        try:
            md, jl = export(path, session.conv.messages, session.turns, self.engine.source.name)
        except OSError as err:
            self.notice(f"cannot save to {path}: {err.strerror or err}", error=True)
            return
        self.notice(f"saved the transcript to {md} and the telemetry to {jl}")

    def toggle_panel(self, name: str) -> None:
        ids = ["cache-panel", "cap-gauge", "block-map", "latency-panel"] if name == "all" else [
            {"cache": "cache-panel", "cap": "cap-gauge", "blocks": "block-map", "latency": "latency-panel"}[name]]
        for wid in ids:
            w = self.part(f"#{wid}")
            w.display = not w.display

    # ---- commands ---------------------------------------------------------------------------
    def run_command(self, cmd: Command) -> None:
        name, arg = cmd.name, cmd.arg
        if name == "help":
            self.action_help()
        elif name == "reset":
            self.action_reset_cache()
        elif name == "cap":
            self.set_cap(arg)
        elif name == "policy":
            self.set_policy(arg)
        elif name == "load":
            try:
                text = read_message_file(arg)
            except CommandError as err:
                self.notice(str(err), error=True)
                return
            lines = text.splitlines()
            preview = "\n".join(lines[:4]) + (f"\n… ({len(lines) - 4:,} more lines)" if len(lines) > 4 else "")
            self.send(text, shown=f"/load {arg} ({len(text):,} characters)\n{preview}", typed=f"/load {arg}")
        elif name == "save":
            self.save_to(arg)
        elif name == "theme":
            self.set_theme(arg)
        elif name == "cache":
            self.set_mode("cache" if arg == "on" else "off")
        elif name == "kv":
            self.set_kv_dtype(arg)
        elif name == "panel":
            self.toggle_panel(arg)
        elif name == "new":
            self.action_new_conversation()
        elif name == "switch":
            self.action_switch_conversation(arg)
        elif name == "close":
            self.close_conversation(arg)
        elif name == "list":
            self.list_conversations()
        elif name == "regen":
            self.action_regenerate()
        elif name == "quit":
            self.quit_when_idle()
        else:  # a command in COMMANDS without a handler here is a bug
            raise KvchatError(f"/{name} has no handler")
