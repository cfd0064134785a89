"""kvchat's decode engine: a Llama model over a paged KV cache with prefix reuse.

Installed as `kvchat.engine` (the repository keeps it in its top-level engine/ folder;
kvchat/engine is a link to it). Public API: Engine, EngineConfig, Conversation,
SamplingParams, the telemetry types, and the errors. Nothing here imports the app or
Textual. Names are imported on first use, so `import kvchat.engine.geometry` (for
`kvchat info`) or the telemetry types never pay for torch.
"""
from __future__ import annotations

from importlib import import_module

_WHERE = {
    "Conversation": "conversation", "Engine": "engine", "EngineConfig": "engine",
    "CapExceeded": "errors", "KvchatError": "errors", "ModelLoadError": "errors", "PoolExhausted": "errors",
    "KNOWN": "geometry", "Geometry": "geometry", "SamplingParams": "sampler",
    "CacheSnapshot": "telemetry", "PrefillEvent": "telemetry", "TokenEvent": "telemetry", "TurnStats": "telemetry",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
