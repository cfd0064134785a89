"""kvchat/bench/gguf_export.py: the bundled model's safetensors written back to F32 and BF16
GGUF files for the llama.cpp peer of `kvchat bench`.

Without llama.cpp: the files are read back with the gguf package's own reader (GGUFReader)
and every tensor is compared with the safetensors kvchat loads (F32: bit for bit after undoing
llama.cpp's rotary row order; BF16: torch's bf16 rounding of them, so within a relative 2^-8),
the architecture keys with config.json, and the tokenizer fields with the original Q4_1 GGUF's,
byte for byte. The row order is also checked against the original file itself: its attn_q and
attn_k, de-quantized, are exactly the F32 export's (transformers de-quantized that file into
the safetensors, undoing the permutation this module redoes).

With llama-cpp-python installed (CI never installs it; skipped with a reason otherwise):
llama.cpp on the F32 file picks the same greedy tokens as kvchat's fp32 engine, and its
logits are within a stated bound of kvchat's.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvchat.bench import gguf_export
from kvchat.engine.sources import bundled_dir, bundled_gguf
from cli_helpers import fails_with

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.xdist_group("gguf")     # the module's exports, once, on one worker


def _source_copy(root: Path, name: str) -> Path:
    src = root / name / bundled_dir().name
    src.mkdir(parents=True, exist_ok=True)
    link = src / "model.safetensors"
    if not link.exists():
        link.symlink_to(bundled_dir() / "model.safetensors")
    shutil.copy(bundled_dir() / "config.json", src / "config.json")
    return src


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Both files of the bundled model, written to tmp (about 4 s for F32, 2 s for BF16)."""
    root = tmp_path_factory.mktemp("export")
    src = _source_copy(root, "src")
    out = root / "out"
    return {p: gguf_export.export(p, src, bundled_gguf(), out) for p in gguf_export.PRECISIONS} | {"src": src}


@pytest.fixture(scope="module")
def safetensors():
    from safetensors.torch import load_file
    return load_file(str(bundled_dir() / "model.safetensors"))


@pytest.fixture(scope="module")
def config():
    return json.loads((bundled_dir() / "config.json").read_text())


class Reader(gguf.GGUFReader):
    """gguf's own reader over a plain ndarray view of its memory map: the same bytes, parsed
    by the same code, 2-3x sooner (a np.memmap view per vocabulary entry costs its
    __array_finalize__; the bundled file has 98,000 of them)."""

    @property
    def data(self):
        return self._plain

    @data.setter
    def data(self, value) -> None:
        self._plain = value.view(np.ndarray)       # its .base keeps the map open


@pytest.fixture(scope="module")
def read(exported):
    """Each file read once: {'f32', 'bf16', 'original'} -> (fields, {tensor name: tensor})."""
    out = {}
    for key, path in (("f32", exported["f32"]), ("bf16", exported["bf16"]), ("original", bundled_gguf())):
        r = Reader(str(path))
        out[key] = (r.fields, {t.name: t for t in r.tensors})
    return out


def names(config) -> list[tuple[str, str]]:
    return gguf_export.tensor_names(config["num_hidden_layers"], config["tie_word_embeddings"])


def hf_order(gname: str, data: np.ndarray, config) -> np.ndarray:
    """A tensor as the safetensors hold it: llama.cpp's rotary row order undone for q and k."""
    if gname.endswith("attn_q.weight"):
        return gguf_export.from_gguf_rows(data, config["num_attention_heads"])
    if gname.endswith("attn_k.weight"):
        return gguf_export.from_gguf_rows(data, config["num_key_value_heads"])
    return data


# ---- the files, without llama.cpp --------------------------------------------------------------------
def test_the_row_permutation_and_its_inverse_are_inverses():
    w = np.arange(3 * 2 * 4 * 5, dtype=np.float32).reshape(3 * 2 * 4, 5)
    p = gguf_export.to_gguf_rows(w, heads=3)
    assert not np.array_equal(p, w)
    assert np.array_equal(gguf_export.from_gguf_rows(p, heads=3), w)
    # head 0, half 4: HF rows 0..3 (first halves) and 4..7 (second halves) interleave as 0,4,1,5,...
    assert p[:8, 0].tolist() == [0, 20, 5, 25, 10, 30, 15, 35]


def test_f32_holds_every_tensor_of_the_safetensors_bit_for_bit(read, safetensors, config):
    got = read["f32"][1]
    want = names(config)
    assert sorted(got) == sorted(g for g, _ in want)          # tied: no output.weight
    for gname, hname in want:
        t = got[gname]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, gname
        ref = safetensors[hname].numpy()
        data = np.asarray(t.data).reshape(ref.shape)
        assert np.array_equal(hf_order(gname, data, config), ref), gname


