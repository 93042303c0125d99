#!/usr/bin/env bash
# Serve model_repository/ with Triton Inference Server, in the foreground.
#
#   scripts/serve.sh [tritonserver args...]
#
# Uses the container's `tritonserver` when one is on PATH; otherwise the server
# that ships inside the nvidia-pytriton wheel, with a backends directory built
# under .cache/ that pairs its Python backend with the stub for this venv's
# Python version. The stub's embedded interpreter picks its environment from the
# first `python3` on PATH (PYTHONPATH is ignored), so the venv's bin/ goes first
# and the project must be pip-installed into it (`pip install -e .`).
#
# Extra arguments go to tritonserver unchanged; a --model-repository among them
# replaces the default one. --speculative-config '<json>' (or =<json>, or @file.json)
# takes vLLM's speculative_config keys; it is checked before the server starts and
# overrides the per-model keys (docs/speculative_config.md). Environment: VENV (default
# <repo>/.venv); SPECDEC_MODELS_DIR (default <repo>/models: where the shipped configs'
# ${SPECDEC_MODELS_DIR}/... checkpoints are); OMP_NUM_THREADS
# (default 1: every model is its own process, and tiny models on CPU run several times
# faster single-threaded than with their threads competing for the cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="$VENV/bin/python"

if [[ ! -x "$PYTHON" ]]; then
    echo "serve.sh: no Python at $PYTHON (set VENV to the virtualenv that has the project installed)" >&2
    exit 1
fi
if ! (cd / && "$PYTHON" -c "import specdec, specdec_triton" 2>/dev/null); then
    echo "serve.sh: 'import specdec, specdec_triton' fails in $VENV; run: $VENV/bin/pip install -e $ROOT --no-deps" >&2
    exit 1
fi
if ! "$PYTHON" -c "import numpy, sys; sys.exit(int(numpy.__version__.split('.')[0]) >= 2)"; then
    echo "serve.sh: the Python backend stub needs numpy<2 in $VENV" >&2
    exit 1
fi

args=()
passed=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --speculative-config=*) spec_config="${1#*=}"; shift ;;
        --speculative-config)
            [[ $# -ge 2 ]] || { echo "serve.sh: --speculative-config needs a JSON object or @file.json" >&2; exit 2; }
            spec_config="$2"; shift 2 ;;
        *) passed+=("$1"); shift ;;
    esac
done
set -- ${passed[@]+"${passed[@]}"}
if [[ -n "${spec_config:-}" ]]; then
    SPECDEC_SPECULATIVE_CONFIG="$("$PYTHON" -m specdec_triton.speculative_config --check "$spec_config")" || exit 2
    export SPECDEC_SPECULATIVE_CONFIG
    echo "serve.sh: speculative_config $SPECDEC_SPECULATIVE_CONFIG" >&2
fi
if ! printf '%s\n' "$@" | grep -qE '^--model-(repository|store)(=|$)'; then
    args+=(--model-repository "$ROOT/model_repository")
fi

SERVER="$(command -v tritonserver || true)"
if [[ -z "$SERVER" ]]; then
    SITE="$("$PYTHON" -c 'import pytriton, os; print(os.path.dirname(os.path.dirname(pytriton.__file__)))')"
    DIST="$SITE/pytriton/tritonserver"
    PYVER="$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    SERVER="$DIST/bin/tritonserver"
    # A backends dir whose python/ holds the backend library, its utils module and the stub.
    BACKENDS="$ROOT/.cache/triton_backends"
    mkdir -p "$BACKENDS/python"
    cp -u "$DIST/backends/python/libtriton_python.so" "$DIST/backends/python/triton_python_backend_utils.py" \
        "$DIST/python_backend_stubs/$PYVER/triton_python_backend_stub" "$BACKENDS/python/"
    args+=(--backend-directory "$BACKENDS" --cache-directory "$DIST/caches")
    LIBPYTHON_DIR="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
    export LD_LIBRARY_PATH="$SITE/nvidia_pytriton.libs:$LIBPYTHON_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

export PATH="$VENV/bin:$PATH"
export SPECDEC_MODELS_DIR="${SPECDEC_MODELS_DIR:-$ROOT/models}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$SERVER" "${args[@]}" "$@"
