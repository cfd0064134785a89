"""FakeBackend's configuration: what a test can set (FakeConfig), the canned replies, its
token counting ("one word = one token" plus a chat template's few) and the two capability
sets it can play (an engine's, a vLLM server's). tests/app/fake_backend.py says why a fake."""
from __future__ import annotations

from dataclasses import dataclass

from kvchat.backends.protocol import BLOCK_MAP, CACHE_TOGGLE, KV_DTYPE, RESET, SINK_WINDOW, Capabilities
from kvchat.engine.policy import POLICIES

REPLIES = ("Hello there! The **KV cache** keeps keys and values.",
           "Each new token adds one row per layer.",
           "Reusing a prefix skips its prefill.")
MESSAGE_OVERHEAD = 4    # "tokens" of chat template around each message
GENERATION_PROMPT = 3
LOCAL_LIKE = Capabilities(policies=tuple(POLICIES), kv_dtypes=("fp32", "bf16", "fp16", "fp8"), block_map="pool")
SERVER_LIKE = Capabilities(
    policies=("stop", "drop-oldest"), kv_dtypes=(), block_map="none",
    missing=((RESET, "the server does not allow a cache reset (start it with --enable-reset)"),
             (CACHE_TOGGLE, "a serving engine always keeps its KV cache"),
             (KV_DTYPE, "the server's KV dtype is fixed when it starts (--kv-cache-dtype)"),
             (SINK_WINDOW, "the server cannot evict from the middle of a sequence"),
             (BLOCK_MAP, "the server reports block counts, not which block holds what")))


def count_tokens(messages: list[dict[str, str]]) -> int:
    return sum(len(m["content"].split()) + MESSAGE_OVERHEAD for m in messages) + GENERATION_PROMPT


@dataclass
class FakeConfig:
    num_blocks: int = 64
    block_size: int = 16
    kv_dtype: str = "fp32"
    token_delay_s: float = 0.0      # per token; tests of stopping set it > 0
    prefill_chunk: int = 512        # prompt tokens per prefill chunk (the engine's CPU_PREFILL_CHUNK)
    prefill_delay_s: float = 0.0    # per chunk; tests of the prefill's progress and of stopping it set it > 0
    replies: tuple[str, ...] = REPLIES
    capabilities: Capabilities = LOCAL_LIKE
    knows_geometry: bool = True     # False: like a server's model that matches no known geometry
    model: str = "fake-smollm2"     # the name info() reports (a conversation's log records it)
    counts_tokens: bool = True      # False: count_tokens says None, like a backend without a tokenizer
    random_weights: bool = True
    reports_reuse: bool = True      # False: reused / computed tokens are None, like a vLLM server started
                                    # without --enable-prompt-tokens-details
