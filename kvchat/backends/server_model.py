"""Which model a vLLM server serves: what it says about itself at connect time, and the
model's geometry (for bytes per token), matched from the served name, `--geometry ALIAS`, or a
local copy of its config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvchat.engine.errors import KvchatError
from kvchat.engine.geometry import HF_REPOS, KNOWN, Geometry, from_hf_config

# vLLM's dtype names -> ours
DTYPES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
           "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}

@dataclass(frozen=True, slots=True)
class ServerModel:
    """What the server says about itself at connect time."""
    name: str
    max_model_len: int | None
    dtype: str | None            # the weights' dtype, from /server_info (dev mode) if it answers
    dev_mode: bool               # /server_info answered: /reset_prefix_cache will too


def match_geometry(name: str, geometry_alias: str | None = None, config_path: str | None = None
                   ) -> tuple[Geometry | None, str]:
    """The served model's geometry and where it came from, or (None, how to give it)."""
    if geometry_alias is not None:
        alias = geometry_alias.strip().lower()
        if alias not in KNOWN:
            raise KvchatError(f"--geometry {geometry_alias!r}: unknown; accepted: {', '.join(sorted(KNOWN))}")
        return KNOWN[alias], f"--geometry {alias}"
    if config_path is not None:
        path = Path(config_path).expanduser()
        cfg = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(cfg.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise KvchatError(f"--model {config_path!r}: no readable config.json there ({err.__class__.__name__}); "
                              "with --server, --model names a local copy of the served model's config.json") from None
        return from_hf_config(data, name), str(cfg)
    key = name.strip().lower()
    by_repo = {repo.lower(): alias for alias, repo in HF_REPOS.items()}
    for candidate in (key, key.rsplit("/", 1)[-1]):
        if candidate in KNOWN:
            return KNOWN[candidate], f"served name {name!r} in kvchat's model table"
        if candidate in by_repo:
            return KNOWN[by_repo[candidate]], f"served name {name!r} in kvchat's model table"
    return None, (f"unknown geometry: the served model {name!r} is not in kvchat's table; give --geometry "
                  f"ALIAS ({', '.join(sorted(KNOWN))}) or --model PATH to a copy of its config.json")
