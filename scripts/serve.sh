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
# replaces the default one. Environment: VENV (default <repo>/.venv); OMP_NUM_THREADS
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
if ! printf '%s\n' "$@" | grep -qE '^--model-(repository|store)(=|$)'; then
    args+=(--model-repository "$ROOT/model_repository")
fi

# The orchestrator reloads a composing model whose process died (docs/reliability.md): that needs
# explicit model control, with every model loaded at start. The model-repository API it opens is
# restricted to a key (SPECDEC_ADMIN_KEY, default a random one per start), so no client can load or
# unload models. A server stopped after a fault waits out --exit-timeout-secs for the dead model.
has_arg() { printf '%s\n' "${@:2}" | grep -qE "^--$1(=|\$)"; }
if ! has_arg model-control-mode "$@"; then
    KEY="${SPECDEC_ADMIN_KEY:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}"
    args+=(--model-control-mode=explicit "--load-model=*"
           "--http-restricted-api=model-repository:specdec-admin-key=$KEY"
           "--grpc-restricted-protocol=model-repository:specdec-admin-key=$KEY")
fi
if ! has_arg exit-timeout-secs "$@"; then
    args+=(--exit-timeout-secs=10)
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
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$SERVER" "${args[@]}" "$@"
