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

from dataclasses import dataclass, replace
from typing import Any

from .errors import ModelLoadError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


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
        if self.n_heads % self.n_kv_heads:
            raise ModelLoadError(f"model geometry {self.name}: {self.n_heads} query heads are not a multiple "
                                 f"of {self.n_kv_heads} KV heads")

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes per element."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * DTYPE_BYTES[kv_dtype]

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


def from_hf_config(cfg: dict[str, Any], name: str = "model") -> Geometry:
    """Read a Llama config.json (transformers 4.x `rope_theta` or 5.x `rope_parameters`)."""
    arch = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if model_type != "llama" and "LlamaForCausalLM" not in arch:
        raise ModelLoadError(
            f"{name}: unsupported architecture {model_type or arch!r}; kvchat runs Llama-architecture "
            "models (model_type 'llama', LlamaForCausalLM)")
    try:
        hidden = int(cfg["hidden_size"])
        n_heads = int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0)))
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return Geometry(
            name=name,
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=hidden,
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position=int(cfg.get("max_position_embeddings", 4096)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            source="config.json",
        )
    except (KeyError, TypeError, ValueError) as err:
        raise ModelLoadError(f"{name}: config.json lacks or mangles {err}; a Llama config needs hidden_size, "
                             "num_attention_heads, num_hidden_layers, intermediate_size, vocab_size") from None
