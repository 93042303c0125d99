#!/usr/bin/env bash
# Create .venv and install the project with everything the server, client and tests need.
# Idempotent: a second run only checks. On a machine without an NVIDIA GPU, torch is pinned
# to the CPU build (an unpinned torch pulls several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECDEC_VENV:-.venv}"
PY="${PYTHON:-python3}"

stamp="$VENV/.specdec-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "[setup] installing torch (CUDA build)"
    "${pip[@]}" torch
  else
    echo "[setup] installing torch==2.13.0 (CPU build)"
    "${pip[@]}" torch==2.13.0
  fi
fi
echo "[setup] installing the project, tritonclient, nvidia-pytriton (tritonserver), the OpenAI server (fastapi, uvicorn), test and benchmark tools"
"${pip[@]}" "numpy<2" -e ".[serve,test,bench]"
echo "$want" > "$stamp"
echo "[setup] done: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
