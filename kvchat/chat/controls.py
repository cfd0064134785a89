"""What the keys and slash commands do to the conversation in focus: the user's experiments
on the cache.

`Controls` acts on the focused Session (opening, switching and closing conversations are
in conversations.py), on the UI thread. What may block on the backend (reset, cache mode,
KV dtype) goes through the screen's `run_op`, which runs it in a worker after the current
turn; settings a backend takes without waiting (cap, policy) change at once, even
mid-reply. A key or command for something this backend cannot do says why, in one line
(`Capabilities.why_not`), and calls nothing.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kvchat.engine.errors import KvchatError
from kvchat.engine.policy import POLICIES
from kvchat.engine.units import human_bytes

from ..backends.protocol import CACHE_TOGGLE, KV_DTYPE, REGENERATE, RESET, SINK_WINDOW
from ..commands import Command, CommandError, read_message_file, token_count
from ..screens.policy_picker import PolicyPicker
from ..screens.model_info import ModelInfoScreen
from ..store.export import export
from ..text import message_preview, per_token, what_if_command
from . import planning
from .browser import Browser
from .conversations import Conversations
from .crowd import CrowdControl
from .editing import Editor
from .generation import Generation
from .host import Host
from .jobs import RunningTurn

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
    def __init__(self, host: Host, conversations: Conversations, browser: Browser, editor: Editor,
                 generation: Generation) -> None:
        self.host = host
        self.conversations = conversations
        self.crowd = CrowdControl(host)
        self.commands = self._commands(conversations, browser, editor, generation)

    def run(self, cmd: Command) -> None:
        """A slash command of commands.COMMANDS (the App's own go up to it before this)."""
        if cmd.name not in self.commands:   # a command in COMMANDS without a handler here is a bug
            raise KvchatError(f"/{cmd.name} has no handler")
        self.commands[cmd.name](cmd.arg)

    def _commands(self, convs: Conversations, browser: Browser, editor: Editor,
                  gen: Generation) -> dict[str, Callable[[Any], object]]:
        """What each command does with its argument; built once."""
        host = self.host
        return {
            "reset": lambda _: self.reset_cache(), "cap": self.set_cap, "policy": self.set_policy,
            "load": self.load, "save": self.save_to, "save!": lambda path: self.save_to(path, overwrite=True),
            "cache": lambda on: self.set_mode("cache" if on == "on" else "off"), "kv": self.set_kv_dtype,
            "panel": lambda name: host.panels.switcher.toggle_panel(name),
            "new": lambda _: host.call_later(convs.new), "switch": convs.switch, "close": convs.close,
            "list": lambda _: convs.list(), "regen": lambda _: self.regenerate(), "chats": lambda _: browser.show(),
            "edit": lambda arg: editor.cancel() if arg == "off" else editor.start(arg),
            "system": gen.set_system, "temperature": partial(gen.set, "temperature"),
            "top-p": partial(gen.set, "top_p"), "seed": partial(gen.set, "seed"),
            "model": lambda _: self.model_info(), "copy": host.copy, "whatif": lambda arg: self.what_if(*arg),
            "plan": self.plan,
        }

    def can(self, capability: str) -> bool:
        """Whether the backend can; if not, the focused transcript says why."""
        caps = self.host.backend.capabilities
        if caps.has(capability):
            return True
        self.host.notice(f"not with this backend: {caps.why_not(capability)}", error=True)
        return False

    # ---- the focused conversation's cache ------------------------------------------------------
    def reset_cache(self) -> None:
        if not self.can(RESET):
            return
        session = self.host.session

        def run() -> str:
            n = session.chat.reset_cache()
            session.log.event("reset_cache", blocks=n)
            return f"cache reset: freed {n} blocks; the next turn prefills the whole history"
        self.host.run_op("reset the cache", run)

    def step_cap(self, up: bool) -> None:
        self.set_cap(next_cap(self.host.session.cap, self.host.backend.info().max_position, up))

    def set_cap(self, cap: int | None) -> None:
        host, session = self.host, self.host.session
        info = host.backend.info()
        top = info.max_position
        if cap is not None and top is not None and cap > top and not info.random_weights:   # as --cap
            host.notice(f"/cap {cap:,} is past {info.model}'s context window of {top:,} tokens; accepted: 1 to "
                        f"{top:,}, or /cap off", error=True)
            return
        try:
            session.chat.set_cap(cap)
        except KvchatError as err:     # e.g. below sink-window's least window
            host.notice(str(err), error=True)
            return
        session.log.event("cap", value=cap)
        session.refresh()
        held = (session.snapshot.tokens_held if session.snapshot else 0) or 0
        note = f"cap {cap:,} tokens" if cap else "no cap"
        if cap and held > cap:
            then = "is refused" if session.policy == "stop" else f"makes room by {session.policy}"
            note += f"; {held - cap:,} tokens over, so the next turn {then}"
        host.settings_changed(note)

    def choose_policy(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self.set_policy(name)
        self.host.dialog(PolicyPicker(self.host.session.policy, self.host.backend.capabilities), chosen)

    def set_policy(self, name: str) -> None:
        """At once when idle; during a job after it, since leaving sink-window drops the
        cache under the engine's lock."""
        host, session = self.host, self.host.session
        caps = host.backend.capabilities
        if name not in caps.policies:
            offered = ", ".join(caps.policies)
            why = (caps.why_not(SINK_WINDOW) if POLICIES[name].streaming else "") or f"it offers {offered}"
            host.notice(f"not with this backend: {why}", error=True)
            return

        old = POLICIES.get(session.state.policy)
        # sink-window's cache is its own (shifted windows are no prefix of the text): entering or
        # leaving it, the next turn computes the whole history again; say what that costs first
        again = (old is not None and old.streaming != POLICIES[name].streaming and session.context_tokens > 0)

        def apply() -> str:
            session.chat.set_policy(name)
            session.log.event("policy", value=name)
            cost = (f"; the next turn prefills the whole history again, {session.context_tokens:,} tokens, as "
                    "sink-window's cache is no prefix of the text" if again else "")
            return f"policy {name}: {POLICIES[name].description}{cost}"
        if host.jobs.busy is not None:
            host.run_op(f"switch to policy {name}", apply, interrupt=False)
            return
        try:
            note = apply()
        except KvchatError as err:     # e.g. a cap below sink-window's least window
            host.notice(str(err), error=True)
            return
        if again:      # the whole line (200 columns) in the transcript; the status line's one fits
            host.notice(note)
            note = f"policy {name}: the next turn prefills the whole history again ({session.context_tokens:,} tokens)"
        host.settings_changed(note)

    def set_mode(self, mode: str) -> None:
        if not self.can(CACHE_TOGGLE):
            return
        session = self.host.session

        def run() -> str:
            session.chat.set_mode(mode)
            session.log.event("mode", value=mode)
            return ("cache off: every token recomputes the whole sequence" if mode == "off"
                    else "cache on: the next turn prefills the history once, then reads the cache")
        self.host.run_op(f"switch the cache {'off' if mode == 'off' else 'on'}", run)

    def toggle_mode(self) -> None:
        self.set_mode("off" if self.host.session.mode == "cache" else "cache")

    def next_kv_dtype(self) -> None:
        order = list(self.host.backend.capabilities.kv_dtypes)
        current = self.host.backend.info().kv_dtype
        if not self.can(KV_DTYPE):
            return
        if not order:
            self.host.notice(f"not with this backend: its KV dtype is fixed ({current})", error=True)
            return
        self.set_kv_dtype(order[(order.index(current) + 1) % len(order)] if current in order else order[0])

    def set_kv_dtype(self, kv: str) -> None:
        host = self.host
        offered = host.backend.capabilities.kv_dtypes
        if not self.can(KV_DTYPE):
            return
        if kv != "auto" and kv not in offered:
            what = f"it rebuilds its cache in {', '.join(offered)}" if offered else "its KV dtype is fixed"
            host.notice(f"not with this backend: {what}, not {kv}", error=True)
            return
        backend, sessions, session = host.backend, self.conversations.sessions, host.session

        def run() -> str:
            now = backend.set_kv_dtype(kv)
            for s in sessions:      # the pool is every conversation's
                s.log.event("kv_dtype", value=now)
            chats = "every conversation's cache" if len(sessions) > 1 else "the cache"
            snap = backend.snapshot(session.chat)
            size = per_token(snap.bytes_per_token, snap.scale_bytes_per_token) if snap.bytes_per_token else "unknown"
            pool = human_bytes(snap.capacity_bytes) if snap.capacity_bytes is not None else "unknown"
            return (f"KV pool rebuilt in {now}: {size} per token; the pool keeps its byte budget "
                    f"({pool}), so it holds {snap.num_blocks:,} blocks of "
                    f"{snap.block_size} now; {chats} dropped, the next turn recomputes its history")
        host.run_op(f"rebuild the pool in {kv}", run)

    # ---- turns ------------------------------------------------------------------------------
    def stop(self) -> None:
        host, turn = self.host, self.host.jobs.replying
        if turn is not None:
            turn.cancel.set()
            host.panels.status("stopping…")
            if turn.view is not host.view:
                host.notice(f"stopping conversation {turn.view.number}'s reply")

    def regenerate(self) -> None:
        host, view, session = self.host, self.host.view, self.host.session
        if not self.can(REGENERATE):
            return
        if host.jobs.queued_in(view):
            host.notice("this conversation's turn is still queued", error=True)
            return
        running = host.jobs.replying
        if running is not None and running.view is view:
            running.cancel.set()        # regenerate the reply in progress once it has stopped
        elif not session.state.messages or session.state.messages[-1]["role"] != "assistant":
            host.notice("nothing to regenerate: the conversation has no reply yet", error=True)
            return
        host.submit(RunningTurn(view, None))

    # ---- the screen and files ---------------------------------------------------------------
    def model_info(self) -> None:
        host = self.host
        host.dialog(ModelInfoScreen(host.backend.info(), host.session.snapshot), None)

    def save_to(self, path: Path | None, overwrite: bool = False) -> None:
        """/save [FILE], /save! FILE (overwrite), ctrl+s: the transcript and telemetry."""
        host, session = self.host, self.host.session
        named = path is not None
        path = path or Path.cwd() / f"kvchat-{time.strftime('%Y%m%d-%H%M%S')}"
        session.log.sync(list(session.refresh().messages))     # a /system since the last turn, say
        try:
            md, jl = export(path, session.log.history, session.turns, host.backend.info().model,
                            overwrite=overwrite)
        except OSError as err:
            host.notice(f"cannot save to {path}: {err.strerror or err}", error=True)
            return
        if not named:       # ctrl+s, /save: say where that is, and how to choose
            host.notice(f"saved the transcript {md.name} and the telemetry {jl.name} in the folder kvchat was "
                        f"started in, {md.parent}; /save FILE saves elsewhere")
            return
        host.notice(f"saved the transcript to {md} and the telemetry to {jl}")

    def load(self, path: Path) -> None:
        try:
            text = read_message_file(path)
        except CommandError as err:
            self.host.notice(str(err), error=True)
            return
        self.host.send(text, shown=message_preview(text, f"/load {path}"), typed=f"/load {path}")

    def plan(self, words: list[str]) -> None:
        """/plan: the flags checked now, the simulation after the current turn (a worker)."""
        try:
            args = planning.parse(words)
        except CommandError as err:
            self.host.notice(str(err), error=True)
            return
        self.host.run_op("simulate the plan", lambda: planning.run_plan_lines(args), interrupt=False)

    def what_if(self, model: str, tokens: str, *rest: str | None) -> None:
        """/whatif MODEL TOKENS [USERS] [BUDGET]: a bare number is users, a size with a unit the budget."""
        given = [r for r in rest if r is not None]
        counts = [r for r in given if r.replace(",", "").replace("_", "").isdigit()]
        budgets = [r for r in given if r not in counts]
        try:
            if len(counts) > 1 or len(budgets) > 1:
                raise CommandError("/whatif takes one number of users and one budget with its unit, "
                                   "e.g. /whatif 8b 8192 16 40GB")
            users = token_count("whatif", counts[0]) if counts else 1
            self.host.notice(what_if_command(model, token_count("whatif", tokens), budgets[0] if budgets else None,
                                             users=users))
        except (KvchatError, CommandError) as err:
            self.host.notice(str(err), error=True)
