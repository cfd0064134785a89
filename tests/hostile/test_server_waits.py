"""Every wait on a server ends (issue 27, high 3 and 6, medium): connect, a plain answer, the
first token, the gap between events, the whole reply; the client stops at the max_tokens it
asked for, and a cancel (the app's Escape) stops a stream that never ends. Short deadlines
come from --timeouts, so each case takes about a second; on code without deadlines they hang
until pytest-timeout stops them."""
from __future__ import annotations

import threading
import time

import pytest

from kvchat.backends.server_api import ConnectionLost, ServerError
from kvchat.backends.vllm import VllmBackend
from kvchat.engine import SamplingParams, TokenEvent, TurnStats

from .conftest import cli, one_line
from .fake_vllm import METRICS, fake_vllm, lost_mid_chunk, reply, silent_listener, token, usage

pytestmark = pytest.mark.timeout(30)
# Only the deadline a test is about is short: a plain answer (the /server_info the CLI asks
# first) gets 3 s, since a loaded CI host once kept the in-process fake server past 0.5 s.
FAST = "connect=1,answer=3,first-token=0.5,gap=0.5,total=3"


def endless(h):
    """Tokens as fast as the socket takes them, past any max_tokens, for ever."""
    h.start_stream()
    h.event({"prompt_token_ids": [1, 2, 3], "choices": []})
    while h.event(token("x", 7)):
        pass


def one_token_then(trickle: str, every: float = 0.05):
    """One token, then `trickle` written again and again: comments, or bytes of a line that
    never ends. Each write resets a per-read timeout; none is an event."""
    def answer(h):
        h.start_stream()
        h.event(token("Hi", 7))
        while h.write(trickle):
            time.sleep(every)
    return answer


def timed(capsys, argv):
    t0 = time.monotonic()
    code, out, err = cli(capsys, argv)
    return code, out, err, time.monotonic() - t0


def test_a_stream_past_max_tokens_is_stopped_by_the_client(capsys):
    with fake_vllm({"/v1/chat/completions": endless}) as s:
        code, out, err, took = timed(capsys, ["ask", "--server", s.url, "--max-tokens", "12", "hi"])
    assert code == 0 and out.strip() == "x" * 12 and took < 5


@pytest.mark.parametrize("trickle", [": keep-alive\n", "d", "\n"], ids=["comments", "endless-line", "blank-lines"])
def test_a_trickling_stream_is_cut_at_the_gap_deadline_and_keeps_what_came(capsys, trickle):
    with fake_vllm({"/v1/chat/completions": one_token_then(trickle)}) as s:
        code, out, err, took = timed(capsys, ["ask", "--server", s.url, "--timeouts", FAST, "hi"])
    assert out.strip() == "Hi"
    one_line(code, err, "incomplete", "--timeouts")
    assert took < 5


def test_a_reply_that_never_starts_is_one_line_at_the_first_token_deadline(capsys):
    def headers_only(h):
        h.start_stream()
        h.hang()
    with fake_vllm({"/v1/chat/completions": headers_only}) as s:
        code, out, err, took = timed(capsys, ["ask", "--server", s.url, "--timeouts", FAST, "hi"])
    one_line(code, err, "sent no reply after 0.5 s", "first-token")
    assert took < 5


def test_a_steady_endless_stream_is_cut_at_the_total_deadline(capsys):
    def slow_forever(h):
        h.start_stream()
        while h.event(token("y", 8)):
            time.sleep(0.05)
    with fake_vllm({"/v1/chat/completions": slow_forever}) as s:
        code, out, err, took = timed(capsys, ["ask", "--server", s.url, "--max-tokens", "100000",
                                              "--timeouts", "total=1", "hi"])
    one_line(code, err, "incomplete")
    assert out.strip().startswith("yyy") and 0.9 < took < 5


def test_a_server_that_accepts_and_never_answers_is_one_line_at_the_answer_deadline(capsys):
    with silent_listener() as url:
        code, out, err, took = timed(capsys, ["info", "--server", url, "--timeouts", "answer=0.5"])
    one_line(code, err, "did not answer", "0.5 s")
    assert took < 5


def test_a_metrics_answer_that_trickles_is_one_line_at_the_answer_deadline(capsys):
    def trickle(h):
        h.send_response(200)
        h.send_header("Content-Length", "100000")
        h.end_headers()
        while h.write("#"):
            time.sleep(0.05)
    with fake_vllm({"/metrics": trickle}) as s:
        # 2 s, not 0.5: the deadline covers the /server_info asked first too, and the subject is
        # the trickle on /metrics, which no deadline's length lets through
        code, out, err, took = timed(capsys, ["info", "--server", s.url, "--timeouts", "answer=2"])
    one_line(code, err, "/metrics", "2 s")
    assert took < 8


def test_an_answer_over_the_size_limit_is_one_line(capsys):
    big = METRICS + "# " + "x" * (17 * 2**20) + "\n"       # valid figures, then 17 MiB of comment
    with fake_vllm({"/metrics": (200, big)}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "more than 16 MiB")