def test_the_f32_rows_are_in_the_original_files_order(read):
    """The Q4_1 file's own q and k, de-quantized, are the F32 export's: the permutation goes
    the way llama.cpp's converter wrote the original, not merely undone by its own inverse."""
    original, ours = read["original"][1], read["f32"][1]
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.29.attn_k.weight"):
        o = original[name]
        deq = gguf.quants.dequantize(o.data, o.tensor_type)
        assert np.array_equal(np.asarray(ours[name].data).reshape(deq.shape), deq), name


# the BF16 file's values are checked on these (a quarter of the weights: the embedding, which is
# also the tied output head, the first and last layers and the final norm), to keep the test
# short; the F32 file is checked whole, and both go through the same code but for the rounding
BF16_CHECKED = ("token_embd.", "blk.0.", "blk.29.", "output_norm.")


def test_bf16_is_kvchats_bf16_rounding_of_the_tensors(read, safetensors, config):
    got = read["bf16"][1]
    assert sorted(got) == sorted(g for g, _ in names(config))
    for gname, hname in names(config):
        assert got[gname].tensor_type == (gguf.GGMLQuantizationType.F32 if gname.endswith("norm.weight")
                                          else gguf.GGMLQuantizationType.BF16), gname
        if not gname.startswith(BF16_CHECKED):
            continue
        t = got[gname]
        ref = safetensors[hname]
        if ref.dim() == 1:      # norms: F32 tensors holding the bf16-rounded values
            data = np.asarray(t.data, dtype=np.float32).reshape(ref.shape)
        else:
            bits = np.asarray(t.data).view(np.uint16).reshape(ref.shape).astype(np.uint32) << 16
            data = bits.view(np.float32)
        data = hf_order(gname, data, config)
        kvchat_bf16 = ref.to(torch.bfloat16).float().numpy()       # what --dtype bf16 multiplies with
        assert np.array_equal(data, kvchat_bf16), gname
        x = ref.numpy().astype(np.float64)
        assert np.all(np.abs(data - x) <= 2.0 ** -8 * np.abs(x)), gname   # round to nearest: half an ulp


def test_the_metadata_llama_cpp_needs_is_there(exported, read, config):
    f = {k: v.contents() for k, v in read["f32"][0].items() if not k.startswith("tokenizer.ggml.")}
    assert f["general.architecture"] == "llama"
    assert f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert f["llama.block_count"] == config["num_hidden_layers"]
    assert f["llama.embedding_length"] == config["hidden_size"]
    assert f["llama.feed_forward_length"] == config["intermediate_size"]
    assert f["llama.attention.head_count"] == config["num_attention_heads"]
    assert f["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert f["llama.rope.dimension_count"] == config["head_dim"]
    assert f["llama.context_length"] == config["max_position_embeddings"]
    assert f["llama.vocab_size"] == config["vocab_size"]
    assert f["llama.rope.freq_base"] == pytest.approx(config["rope_parameters"]["rope_theta"])
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(config["rms_norm_eps"], rel=1e-6)
    assert "general.quantization_version" not in f       # not a quantized file
    assert gguf_export.file_precision(exported["f32"]) == "F32"
    assert gguf_export.file_precision(exported["bf16"]) == "BF16"
    assert gguf_export.file_precision(bundled_gguf()) == "Q4_1"


@pytest.mark.parametrize("precision", gguf_export.PRECISIONS)
def test_the_tokenizer_fields_are_the_originals_byte_for_byte(read, precision):
    orig, ours = read["original"][0], read[precision][0]
    keys = [k for k in orig if k.startswith(("tokenizer.", "general.")) and k not in
            ("general.architecture", "general.file_type", "general.quantization_version")]
    assert "tokenizer.ggml.tokens" in keys and "tokenizer.ggml.merges" in keys and "tokenizer.chat_template" in keys
    for k in keys:
        assert k in ours, k
        assert [bytes(p.tobytes()) for p in ours[k].parts] == [bytes(p.tobytes()) for p in orig[k].parts], k


def tiny_source(root: Path, config) -> Path:
    """A two-layer model of random weights with the bundled vocabulary and an untied output
    head, so a rebuild costs a fraction of a second and output.weight is written too."""
    from safetensors.torch import save_file
    from kvchat.engine.geometry import from_hf_config, weight_shapes
    cfg = dict(config, num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    src = root / "tiny"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    shapes = weight_shapes(from_hf_config(cfg, "tiny"))
    save_file({k: torch.randn(shape, generator=g) for k, shape in shapes.items()}, str(src / "model.safetensors"))
    return src


def test_the_file_is_reused_and_rebuilt_when_its_source_changes(exported, config, tmp_path):
    f32 = exported["f32"]
    before = f32.stat()
    again = gguf_export.export("f32", exported["src"], bundled_gguf(), f32.parent)
    assert again == f32 and again.stat().st_ino == before.st_ino and again.stat().st_mtime_ns == before.st_mtime_ns

    src, out = tiny_source(tmp_path, config), tmp_path / "out"
    first = gguf_export.export("f32", src, bundled_gguf(), out)
    stale = out / f"{gguf_export.EXPORTING}{2**22 + 12345}-x.gguf"     # a dead writer's leftover
    stale.write_bytes(b"partial")
    cfg = json.loads((src / "config.json").read_text())
    cfg["kvchat_test"] = "changed"                    # same geometry, another config: another key
    (src / "config.json").write_text(json.dumps(cfg))
    second = gguf_export.export("f32", src, bundled_gguf(), out)
    assert second != first and second.is_file()
    assert not first.exists() and not stale.exists()     # the old key's file and the leftover are gone
    assert sorted(p.name for p in out.iterdir()) == [second.name]
    from kvchat.engine.gguf_header import read_header
    assert read_header(second).tensors["output.weight"] == (32, 49152)     # untied: the head is written


def test_an_unknown_precision_is_refused():
    from kvchat.engine.errors import KvchatError
    with pytest.raises(KvchatError, match="accepted: f32, bf16"):
        gguf_export.export("q8_0")


# ---- the bench flag ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    ("f16", "'f16' is not a file llama.cpp runs here; choose from f32, bf16, q4_1"),
    ("f32,,q4_1", "expected comma-separated files"),
    ("", "expected comma-separated files"),
])
def test_bad_llama_cpp_files_give_one_line_and_exit_2(capsys, value, fragment):
    fails_with(capsys, ["bench", "--llama-cpp", value, "--contexts", "64"], fragment)


