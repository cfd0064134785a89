"""What the keys and slash commands do: the user's experiments on the cache.

A mixin of KvChatApp; every method runs on the UI thread. Anything that takes
engine.lock (reset, cache mode, KV dtype, new conversation) goes through `run_op`, which
runs it in a worker after the current turn; settings the engine reads without the lock
(cap, policy) change at once, even mid-reply.
"""
from __future__ import annotations

import time
from pathlib import Path

from engine.engine import KV_DTYPES
from engine.errors import KvchatError
from engine.policy import POLICIES

from . import settings as settings_mod
from .commands import Command, CommandError, read_message_file
from .session import ChatSession
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
        def run() -> str:
            session = self.session
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

    def action_new_conversation(self) -> None:
        old = self.session
        new: list[ChatSession] = []

        def run() -> str:
            self.engine.close_conversation(old.conv)
            old.log.event("closed")
            old.log.close()
            new.append(ChatSession.start(self.engine, old.options(), self.options.data_root))
            return "new conversation; the last one is saved, and its full blocks stay cached for reuse"
        self.run_op("start a new conversation", run, then=lambda: self.switch_session(new[0]),
                    conv=lambda: new[0].conv)

    def action_regenerate(self) -> None:
        conv = self.session.conv
        if self.busy == "reply":
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
        session.conv.set_cap(cap)
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
        self.session.conv.set_policy(name)
        self.session.log.event("policy", value=name)
        self.update_gauge()
        self.update_status()
        self.notice(f"policy {name}: {POLICIES[name].description}")

    def set_mode(self, mode: str) -> None:
        def run() -> str:
            self.session.conv.set_mode(mode)
            self.session.log.event("mode", value=mode)
            return ("cache off: every token recomputes the whole sequence" if mode == "off"
                    else "cache on: the next turn prefills the history once, then reads the cache")
        self.run_op(f"switch the cache {'off' if mode == 'off' else 'on'}", run)

    def set_kv_dtype(self, kv: str) -> None:
        def run() -> str:
            self.engine.set_kv_dtype(kv)
            self.session.log.event("kv_dtype", value=self.engine.kv_dtype)
            return (f"KV pool rebuilt in {self.engine.kv_dtype}: {self.engine.bytes_per_token:,} B per token; "
                    "caches dropped, the next turn recomputes its history")
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
        elif name == "regen":
            self.action_regenerate()
        elif name == "quit":
            self.quit_when_idle()
        else:  # a command in COMMANDS without a handler here is a bug
            raise KvchatError(f"/{name} has no handler")
