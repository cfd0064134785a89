"""kvchat's decode engine: a Llama model over a paged KV cache with prefix reuse.

Installed as `kvchat.engine` (the repository keeps it in its top-level engine/ folder;
kvchat/engine is a link to it). Public API: every name below, which is every engine name
kvchat uses (Engine, EngineConfig, Conversation, SamplingParams, the telemetry types, the
errors, and the torch-free sizing and geometry helpers). Nothing here imports the app or
Textual. Names are imported on first use, so `import kvchat.engine.geometry` (for
`kvchat info`) or the telemetry types never pay for torch.
"""
from __future__ import annotations

from importlib import import_module

_WHERE = {
    "Conversation": "conversation", "Engine": "engine", "EngineConfig": "engine", "Preflight": "engine",
    "preflight": "engine", "check_memory": "engine", "pick_device": "engine", "pick_dtypes": "engine",
    "CapExceeded": "errors", "KvchatError": "errors", "ModelLoadError": "errors", "PoolExhausted": "errors",
    "TurnCancelled": "errors",
    "DTYPE_BYTES": "geometry", "Geometry": "geometry", "HF_REPOS": "geometry", "KV_DTYPES": "geometry",
    "MODEL_DTYPES": "geometry", "cuda_limits": "geometry", "from_hf_config": "geometry",
    "KNOWN": "geometry", "POLICIES": "policy", "make_policy": "policy", "plan_pool": "pool_spec",
    "SamplingParams": "sampler", "WhatIf": "sizing", "step_reads": "sizing", "what_if": "sizing",
    "resolve": "sources", "DEFAULT_SINK_TOKENS": "streaming", "check_window_cap": "streaming",
    "human_bytes": "units", "parse_bytes": "units", "render_chat": "template",
    "CacheSnapshot": "telemetry", "PrefillEvent": "telemetry", "PrefillProgress": "telemetry",
    "RequestView": "telemetry", "SchedulerSnapshot": "telemetry",
    "StepRecord": "telemetry", "TokenEvent": "telemetry", "TurnStats": "telemetry",
    "CACHED": "telemetry", "FREE": "telemetry", "HELD": "telemetry", "OTHER": "telemetry",
    "PARTIAL": "telemetry", "REUSED": "telemetry", "SHARED": "telemetry",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
