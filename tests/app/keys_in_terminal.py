"""The app on the scripted FakeBackend, for test_tmux's key run: each key action that
reaches it and each dialog it closes are appended to the log file named in argv[1].

A script, not a fixture: tmux runs it in a real terminal, where the keys go through the
terminal and the multiplexer as a user's would. The fake keeps it fast; what is tested
is the keys' path, not the model.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))     # tests/: its app/ is a package

from app.fake_backend import FakeBackend  # noqa: E402

from kvchat.app.shell import AppOptions, KvChatApp  # noqa: E402
from kvchat.engine.sampler import SamplingParams  # noqa: E402
from kvchat.keys import KEY_IDS  # noqa: E402


class RecordingApp(KvChatApp):
    def __init__(self, log: Path) -> None:
        backend = FakeBackend()
        super().__init__(lambda: backend, AppOptions(model="fake-smollm2", sampling=SamplingParams(max_tokens=16)))
        self.key_log = log

    def record(self, line: str) -> None:
        with open(self.key_log, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")

    async def run_action(self, action, default_namespace=None, namespaces=None) -> bool:
        """Every key's action (bound by its id, on the chat screen or as `app.ID`) as it reaches the app."""
        name = action.split("(")[0].rpartition(".")[2] if isinstance(action, str) else ""
        if name in KEY_IDS:
            self.record(name)
        return await super().run_action(action, default_namespace, namespaces)

    def pop_screen(self):
        self.record("closed")
        return super().pop_screen()


if __name__ == "__main__":
    sys.exit(RecordingApp(Path(sys.argv[1])).run() or 0)
