"""What the keys and slash commands do: the user's experiments on the cache.

`Controls` acts on the focused conversation (opening, switching and closing conversations
are in conversations.py), on the UI thread. What may block on the backend (reset, cache
mode, KV dtype) goes through `app.run_op`, which runs it in a worker after the current
turn; settings a backend takes without waiting (cap, policy) change at once, even
mid-reply. A key or command for something this backend cannot do says why, in one line
(`Capabilities.why_not`), and calls nothing.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvchat.engine.errors import KvchatError
from kvchat.engine.policy import POLICIES
from kvchat.engine.units import human_bytes

from ..store import settings as settings_mod
from .clipboard import copy_last
from ..backends.protocol import CACHE_TOGGLE, KV_DTYPE, REGENERATE, RESET, SINK_WINDOW
from ..commands import Command, CommandError, read_message_file, token_count
from .conversations import Conversations
from .host import Host
from .jobs import Busy
from ..store.log import export
from ..screens import HelpScreen, PolicyPicker
from ..widgets import PanelSwitcher
from ..screens.model_info import ModelInfoScreen

MIN_CAP = 64
NO_LIMIT = 1 << 20      # the top cap step when the backend does not know the model's context


def next_cap(cap: int | None, max_position: int | None, up: bool) -> int | None:
    """Caps step by powers of two below the model's context; above them is "no cap" (the
    model's own limit)."""
    top = max_position or NO_LIMIT
    steps = [1 << i for i in range(MIN_CAP.bit_length() - 1, 40) if (1 << i) < top]
    if up:
        return None if cap is None else next((s for s in steps if s > cap), None)
    current = top if cap is None else cap
    lower = [s for s in steps if s < current]
    return lower[-1] if lower else cap


