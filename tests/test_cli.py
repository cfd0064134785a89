"""The headless CLI: its JSON contract, and one clear line with exit status 2 for bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvchat.engine.engine import cpu_auto_dtype
from kvchat.engine.geometry import DTYPE_BYTES
from kvchat.engine.sources import bundled_dir
from kvchat.cli.command import main
from cli_helpers import fails_with


@pytest.fixture
def model_copy(tmp_path):
    """A copy of the bundled model directory that a test may damage."""
    src = bundled_dir()
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_ask_json_reports_the_turn(capsys):
    assert main(["ask", "--json", "--max-tokens", "12", "--kv-budget", "32MiB",
                 "What is the capital of France?"]) == 0
    rec = json.loads(capsys.readouterr().out)
    for key in ("reply", "prompt_tokens", "reused_tokens", "computed_tokens", "generated_tokens", "ttft_ms",
                "decode_ms", "kv_bytes_per_token", "kv_bytes_used", "kv_bytes_allocated", "block_size",
                "blocks_used"):
        assert key in rec
    assert "Paris" in rec["reply"]
    # SmolLM2's 30 layers of 3 KV heads of 64, in auto's cache: the weights' dtype (engine.cpu_auto_dtype)
    assert rec["kv_dtype"] == cpu_auto_dtype()
    assert rec["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * DTYPE_BYTES[rec["kv_dtype"]]
    # a reply's tokens are fed back one step each; the end-of-turn token that stops it is not,
    # nor is the last token when max_tokens stops it
    unfed = 0 if rec["stop_reason"] == "eos" else 1
    held = rec["prompt_tokens"] + rec["generated_tokens"] - unfed
    assert rec["kv_bytes_used"] == held * rec["kv_bytes_per_token"]
    assert rec["blocks_used"] == -(-held // 16)
    assert rec["kv_bytes_allocated"] == rec["blocks_used"] * 16 * rec["kv_bytes_per_token"]
    assert len(rec["decode_ms"]) == rec["generated_tokens"] - unfed


def test_replay_reuses_more_each_turn_while_computing_about_the_new_message(tmp_path, capsys):
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(["Hi, I am Sam.", "Name three colours.", "Which one is the sky?"]))
    assert main(["replay", str(f), "--json", "--max-tokens", "16", "--kv-budget", "32MiB"]) == 0
    turns = json.loads(capsys.readouterr().out)
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["reused_tokens"] == 0
    assert turns[1]["reused_tokens"] > 0 and turns[2]["reused_tokens"] > turns[1]["reused_tokens"]
    for prev, t in zip(turns, turns[1:]):
        new_part = t["prompt_tokens"] - prev["prompt_tokens"] - prev["generated_tokens"]
        assert t["computed_tokens"] <= new_part + 2 * t["block_size"]


def test_replay_runs_several_conversations_at_once_and_says_how_many_shared_each_step(tmp_path, capsys):
    f = tmp_path / "chats.json"
    f.write_text(json.dumps([["Name a colour.", "And another?"], ["Name a fruit."], ["Name a river."]]))
    assert main(["replay", str(f), "--json", "--max-tokens", "6", "--kv-budget", "32MiB"]) == 0
    turns = json.loads(capsys.readouterr().out)
    assert [(t["turn"], t["conversation"]) for t in turns] == [(1, 0), (1, 1), (1, 2), (2, 0)]
    for t in turns:
        assert len(t["step_sequences"]) == len(t["step_tokens"]) == len(t["decode_ms"])
    assert max(max(t["step_sequences"]) for t in turns if t["turn"] == 1) >= 2, "no step was shared"
    assert all(max(s, default=1) <= 3 for s in (t["step_sequences"] for t in turns))


@pytest.mark.parametrize("model,per_token", [("llama-3.1-8b", 131072), ("llama-3.1-70b", 327680),
                                             ("llama-2-7b", 524288)])
def test_info_gives_the_known_bytes_per_token_without_weights(capsys, model, per_token):
    assert main(["info", "--model", model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == per_token


def test_info_fp8_halves_bf16(capsys):
    assert main(["info", "--model", "llama-3.1-8b", "--kv-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 65536


def test_missing_path(capsys, tmp_path):
    fails_with(capsys, ["ask", "--model", str(tmp_path / "nope"), "hi"], "not found", "alias")


def test_directory_without_config(capsys, tmp_path):
    fails_with(capsys, ["ask", "--model", str(tmp_path), "hi"], "no config.json")


def test_truncated_safetensors(capsys, model_copy):
    st = model_copy / "model.safetensors"
    st.write_bytes(st.read_bytes()[:4096])
    fails_with(capsys, ["ask", "--model", str(model_copy), "hi"], "corrupt or truncated safetensors")


def test_corrupt_safetensors_header(capsys, model_copy):
    (model_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    fails_with(capsys, ["ask", "--model", str(model_copy), "hi"], "corrupt or truncated safetensors")


def test_unsupported_architecture(capsys, model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (model_copy / "config.json").write_text(json.dumps(cfg))
    fails_with(capsys, ["ask", "--model", str(model_copy), "hi"], "unsupported architecture", "Llama")


def test_pickled_checkpoint_is_refused(capsys, tmp_path):
    ckpt = tmp_path / "model.bin"
    ckpt.write_bytes(b"\x80\x04not really")
    fails_with(capsys, ["ask", "--model", str(ckpt), "hi"], "pickled")


def test_alias_without_weights_says_where_it_looked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("KVCHAT_MODELS", str(tmp_path / "models"))
    err = fails_with(capsys, ["ask", "--model", "llama-3.1-8b", "hi"], "no local weights", "--random-weights")
    assert str(tmp_path) in err


def test_random_weights_need_only_the_config_and_the_tokenizer(capsys, model_copy):
    """A directory of config.json and tokenizer files (a few MB of an 8B model's repository) runs
    its geometry with random weights; without --random-weights it still needs its safetensors."""
    (model_copy / "model.safetensors").unlink()
    fails_with(capsys, ["ask", "--model", str(model_copy), "hi"], "no *.safetensors weights")
    assert main(["ask", "--json", "--model", str(model_copy), "--random-weights", "--max-tokens", "3",
                 "--kv-budget", "32MiB", "hi"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["generated_tokens"] == 3 and rec["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * DTYPE_BYTES[rec["kv_dtype"]]
    (model_copy / "tokenizer.json").unlink()
    fails_with(capsys, ["ask", "--model", str(model_copy), "--random-weights", "hi"], "no tokenizer")


@pytest.mark.parametrize("flag,value,fragment", [
    ("--block-size", "0", "--block-size must be a positive integer"),
    ("--block-size", "-16", "--block-size must be a positive integer"),
    ("--kv-budget", "0", "must be positive"),
    ("--kv-budget", "-5MiB", "must be positive"),
    ("--kv-budget", "12parsecs", "cannot read size"),
    ("--kv-budget", "1KiB", "too small for one block"),
])
def test_bad_cache_flags(capsys, flag, value, fragment):
    fails_with(capsys, ["ask", f"{flag}={value}", "hi"], fragment)


def test_unreadable_replay_files(capsys, tmp_path):
    fails_with(capsys, ["replay", str(tmp_path / "missing.json")], "no such file")
    bad = tmp_path / "bad.json"
    bad.write_text("[\"unterminated")
    fails_with(capsys, ["replay", str(bad)], "not valid JSON")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"messages": ["hi"]}))
    fails_with(capsys, ["replay", str(wrong)], "expected a non-empty JSON list")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    fails_with(capsys, ["replay", str(binary)], "replay file")


def test_unknown_flag_is_one_line(capsys):
    fails_with(capsys, ["ask", "--frobnicate", "hi"], "unrecognized arguments")


def test_the_installed_command_answers_about_paris():
    out = subprocess.run([sys.executable, "-m", "kvchat", "ask", "--max-tokens", "16", "--kv-budget", "32MiB",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
