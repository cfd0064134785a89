"""Model geometry: the shapes that decide what the KV cache costs.

Known geometries sit in one table. Sources:
- Llama 3.1 8B / 70B: The Llama 3 Herd of Models (Meta, 2024), Table 3, and the models'
  config.json (rope_theta 500000, "llama3" rope scaling: factor 8, low/high frequency
  factors 1 and 4, original context 8192).
- Llama 2 7B: Llama 2: Open Foundation and Fine-Tuned Chat Models (Touvron et al., 2023);
  no GQA below 34B, so 32 KV heads.
- SmolLM2-135M-Instruct: its config.json (HuggingFaceTB), 30 layers, 9/3 heads of 64.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .errors import ModelLoadError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
SCALE_BYTES = 4   # an fp8 cache keeps one fp32 scale per token, layer, K/V and KV head
MODEL_DTYPES = ("auto", "fp32", "bf16", "fp16")          # --dtype's choices (auto: bf16 on CUDA and AVX512-BF16 CPUs)
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8")      # --kv-dtype's (auto: the model's dtype)

# The largest value of each size a model file may claim: several times the largest Llama
# (3.1 405B: 126 layers, hidden 16,384, 128 heads, 53,248 intermediate, 128,256 tokens, 131,072
# positions). A config past these is a typo or an attack, and is refused before anything is
# sized from it (a table of 10^8 layers' weight names would take gigabytes).
LIMITS = {"n_layers": 1024, "hidden": 1 << 17, "n_heads": 1024, "n_kv_heads": 1024, "head_dim": 1024,
          "intermediate": 1 << 20, "vocab_size": 1 << 22, "max_position": 1 << 24}


@dataclass(frozen=True, slots=True)
class Geometry:
    name: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position: int = 4096
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab_size"):
            if getattr(self, attr) <= 0:
                raise ModelLoadError(f"model geometry {self.name}: {attr} must be positive, got {getattr(self, attr)}")
        for attr, most in LIMITS.items():
            if getattr(self, attr) > most:
                raise ModelLoadError(f"model geometry {self.name}: {attr} {getattr(self, attr):,} is past the "
                                     f"{most:,} kvchat accepts")
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"model geometry {self.name}: {self.n_heads} query heads are not a multiple "
                                 f"of {self.n_kv_heads} KV heads")

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

    def kv_scale_bytes_per_token(self, kv_dtype: str) -> int:
        """fp8: 2 (K and V) x layers x KV heads fp32 scales per token; other dtypes store none."""
        return 2 * self.n_layers * self.n_kv_heads * SCALE_BYTES if kv_dtype == "fp8" else 0

    def formula(self, kv_dtype: str) -> str:
        b = DTYPE_BYTES[kv_dtype]
        return (f"2 x {self.n_layers} x {self.n_kv_heads} x {self.head_dim} x S x {b} B"
                f" = {self.kv_bytes_per_token(kv_dtype):,} B x S")

    def param_count(self) -> int:
        attn = self.hidden * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.n_heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        layer = attn + mlp + 2 * self.hidden
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        return self.n_layers * layer + self.vocab_size * self.hidden + head + self.hidden


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

KNOWN: dict[str, Geometry] = {
    "llama-3.1-8b": Geometry(
        "llama-3.1-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128,
        intermediate=14336, vocab_size=128256, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position=131072, norm_eps=1e-5, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        source="The Llama 3 Herd of Models, Table 3; meta-llama/Llama-3.1-8B config.json"),
    "llama-3.1-70b": Geometry(
        "llama-3.1-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128,
        intermediate=28672, vocab_size=128256, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position=131072, norm_eps=1e-5, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        source="The Llama 3 Herd of Models, Table 3; meta-llama/Llama-3.1-70B config.json"),
    "llama-2-7b": Geometry(
        "llama-2-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128,
        intermediate=11008, vocab_size=32000, rope_theta=10000.0, max_position=4096, norm_eps=1e-5,
        bos_token_id=1, eos_token_ids=(2,),
        source="Llama 2: Open Foundation and Fine-Tuned Chat Models; meta-llama/Llama-2-7b-hf config.json"),
    "smollm2-135m": Geometry(
        "smollm2-135m", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64,
        intermediate=1536, vocab_size=49152, rope_theta=100000.0, max_position=8192, norm_eps=1e-5,
        tie_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
        source="HuggingFaceTB/SmolLM2-135M-Instruct config.json"),
}
KNOWN["llama-3.1-8b-instruct"] = replace(KNOWN["llama-3.1-8b"], name="llama-3.1-8b-instruct")

# The HF repositories each alias resolves to (hub cache layout models--ORG--NAME).
HF_REPOS: dict[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-8b-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
}


ROPE_TYPES = ("default", "llama3")     # what model.rope_inv_freq implements
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_NEEDED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
_MAX_INT = 2**31 - 1                    # a size past int32 in a config is a typo, not a model
_BOUND = {"num_hidden_layers": "n_layers", "hidden_size": "hidden", "num_attention_heads": "n_heads",
          "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim", "intermediate_size": "intermediate",
          "vocab_size": "vocab_size", "max_position_embeddings": "max_position"}


def _int(cfg: dict[str, Any], key: str, name: str, default: int | None = None, lo: int = 1) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ModelLoadError(f"{name}: config.json lacks {key!r}; a Llama config needs {', '.join(_NEEDED)}")
    most = LIMITS[_BOUND[key]] if key in _BOUND else _MAX_INT
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= most:
        shown = (f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**30
                 else f"{value:g}" if isinstance(value, float) else repr(value)[:40])
        raise ModelLoadError(f"{name}: config.json {key} must be a whole number from {lo} to {most:,}, got {shown}")
    return value


def _float(cfg: dict[str, Any], key: str, name: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelLoadError(f"{name}: config.json {key} must be a positive finite number, got {value!r}")
    return float(value)


def _rope_scaling(cfg: dict[str, Any], name: str) -> dict[str, Any] | None:
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"{name}: config.json rope_scaling must be an object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{name}: unsupported rope scaling type {kind!r}; accepted: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return None
    for key in _LLAMA3_KEYS:
        _float(scaling, key, name, None)  # type: ignore[arg-type]
    return dict(scaling)


def check_hf_config(cfg: Any, name: str = "model") -> None:
    """Refuse, in one line, any config kvchat's Llama would run wrongly or that asks for the
    model's own code (auto_map): kvchat never runs code shipped with a model."""
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{name}: config.json must be a JSON object, got {type(cfg).__name__}")
    if "auto_map" in cfg:
        raise ModelLoadError(f"{name}: config.json has auto_map (custom model code), which kvchat never runs; "
                             "accepted: a plain Llama config (model_type 'llama')")
    model_type = cfg.get("model_type")
    arch = cfg.get("architectures") or []
    if model_type != "llama" or not isinstance(arch, list) or any(a != "LlamaForCausalLM" for a in arch):
        raise ModelLoadError(
            f"{name}: unsupported architecture {model_type if model_type != 'llama' else arch!r}; kvchat runs "
            "Llama-architecture models (model_type 'llama', LlamaForCausalLM)")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ModelLoadError(f"{name}: config.json sets {flag}; kvchat's Llama has no biases (accepted: false)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{name}: config.json hidden_act {cfg['hidden_act']!r}; accepted: silu")


