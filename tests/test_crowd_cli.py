"""`kvchat crowd` headless, on tiny sizes with the bundled model: the table, the JSON file's
per-user turn records and per-step totals, the plot; and its bad flags in one line, exit 2."""
from __future__ import annotations

import json

import pytest

from kvchat.cli.command import main


def test_a_short_crowd_run_writes_its_turns_steps_and_plot(tmp_path, capsys):
    out, png = tmp_path / "crowd.json", tmp_path / "crowd.png"
    rc = main(["crowd", "--users", "1,2", "--minutes", "0.12", "--think", "0.05", "--reply-tokens", "3",
               "--kv-budget", "32MiB", "--json", str(out), "--plot", str(png), "--quiet"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "users" in printed.splitlines()[0] and "aggregate tokens/s against users" in printed
    runs = json.loads(out.read_text())["runs"]
    assert [r["summary"]["users"] for r in runs] == [1, 2]
    two = runs[1]
    assert {t["user"] for t in two["turns"]} == {0, 1}
    assert all(t["generated_tokens"] >= 1 and t["ttft_ms"] > 0 for t in two["turns"] if t["error"] is None)
    s = two["summary"]
    assert s["turns"] >= 2 and s["tokens_per_s"] > 0 and s["ttft_p50_ms"] > 0
    assert s["reply_tokens"] == sum(t["generated_tokens"] for t in two["turns"] if t["error"] is None)
    steps = two["steps"]
    assert steps and all(st["weight_bytes"] > 0 for st in steps)
    assert [st["index"] for st in steps] == sorted({st["index"] for st in steps})   # each step once, in order
    assert s["max_sequences"] == max(st["sequences"] for st in steps)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, words", [
    (["--users", "0", "--minutes", "1"], "--users must be"),
    (["--users", "2,x", "--minutes", "1"], "--users must be"),
    (["--users", "65", "--minutes", "1"], "1 to 64"),
    (["--users", "2", "--minutes", "0"], "--minutes must be"),
    (["--users", "2", "--minutes", "inf"], "--minutes must be"),
    (["--users", "2", "--minutes", "1", "--think", "-1"], "--think must be"),
    (["--users", "2", "--minutes", "1", "--plot", "x.txt"], "give a .png"),
    (["--users", "2", "--minutes", "1", "--json", "/no/such/folder/x.json"], "does not exist"),
    (["--minutes", "1"], "--users"),
])
def test_bad_crowd_flags_get_one_line_and_exit_2(argv, words, capsys):
    assert main(["crowd", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err
