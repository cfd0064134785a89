"""`kvchat` (the chat): everything checked before the UI starts (flags, settings, theme, the
model's location, the conversation to resume), then the app, given a factory that loads the
backend. Any problem before the UI is one line and exit status 2; loading the weights then
happens inside the UI, with progress shown."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from kvchat.engine.errors import KvchatError

from ..store import settings as settings_mod
from ..app import theming
from .args import UsageError
from ..app.shell import AppOptions, KvChatApp
from ..store.catalog import resume_paths
from ..chat.session import ChatOptions
from ..store.settings import SettingsError
from ..store.log import Restored, StoreError, lock_holder, restore
from ..text import reading_line, shown

EXIT_JOIN_S = 3.0     # after the app ends: the crowd's users have this long to leave the engine


class LaunchError(Exception):
    """Why kvchat cannot start; str() is one line."""


def run_chat(args) -> int:
    """The chat app. Bad flags, settings, or a missing model end here, before the UI starts,
    with one line on stderr and exit status 2."""
    try:
        app = prepare(args)
    except LaunchError as err:
        print(f"kvchat: {shown(err)}", file=sys.stderr)
        return 2
    if not all(f is not None and not f.closed and f.isatty() for f in (sys.stdin, sys.stdout)):
        print("kvchat: kvchat needs a terminal; use kvchat ask \"...\" (or kvchat replay FILE)", file=sys.stderr)
        return 2
    app.run()
    if not app.settle(EXIT_JOIN_S):
        # a crowd user still inside a step: ending the interpreter under it can abort the
        # process (torch's and OpenMP's threads torn down mid-call); nothing of it is saved
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(app.return_code or 0)
    if app.backend is not None:
        app.backend.shutdown()
    if app.failure:
        print(f"kvchat: {shown(app.failure)}", file=sys.stderr)
        return 2
    if app.signalled is not None and app.backend is None:
        # signalled while the model loads: the load cannot be interrupted, and nothing is
        # open to save yet, so the process ends now rather than after the load's thread
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + app.signalled)
    return app.return_code or 0


def prepare(args) -> KvChatApp:
    try:
        return _prepare(args)
    except (KvchatError, SettingsError, StoreError, UsageError) as err:
        raise LaunchError(str(err)) from None
    except OSError as err:
        raise LaunchError(f"{err.filename or ''}: {err.strerror or err}".lstrip(": ")) from None


def _prepare(args) -> KvChatApp:
    from kvchat.engine import make_policy, preflight

    from .args import check_server_flags, check_start, engine_config, sampling
    from ..backends.local import LocalBackend

    path = settings_mod.config_path()
    settings = settings_mod.load(path)
    themes = theming.available()
    if args.theme is not None and args.theme not in themes:
        raise KvchatError(f"unknown --theme {args.theme!r}; accepted: {', '.join(themes)}")
    if args.theme is None and settings.theme is not None and settings.theme not in themes:
        raise SettingsError(f"settings file {path}: unknown theme {settings.theme!r}; accepted: {', '.join(themes)}")
    theme = args.theme or settings.theme or "dark"
    make_policy(args.policy)
    if check_server_flags(args):
        return _prepare_server(args, settings, path, theme)
    cfg = engine_config(args)
    sp = sampling(args, default_max=512)
    checked = preflight(cfg)
    check_start(args, checked.source, checked.device, checked.kv_dtype)
    options = _options(args, settings, path, theme, checked.source.name, sp)
    return KvChatApp(lambda: LocalBackend.load(cfg, checked=checked), options, settings, path)


def _prepare_server(args, settings, path, theme) -> KvChatApp:
    """`kvchat --server URL`: connect (within --timeouts connect and answer) before the UI, so a bad URL, a server
    that is not vLLM or a refused key is one line on stderr; the app then gets the backend."""
    from .args import sampling
    from ..backends.vllm import VllmBackend
    backend = VllmBackend.from_flags(args)
    try:
        if args.policy not in backend.capabilities.policies:
            backend.open(policy=args.policy)      # raises the one line that says why not
        options = _options(args, settings, path, theme, f"{backend.model.name} at {backend.api.url}",
                           sampling(args, default_max=512))
    except BaseException:
        backend.shutdown()
        raise
    return KvChatApp(lambda: backend, options, settings, path)


def _reading(path: Path):
    """A big log takes seconds to read back before the UI starts: its progress, on one line
    of stderr rewritten in place (a terminal only; nothing for a small log)."""
    if not sys.stderr.isatty():
        return None

    def tell(done: int, total: int) -> None:
        end = "\n" if done >= total else ""
        print(f"\r{shown(reading_line(path.name, done, total))}", end=end, file=sys.stderr, flush=True)
    return tell


def _options(args, settings, path, theme, model: str, sp) -> AppOptions:
    restored: Restored | None = None
    reopen: list[Path] = []
    if args.resume:
        last, reopen = resume_paths()
        if last is None:
            raise KvchatError("--resume: no saved conversation yet; start one with plain `kvchat`")
        holder = lock_holder(last)
        if holder is not None and holder != os.getpid():
            raise KvchatError(f"--resume: {last.name} is open in another kvchat (pid {holder}); close it there first")
        restored = restore(last, _reading(last))   # damaged records are skipped; the app says how many
    if args.theme is not None and args.theme != settings.theme:
        settings.theme = args.theme
        settings_mod.save(settings, path)
    return AppOptions(
        model=model, sampling=sp, theme=theme, restored=restored, reopen=reopen,
        chat=ChatOptions(system=args.system, cap=args.cap, policy=args.policy,
                         mode="off" if args.no_cache else "cache"))
