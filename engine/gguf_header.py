"""A GGUF file's header, read by kvchat itself before anything else touches the file.

GGUF (ggml's format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): the magic
"GGUF", a version, the tensor and key-value counts, the key-values (typed scalars, strings,
arrays), then one line per tensor (name, dims, type, offset). Every length and count in it is
checked against the bytes left in the file before it is used, so a string that claims 2^40
bytes is refused in one line instead of becoming an allocation; the file is memory-mapped,
never read whole. From the header come the model's geometry (for `kvchat info`, with no
conversion) and its size (for the memory check made before a conversion).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .files import FileRefused, open_regular
from .geometry import Geometry, from_hf_config

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
KEEP_STRING = 1 << 16        # longer strings (a chat template) are checked and skipped
KEEP_ARRAY = 1 << 12         # longer arrays (the vocabulary) keep only their length
MAX_TENSORS = 1 << 20
MAX_DIMS = 8


class GgufError(ModelLoadError):
    """A GGUF header kvchat cannot read; str() is one line naming the file."""


@dataclass(frozen=True, slots=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]       # scalars and short strings as values; long arrays as ("array", type, n)
    tensors: dict[str, tuple[int, ...]]   # name -> dims


class _Reader:
    """Bounds-checked little-endian reads from a memory map."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, why: str) -> GgufError:
        return GgufError(f"{self.path}: cannot read this GGUF as a Llama model ({why})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} of {n:,} bytes at offset {self.pos:,} runs past the end of the "
                            f"{len(self.buf):,}-byte file")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str, keep: bool = True) -> str | None:
        n = self.scalar("<Q", f"{what}'s length")
        self.need(n, what)
        raw = self.buf[self.pos:self.pos + n] if keep and n <= KEEP_STRING else None
        self.pos += n
        if raw is None:
            return None
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None

    def value(self, kind: int, what: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind == ARRAY:
            item = self.scalar("<I", f"{what}'s element type")
            n = self.scalar("<Q", f"{what}'s length")
            least = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8
            if item not in _SCALARS and item != STRING:
                raise self.fail(f"{what} is an array of type {item}; expected scalars or strings")
            self.need(n * least, f"{what}'s {n:,} elements")
            if n > KEEP_ARRAY:
                if item == STRING:
                    for i in range(n):
                        self.string(f"{what}[{i}]", keep=False)
                else:
                    self.pos += n * least
                return ("array", item, n)
            return [self.value(item, f"{what}[{i}]") for i in range(n)]
        raise self.fail(f"{what} has value type {kind}; expected 0 to 12")


def read_header(path: Path) -> GgufHeader:
    """The key-values and tensor shapes of the GGUF at `path`; GgufError if anything in the
    header does not fit the file."""
    try:
        fh = open_regular(path)
    except FileRefused as err:
        raise GgufError(f"{path}: {err}") from None
    with fh:
        try:
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (ValueError, OSError) as err:     # an empty file cannot be mapped
            raise GgufError(f"{path}: cannot read this GGUF as a Llama model ({err})") from None
    with buf:
        r = _Reader(buf, path)
        r.need(4, "the magic")
        if buf[:4] != MAGIC:
            raise r.fail("it does not start with GGUF")
        r.pos = 4
        version = r.scalar("<I", "the version")
        if version not in (2, 3):
            raise r.fail(f"version {version}; kvchat reads GGUF versions 2 and 3")
        n_tensors = r.scalar("<Q", "the tensor count")
        n_kv = r.scalar("<Q", "the key-value count")
        r.need(n_kv * 13, f"{n_kv:,} key-values")            # each: a length, a type and a value at least
        if n_tensors > MAX_TENSORS:
            raise r.fail(f"{n_tensors:,} tensors; kvchat reads at most {MAX_TENSORS:,}")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = r.string(f"key {i}") or f"(key {i})"
            kind = r.scalar("<I", f"{key}'s type")
            metadata[key] = r.value(kind, key)
        tensors: dict[str, tuple[int, ...]] = {}
        for i in range(n_tensors):
            name = r.string(f"tensor {i}'s name") or f"(tensor {i})"
            n_dims = r.scalar("<I", f"{name}'s dimension count")
            if n_dims > MAX_DIMS:
                raise r.fail(f"tensor {name} has {n_dims} dimensions")
            tensors[name] = tuple(r.scalar("<Q", f"{name}'s dims") for _ in range(n_dims))
            r.scalar("<I", f"{name}'s type")
            r.scalar("<Q", f"{name}'s offset")
        return GgufHeader(version, metadata, tensors)


def geometry(header: GgufHeader, name: str, path: Path) -> Geometry:
    """The model's geometry from its GGUF metadata (llama.* keys), checked like a config.json."""
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r}; kvchat runs Llama models")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size") or (tokens[2] if isinstance(tokens, tuple) else len(tokens) if isinstance(tokens, list)
                                  else None)
    heads = get("attention.head_count")
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
           "num_hidden_layers": get("block_count"), "hidden_size": get("embedding_length"),
           "num_attention_heads": heads, "num_key_value_heads": get("attention.head_count_kv", heads),
           "intermediate_size": get("feed_forward_length"), "vocab_size": vocab,
           "max_position_embeddings": get("context_length", 4096),
           "rope_theta": get("rope.freq_base", 10000.0), "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
           "tie_word_embeddings": "output.weight" not in header.tensors,
           "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id")}
    if get("rope.dimension_count") is not None:
        cfg["head_dim"] = get("rope.dimension_count")
    return replace(from_hf_config(cfg, name), source="GGUF metadata")