def from_hf_config(cfg: Any, name: str = "model") -> Geometry:
    """Read a Llama config.json (transformers 4.x `rope_theta` or 5.x `rope_parameters`),
    checking every field kvchat uses."""
    check_hf_config(cfg, name)
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"{name}: config.json rope_parameters must be an object, got {rope!r}")
    hidden = _int(cfg, "hidden_size", name)
    n_heads = _int(cfg, "num_attention_heads", name)
    vocab = _int(cfg, "vocab_size", name)
    head_dim = _int({"head_dim": cfg.get("head_dim") or hidden // n_heads}, "head_dim", name)
    ids = {}
    for key in ("bos_token_id", "eos_token_id"):
        v = cfg.get(key)
        vs = v if isinstance(v, list) else ([] if v is None else [v])
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab for i in vs):
            raise ModelLoadError(f"{name}: config.json {key} must be token ids in [0, {vocab}), got {v!r}")
        ids[key] = vs
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ModelLoadError(f"{name}: config.json tie_word_embeddings must be true or false, got {tie!r}")
    return Geometry(
        name=name,
        n_layers=_int(cfg, "num_hidden_layers", name),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=_int(cfg, "num_key_value_heads", name, default=n_heads),
        head_dim=head_dim,
        intermediate=_int(cfg, "intermediate_size", name),
        vocab_size=vocab,
        rope_theta=_float(cfg, "rope_theta", name, rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(cfg, name),
        max_position=_int(cfg, "max_position_embeddings", name, default=4096),
        norm_eps=_float(cfg, "rms_norm_eps", name, 1e-5),
        tie_embeddings=tie,
        bos_token_id=ids["bos_token_id"][0] if ids["bos_token_id"] else None,
        eos_token_ids=tuple(ids["eos_token_id"]),
        source="config.json",
    )


def weight_shapes(geom: Geometry) -> dict[str, tuple[int, ...]]:
    """Every tensor a LlamaForCausalLM checkpoint of this geometry holds, by its HF name."""
    q, kv = geom.n_heads * geom.head_dim, geom.n_kv_heads * geom.head_dim
    h, f = geom.hidden, geom.intermediate
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (geom.vocab_size, h), "model.norm.weight": (h,)}
    if not geom.tie_embeddings:
        out["lm_head.weight"] = (geom.vocab_size, h)
    for i in range(geom.n_layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    return out


def cuda_limits(geom: Geometry, block_size: int) -> None:
    """The Triton kernels take power-of-two block sizes (1..1024) and head dims (16..256);
    checked when the engine starts on CUDA, not inside a kernel mid-turn."""
    if block_size > 1024 or block_size & (block_size - 1):
        raise ModelLoadError(f"--block-size {block_size}: on CUDA the kernels need a power of two from 1 to 1024 "
                             "(e.g. 16)")
    d = geom.head_dim
    if not 16 <= d <= 256 or d & (d - 1):
        raise ModelLoadError(f"{geom.name}: head_dim {d} is not a power of two from 16 to 256, which the CUDA "
                             "kernels need; run it with --device cpu")
