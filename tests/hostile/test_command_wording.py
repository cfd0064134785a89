"""Issue 27's low item: an error line shared between commands fits the command it ends. Only
the chat keeps a conversation; `info`, `ask`, `replay`, `bench`, `crowd` and `plan` have none,
so none of their lines says "the conversation so far is kept", and none offers the chat's
remedies (/cap, /policy, ctrl+n) where the command has flags or nothing at all."""
from __future__ import annotations

import json
import socketserver
import threading

from .conftest import cli, one_line
from .fake_vllm import fake_vllm, lost_mid_chunk

CHAT_WORDS = ("conversation", "/cap", "/policy", "ctrl+n", "send again")


def no_chat_words(err: str) -> None:
    assert not [w for w in CHAT_WORDS if w in err], err


def test_info_against_a_server_that_does_not_speak_http(capsys):
    class Garbage(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            self.request.recv(65536)
            self.request.sendall(b"\x00\xffnot http at all\r\n\r\n")
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, out, err = cli(capsys, ["info", "--server", f"http://127.0.0.1:{server.server_address[1]}"])
    finally:
        server.shutdown()
        server.server_close()
    one_line(code, err, "try again")
    no_chat_words(err)


def test_ask_whose_reply_loses_its_connection(capsys):
    with fake_vllm({"/v1/chat/completions": lost_mid_chunk}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "lost mid-reply", "try again once the server is back")
    no_chat_words(err)


def test_ask_past_the_models_context_is_told_to_send_less(capsys):
    """The local engine (random weights: the refusal comes before any compute) refuses a
    message past the model's 8,192 positions; ask has no --cap or --policy to offer."""
    code, out, err = cli(capsys, ["ask", "--random-weights", "word " * 9000])
    one_line(code, err, "8,192", "send a shorter message")
    no_chat_words(err)
    assert "--cap" not in err and "--policy" not in err


def test_replay_whose_reply_loses_its_connection(capsys, tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(["hi", "and again"]))
    with fake_vllm({"/v1/chat/completions": lost_mid_chunk}) as s:
        code, out, err = cli(capsys, ["replay", "--server", s.url, str(tmp_path / "r.json")])
    one_line(code, err, "lost mid-reply")
    no_chat_words(err)


def test_replay_over_its_cap_names_the_flags(capsys, tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(["a long first message"]))
    with fake_vllm({"/tokenize": (200, {"count": 100})}) as s:
        code, out, err = cli(capsys, ["replay", "--server", s.url, "--cap", "40", str(tmp_path / "r.json")])
    one_line(code, err, "the cap is 40", "raise --cap", "--policy drop-oldest")
    no_chat_words(err)


def test_bench_whose_reply_loses_its_connection(capsys):
    with fake_vllm({"/v1/completions": lost_mid_chunk}) as s:
        code, out, err = cli(capsys, ["bench", "--server", s.url, "--runs", "1", "--contexts", "64",
                                      "--new-tokens", "2", "--no-peers"])
    assert code == 2 and "lost mid-reply" in err, err
    no_chat_words(err)


def test_crowd_users_whose_replies_lose_their_connection(capsys):
    with fake_vllm({"/v1/chat/completions": lost_mid_chunk}) as s:
        code, out, err = cli(capsys, ["crowd", "--server", s.url, "--users", "1", "--minutes", "0.05"])
    assert "refused: " in err and "lost mid-reply" in err, err
    no_chat_words(err)


def test_a_cap_refusal_in_a_crowd_users_progress_line_offers_no_chat_remedy(capsys):
    """The engine's own refusal (engine/policy.py), as a crowd user's progress line shows it."""
    from kvchat.crowd.command import _progress
    from kvchat.crowd.driver import CrowdTurn
    from kvchat.engine.errors import CapExceeded
    from kvchat.engine.policy import StopPolicy
    try:
        StopPolicy().fit([{"role": "user", "content": "x"}], lambda m: 100, 64, "the model's maximum context")
    except CapExceeded as err:
        refusal = str(err)
    assert "ctrl+n" in refusal          # the engine words it for the chat
    turn = CrowdTurn(user=0, turn=0, long=True, conversation=1, start_s=0.0, end_s=0.1, prompt_tokens=0,
                     reused_tokens=0, generated_tokens=0, ttft_ms=None, ms_per_token=None, error=refusal)
    _progress(turn)
    err = capsys.readouterr().err
    assert "refused: this turn needs 100 tokens" in err and "send a shorter message" in err, err
    no_chat_words(err)
