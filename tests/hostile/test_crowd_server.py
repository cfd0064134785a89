"""`kvchat crowd --server`: the simulated users as concurrent streams to a vLLM server (the
stand-in of fake_vllm.py, real HTTP on loopback): several streams at once, each user's turns
timed on the client's clock, and the figures only a local engine reports (its steps, its
preemptions) left out of the run and n/a in the table, never 0."""
from __future__ import annotations

import json
import threading

from .conftest import cli
from .fake_vllm import fake_vllm, reply


def test_a_crowd_against_a_server_sends_concurrent_streams_and_marks_what_it_cannot_see(capsys, tmp_path):
    lock, live, most = threading.Lock(), [0], [0]

    def slow_reply(h) -> None:
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        try:
            h.stream(reply("one", " two", " three"), delay=0.05)
        finally:
            with lock:
                live[0] -= 1
    out = tmp_path / "crowd.json"
    with fake_vllm({"/v1/chat/completions": slow_reply}) as s:
        code, stdout, err = cli(capsys, ["crowd", "--server", s.url, "--users", "3", "--minutes", "0.03",
                                         "--think", "0.05", "--json", str(out), "--quiet"])
        asked = [b for m, p, _, b in s.seen if p == "/v1/chat/completions"]
    assert code == 0, err
    assert most[0] >= 2, "the users' streams never overlapped"
    run = json.loads(out.read_text())["runs"][0]
    assert {t["user"] for t in run["turns"]} == {0, 1, 2}
    assert all(t["generated_tokens"] == 3 and t["ttft_ms"] > 0 for t in run["turns"] if t["error"] is None)
    assert run["steps"] == [] and run["summary"]["preemptions"] is None
    assert len(asked) >= len(run["turns"])
    # each user's history grows: a later request carries its earlier question and reply
    longest = max(len(b["messages"]) for b in asked)
    assert longest >= 3
    row = stdout.splitlines()[1].split()
    assert row[0] == "3" and "n/a" in row             # preemptions and recomputed: the server's to tell


def test_a_reply_the_end_of_the_run_cuts_midway_is_not_a_turn_of_the_run(capsys, tmp_path):
    """The run ends while every user's reply is still streaming (a token each 0.5 s, the run
    1.2 s long): those cut replies are not turns, so no turn in the run is short of its tokens."""
    out = tmp_path / "crowd.json"
    with fake_vllm({"/v1/chat/completions": lambda h: h.stream(reply("one", " two", " three"), delay=0.5)}) as s:
        code, _, err = cli(capsys, ["crowd", "--server", s.url, "--users", "2", "--minutes", "0.02",
                                    "--think", "0.05", "--json", str(out), "--quiet"])
    assert code == 0, err
    turns = json.loads(out.read_text())["runs"][0]["turns"]
    assert all(t["generated_tokens"] == 3 for t in turns), [t["generated_tokens"] for t in turns]
