"""A model directory never runs its own code (issue 11, high item 1).

Each directory here ships Python that would create a marker file when imported, and asks
for it through `auto_map`, the way a hub repository with custom code does. kvchat must
refuse it in one line, before transformers could ask "Do you wish to run the custom code?"
on stdout; stdin answers "y" to that question, so a prompt would run the code."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.engine.sources import bundled_dir
from cli_helpers import ROOT, run_kvchat

EVIL = '''import pathlib
pathlib.Path({marker!r}).write_text("the model directory's code ran")
'''


def evil_dir(tmp_path: Path, config: dict | None = None, tokenizer_config: dict | None = None) -> tuple[Path, Path]:
    """The bundled model (weights and tokenizer linked, not copied) with custom code beside it."""
    src, d, marker = bundled_dir(), tmp_path / "evil-model", tmp_path / "code-ran"
    d.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "chat_template.jinja"):
        (d / name).symlink_to(src / name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((src / "tokenizer_config.json").read_text())
    tok.update(tokenizer_config or {})
    (d / "tokenizer_config.json").write_text(json.dumps(tok))
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (d / f"{module}.py").write_text(EVIL.format(marker=str(marker)))
    return d, marker


CUSTOM_MODEL = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
CUSTOM_TOKENIZER = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}


@pytest.mark.parametrize("config, tokenizer_config, fragment", [
    ({"model_type": "evil", "architectures": ["EvilModel"], "auto_map": CUSTOM_MODEL}, None, "auto_map"),
    ({"auto_map": CUSTOM_MODEL}, None, "auto_map"),                    # a llama model_type does not excuse it
    ({"model_type": "evil"}, None, "unsupported architecture 'evil'"),
    (None, {"auto_map": CUSTOM_TOKENIZER, "tokenizer_class": "EvilTokenizer"}, "auto_map"),
], ids=["custom-model-type", "llama-with-auto-map", "other-model-type", "custom-tokenizer"])
def test_a_model_directory_with_its_own_code_is_refused_and_the_code_never_runs(tmp_path, config, tokenizer_config,
                                                                                fragment):
    d, marker = evil_dir(tmp_path, config, tokenizer_config)
    out = run_kvchat(["ask", "--json", "--model", str(d), "hi"], input="y\n", text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and fragment in out.stderr, out.stderr
    assert not marker.exists()


def test_the_tokenizer_loader_itself_refuses_remote_code_without_asking(tmp_path):
    """Below resolve()'s check: load_tokenizer alone must pass trust_remote_code=False."""
    d, marker = evil_dir(tmp_path, None, {"auto_map": CUSTOM_TOKENIZER, "tokenizer_class": "EvilTokenizer"})
    script = ("import sys\n"
              "from kvchat.engine.tokenizer import load_tokenizer\n"
              "from kvchat.engine.errors import KvchatError\n"
              "from kvchat.engine.geometry import KNOWN\n"
              "from kvchat.engine.sources import ModelSource\n"
              "from pathlib import Path\n"
              f"src = ModelSource('evil', KNOWN['smollm2-135m'], None, Path({str(d)!r}))\n"
              "try:\n    load_tokenizer(src)\nexcept KvchatError as err:\n"
              "    print(err, file=sys.stderr); sys.exit(2)\n")
    out = subprocess.run([sys.executable, "-c", script], input="y\n", capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    assert not marker.exists()


def test_a_conversion_killed_mid_write_leaves_no_temp_dir_behind(tmp_path, monkeypatch):
    """convert_gguf cleans .converting-<pid>-* dirs of dead processes when it starts; a live
    process's own conversion is left alone."""
    from kvchat.engine.sources import bundled_gguf, convert_gguf
    real = bundled_dir() / "model.safetensors"
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    gguf = bundled_gguf()
    done = tmp_path / "converted" / f"{gguf.stem}-{gguf.stat().st_size}"
    done.mkdir(parents=True)
    (done / "model.safetensors").symlink_to(real)                                   # already converted
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = done.parent / f".converting-{dead.pid}-abc123"
    live = done.parent / f".converting-{os.getppid()}-def456"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half written")
    assert convert_gguf(gguf) == done
    assert not stale.exists() and live.exists()
