"""Model files that lie, hang or explode (issue 27, high 3 and 4, medium): FIFOs and folders
where files belong, sizes that would allocate gigabytes, GGUF headers with impossible lengths,
safetensors headers that do not match their bytes, broken chat templates. Each ends in one
line with exit 2, quickly, before anything large is built. The files are crafted here; the
tiny Llama is tests/test_bad_input.py's."""
from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import kvchat
from test_bad_input import TINY, write_tiny

from .conftest import cli, one_line, raw_control

pytestmark = pytest.mark.timeout(60)
LIMIT_AS = 3 * 2**30       # a subprocess that would allocate gigabytes fails at 3 GiB instead
CODE = Path(kvchat.__file__).resolve().parents[1]     # the kvchat under test, for subprocesses


def kvchat_limited(args: list[str], tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """`python -m kvchat ARGS` under a 3 GiB address-space limit: what must not allocate is
    run where allocating cannot take the machine down."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT_AS, LIMIT_AS))
    env = dict(os.environ, PYTHONPATH=str(CODE), KVCHAT_DATA_DIR=str(tmp_path / "data"),
               KVCHAT_CONFIG_DIR=str(tmp_path / "config"), KVCHAT_CACHE_DIR=str(tmp_path / "cache"))
    try:
        return subprocess.run([sys.executable, "-m", "kvchat", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, preexec_fn=limit, cwd=CODE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"kvchat {' '.join(args)} ran past {timeout} s")


def refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [x for x in proc.stderr.splitlines() if not x.startswith("loading ")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


# ---- a FIFO or a folder where a file belongs ----------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"])
def test_a_fifo_in_a_model_directory_is_refused_without_waiting(capsys, tmp_path, name):
    d = write_tiny(tmp_path / "tiny")
    (d / name).unlink()
    os.mkfifo(d / name)
    code, out, err = cli(capsys, ["ask", "--model", str(d), "hi"])
    one_line(code, err, name)


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_a_folder_where_a_model_file_belongs_is_one_line(capsys, tmp_path, name):
    d = write_tiny(tmp_path / "tiny")
    (d / name).unlink()
    (d / name).mkdir()
    code, out, err = cli(capsys, ["ask", "--model", str(d), "hi"])
    one_line(code, err, name)


def test_a_gguf_that_is_a_fifo_is_refused_without_waiting(capsys, tmp_path):
    os.mkfifo(tmp_path / "model.gguf")
    code, out, err = cli(capsys, ["ask", "--model", str(tmp_path / "model.gguf"), "hi"])
    one_line(code, err, "model.gguf")


def test_a_model_directory_without_a_tokenizer_is_one_line(capsys, tmp_path):
    d = write_tiny(tmp_path / "tiny")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (d / f).unlink()
    code, out, err = cli(capsys, ["ask", "--model", str(d), "hi"])
    one_line(code, err, "tokenizer")


def test_a_model_directorys_name_is_shown_inert(capsys, tmp_path, sequence):
    d = tmp_path / f"model{sequence}dir"
    d.mkdir()
    code, out, err = cli(capsys, ["ask", "--model", str(d), "hi"])
    one_line(code, err, "no config.json", "model\\x1b")
    assert not raw_control(err)
    write_tiny(tmp_path / "named", {})
    (tmp_path / "named").rename(tmp_path / f"m{sequence}")
    code, out, err = cli(capsys, ["info", "--model", str(tmp_path / f"m{sequence}")])
    assert code == 0 and not raw_control(out + err) and "m\\x1b" in out


# ---- sizes that would allocate before any check --------------------------------------------------
def write_config(tmp_path: Path, **changes) -> Path:
    """The tiny model with `changes` in its config.json (its weights stay tiny)."""
    d = write_tiny(tmp_path / "model")
    (d / "config.json").write_text(json.dumps({**TINY, **changes}))
    return d


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 100_000_000), ("hidden_size", 2**30),
                                        ("intermediate_size", 2**30), ("vocab_size", 10**9),
                                        ("num_attention_heads", 2**20), ("max_position_embeddings", 2**31 - 1)])
def test_absurd_config_sizes_are_refused_by_info_before_any_allocation(tmp_path, key, value):
    changes = {key: value}
    if key == "num_attention_heads":
        changes.update(num_key_value_heads=2**20, head_dim=16)
    d = write_config(tmp_path, **changes)
    refused(kvchat_limited(["info", "--model", str(d)], tmp_path), key)


def test_info_reads_config_json_only(tmp_path):
    """A geometry-only command needs neither weights nor a tokenizer."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    proc = kvchat_limited(["info", "--model", str(d), "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["n_layers"] == 2


# ---- GGUF headers ---------------------------------------------------------------------------------
U32, F32, STRING, ARRAY, U64 = 4, 6, 8, 9, 10


def gguf_string(text: str, claimed: int | None = None) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data) if claimed is None else claimed) + data


def gguf(kvs: list[tuple[str, int, object]], tensors: list[tuple[str, tuple[int, ...]]] = (),
         n_kv: int | None = None) -> bytes:
    """A GGUF v3 header: key-values, then tensor infos (no tensor data)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs) if n_kv is None else n_kv)
    for key, kind, value in kvs:
        out += gguf_string(key) + struct.pack("<I", kind)
        if kind == U32:
            out += struct.pack("<I", value)
        elif kind == F32:
            out += struct.pack("<f", value)
        elif kind == U64:
            out += struct.pack("<Q", value)
        elif kind == STRING:
            out += value if isinstance(value, bytes) else gguf_string(value)
        elif kind == ARRAY:
            item, items = value
            out += struct.pack("<IQ", item, len(items)) + b"".join(gguf_string(i) for i in items)
    for name, dims in tensors:
        out += gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", 0, 0)
    return out


def llama_kvs(layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256):
    """Llama 3.1 70B's metadata."""
    return [("general.architecture", STRING, "llama"), ("llama.block_count", U32, layers),
            ("llama.embedding_length", U32, hidden), ("llama.attention.head_count", U32, heads),
            ("llama.attention.head_count_kv", U32, kv_heads), ("llama.feed_forward_length", U32, ffn),
            ("llama.context_length", U32, 131072), ("llama.vocab_size", U32, vocab),
            ("llama.rope.freq_base", F32, 500000.0), ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5)]