class Controls:
    def __init__(self, app: Host, conversations: Conversations) -> None:
        self.app = app
        self.conversations = conversations

    def can(self, capability: str) -> bool:
        """Whether the backend can; if not, the focused transcript says why."""
        caps = self.app.backend.capabilities
        if caps.has(capability):
            return True
        self.app.notice(f"not with this backend: {caps.why_not(capability)}", error=True)
        return False

    # ---- the focused conversation's cache ------------------------------------------------------
    def reset_cache(self) -> None:
        if not self.can(RESET):
            return
        view = self.app.view

        def run() -> str:
            n = view.chat.reset_cache()
            view.conversation_log.event("reset_cache", blocks=n)
            return f"cache reset: freed {n} blocks; the next turn prefills the whole history"
        self.app.run_op("reset the cache", run)

    def step_cap(self, up: bool) -> None:
        self.set_cap(next_cap(self.app.view.cap, self.app.backend.info().max_position, up))

    def set_cap(self, cap: int | None) -> None:
        app, view = self.app, self.app.view
        try:
            view.chat.set_cap(cap)
        except KvchatError as err:     # e.g. below sink-window's least window
            app.notice(str(err), error=True)
            return
        view.conversation_log.event("cap", value=cap)
        view.refresh_state()
        app.update_gauge()
        app.update_status()
        held = (view.snapshot.tokens_held if view.snapshot else 0) or 0
        note = f"cap {cap:,} tokens" if cap else "no cap"
        if cap and held > cap:
            then = "is refused" if view.policy == "stop" else f"makes room by {view.policy}"
            note += f"; {held - cap:,} tokens over, so the next turn {then}"
        app.status_note(note)

    def choose_policy(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self.set_policy(name)
        self.app.push_screen(PolicyPicker(self.app.view.policy, self.app.backend.capabilities), chosen)

    def set_policy(self, name: str) -> None:
        """At once when idle; during a job after it, since leaving sink-window drops the
        cache under the engine's lock."""
        app, view = self.app, self.app.view
        caps = app.backend.capabilities
        if name not in caps.policies:
            offered = ", ".join(caps.policies)
            why = (caps.why_not(SINK_WINDOW) if POLICIES[name].streaming else "") or f"it offers {offered}"
            app.notice(f"not with this backend: {why}", error=True)
            return

        def apply() -> str:
            view.chat.set_policy(name)
            view.conversation_log.event("policy", value=name)
            return f"policy {name}: {POLICIES[name].description}"
        if app.jobs.busy is not None:
            app.run_op(f"switch to policy {name}", apply, interrupt=False)
            return
        try:
            note = apply()
        except KvchatError as err:     # e.g. a cap below sink-window's least window
            app.notice(str(err), error=True)
            return
        view.refresh_state()
        app.update_gauge()
        app.update_status()
        app.status_note(note)

    def set_mode(self, mode: str) -> None:
        if not self.can(CACHE_TOGGLE):
            return
        view = self.app.view

        def run() -> str:
            view.chat.set_mode(mode)
            view.conversation_log.event("mode", value=mode)
            return ("cache off: every token recomputes the whole sequence" if mode == "off"
                    else "cache on: the next turn prefills the history once, then reads the cache")
        self.app.run_op(f"switch the cache {'off' if mode == 'off' else 'on'}", run)

    def next_kv_dtype(self) -> None:
        order = list(self.app.backend.capabilities.kv_dtypes)
        current = self.app.backend.info().kv_dtype
        if not self.can(KV_DTYPE):
            return
        if not order:
            self.app.notice(f"not with this backend: its KV dtype is fixed ({current})", error=True)
            return
        self.set_kv_dtype(order[(order.index(current) + 1) % len(order)] if current in order else order[0])

    def set_kv_dtype(self, kv: str) -> None:
        app = self.app
        offered = app.backend.capabilities.kv_dtypes
        if not self.can(KV_DTYPE):
            return
        if kv != "auto" and kv not in offered:
            what = f"it rebuilds its cache in {', '.join(offered)}" if offered else "its KV dtype is fixed"
            app.notice(f"not with this backend: {what}, not {kv}", error=True)
            return

        def run() -> str:
            now = app.backend.set_kv_dtype(kv)
            for view in app.views:      # the pool is every conversation's
                view.conversation_log.event("kv_dtype", value=now)
            chats = "every conversation's cache" if len(app.views) > 1 else "the cache"
            per_token = app.backend.info().bytes_per_token
            snap = app.backend.snapshot(app.view.chat)
            return (f"KV pool rebuilt in {now}: {per_token or 0:,} B per token; the pool keeps its byte budget "
                    f"({human_bytes(snap.capacity_bytes)}), so it holds {snap.num_blocks:,} blocks of "
                    f"{snap.block_size} now; {chats} dropped, the next turn recomputes its history")
        app.run_op(f"rebuild the pool in {kv}", run)

    # ---- turns ------------------------------------------------------------------------------
    def stop(self) -> None:
        app = self.app
        if app.jobs.busy is Busy.REPLY:
            app.turn.cancel.set()
            app.status("stopping…")
            if app.turn.view is not app.view:
                app.notice(f"stopping conversation {app.turn.view.number}'s reply")

    def regenerate(self) -> None:
        app, view = self.app, self.app.view
        if not self.can(REGENERATE):
            return
        if app.queued(view):
            app.notice("this conversation's turn is still queued", error=True)
            return
        if app.replying(view):
            app.turn.cancel.set()        # regenerate the reply in progress once it has stopped
        elif not view.state.messages or view.state.messages[-1]["role"] != "assistant":
            app.notice("nothing to regenerate: the conversation has no reply yet", error=True)
            return
        app.submit(view.ask(None))

    # ---- the screen and files ---------------------------------------------------------------
    def help(self) -> None:
        self.app.push_screen(HelpScreen(self.app.keymap(), str(self.app.settings_path)))

    def toggle_panels(self) -> None:
        self.app.part(PanelSwitcher).toggle()

    def toggle_panel(self, name: str) -> None:
        self.app.part(PanelSwitcher).toggle_panel(name)

    def next_panel(self) -> None:
        self.app.part(PanelSwitcher).cycle()

    def next_theme(self) -> None:
        names = list(self.app.themes)
        self.set_theme(names[(names.index(self.app.theme_name) + 1) % len(names)])

    def set_theme(self, name: str) -> None:
        app = self.app
        app.apply_theme(name)
        app.settings.theme = name
        try:
            settings_mod.save(app.settings, app.settings_path)
        except OSError as err:
            app.notice(f"theme {name} (not remembered: cannot write {app.settings_path}: {err.strerror})",
                       error=True)
            return
        app.status_note(f"theme {name}")

    def model_info(self) -> None:
        app = self.app
        app.push_screen(ModelInfoScreen(app.backend.info(), app.view.snapshot if app.view else None))

    def save_to(self, path: Path | None, overwrite: bool = False) -> None:
        """/save [FILE], /save! FILE (overwrite), ctrl+s: the transcript and telemetry."""
        app, view = self.app, self.app.view
        path = path or Path.cwd() / f"kvchat-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            md, jl = export(path, list(view.refresh_state().messages), view.turns, app.backend.info().model,
                            overwrite=overwrite)
        except OSError as err:
            app.notice(f"cannot save to {path}: {err.strerror or err}", error=True)
            return
        app.notice(f"saved the transcript to {md} and the telemetry to {jl}")

    def load(self, path: Path) -> None:
        try:
            text = read_message_file(path)
        except CommandError as err:
            self.app.notice(str(err), error=True)
            return
        lines = text.splitlines()
        preview = "\n".join(lines[:4]) + (f"\n… ({len(lines) - 4:,} more lines)" if len(lines) > 4 else "")
        self.app.send(text, shown=f"/load {path} ({len(text):,} characters)\n{preview}", typed=f"/load {path}")

    def what_if(self, model: str, tokens: str, budget: str | None) -> None:
        from ..text import what_if_command
        try:
            self.app.notice(what_if_command(model, token_count("whatif", tokens), budget))
        except (KvchatError, CommandError) as err:
            self.app.notice(str(err), error=True)

    # ---- keys and commands -------------------------------------------------------------------
    def key_handlers(self) -> dict[str, Callable[[], None]]:
        """What each key of keys.KEYS does, by its action name."""
        app = self.app
        return {
            "help": self.help, "reset_cache": self.reset_cache, "cap_down": lambda: self.step_cap(up=False),
            "cap_up": lambda: self.step_cap(up=True), "choose_policy": self.choose_policy, "stop": self.stop,
            "regenerate": self.regenerate, "kv_dtype": self.next_kv_dtype, "toggle_panels": self.toggle_panels,
            "next_panel": self.next_panel,
            "cache_mode": lambda: self.set_mode("off" if app.view.mode == "cache" else "cache"),
            "save": lambda: self.save_to(None), "theme": self.next_theme, "quit": lambda: app.quit_when_idle(),
            "new_conversation": lambda: self.conversations.new(),
            "next_conversation": lambda: self.conversations.step(+1),
            "previous_conversation": lambda: self.conversations.step(-1),
            "close_conversation": lambda: self.conversations.close(None),
            "chat_browser": lambda: app.browser.show(), "edit_last": lambda: app.editor.start(None),
            "palette": lambda: app.action_command_palette(),
            "copy_reply": lambda: copy_last(app, "reply"), "copy_code": lambda: copy_last(app, "code"),
        }

    def key(self, name: str) -> None:
        self.key_handlers()[name]()

    def run(self, cmd: Command) -> None:
        app, arg = self.app, cmd.arg
        handlers = {
            "help": self.help, "reset": self.reset_cache, "cap": lambda: self.set_cap(arg),
            "policy": lambda: self.set_policy(arg), "load": lambda: self.load(arg), "save": lambda: self.save_to(arg),
            "save!": lambda: self.save_to(arg, overwrite=True),
            "theme": lambda: self.set_theme(arg), "cache": lambda: self.set_mode("cache" if arg == "on" else "off"),
            "kv": lambda: self.set_kv_dtype(arg), "panel": lambda: self.toggle_panel(arg),
            "new": self.conversations.new, "switch": lambda: self.conversations.switch(arg),
            "close": lambda: self.conversations.close(arg), "list": self.conversations.list,
            "regen": self.regenerate, "quit": app.quit_when_idle,
            "chats": lambda: app.browser.show(),
            "edit": lambda: app.editor.cancel() if arg == "off" else app.editor.start(arg),
            "system": lambda: app.generation.set_system(arg),
            "temperature": lambda: app.generation.set(temperature=arg),
            "top-p": lambda: app.generation.set(top_p=arg), "seed": lambda: app.generation.set(seed=arg),
            "model": self.model_info, "copy": lambda: copy_last(app, arg),
            "whatif": lambda: self.what_if(*arg),
        }
        if cmd.name not in handlers:   # a command in COMMANDS without a handler here is a bug
            raise KvchatError(f"/{cmd.name} has no handler")
        handlers[cmd.name]()
