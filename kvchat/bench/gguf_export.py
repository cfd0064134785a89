"""The bundled model's own weights as F32 and BF16 GGUF files, for the llama.cpp peer of
`kvchat bench` (bench-only; the engine never reads these files).

kvchat runs the safetensors that transformers de-quantized from the bundled Q4_1 GGUF
(engine/sources.py: convert_gguf). llama.cpp on that Q4_1 file reads a seventh of the bytes
kvchat's fp32 weights do, so its column is not like for like. This module writes those very
fp32 tensors back into GGUF:

- F32: every tensor as kvchat loads it, bit for bit;
- BF16: the matrices and the embedding rounded to bf16 the way kvchat's --dtype bf16 rounds
  them (torch's round-to-nearest-even); the 1-D norms stay F32 tensors (llama.cpp multiplies
  norms in F32, as llama.cpp's own converter stores them) holding the same bf16-rounded values
  kvchat's bf16 run widens back to fp32.

Metadata: every general.* and tokenizer.* field of the original GGUF is copied byte for byte
(so llama.cpp tokenizes and templates identically); the llama.* architecture keys are written
from the model's geometry (its config.json); general.file_type names the new precision.

Rotary layout: llama.cpp's converter permutes each head's q_proj/k_proj rows from the Hugging
Face layout (the first half of a head's rows rotate with the second half) to interleaved
pairs (rows 2i and 2i+1 rotate together). transformers' GGUF reader undid that permutation
when it made kvchat's safetensors; `to_gguf_rows` applies it again and `from_gguf_rows`
inverts it (for the tests). K uses the KV head count.

The files are cached beside the converted safetensors (<cache>/converted/), named by a key
over the source's files and this format's version, so a changed source gets a new file (the
old one is removed); each is written to a temporary name and renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvchat.engine.errors import KvchatError

FORMAT = 1                      # bump when the bytes this module writes change
PRECISIONS = ("f32", "bf16")
EXPORTING = ".exporting-"       # <folder>/.exporting-<pid>-<random>.gguf: a write under way
# original keys not copied: the reader's own counts, what the writer sets, and the quantized file's type
NOT_COPIED = ("GGUF.", "general.architecture", "general.file_type", "general.quantization_version", "llama.")


# ---- the rotary permutation ---------------------------------------------------------------------
def to_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face rows (per head: the first halves, then the second halves) -> llama.cpp's
    (per head: pairs that rotate together, interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def from_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of to_gguf_rows."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- names -----------------------------------------------------------------------------------------
def tensor_names(n_layers: int, tied: bool) -> list[tuple[str, str]]:
    """(GGUF name, safetensors name) for every tensor a llama GGUF holds."""
    names = [("token_embd.weight", "model.embed_tokens.weight")]
    for i in range(n_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        names += [(gg + "attn_norm.weight", hf + "input_layernorm.weight"),
                  (gg + "attn_q.weight", hf + "self_attn.q_proj.weight"),
                  (gg + "attn_k.weight", hf + "self_attn.k_proj.weight"),
                  (gg + "attn_v.weight", hf + "self_attn.v_proj.weight"),
                  (gg + "attn_output.weight", hf + "self_attn.o_proj.weight"),
                  (gg + "ffn_norm.weight", hf + "post_attention_layernorm.weight"),
                  (gg + "ffn_gate.weight", hf + "mlp.gate_proj.weight"),
                  (gg + "ffn_up.weight", hf + "mlp.up_proj.weight"),
                  (gg + "ffn_down.weight", hf + "mlp.down_proj.weight")]
    names.append(("output_norm.weight", "model.norm.weight"))
    if not tied:
        names.append(("output.weight", "lm_head.weight"))
    return names


# ---- where the file goes -----------------------------------------------------------------------------
def _stat_key(path: Path) -> list[Any]:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def cache_key(precision: str, source_dir: Path, original: Path) -> str:
    """A short hash over what the file is made from: a changed source gives a new name."""
    parts = {"format": FORMAT, "precision": precision, "weights": _stat_key(source_dir / "model.safetensors"),
             "config": hashlib.sha256((source_dir / "config.json").read_bytes()).hexdigest(),
             "original": _stat_key(original)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def export_path(precision: str, source_dir: Path, original: Path, folder: Path | None = None) -> Path:
    folder = source_dir.parent if folder is None else folder
    return folder / f"{source_dir.name}.{precision.upper()}-{cache_key(precision, source_dir, original)}.gguf"


# ---- exporting -------------------------------------------------------------------------------------------
def export(precision: str, source_dir: Path | None = None, original: Path | None = None,
           folder: Path | None = None) -> Path:
    """The GGUF of source_dir's safetensors in `precision` ('f32' or 'bf16'), made once and
    cached; later calls with the same source return it at once. Defaults: the bundled model's
    converted safetensors, its original GGUF, and the folder the safetensors sit in."""
    from kvchat.engine.sources import bundled_dir, bundled_gguf
    if precision not in PRECISIONS:
        raise KvchatError(f"GGUF export: precision {precision!r}; accepted: {', '.join(PRECISIONS)}")
    source_dir = bundled_dir() if source_dir is None else source_dir
    original = bundled_gguf() if original is None else original
    out = export_path(precision, source_dir, original, folder)
    if out.parent.is_dir():
        _remove_stale(out)
    if out.is_file():
        return out
    geom = _geometry(source_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = geom.param_count() * (4 if precision == "f32" else 2) + (64 << 20)
    free = shutil.disk_usage(out.parent).free
    if need > free:
        raise KvchatError(f"GGUF export: {out.name} needs about {need / 2**30:.2f} GiB in {out.parent}; "
                          f"{free / 2**30:.2f} GiB are free there")
    fd, tmp_name = tempfile.mkstemp(dir=out.parent, prefix=f"{EXPORTING}{os.getpid()}-", suffix=".gguf")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write(tmp, precision, geom, source_dir, original)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _remove_stale(out: Path) -> None:
    """Earlier files of the same source and precision under another key, and the temporary
    files of exports whose process is gone."""
    from kvchat.engine.sources import process_alive
    stem = out.name.rsplit("-", 1)[0]
    for old in out.parent.glob(f"{stem}-*.gguf"):
        if old != out:
            old.unlink(missing_ok=True)
    for tmp in out.parent.glob(f"{EXPORTING}*.gguf"):
        try:
            pid = int(tmp.name[len(EXPORTING):].split("-")[0])
        except ValueError:
            pid = 0
        if pid != os.getpid() and not process_alive(pid):
            tmp.unlink(missing_ok=True)


def _geometry(source_dir: Path):
    from kvchat.engine.geometry import from_hf_config
    geom = from_hf_config(json.loads((source_dir / "config.json").read_text(encoding="utf-8")), source_dir.name)
    if geom.rope_scaling:
        raise KvchatError(f"GGUF export: {source_dir.name} scales its rotary positions "
                          f"({geom.rope_scaling.get('rope_type', '?')}); the export writes plain-RoPE llama files only")
    return geom


def _write(path: Path, precision: str, geom, source_dir: Path, original: Path) -> None:
    import gguf
    import torch
    from safetensors import safe_open

    w = gguf.GGUFWriter(None, "llama")
    copy_fields(original, w)
    w.add_block_count(geom.n_layers)
    w.add_context_length(geom.max_position)
    w.add_embedding_length(geom.hidden)
    w.add_feed_forward_length(geom.intermediate)
    w.add_head_count(geom.n_heads)
    w.add_head_count_kv(geom.n_kv_heads)
    w.add_key_length(geom.head_dim)
    w.add_value_length(geom.head_dim)
    w.add_rope_dimension_count(geom.head_dim)
    w.add_rope_freq_base(float(geom.rope_theta))
    w.add_layer_norm_rms_eps(float(geom.norm_eps))
    w.add_vocab_size(geom.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if precision == "f32" else gguf.LlamaFileType.MOSTLY_BF16)

    with safe_open(str(source_dir / "model.safetensors"), framework="pt", device="cpu") as fh:
        for gname, hname in tensor_names(geom.n_layers, geom.tie_embeddings):
            t = fh.get_tensor(hname).float()
            if gname.endswith("attn_q.weight"):
                t = torch.from_numpy(to_gguf_rows(t.numpy(), geom.n_heads).copy())
            elif gname.endswith("attn_k.weight"):
                t = torch.from_numpy(to_gguf_rows(t.numpy(), geom.n_kv_heads).copy())
            if precision == "f32":
                w.add_tensor(gname, t.contiguous().numpy())
            elif t.dim() == 1:      # norms: F32 tensors holding kvchat's bf16-rounded values
                w.add_tensor(gname, t.to(torch.bfloat16).float().contiguous().numpy())
            else:
                bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
                w.add_tensor(gname, bits, raw_shape=bits.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_fields(path: Path) -> list[tuple[str, int, int | None, Any]]:
    """The key-values of a GGUF as (key, value type, element type of an array, value), strings
    as raw bytes. Read here rather than with gguf.GGUFReader, which makes a numpy view per
    vocabulary entry (about 6 s for the bundled file's 98,000 tokens and merges)."""
    import mmap
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str) -> Any:
            nonlocal pos
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> bytes:
            nonlocal pos
            n = take("<Q")
            if pos + n > len(buf):
                raise struct.error("a string runs past the end of the file")
            raw = buf[pos:pos + n]
            pos += n
            return raw

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in _SCALARS:
                dt = np.dtype(_SCALARS[kind])
                pos += dt.itemsize
                return np.frombuffer(buf, dt, 1, pos - dt.itemsize)[0].item()
            if kind == _STRING:
                return string()
            raise struct.error(f"value type {kind}")

        try:
            magic, version = struct.unpack_from("<4sI", buf, 0)
            if magic != b"GGUF" or version not in (2, 3):
                raise struct.error(f"magic {magic!r}, version {version}")
            pos = 8
            take("<Q")                  # tensor count
            n_kv = take("<Q")
            out: list[tuple[str, int, int | None, Any]] = []
            for _ in range(n_kv):
                key = string().decode("utf-8")
                kind = take("<I")
                if kind != _ARRAY:
                    out.append((key, kind, None, value(kind)))
                    continue
                item, n = take("<I"), take("<Q")
                if item in _SCALARS:
                    dt = np.dtype(_SCALARS[item])
                    out.append((key, kind, item, np.frombuffer(buf, dt, n, pos).tolist()))
                    pos += n * dt.itemsize
                elif item == _STRING:
                    out.append((key, kind, item, [string() for _ in range(n)]))
                else:
                    raise struct.error(f"{key} is an array of type {item}")
        except (struct.error, ValueError) as err:
            raise KvchatError(f"GGUF export: cannot read the key-values of {path} ({err})") from None
        return out


_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8",
            12: "<f8"}


def copy_fields(original: Path, writer) -> None:
    """Every key-value of the original but NOT_COPIED, with its own value types."""
    from gguf import GGUFValueType
    for key, kind, item, val in read_fields(original):
        if key.startswith(NOT_COPIED):
            continue
        writer.add_key_value(key, val, GGUFValueType(kind), sub_type=None if item is None else GGUFValueType(item))


def file_precision(path: Path) -> str:
    """The precision a GGUF's general.file_type names ('F32', 'BF16', 'Q4_1', ...), or '?'."""
    import gguf
    try:
        kinds = {key: val for key, _, _, val in read_fields(path)}
        name = gguf.LlamaFileType(int(kinds["general.file_type"])).name
    except (KvchatError, OSError, KeyError, ValueError, TypeError):
        return "?"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
