"""The chat screen: the conversations on the left, the KV cache's telemetry on the right.

It owns what a chat is made of: the open conversations (conversations.py: each a Session and
its ChatView), the job queue that runs their turns and operations one at a time (jobs.py,
worker.py) and the panels that draw the one in focus (panels.py). Each key is an action by its
id (keys.py), one line handing the work to the part that acts on the state. The App above keeps
settings, themes, the keymap, the backend's load and quitting.

Threads: the UI thread owns every widget. Turns and blocking operations run in thread workers
and report back only through messages (messages.py), handled here: the Session first, then the
ChatView draws the text, then the panels. A turn holds the backend from its prefill to its last
token, so the UI thread calls only what never waits on it (`state()`, `info()`, set_cap).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import ContentSwitcher, Footer, ProgressBar, TextArea

from kvchat.engine.errors import KvchatError
from kvchat.engine.sampler import SamplingParams
from kvchat.engine.telemetry import CacheSnapshot

from .. import keys
from ..backends.protocol import Backend
from ..commands import BEFORE_LOAD, Command, CommandError, message_text, parse
from ..store.log import Restored
from ..text import RANDOM_WEIGHTS, prefill_line
from ..widgets.chat_input import ChatInput
from ..widgets.conversation_bar import ConversationBar
from ..widgets.panel_switcher import PanelSwitcher
from ..widgets.status_bar import StatusBar
from ..widgets.layout import layout_for
from .browser import Browser
from .clipboard import to_copy
from .controls import Controls
from .conversations import Conversations, read_the_cache
from .draft import DraftCounter
from .editing import Editor
from .generation import Generation, describe, resumed
from .input_keys import InputKeys
from .jobs import Busy, JobQueue, Op, RunningTurn, Then
from .messages import AppCommand, BackendFailed, BackendReady, LogFailed, OpEnded, TurnEnded, TurnProgress
from .panels import Panels
from .relay import Governor
from .session import ChatOptions, Session
from .view import ChatView
from .worker import run_op, run_turn

R = TypeVar("R")
APP_KEYS = frozenset(k.id for k in keys.KEYS if k.app)    # /help, /theme, /quit: the App's, as their keys are


class ChatScreen(InputKeys, Screen[None]):
    BINDINGS = keys.bindings()

    def __init__(self, model: str, sampling: SamplingParams, options: ChatOptions, keymap: dict[str, str],
                 themes: tuple[str, ...], data_root: Path | None = None, restored: Restored | None = None,
                 reopen: list[Path] | None = None) -> None:
        super().__init__()
        self.model = model                          # a label for the loading line
        self.options = options                      # the first conversation's settings
        self.keymap = keymap
        self.themes = themes
        self.restored, self.reopen = restored, list(reopen or [])
        self._backend: Backend | None = None
        self.jobs = JobQueue()
        self.governor = Governor()
        self.conversations = Conversations(self, data_root)
        self.browser = Browser(self, self.conversations, data_root)
        self.editor = Editor(self)
        self.generation = Generation(self, self.conversations, resumed(sampling, restored))
        self.controls = Controls(self, self.conversations, self.browser, self.editor, self.generation)
        self.conversations.on_change = self.browser.remember
        self.closing = False        # the app exits: worker messages still queued are dropped
        self.quitting, self.exit_code = False, 0   # exit with that status once the job ends (App.action_quit)
        self.panels = Panels(self)
        self.draft: DraftCounter

    # ---- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        status = StatusBar()
        status.info = f"kvchat · {self.model}"
        yield status
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                yield ConversationBar(id="conversations", classes="single")
                with ContentSwitcher(id="transcripts", initial="transcript"):
                    with ChatView(self.conversations.number(), id="transcript"):
                        yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="loading")
                yield ChatInput(id="input")
            yield PanelSwitcher(id="panels")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.draft = DraftCounter(self.input, self.conversations)
        self.input.focus()
        self.panels.switcher.set_hint(self.keymap["next_panel"].split(",")[0])
        self.panels.switcher.use_layout(layout_for(self.app.size.width, self.app.size.height))

    def on_resize(self, event: events.Resize) -> None:
        self.panels.switcher.use_layout(layout_for(event.size.width, event.size.height))

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("the backend is not loaded yet (the chat keys and commands wait for it)")
        return self._backend

    @property
    def view(self) -> ChatView:
        """The conversation in focus (the first one, while the model loads)."""
        return self.conversations.focused or self.query_one("#transcript", ChatView)

    @property
    def session(self) -> Session:
        session = self.conversations.session
        if session is None:
            raise RuntimeError("no conversation before the model loads (the chat keys and commands wait for it)")
        return session

    @property
    def transcripts(self) -> ContentSwitcher:
        return self.query_one("#transcripts", ContentSwitcher)

    @property
    def bar(self) -> ConversationBar:
        return self.query_one(ConversationBar)

    @property
    def input(self) -> ChatInput:
        return self.query_one(ChatInput)

    def key_display(self, key_id: str) -> str:
        return self.app.get_key_display(Binding(self.keymap[key_id].split(",")[0].strip(), ""))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The chat keys need a conversation: until the model loads they show disabled."""
        if action in keys.KEY_IDS and action not in BEFORE_LOAD and self.conversations.session is None:
            return None
        return True

    # ---- what the helpers show --------------------------------------------------------------------
    def notice(self, text: str, error: bool = False) -> None:
        """A line in the focused conversation's transcript."""
        self.view.add_notice(text, error)

    def show_settings(self) -> None:
        self.panels.settings(self.backend.info(), self.session, len(self.conversations.views),
                             describe(self.generation.sampling))

    def settings_changed(self, note: str) -> None:
        """A setting of the focused conversation changed: the gauge and the status line show it,
        and the note says what changed."""
        self.session.refresh()
        self.panels.cap(self.session, self.backend.info())
        self.show_settings()
        self.panels.note(note)

    def keep_snapshot(self, session: Session | None, snap: CacheSnapshot | None, draw: bool = True) -> Session | None:
        """Keep the snapshot on the conversation in focus when it was taken; that conversation
        if it is still the one on show (its panels drawn now, unless not `draw`), else None."""
        if session is None or snap is None:
            return None
        session.snapshot = snap
        shown = session if session is self.conversations.session else None
        if shown is not None and draw:
            self.panels.snapshot(shown, snap, self.backend.info())
        return shown

    def dialog(self, screen: Screen[R], chosen: Callable[[R | None], None] | None) -> None:
        self.app.push_screen(screen, chosen)

    def copy(self, what: str) -> None:
        """/copy, ctrl+y, ctrl+g: the last reply, or its last code block, to the clipboard."""
        text, line = to_copy(self.view, what)
        if text is None:
            self.notice(line, error=True)
            return
        self.app.copy_to_clipboard(text)
        self.panels.note(line)

    # ---- loading ------------------------------------------------------------------------------
    async def on_backend_ready(self, msg: BackendReady) -> None:
        """The model loaded (the App's worker posts it here, then it goes on up to the App):
        the first conversation starts, or resumes."""
        if self.closing:
            return
        backend, seconds = msg.backend, msg.seconds
        self._backend = self.draft.backend = backend
        view, restored = self.view, self.restored
        try:
            session = Session.open(backend, view.number, self.options, self.conversations.data_root, restored)
        except (KvchatError, OSError) as err:
            self.post_message(BackendFailed(f"cannot start the conversation: {err}"))
            return
        await self.conversations.add(view, session)
        self.conversations.focused = view
        await self.query_one("#loading").remove()
        if restored is not None:
            await self.browser.resume(view, restored)
        info = backend.info()
        view.add_notice(f"{info.model} loaded in {seconds:.0f} s; F1 shows the keys")
        if info.random_weights:
            view.add_notice(RANDOM_WEIGHTS, error=False).add_class("warning")
        self.panels.latency.attach(session.latency)
        self.panels.backend_ready(info, backend.capabilities)
        if self.reopen:
            await self.browser.reopen_all(self.reopen)
        self.show_settings()
        self.conversations.refresh_bar()
        self.run_op("read the cache", read_the_cache)   # first snapshot, taken off the UI thread
        self.job_done()

    # ---- what the user types ------------------------------------------------------------------
    def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        try:
            cmd = parse(event.text, self.themes)
        except CommandError as err:
            self.notice(str(err), error=True)
            return
        session = self.conversations.session
        if cmd is None and session is not None and session.editing is not None:
            self.editor.resend(message_text(event.text))
        elif cmd is None:
            self.send(message_text(event.text))
        else:
            self.run_command(cmd)

    def run_command(self, cmd: Command) -> None:
        if self.conversations.session is None and cmd.name not in BEFORE_LOAD:
            self.notice(f"/{cmd.name} waits for the model to load", error=True)
        elif cmd.name in APP_KEYS:
            self.post_message(AppCommand(cmd))
        else:
            self.controls.run(cmd)

    def on_key(self, event: events.Key) -> None:
        """A character typed while another widget has focus (the transcript, a panel, a code
        block: none of them takes characters) goes to the input, which takes focus back;
        Tab still moves focus, and the focused widget keeps its own keys (arrows, pages)."""
        if not event.is_printable or not event.character:
            return
        field = self.input
        if self.focused is field:
            return
        event.stop()
        field.focus()
        field.insert(event.character)

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        """The draft changed: its token count beside the input, throttled."""
        if isinstance(event.text_area, ChatInput):
            self.draft.changed()

    # ---- keys: each by its id in keys.KEYS --------------------------------------------------------
    def action_reset_cache(self) -> None:
        self.controls.reset_cache()

    def action_cap_down(self) -> None:
        self.controls.step_cap(up=False)

    def action_cap_up(self) -> None:
        self.controls.step_cap(up=True)

    def action_choose_policy(self) -> None:
        self.controls.choose_policy()

    def action_stop(self) -> None:
        self.controls.stop()

    async def action_new_conversation(self) -> None:
        await self.conversations.new()

    def action_previous_conversation(self) -> None:
        self.conversations.step(-1)

    def action_next_conversation(self) -> None:
        self.conversations.step(+1)

    def action_switch_conversation(self, number: int) -> None:
        """A click on the conversation bar."""
        self.conversations.switch(number)

    def action_close_conversation(self) -> None:
        self.conversations.close(None)

    def action_chat_browser(self) -> None:
        self.browser.show()

    def action_edit_last(self) -> None:
        self.editor.start(None)

    def action_regenerate(self) -> None:
        self.controls.regenerate()

    def action_cache_mode(self) -> None:
        self.controls.toggle_mode()

    def action_kv_dtype(self) -> None:
        self.controls.next_kv_dtype()

    def action_toggle_panels(self) -> None:
        self.panels.switcher.toggle()

    def action_next_panel(self) -> None:
        self.panels.switcher.cycle()

    def action_save(self) -> None:
        self.controls.save_to(None)

    def action_copy_reply(self) -> None:
        self.copy("reply")

    def action_copy_code(self) -> None:
        self.copy("code")

    # ---- turns and operations, one at a time --------------------------------------------------
    def send(self, text: str, shown: str | None = None, typed: str | None = None) -> None:
        """Send a message, shown in the transcript as `shown` (a /load preview); `typed` is
        what goes back into the input if the turn cannot run."""
        view, jobs = self.view, self.jobs
        if jobs.replying_in(view) or jobs.queued_in(view):
            self.notice("still replying: press escape to stop it, then send", error=True)
            self.input.restore(typed or text)
            return
        running = jobs.replying
        if jobs.busy is Busy.LOAD:
            self.notice("the model is still loading; your message will be sent when it is ready")
        elif running is not None:
            self.notice(f"queued: conversation {running.view.number} is replying, and the engine runs one "
                        "turn at a time; this one starts when it ends")
        turn = RunningTurn(view, text, shown, typed)
        turn.user = view.show_user(shown or text)
        self.submit(turn)

    def submit(self, turn: RunningTurn) -> None:
        self.jobs.submit(turn)
        self._start_next()

    def run_op(self, label: str, run: Callable[[], str | None], then: Then | None = None,
               focus: Callable[[], Session] | None = None, interrupt: bool = True) -> None:
        """Run a backend operation in a worker, after the current job; stops a reply first
        unless interrupt is False (then it waits for the reply to end)."""
        running = self.jobs.replying
        if running is not None and interrupt:
            running.cancel.set()
            self.notice(f"stopping the reply to {label}")
        self.jobs.submit(Op(label, run, then, focus))
        self._start_next()

    def _start_next(self) -> None:
        job = self.jobs.next()
        if isinstance(job, Op):
            self.panels.status(f"{job.label}…")
            self.call_later(self.run_worker, partial(run_op, job, self.backend, lambda: self.session,
                                                     self.post_message), thread=True, group="op", exit_on_error=False)
        elif job is not None:
            self.call_later(self._start_turn, job)

    async def _start_turn(self, turn: RunningTurn) -> None:
        session = turn.view.session
        if turn.view not in self.conversations.views or session is None:   # closed while it waited
            self.job_done()
            return
        turn.reply = await turn.view.begin_reply(regenerate=turn.text is None)
        session.begin_turn(self.backend.info().kv_dtype)
        self.panels.status("prefilling…")
        self.conversations.refresh_bar()
        self.governor.begin()
        self.run_worker(partial(run_turn, turn, session, self.backend, self.generation.sampling,
                                lambda: self.session, lambda: self.governor.interval, self.post_message),
                        thread=True, group="turn", exit_on_error=False)

    async def on_turn_progress(self, msg: TurnProgress) -> None:
        """A batch of the reply: the Session, the text, then the panels and the status line."""
        if self.closing:
            msg.drawn.set()
            return
        p, session, view = msg.progress, msg.session, msg.turn.view
        session.progress(p)
        if msg.turn.reply is not None:
            await msg.turn.reply.append(p.text)
        where = f"conversation {view.number} " if view is not self.view else ""
        state = where + (prefill_line(p.prefill_progress, eta_s=p.prefill_eta_s) if p.prefill_progress is not None
                         else f"replying · {p.generated} tokens")
        self.panels.progress(session, bool(p.points), self.keep_snapshot(msg.focus, p.snapshot, draw=False), p.snapshot,
                             self.backend.info(), state)
        if p.prefill is not None:
            self.conversations.note_preemptions(session)   # making room for the prompt may have preempted others
        self.governor.tick()
        self.call_after_refresh(msg.drawn.set)      # the worker's next step waits for this draw

    async def on_turn_ended(self, msg: TurnEnded) -> None:
        """The reply finished (or was refused): the Session, the transcript, then the panels."""
        if self.closing:
            return
        turn, session = msg.turn, msg.session
        session.end_turn(msg.record, msg.stats)
        if msg.accepted:
            await turn.view.finish(turn.reply, msg.record, msg.error, self.backend.info().max_position)
        else:
            await turn.view.refuse(turn.user, turn.reply, msg.error)
        self.panels.latency_changed(session, live=False)
        if not msg.accepted and turn.text is not None and turn.view is self.view and not self.input.text:
            self.input.restore(turn.typed or turn.text)
        self.keep_snapshot(msg.focus, msg.snapshot)
        self.job_done()
        self.conversations.note_preemptions(session)

    async def on_op_ended(self, msg: OpEnded) -> None:
        if self.closing:
            return
        if msg.then is not None:
            result = msg.then()
            if result is not None:
                await result
        for session in self.conversations.sessions:
            session.refresh()
        self.keep_snapshot(msg.focus, msg.snapshot)
        self.show_settings()
        if msg.error:
            self.notice(msg.error, error=True)
        elif msg.note:
            self.notice(msg.note)
        self.job_done()

    def on_log_failed(self, msg: LogFailed) -> None:
        view = self.conversations.view_of(msg.session)
        if view is not None:
            view.add_notice(msg.line, error=True)

    def job_done(self) -> None:
        idle = not self.jobs
        if idle:
            self.panels.status("quitting" if self.quitting else "ready")
        self.jobs.done()
        if idle and self.quitting:
            self.app.exit(return_code=self.exit_code)
            return
        self._start_next()