def test_llama_cpp_files_with_no_llama_cpp_is_refused(capsys):
    fails_with(capsys, ["bench", "--llama-cpp", "f32", "--no-llama-cpp"], "--llama-cpp 'f32' with --no-llama-cpp")


def test_the_flag_parses_to_the_tables_order_and_the_default_follows_the_dtype():
    from kvchat.bench.flags import parse_llama_cpp
    from kvchat.bench.peers import default_llama_cpp
    assert parse_llama_cpp("q4_1, BF16,f32") == ("f32", "bf16", "q4_1")
    assert default_llama_cpp("fp32") == ("f32", "q4_1")
    assert default_llama_cpp("bf16") == ("bf16", "q4_1")
    assert default_llama_cpp("fp16") == ("q4_1",)


def test_the_report_names_each_file_and_divides_by_the_same_weights_column():
    from kvchat.bench.report import Series, label, markdown, summarise
    ours, f32, q4 = Series(), Series(), Series()
    ours.decode_ms, f32.decode_ms, q4.decode_ms = [10.0, 10.0], [8.0, 8.0], [4.0, 4.0]
    results = {1024: {"kvchat": ours, "llama_cpp_f32": f32, "llama_cpp": q4}}
    meta = {"runs": 1, "new_tokens": 2, "nocache_tokens": 2, "model": {"kv_bytes_per_token": 4, "kv_dtype": "fp32"},
            "llama_cpp": {"files": {"llama_cpp_f32": {"precision": "F32"}, "llama_cpp": {"precision": "Q4_1"}},
                          "same_weights": "llama_cpp_f32"}}
    s = summarise(results, None, "llama_cpp_f32")
    assert s["decode_ratio_vs_llama_cpp"] == {"1024": 1.25}
    assert label("llama_cpp", meta) == "llama.cpp Q4_1 (4-bit file)"
    text = markdown(results, meta, s)
    assert "| llama.cpp F32 (same weights) | llama.cpp Q4_1 (4-bit file) |" in text
    assert "kvchat ÷ llama.cpp (same weights) |" in text and "| 1.25× |" in text


# ---- llama.cpp on the F32 file ---------------------------------------------------------------------------
# marked, not importorskip'd in the fixture: the session's engine would load before the skip
needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (CI never installs it); "
                                            "the llama.cpp checks of the export are skipped")


@pytest.fixture(scope="module")
def llama_f32(exported):
    import llama_cpp
    threads = torch.get_num_threads()
    return llama_cpp.Llama(model_path=str(exported["f32"]), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                           n_batch=512, type_k=0, type_v=0, logits_all=True, verbose=False)   # K, V in F32


def prompt(engine, text: str) -> list[int]:
    conv = engine.new_conversation()
    try:
        return conv.render([{"role": "user", "content": text}])
    finally:
        engine.close_conversation(conv)


@needs_llama_cpp
@pytest.mark.parametrize("text", ["Tell me about the history of the printing press in Europe.",
                                  "Write two sentences about the sea."])