def write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_a_gguf_string_of_two_to_the_forty_bytes_is_refused(tmp_path):
    bad = [("general.architecture", STRING, gguf_string("llama", claimed=2**40))]
    path = write(tmp_path, "big-string.gguf", gguf(bad))
    refused(kvchat_limited(["info", "--model", str(path)], tmp_path), "past the end")
    refused(kvchat_limited(["ask", "--model", str(path), "hi"], tmp_path), "past the end")


def test_a_gguf_claiming_billions_of_key_values_is_refused(tmp_path):
    path = write(tmp_path, "many.gguf", gguf(llama_kvs(), n_kv=2**62))
    refused(kvchat_limited(["info", "--model", str(path)], tmp_path), "key-values")


def test_a_gguf_of_a_70b_model_gives_its_geometry_without_building_it(tmp_path):
    path = write(tmp_path, "llama-70b.gguf", gguf(llama_kvs()))
    proc = kvchat_limited(["info", "--model", str(path), "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert (info["n_layers"], info["n_kv_heads"], info["kv_bytes_per_token"]) == (80, 8, 327680)


def test_a_gguf_of_a_70b_model_is_refused_by_the_memory_check_before_conversion(tmp_path):
    path = write(tmp_path, "llama-70b.gguf", gguf(llama_kvs()))
    refused(kvchat_limited(["ask", "--model", str(path), "hi"], tmp_path), "GiB of memory")
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())


@pytest.mark.parametrize("kvs, fragment", [
    (llama_kvs(layers=100_000_000), "num_hidden_layers"),
    (llama_kvs(vocab=2**31), "vocab_size"),
    ([("general.architecture", STRING, "mamba")] + llama_kvs()[1:], "unsupported architecture"),
    ([("general.architecture", ARRAY, (STRING, ["llama"] * 3))], "unsupported architecture"),
], ids=["layers-1e8", "vocab-2e31", "not-llama", "arch-an-array"])
def test_impossible_gguf_metadata_is_one_line(tmp_path, kvs, fragment):
    path = write(tmp_path, "bad.gguf", gguf(kvs))
    refused(kvchat_limited(["info", "--model", str(path)], tmp_path), fragment)


# ---- safetensors headers that lie ---------------------------------------------------------------
def rewrite_header(path: Path, change) -> None:
    """Edit a safetensors file's JSON header in place (keeping the data bytes)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


EMBED = "model.embed_tokens.weight"


def shrink_range(h):          # the shape says 49152 x 64 floats, the range holds 4 bytes
    b = h[EMBED]["data_offsets"][0]
    h[EMBED]["data_offsets"] = [b, b + 4]


def claim_f16(h):             # the same bytes, said to be half as many elements
    h[EMBED]["dtype"] = "F16"


def swap_shape(h):            # as many elements, in another shape: that one the loader catches
    h[EMBED]["shape"] = [64, 49152]


def negative_offset(h):
    h[EMBED]["data_offsets"] = [-8, h[EMBED]["data_offsets"][1]]


def bool_shape(h):
    h[EMBED]["shape"] = [True, 64]


@pytest.mark.parametrize("change, fragment", [
    (shrink_range, "needs"), (claim_f16, "needs"), (negative_offset, "outside"), (bool_shape, "shape"),
    (swap_shape, "shape"),
], ids=["range-too-short", "dtype-lies", "negative-offset", "bool-dim", "shape-swapped"])
def test_a_safetensors_header_that_lies_is_one_line(capsys, tmp_path, change, fragment):
    d = write_tiny(tmp_path / "tiny")
    rewrite_header(d / "model.safetensors", change)
    code, out, err = cli(capsys, ["ask", "--model", str(d), "--max-tokens", "2", "hi"])
    one_line(code, err, "embed_tokens", fragment)


# ---- chat templates -------------------------------------------------------------------------------
def with_template(tmp_path: Path, template: str) -> Path:
    d = write_tiny(tmp_path / "tiny")
    (d / "chat_template.jinja").write_text(template)
    return d


@pytest.mark.parametrize("template, fragment", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{{ no_such_function() }}", "UndefinedError"),
    ("{{ raise_exception('this template refuses every chat') }}", "refuses every chat"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError"),
], ids=["syntax", "undefined", "raises", "sandbox", "type-error"])
def test_a_broken_chat_template_is_one_line_when_the_model_loads(capsys, tmp_path, template, fragment):
    d = with_template(tmp_path, template)
    code, out, err = cli(capsys, ["ask", "--model", str(d), "--max-tokens", "2", "hi"])
    one_line(code, err, "chat template", fragment)


def test_a_template_that_fails_on_a_later_turn_fails_that_turn_in_one_line(capsys, tmp_path):
    template = ("{% for m in messages %}{% if 'forbidden' in m.content %}{{ raise_exception('no such word') }}"
                "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    d = with_template(tmp_path, template)
    f = tmp_path / "chat.json"
    f.write_text(json.dumps(["one", "a forbidden word"]))
    code, out, err = cli(capsys, ["replay", "--model", str(d), "--max-tokens", "2", str(f)])
    one_line(code, err, "chat template", "no such word")
