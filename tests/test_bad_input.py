"""Every category of bad input in issue 11, as a table: each case runs the CLI (in-process
through main(), or as a subprocess where the terminal, stdout or argv bytes matter) and must
end with exit status 2, exactly one line on stderr, no traceback, and no file changed.

Model-directory cases start from a tiny Llama (2 layers, hidden 64) written here with
random weights and the bundled tokenizer, so a damaged copy costs a few MB, not 500.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cli_helpers import ROOT
from kvchat.cli.command import main
from kvchat.engine.sources import bundled_dir

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 49152, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}


def write_tiny(d: Path, config: dict | None = None, weights: Callable[[dict], None] | None = None) -> Path:
    """A tiny Llama directory: config.json (TINY updated with `config`), random float32
    safetensors of the shapes its own config implies (then `weights` may damage them), and
    the bundled model's tokenizer files."""
    from safetensors.torch import save_file

    from kvchat.engine.geometry import from_hf_config, weight_shapes
    d.mkdir(parents=True)
    cfg = {**TINY, **(config or {})}
    shapes = weight_shapes(from_hf_config({**TINY, "vocab_size": cfg["vocab_size"]}, "tiny"))
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
    if weights:
        weights(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir() / name, d / name)
    return d


# ---- the cases ------------------------------------------------------------------------------
# Each: (id, argv or a function tmp_path -> argv, a fragment the line must hold).
def tiny(config=None, weights=None, argv=("ask", "--model", "{dir}", "hi")):
    def setup(tmp: Path) -> list[str]:
        d = write_tiny(tmp / "tiny", config, weights)
        return [a.replace("{dir}", str(d)) for a in argv]
    return setup