def test_llama_cpp_greedy_tokens_on_the_f32_file_are_kvchats(engine, llama_f32, text):
    from kvchat.engine import SamplingParams
    conv = engine.new_conversation()
    try:
        events = list(conv.send(text, SamplingParams(max_tokens=24)))
        stops = conv.stop_ids()
    finally:
        engine.close_conversation(conv)
    ours = [e.token_id for e in events if type(e).__name__ == "TokenEvent" and e.token_id >= 0]
    llama_f32.reset()
    theirs: list[int] = []
    for tok in llama_f32.generate(prompt(engine, text), top_k=1, top_p=1.0, temp=0.0, reset=True):
        if tok in stops or len(theirs) == 24:
            break
        theirs.append(tok)
    assert len(ours) == 24           # 24 tokens, no early stop: a long enough run to diverge on
    assert theirs == ours


# Logits: relative error max|llama.cpp - kvchat| / max|kvchat| over every position of a prompt,
# under 1e-4. Both sides are fp32 throughout (weights, activations, K and V: the fixture asks
# llama.cpp for an F32 cache); they differ only in how each product and reduction is ordered
# and blocked (ggml's vector sums, its own expf and SiLU, against kvchat's C kernels). A dot
# product of length n <= 1536 summed in another order moves by about sqrt(n) 2^-24 ~ 2e-6 of its
# terms' magnitudes (gamma_n = n 2^-24 ~ 1e-4 at worst); measured through the 30 layers, with
# llama-cpp-python 0.3.36 on an AVX512 Xeon: 2.8e-6. The bound leaves 35x that for other
# CPUs' vector widths and orders, and stays under what one real difference gives: llama.cpp's
# default F16 K/V cache alone measured 1.1e-3, the BF16 file 1.4e-2.
LOGITS_REL_TOL = 1e-4


@needs_llama_cpp
def test_llama_cpp_logits_on_the_f32_file_are_kvchats_within_the_bound(engine, llama_f32):
    ids = prompt(engine, "Explain why the sky is blue, in one paragraph.")
    with torch.no_grad():
        ours = engine.model.forward_dense(torch.tensor(ids), last_only=False).double()     # (T, V)
    llama_f32.reset()
    llama_f32.eval(ids)
    theirs = torch.from_numpy(np.array(llama_f32.scores[: len(ids)], dtype=np.float64))
    err = float((theirs - ours).abs().max() / ours.abs().max())
    assert err < LOGITS_REL_TOL, f"relative logit error {err:.2e}"
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


# The bench's bf16 row: llama.cpp on the BF16 file with K and V cached in BF16, as kvchat's auto
# cache is beside bf16 weights (kvchat/bench/peers.py: GGML_CACHE_TYPES). Against kvchat's fp32
# logits: bf16 keeps 8 bits of mantissa (a rounding of 2^-9 per weight and per cached value), and
# through 30 layers that measured 1.47e-2 relative here (the BF16 file with an F32 cache: 1.43e-2;
# with F16: 1.21e-2). Bound 5e-2, with every position's argmax kvchat's: a cache type llama.cpp
# read wrongly would be off by the logits' own scale.
BF16_LOGITS_REL_TOL = 5e-2


@needs_llama_cpp
def test_llama_cpp_on_the_bf16_file_with_a_bf16_cache_is_kvchats_within_bf16s_bound(engine, exported):
    import llama_cpp
    from kvchat.bench.peers import GGML_CACHE_TYPES
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(model_path=str(exported["bf16"]), n_ctx=512, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, type_k=GGML_CACHE_TYPES["bf16"][0], type_v=GGML_CACHE_TYPES["bf16"][0],
                          logits_all=True, verbose=False)
    ids = prompt(engine, "Explain why the sky is blue, in one paragraph.")
    with torch.no_grad():
        ours = engine.model.forward_dense(torch.tensor(ids), last_only=False).double()
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float64))
    err = float((theirs - ours).abs().max() / ours.abs().max())
    assert 1e-4 < err < BF16_LOGITS_REL_TOL, f"relative logit error {err:.2e}"    # bf16's error, not fp32's
    assert torch.equal(theirs.argmax(-1), ours.argmax(-1))


@needs_llama_cpp
def test_the_benchs_llama_cpp_peer_decodes_the_bundled_q4_1_file():
    """On a Xeon with AMX, llama.cpp moved the Q4_1 weights into its AMX layout and crashed in the
    first decode (SIGSEGV), ending `kvchat bench`; the peer loads them without those layouts
    (peers.py: _plain_weight_layouts). In a child process, so a crash fails this test only."""
    import subprocess
    import sys
    code = ("from kvchat.bench.peers import LlamaCppPeer\nfrom kvchat.engine.sources import bundled_gguf\n"
            "t = LlamaCppPeer(bundled_gguf(), 1200, 2).generate(list(range(1000, 2024)), 4)\n"
            "print('decoded', len(t.decode_ms))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "decoded 4" in done.stdout, (done.returncode, done.stderr[-1500:])
