"""The kvchat App: settings, themes, the keymap, the backend's load, and quitting.

Everything a chat is made of lives in its one screen, the ChatScreen (kvchat/chat/screen.py):
the conversations, the job queue, the panels, and the keys that act on them. The App keeps
what outlives a conversation: the settings file, the themes, the keymap (`set_keymap`
rebinds every key by its id), the help and the command palette, and the model's load, which
runs in a thread worker and hands the backend to the screen. Quitting lets the reply in
progress end, so it is saved, then exits; SIGINT, SIGTERM and SIGHUP quit the same way,
sooner (a closed terminal or a `kill` mid-reply keeps what streamed, and the terminal leaves
the alternate screen and mouse mode as on ctrl+q). They and a terminal that went away reach
the app through app/signals.py, not the event loop, which a dead terminal can block for good.
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import RenderableType
from textual.app import App

from kvchat.engine.errors import KvchatError

from .. import keys
from ..backends.protocol import Backend
from ..chat.jobs import Busy
from ..chat.messages import AppCommand, BackendFailed, BackendReady
from ..chat.screen import ChatScreen
from ..chat.unsent import keep_unsent
from ..chat.worker import one_line
from ..commands import BEFORE_LOAD
from ..screens.help_screen import HelpScreen
from ..store import settings as settings_mod
from ..store.settings import Settings
from . import heap, theming
from .palette import KvchatCommands
from .signals import SignalWatch, terminal_fds
from .startup import AppOptions

QUIT_GRACE_S = 10.0        # ctrl+q: the reply in progress has this long to stop and be saved
SIGNAL_GRACE_S = 3.0       # a signal: shorter (a stop takes one decode step or one prefill chunk)
EXIT_GRACE_S = 2.0         # then the app has this long to restore the terminal and end
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _last_resort(saved: threading.Event | None, code: int) -> None:
    """A signal's backstop, in a daemon thread: once the reply in progress is in the log (or
    SIGNAL_GRACE_S passed), the app has EXIT_GRACE_S to end by itself, and then the process
    ends here. A terminal that hung up (SIGHUP) leaves Textual waiting forever to write the
    sequences that restore it, and its event loop blocked on them; a process ending normally
    takes this thread along."""
    if saved is not None:
        saved.wait(SIGNAL_GRACE_S)
    time.sleep(EXIT_GRACE_S)
    os._exit(code)


class KvChatApp(App[int], inherit_bindings=False):
    """App's own ctrl+q / ctrl+c bindings are replaced by keys.KEYS (not inherited), which the
    chat screen binds; help, theme, palette and quit bind to this App's actions."""

    TITLE = "kvchat"
    ENABLE_COMMAND_PALETTE = False     # its built-in ctrl+p binding: keys.KEYS has a rebindable one instead
    DEFAULT_MODE = "chat"              # the one mode: its screen is mounted before the App's own mount
    COMMANDS = {KvchatCommands}
    chat_screen: ChatScreen

    def __init__(self, backend_factory: Callable[[], Backend], options: AppOptions,
                 settings: Settings | None = None, settings_path: Path | None = None) -> None:
        self.themes = theming.available()
        folder = theming.themes_dir()
        super().__init__(css_path=[folder / theming.BASE_CSS, *(t.path for t in self.themes.values())])
        self.register_theme(theming.HIGH_CONTRAST)
        self.backend_factory = backend_factory
        self.options = options
        self.settings = settings or Settings()
        self.settings_path = settings_path
        self.theme_name = options.theme if options.theme in self.themes else next(iter(self.themes))
        self.backend: Backend | None = None
        self.failure: str | None = None         # one line for stderr after exit
        self.signalled: int | None = None       # the signal that asked the app to quit
        self._signals: SignalWatch | None = None
        self._load_started = time.perf_counter()
        self.use_command_palette = True         # opened by keys.KEYS' "palette" key
        self.add_mode("chat", self._chat)

    def _chat(self) -> ChatScreen:
        o = self.options
        self.chat_screen = ChatScreen(o.model, o.sampling, o.chat, self.keymap(), tuple(self.themes), o.data_root,
                                      o.restored, o.reopen)
        return self.chat_screen

    def on_mount(self) -> None:
        self.apply_theme(self.theme_name)
        self.set_keymap(self.settings.keys)
        self._load_timer = self.set_interval(0.1, self._loading_tick)
        self.run_worker(self._load, thread=True, group="load", exit_on_error=False)
        if not self.is_headless:                # a test's app leaves the test runner's signals alone
            loop = asyncio.get_running_loop()
            # closed by run(), as the app ends, the previous handlers then back
            self._signals = SignalWatch(SIGNALS, terminal_fds(), lambda sig: self._signalled(loop, sig))

    def run(self, **kwargs: Any) -> int | None:
        """App.run, then the signals' previous handlers back (after the terminal is restored,
        which can block too)."""
        try:
            return super().run(**kwargs)
        finally:
            if self._signals is not None:
                self._signals.close()
                self._signals = None

    def _signalled(self, loop: asyncio.AbstractEventLoop, sig: int) -> None:
        """SIGINT, SIGTERM, SIGHUP, or the terminal gone (SIGHUP), in the signals' thread: quit
        as ctrl+q does, the reply in progress stopped and saved, within SIGNAL_GRACE_S; a second
        signal exits at once. The exit status is the shell's for a signal, 128 + its number. The
        reply is stopped and the backstop started here, so both happen when the loop never gets
        to the quit; its worker saves the reply without the loop."""
        again = self.signalled is not None
        self.signalled = sig
        try:
            if again:
                loop.call_soon_threadsafe(self.exit, None, 128 + sig)
                return
            turn = self.chat_screen.jobs.replying
            if turn is not None:    # stopped from here: a loop blocked on a dead terminal never runs the quit,
                turn.quitting = True    # and the reply would stream on, unsaved, until the backstop
                turn.cancel.set()
            threading.Thread(target=_last_resort, args=(turn.saved if turn is not None else None, 128 + sig),
                             daemon=True, name="kvchat-signal").start()
            loop.call_soon_threadsafe(self.call_later, self.action_quit, SIGNAL_GRACE_S)
        except RuntimeError:        # the loop closed: the app has ended already
            pass

    def exit(self, result: int | None = None, return_code: int = 0, message: RenderableType | None = None) -> None:
        self.chat_screen.closing = True     # worker messages still in the queue are dropped from now on
        super().exit(result, return_code, message)

    def settle(self, wait_s: float) -> bool:
        """After the app ended: the crowd's threads out of the engine within `wait_s` (True),
        so the interpreter never ends under a thread that is inside torch."""
        screen = getattr(self, "chat_screen", None)
        return screen is None or screen.controls.crowd.join(wait_s)

    def keymap(self) -> dict[str, str]:
        return {k.id: self.settings.keys.get(k.id, k.keys) for k in keys.KEYS}

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The palette waits for the model (what it runs acts on a conversation)."""
        if action in keys.KEY_IDS and action not in BEFORE_LOAD and self.backend is None:
            return None
        return True

    # ---- themes ---------------------------------------------------------------------------------
    def apply_theme(self, name: str) -> None:
        for t in self.themes.values():
            self.remove_class(t.css_class)
        self.add_class(self.themes[name].css_class)
        self.theme = self.themes[name].base
        self.theme_name = name

    def set_theme(self, name: str) -> None:
        """Switch and remember it in the settings file."""
        self.apply_theme(name)
        self.settings.theme = name
        try:
            settings_mod.save(self.settings, self.settings_path)
        except OSError as err:
            self.chat_screen.notice(f"theme {name} (not remembered: cannot write {self.settings_path}: "
                                    f"{err.strerror})", error=True)
            return
        self.chat_screen.panels.note(f"theme {name}")

    # ---- keys and commands of the App -----------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap(), str(self.settings_path)))

    def action_theme(self) -> None:
        names = list(self.themes)
        self.set_theme(names[(names.index(self.theme_name) + 1) % len(names)])

    def action_crowd(self) -> None:
        self.chat_screen.controls.crowd.toggle()

    def action_palette(self) -> None:
        self.action_command_palette()

    async def action_quit(self, grace: float = QUIT_GRACE_S) -> None:
        """Let the reply in progress end (so it is saved), then exit: the jobs that wait are
        dropped, their messages and the draft kept in the log as unanswered (chat/unsent.py),
        the reply in progress stops, and the chat screen exits once its job ends. A load
        cannot be interrupted: the process ends after it (cli/launch.py)."""
        screen, jobs = self.chat_screen, self.chat_screen.jobs
        screen.controls.crowd.stop()        # at once: the simulated users are never waited for
        await self._typed_settled()
        code = 128 + self.signalled if self.signalled is not None else 0
        screen.quitting, screen.exit_code = True, code
        session, draft = screen.conversations.session, None
        if screen.is_mounted and (session is None or session.editing is None):
            draft = (screen.view, screen.input.text)        # an edit's draft is not a new message
        keep_unsent(jobs, draft, screen.options, screen.conversations.data_root, self.options.model,
                    screen.restored)
        if jobs.busy in (None, Busy.LOAD):
            self.exit(return_code=code)
            return
        if jobs.replying is not None:
            jobs.replying.quitting = True
            jobs.replying.cancel.set()
        screen.panels.status("quitting…")
        self.set_timer(grace, lambda: self.exit(return_code=code))    # a stuck job must not keep the app open

    async def _typed_settled(self, timeout: float = 1.0) -> None:
        """Wait until the keys typed before ctrl+q have landed: in a terminal a burst (text,
        Enter, ctrl+q) reaches this action while the input's queue still holds the text's last
        keys and its Enter; the message that Enter posts then bubbles up through the input's
        parents to the screen, one queue at a time. A callback through each of those queues,
        twice (the Enter's message is posted behind the first one), runs after all of it."""
        screen = self.chat_screen
        if not screen.is_mounted:
            return
        field = screen.input
        path = [field, *field.ancestors[:field.ancestors.index(screen) + 1]]
        deadline = time.monotonic() + timeout
        for node in path + path:
            landed = asyncio.get_running_loop().create_future()
            node.call_later(lambda f=landed: f.done() or f.set_result(None))
            try:
                await asyncio.wait_for(landed, max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return          # a queue that does not answer must not keep the app open

    async def on_app_command(self, msg: AppCommand) -> None:
        """/help, /theme NAME, /quit, typed in the chat."""
        name = msg.command.name
        if name == "theme":
            self.set_theme(msg.command.arg)
        elif name == "help":
            self.action_help()
        elif name == "quit":
            await self.action_quit()
        elif name == "crowd":
            self.chat_screen.controls.crowd.command(msg.command.arg)

    # ---- loading ----------------------------------------------------------------------------------
    def _loading_tick(self) -> None:
        if self.chat_screen.is_mounted:      # its status line is there
            self.chat_screen.panels.status(f"loading {self.options.model} … "
                                           f"{time.perf_counter() - self._load_started:.1f} s")

    def _load(self) -> None:
        """In a worker: build the backend (the model load takes seconds) and hand it to the
        chat screen, which starts the first conversation (after its own mount: its messages
        wait for it) and passes the message on up here."""
        t0 = time.perf_counter()
        try:
            backend = self.backend_factory()
        except KvchatError as err:
            self.post_message(BackendFailed(str(err)))
        except Exception as err:  # torch and transformers raise many types; report, never hide
            self.post_message(BackendFailed(f"cannot load the model: {one_line(err)}"))
        else:
            self.chat_screen.post_message(BackendReady(backend, time.perf_counter() - t0))

    def on_backend_ready(self, msg: BackendReady) -> None:
        self._load_timer.stop()
        self.backend = msg.backend
        if not self.is_headless:      # the model's objects out of the collector's walks (app/heap.py)
            heap.settle()

    def on_backend_failed(self, msg: BackendFailed) -> None:
        self.failure = msg.error
        self.exit(return_code=2)