def config_text(text: str | bytes):
    def setup(tmp: Path) -> list[str]:
        d = write_tiny(tmp / "tiny")
        (d / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["ask", "--model", str(d), "hi"]
    return setup


def replay_file(content: str | bytes):
    def setup(tmp: Path) -> list[str]:
        f = tmp / "chat.json"
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        return ["replay", str(f)]
    return setup


def model_file(name: str, content: bytes):
    def setup(tmp: Path) -> list[str]:
        (tmp / name).write_bytes(content)
        return ["ask", "--model", str(tmp / name), "hi"]
    return setup


def replay_special(kind: str):
    def setup(tmp: Path) -> list[str]:
        if kind == "fifo":
            os.mkfifo(tmp / "fifo.json")
            return ["replay", str(tmp / "fifo.json")]
        if kind == "dir":
            return ["replay", str(tmp)]
        return ["replay", kind]                       # a device
    return setup


def _cast(name: str, dtype: torch.dtype):
    def damage(t: dict) -> None:
        t[name] = t[name].to(dtype)
    return damage


def _reshape(name: str, shape: tuple[int, ...]):
    def damage(t: dict) -> None:
        t[name] = torch.zeros(shape)
    return damage


def _drop(name: str):
    def damage(t: dict) -> None:
        del t[name]
    return damage


LONG_PROMPT = "word " * 2000
Q0 = "model.layers.0.self_attn.q_proj.weight"

CASES = [
    # numbers: non-finite, absurd, out of range; bounds checked against the machine
    ("temperature-nan", ["ask", "--temperature", "nan", "hi"], "--temperature must be in [0, 100]"),
    ("temperature-inf", ["ask", "--temperature", "inf", "hi"], "--temperature must be in"),
    ("temperature-overflows-to-inf", ["ask", "--temperature", "1e309", "hi"], "--temperature must be in"),
    ("temperature-negative", ["ask", "--temperature", "-1", "hi"], "--temperature must be in"),
    ("temperature-absurd", ["ask", "--temperature", "1e300", "hi"], "--temperature must be in"),
    ("top-p-zero", ["ask", "--top-p", "0", "hi"], "--top-p must be in (0, 1]"),
    ("top-p-above-one", ["ask", "--top-p", "1.5", "hi"], "--top-p must be in (0, 1]"),
    ("top-p-nan", ["ask", "--top-p", "nan", "hi"], "--top-p must be in (0, 1]"),
    ("top-k-negative", ["ask", "--top-k", "-1", "hi"], "--top-k must be a positive integer"),
    ("top-k-float", ["ask", "--top-k", "2.5", "hi"], "--top-k must be a positive integer"),
    ("max-tokens-zero", ["ask", "--max-tokens", "0", "hi"], "--max-tokens must be a positive integer"),
    ("max-tokens-absurd", ["ask", "--max-tokens", "99999999999999", "hi"], "up to 10,000,000"),
    ("seed-negative", ["ask", "--seed", "-1", "hi"], "--seed must be an integer >= 0"),
    ("seed-past-int64", ["ask", "--seed", str(2**64), "hi"], "--seed must be an integer >= 0"),
    ("threads-zero", ["ask", "--threads", "0", "hi"], "--threads must be a positive integer"),
    ("threads-absurd", ["ask", "--threads", "1000000", "hi"], "up to 1,024"),
    ("block-size-zero", ["ask", "--block-size", "0", "hi"], "--block-size must be a positive integer"),
    ("block-size-absurd", ["ask", "--block-size", "1000000", "hi"], "up to 4,096"),
    ("kv-budget-1000TiB", ["ask", "--kv-budget", "1000TiB", "hi"], "does not fit"),
    ("kv-budget-overflows", ["ask", "--kv-budget", "1e400", "hi"], "beyond any machine"),
    ("kv-budget-past-an-exabyte", ["ask", "--kv-budget", "99999999TiB", "hi"], "beyond any machine"),
    ("kv-budget-nan", ["ask", "--kv-budget", "nan", "hi"], "cannot read size"),
    ("kv-budget-fraction-of-a-byte", ["ask", "--kv-budget", "0.5", "hi"], "must be positive"),
    ("kv-budget-unknown-unit", ["ask", "--kv-budget", "5EiB", "hi"], "cannot read size"),
    ("kv-budget-below-one-block", ["ask", "--kv-budget", "1KiB", "hi"], "too small for one block"),
    ("cap-zero", ["replay", "--cap", "0", "x.json"], "--cap must be a positive integer"),
    ("cap-absurd", ["replay", "--cap", "99999999999", "x.json"], "--cap must be a positive integer"),
    ("info-tokens-zero", ["info", "--tokens", "0"], "--tokens must be a positive integer"),
    ("info-kv-budget-inf", ["info", "--kv-budget", "1e999GiB"], "beyond any machine"),
    # text: bytes that are not UTF-8 reach Python as lone surrogates
    ("prompt-not-utf8", ["ask", "caf\udce9"], "the message is not valid UTF-8"),
    ("system-not-utf8", ["ask", "--system", "\udcff", "hi"], "--system is not valid UTF-8"),
    ("replay-message-lone-surrogate", replay_file('["\\ud800 hi"]'), "message 1 is not valid UTF-8"),
    ("prompt-empty", ["ask", "  "], "empty message"),
    ("prompt-longer-than-the-context", tiny(argv=("ask", "--json", "--model", "{dir}", LONG_PROMPT)),
     "the cap is 512"),
    ("cap-past-the-context", tiny(argv=("replay", "--cap", "100000", "--model", "{dir}", "x.json")),
     "past tiny's context window of 512 tokens"),
    # files
    ("replay-nested-deeply", replay_file("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    ("replay-nested-lists-of-lists", replay_file("[[[\"hi\"]]]"), "message 1 is list"),
    ("replay-message-without-content", replay_file('[{"role": "user"}]'), 'a string "content"'),
    ("replay-message-not-from-the-user", replay_file('[{"role": "assistant", "content": "hi"}]'),
     '"role": "user"'),
    ("replay-message-a-number", replay_file("[\"hi\", 3]"), "message 2 is int"),
    ("replay-empty-list", replay_file("[]"), "expected a non-empty JSON list"),
    ("replay-empty-message", replay_file('["hi", "  "]'), "message 2 is empty"),
    ("replay-empty-conversation", replay_file("[[\"hi\"], []]"), "conversation 2 is empty"),
    ("replay-null", replay_file("null"), "expected a non-empty JSON list"),
    ("replay-object", replay_file('{"messages": ["hi"]}'), "expected a non-empty JSON list"),
    ("replay-not-json", replay_file("[\"unterminated"), "not valid JSON"),
    ("replay-not-utf8", replay_file(b"[\"\xff\xfe\"]"), "not UTF-8"),
    ("replay-missing", ["replay", "no-such.json"], "no such file"),
    ("replay-fifo", replay_special("fifo"), "not a regular file"),
    ("replay-device", replay_special("/dev/zero"), "not a regular file"),
    ("replay-directory", replay_special("dir"), "is a directory"),
    # model directories
    ("model-path-too-long", ["ask", "--model", "m" * 5000, "hi"], "File name too long"),
    ("model-a-gguf-that-is-not", model_file("fake.gguf", b"GGUF junk"), "cannot read this GGUF as a Llama model"),
    ("model-a-pickle", model_file("model.bin", b"\x80\x04junk"), "pickled checkpoints are not loaded"),
    ("config-a-list", config_text("[1, 2]"), "must be a JSON object"),
    ("config-a-string", config_text('"llama"'), "must be a JSON object"),
    ("config-not-utf8", config_text(b"{\"model_type\": \"\xff\"}"), "unreadable config.json"),
    ("config-nested-deeply", config_text("[" * 100_000 + "]" * 100_000), "config.json"),
    ("config-other-architecture", tiny({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}),
     "unsupported architecture"),
    ("config-rope-yarn", tiny({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
     "unsupported rope scaling type 'yarn'"),
    ("config-rope-dynamic", tiny({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
     "unsupported rope scaling type 'dynamic'"),
    ("config-rope-llama3-incomplete", tiny({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
     "low_freq_factor"),
    ("config-rope-scaling-a-string", tiny({"rope_scaling": "llama3"}), "rope_scaling must be an object"),
    ("config-hidden-size-a-string", tiny({"hidden_size": "64"}), "hidden_size must be a whole number"),
    ("config-hidden-size-missing", tiny({"hidden_size": None}), "lacks 'hidden_size'"),
    ("config-norm-eps-nan", config_text(json.dumps({**TINY, "rms_norm_eps": float("nan")})),
     "rms_norm_eps must be a positive finite number"),
    ("config-kv-heads-not-dividing", tiny({"num_key_value_heads": 3}), "not a multiple of 3 KV heads"),
    ("config-eos-outside-vocab", tiny({"eos_token_id": 10**6}), "eos_token_id must be token ids"),
    ("config-attention-bias", tiny({"attention_bias": True}), "has no biases"),
    ("config-other-activation", tiny({"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    ("config-head-dim-mismatch", tiny({"head_dim": 32}), "q_proj.weight has shape [64, 64]"),
    ("weights-q-proj-wrong-shape", tiny(weights=_reshape(Q0, (60, 64))), "q_proj.weight has shape [60, 64]"),
    ("weights-int8", tiny(weights=_cast(Q0, torch.int8)), "has dtype I8"),
    ("weights-int32-embedding", tiny(weights=_cast("model.embed_tokens.weight", torch.int32)), "has dtype I32"),
    ("weights-missing-a-tensor", tiny(weights=_drop("model.layers.1.mlp.down_proj.weight")),
     "lack model.layers.1.mlp.down_proj.weight"),
    ("vocab-smaller-than-the-tokenizer", tiny({"vocab_size": 1000}, argv=("ask", "--json", "--model", "{dir}", "hi")),
     "the tokenizer has 49,152 tokens"),
    ("tokenizer-config-a-list", tiny(weights=None, argv=("ask", "--model", "{dir}/tokenizer_config.json", "hi")),
     "not a model"),
    # flags: in the wrong place they are still read (the flag before the subcommand is kept)
    ("flag-before-subcommand", ["--kv-budget", "1KiB", "ask", "hi"], "too small for one block"),
    ("bad-flag-after-the-message", ["ask", "hi", "--temperature", "nan"], "--temperature must be in"),
    ("unknown-flag", ["ask", "--frobnicate", "hi"], "unrecognized arguments"),
    ("missing-subcommand-argument", ["ask"], "the following arguments are required: message"),
    # cap and policy: refused at start, not per turn
    ("replay-cap-below-sink-window", ["replay", "--cap", "8", "--policy", "sink-window", "x.json"],
     "sink-window needs a cap of at least 48"),
    ("chat-cap-below-sink-window", ["--cap", "8", "--policy", "sink-window"], "sink-window needs a cap of at least 48"),
    ("replay-unknown-policy", ["replay", "--policy", "forever", "x.json"], "unknown cap policy 'forever'"),
    ("chat-unknown-policy", ["--policy", "forever"], "unknown cap policy 'forever'"),
]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A private data and config dir, and a valid replay file x.json in the working dir."""
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("KVCHAT_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.json").write_text(json.dumps(["hi"]))
    return tmp_path


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: what a refused command must not change."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in root.rglob("*") if not p.is_dir()}


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_status_2_and_changes_nothing(workdir, capsys, argv, fragment):
    argv = argv(workdir) if callable(argv) else argv
    before = tree(workdir)
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert (code, len(lines)) == (2, 1), captured.err
    assert fragment in lines[0] and "Traceback" not in captured.err
    assert tree(workdir) == before


# ---- where the terminal, stdout or the pipe matter: subprocesses ------------------------------
def shell(cmd: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", cmd], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT),
                 KVCHAT_DATA_DIR=str(tmp_path / "data"), KVCHAT_CONFIG_DIR=str(tmp_path / "config")))


PY = f"{sys.executable} -m kvchat"
SUBPROCESS_CASES = [
    ("chat-with-stdin-closed", f"{PY} <&-", "kvchat needs a terminal; use kvchat ask"),
    ("chat-with-stdin-not-a-tty", f"{PY} < /dev/null", "kvchat needs a terminal; use kvchat ask"),
    ("ask-with-stdout-closed", f"{PY} ask --max-tokens 4 --kv-budget 32MiB hi >&-", "stdout is closed"),
    ("prompt-bytes-not-utf8", f"{PY} ask $'caf\\xe9' > out.txt", "the message is not valid UTF-8"),
    ("output-cut-by-head", f"set -o pipefail; {PY} ask --max-tokens 200 --kv-budget 32MiB "
                           "'Count from 1 to 100, one number a line.' | head -c 10 > /dev/null", "broken pipe"),
]


@pytest.mark.parametrize("cmd, fragment", [c[1:] for c in SUBPROCESS_CASES], ids=[c[0] for c in SUBPROCESS_CASES])
def test_bad_terminal_and_output_are_one_line_and_status_2(tmp_path, cmd, fragment):
    out = shell(cmd, tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if not line.startswith("loading ")]
    assert len(lines) == 1 and fragment in lines[0], out.stderr
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr


def test_flags_given_before_the_subcommand_take_effect(workdir, capsys):
    assert main(["--max-tokens", "2", "--no-cache", "--kv-budget", "32MiB", "--block-size", "32",
                 "ask", "--json", "hi"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["generated_tokens"] <= 2, rec["mode"], rec["block_size"]) == (True, "off", 32)


# ---- the CUDA kernels' limits, checked at start (the machine here may have no GPU) -----------
@pytest.mark.parametrize("block_size, head_dim, fragment", [
    (24, 64, "--block-size 24: on CUDA the kernels need a power of two"),
    (2048, 64, "--block-size 2048"),
    (16, 80, "head_dim 80 is not a power of two"),
    (16, 512, "head_dim 512"),
])
def test_cuda_only_limits_are_refused_at_start(block_size, head_dim, fragment):
    import argparse
    from dataclasses import replace

    from kvchat.cli.args import check_start
    from kvchat.engine.errors import KvchatError
    from kvchat.engine.geometry import KNOWN
    from kvchat.engine.sources import ModelSource
    geom = replace(KNOWN["llama-2-7b"], head_dim=head_dim)
    args = argparse.Namespace(kv_budget=None, block_size=block_size, system=None, policy="stop", cap=None)
    with pytest.raises(KvchatError, match=fragment):
        check_start(args, ModelSource("m", geom, None, Path(".")), torch.device("cuda"), "bf16")
    check_start(args, ModelSource("m", geom, None, Path(".")), torch.device("cpu"), "bf16")  # fine on CPU


# ---- slash commands: one line, nothing read that is not a regular file ----------------------
def test_load_refuses_a_fifo_and_a_device_at_once(tmp_path):
    from kvchat.commands import CommandError, read_message_file
    os.mkfifo(tmp_path / "fifo")
    for path, why in ((tmp_path / "fifo", "not a regular file"), (Path("/dev/zero"), "not a regular file"),
                      (Path("/dev/urandom"), "not a regular file")):
        with pytest.raises(CommandError, match=why) as err:
            read_message_file(path)                 # a FIFO without a writer would block here forever
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("/save /etc/", "give a file name"),
    ("/save .", "give a file name"),
    ("/save!", "usage: /save! FILE"),
    ("/save a b", "usage: /save [FILE]"),
])
def test_save_commands_name_what_is_wrong(text, message):
    from kvchat.commands import CommandError, parse
    with pytest.raises(CommandError, match=re.escape(message)):
        parse(text)


def test_save_bang_parses_to_an_overwriting_save():
    from kvchat.commands import Command, parse
    assert parse("/save! notes/chat") == Command("save!", Path("notes/chat"))
