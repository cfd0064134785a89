"""What a server says reaches the terminal inert and without secrets (issue 27, high 1 and 2):
its model name, its replies, its error bodies and events, on every CLI path. `--json` stays
exact JSON. The servers are tests/hostile/fake_vllm.py: real HTTP on loopback."""
from __future__ import annotations

import json

import pytest

from cli_helpers import refusing_port
from kvchat.backends import vllm
from kvchat.store.log import data_dir

from .conftest import cli, one_line, raw_control
from .fake_vllm import fake_vllm, models, reply

KEY = "sk-hostile-7f3a9c21d4e8b6"       # unique enough never to appear by chance
PASSWORD = "pw-5b8e1d93c4a7"


# ---- escape sequences from the server ----------------------------------------------------------
def test_a_served_models_name_is_printed_inert(capsys, sequence):
    with fake_vllm({"/v1/models": (200, models(name=f"evil{sequence}model"))}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
        assert code == 0 and "attached to evil" in err
        assert not raw_control(out + err) and "\\x1b" in err
        code, out, err = cli(capsys, ["info", "--server", s.url, "--geometry", "smollm2-135m"])
        assert code == 0 and not raw_control(out + err) and "\\x1b" in out


def test_a_reply_is_printed_inert_and_its_json_stays_exact(capsys, sequence):
    texts = ("Hello", sequence, " world")
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(reply(*texts))}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
        assert code == 0 and not raw_control(out + err)
        assert out.startswith("Hello\\x1b") and out.rstrip().endswith(" world")
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi", "--json"])
        assert code == 0 and not raw_control(out)
        assert json.loads(out)["reply"] == "".join(texts)


def test_an_error_body_is_shown_inert(capsys, sequence):
    body = {"error": {"message": f"boom{sequence}boom"}}
    with fake_vllm({"/v1/chat/completions": (500, body)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "answered 500", "boom\\x1b")
    assert not raw_control(err)


def test_an_error_event_mid_stream_is_shown_inert(capsys, sequence):
    def fails(h):
        h.stream([{"error": {"message": f"engine died{sequence}", "code": 500}}], done=False)
    with fake_vllm({"/v1/chat/completions": fails}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "stopped the reply", "engine died\\x1b")
    assert not raw_control(out + err)


def test_a_metrics_label_with_escapes_is_refused_inert(capsys, sequence):
    metrics = f'# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size="16",cache_dtype="fp8{sequence}"}} 1\n'
    with fake_vllm({"/metrics": (200, metrics)}) as s:
        code, out, err = cli(capsys, ["info", "--server", s.url])
    one_line(code, err, "cache_dtype")
    assert not raw_control(err)


def test_a_replay_files_messages_are_echoed_inert(capsys, sequence, tmp_path):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps([f"first{sequence}", "second"]))
    with fake_vllm() as s:
        code, out, err = cli(capsys, ["replay", "--server", s.url, str(f)])
    assert code == 0 and "> first\\x1b" in out and not raw_control(out + err)


# ---- secrets --------------------------------------------------------------------------------------
def echo_authorization(status: int):
    """A server that puts the request's Authorization header into its error body."""
    def answer(h):
        h.send_body(status, {"error": {"message": f"bad request from {h.headers.get('Authorization')}"}})
    return answer


@pytest.mark.parametrize("status", [400, 500])
def test_the_api_key_echoed_in_an_error_body_is_redacted(capsys, monkeypatch, status):
    monkeypatch.setenv("KVCHAT_API_KEY", KEY)
    with fake_vllm({"/v1/chat/completions": echo_authorization(status)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
        assert s.seen[-1][2]["Authorization"] == f"Bearer {KEY}"     # it was sent
    one_line(code, err, f"answered {status}", "Bearer ***")
    assert KEY not in out + err


def test_the_api_key_echoed_in_an_error_event_is_redacted(capsys, monkeypatch):
    monkeypatch.setenv("KVCHAT_API_KEY", KEY)

    def echo(h):
        h.stream([{"error": {"message": f"rejected {h.headers.get('Authorization')}"}}], done=False)
    with fake_vllm({"/v1/chat/completions": echo}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    one_line(code, err, "stopped the reply")
    assert KEY not in out + err


def test_the_api_key_echoed_in_the_reply_is_redacted_even_split_across_tokens(capsys, monkeypatch):
    monkeypatch.setenv("KVCHAT_API_KEY", KEY)
    pieces = ("your key is ", KEY[:6], KEY[6:15], KEY[15:], " ok")
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(reply(*pieces))}) as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
        assert code == 0 and KEY not in out and "your key is ***" in out
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi", "--json"])
        assert code == 0 and KEY not in out and json.loads(out)["reply"] == "your key is *** ok"


def with_userinfo(url: str) -> str:
    return url.replace("http://", f"http://admin:{PASSWORD}@")


def test_url_credentials_are_sent_but_never_printed_by_info(capsys):
    with fake_vllm() as s:
        code, out, err = cli(capsys, ["info", "--server", with_userinfo(s.url), "--geometry", "smollm2-135m"])
        assert code == 0 and PASSWORD not in out + err and s.url in out
        code, out, err = cli(capsys, ["info", "--server", with_userinfo(s.url), "--json"])
        assert code == 0 and PASSWORD not in out + err and json.loads(out)["server"] == s.url
        assert s.seen[0][2]["Authorization"].startswith("Basic ")      # the credentials were used


def test_url_credentials_are_not_in_ask_errors_or_the_echoed_basic_header(capsys):
    with fake_vllm({"/v1/chat/completions": echo_authorization(500)}) as s:
        code, out, err = cli(capsys, ["ask", "--server", with_userinfo(s.url), "hi"])
    one_line(code, err, "answered 500")
    assert PASSWORD not in err and "YWRtaW46" not in err          # base64 of "admin:..."


def test_url_credentials_are_not_in_the_nothing_listening_line(capsys):
    with refusing_port() as port:
        code, out, err = cli(capsys, ["info", "--server", f"http://admin:{PASSWORD}@127.0.0.1:{port}"])
    one_line(code, err, "nothing answers", str(port))
    assert PASSWORD not in err


def test_url_credentials_are_not_in_a_bad_url_line(capsys):
    code, out, err = cli(capsys, ["ask", "--server", f"http://admin:{PASSWORD}@127.0.0.1:99999", "hi"])
    one_line(code, err, "port")
    assert PASSWORD not in err


def test_an_internal_error_keeps_secrets_out_of_stderr_and_errors_log(capsys, monkeypatch):
    monkeypatch.setenv("KVCHAT_API_KEY", KEY)

    def broken(self):
        raise RuntimeError(f"unexpected: header was Bearer {KEY} \x1b]0;x\x07")
    monkeypatch.setattr(vllm.VllmBackend, "_probe", broken)
    with fake_vllm() as s:
        code, out, err = cli(capsys, ["ask", "--server", s.url, "hi"])
    assert code == 1 and "internal error" in err and KEY not in err and not raw_control(err)
    log = (data_dir() / "errors.log").read_text()
    assert "RuntimeError" in log and KEY not in log and not raw_control(log)
