"""kvchat's decode engine: a Llama model over a paged KV cache with prefix reuse.

Public API: Engine, EngineConfig, Conversation, SamplingParams, the telemetry types, and
the errors. Nothing here imports the app or Textual.
"""
from .conversation import Conversation
from .engine import Engine, EngineConfig
from .errors import CapExceeded, KvchatError, ModelLoadError, PoolExhausted
from .geometry import KNOWN, Geometry
from .sampler import SamplingParams
from .telemetry import CacheSnapshot, PrefillEvent, TokenEvent, TurnStats

__all__ = ["Conversation", "Engine", "EngineConfig", "CapExceeded", "KvchatError", "ModelLoadError",
           "PoolExhausted", "KNOWN", "Geometry", "SamplingParams", "CacheSnapshot", "PrefillEvent",
           "TokenEvent", "TurnStats"]