def test_the_default_answer_deadline_is_seconds_not_minutes():
    from kvchat.backends.deadlines import Deadlines
    d = Deadlines()
    assert d.answer <= 10 and d.connect <= 5 and d.gap < d.first_token < d.total


@pytest.mark.parametrize("flag, fragment", [("gap=0", "gap=0"), ("gap=-1", "gap=-1"), ("wait=3", "NAME"),
                                            ("gap", "NAME=SECONDS"), ("total=soon", "not a number"),
                                            ("total=inf", "total=inf")])
def test_bad_timeouts_are_one_line(capsys, flag, fragment):
    with fake_vllm() as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "--timeouts", flag, "hi"])
    one_line(code, err, "--timeouts", fragment)


def test_timeouts_without_a_server_are_one_line(capsys):
    code, out, err = cli(capsys, ["ask", "--timeouts", "gap=1", "hi"])
    one_line(code, err, "--timeouts needs --server")


# ---- cancelling (the app's Escape) -----------------------------------------------------------------
def run_in_thread(gen, events: list):
    def drain():
        for ev in gen:
            events.append(ev)
    t = threading.Thread(target=drain, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("trickle", [": ping\n", "d"], ids=["comments", "endless-line"])
def test_cancel_stops_a_stream_that_never_ends_within_a_second(trickle):
    with fake_vllm({"/v1/chat/completions": one_token_then(trickle)}) as s:
        backend = VllmBackend(s.url)
        try:
            chat = backend.open()
            cancel = threading.Event()
            events: list = []
            t = run_in_thread(chat.send("hi", SamplingParams(max_tokens=50), cancel=cancel), events)
            deadline = time.monotonic() + 5
            while not any(isinstance(e, TokenEvent) for e in events) and time.monotonic() < deadline:
                time.sleep(0.01)
            cancel.set()
            t0 = time.monotonic()
            t.join(timeout=5)
            assert not t.is_alive() and time.monotonic() - t0 < 1.0
            stats = events[-1]
            assert isinstance(stats, TurnStats) and stats.stop_reason == "cancelled" and stats.reply == "Hi"
            assert chat.messages[-1] == {"role": "assistant", "content": "Hi"}
        finally:
            backend.shutdown()


def test_cancel_stops_an_endless_token_stream_too():
    with fake_vllm({"/v1/chat/completions": endless}) as s:
        backend = VllmBackend(s.url)
        try:
            cancel = threading.Event()
            events: list = []
            t = run_in_thread(backend.open().send("hi", SamplingParams(max_tokens=10**6), cancel=cancel), events)
            time.sleep(0.3)
            cancel.set()
            t.join(timeout=5)
            assert not t.is_alive() and events[-1].stop_reason == "cancelled"
        finally:
            backend.shutdown()


# ---- a reply that ends early ---------------------------------------------------------------------
def cut_after(n: int, done: bool = False):
    def answer(h):
        h.stream([{"prompt_token_ids": [1, 2], "choices": []}] + [token(f"w{i} ", i) for i in range(n)], done=done)
    return answer


def test_a_stream_cut_without_done_or_finish_is_kept_and_marked_cut(capsys):
    with fake_vllm({"/v1/chat/completions": cut_after(3)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
        assert out.strip() == "w0 w1 w2"
        one_line(code, err, "incomplete", "ended before the reply did")
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi", "--json"])
        assert code == 2 and '"stop_reason": "cut"' in out


def test_a_stream_cut_before_any_token_is_one_line_and_changes_nothing(capsys):
    with fake_vllm({"/v1/chat/completions": cut_after(0)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "without [DONE]")


def test_done_with_a_finish_reason_is_a_complete_reply(capsys):
    events = reply("a", "b")
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(events, done=False)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])   # finish "stop" came: complete
    assert code == 0 and out.strip() == "ab"


def test_a_server_that_drops_the_connection_on_info_says_nothing_of_a_conversation(capsys):
    def slam(h):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"da")
        h.wfile.flush()
        h.connection.close()
    with fake_vllm({"/v1/models": slam}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "lost")
    assert "conversation" not in err


def test_usage_only_after_the_last_token_is_still_read():
    events = [token("a", 1), token("b", 2, "length"), usage(prompt=9, completion=2, cached=4)]
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(events)}) as s:
        backend = VllmBackend(s.url)
        try:
            stats = list(backend.open().send("hi", SamplingParams(max_tokens=2)))[-1]
        finally:
            backend.shutdown()
    assert (stats.stop_reason, stats.prompt_tokens, stats.reused_tokens, stats.generated_tokens) == \
        ("max_tokens", 9, 4, 2)


def test_a_connection_broken_mid_reply_is_one_line_and_keeps_the_conversation(capsys):
    with fake_vllm({"/v1/chat/completions": lost_mid_chunk}) as s:
        backend = VllmBackend(s.url)
        try:
            chat = backend.open()
            with pytest.raises(ConnectionLost, match="lost mid-reply.*try again once the server is back"):
                list(chat.send("hi", SamplingParams(max_tokens=8)))
            assert chat.messages == []
        finally:
            backend.shutdown()
