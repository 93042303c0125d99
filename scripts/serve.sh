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
# replaces the default one. Options of this script's own:
# --speculative-config '<json>' (or =<json>, or @file.json): vLLM's speculative_config keys,
#   checked before the server starts, overriding the per-model keys (docs/speculative_config.md);
# --openai-port N (or --openai-port=N): the OpenAI-compatible server (python -m specdec_openai)
#   on that port, talking to this Triton over gRPC and stopping with it; default 9000 (or
#   $SPECDEC_OPENAI_PORT), 0: off; --openai-chat-template FILE gives it a chat template;
# --openai-api-key KEY (better: SPECDEC_OPENAI_API_KEY=KEY in the environment, out of ps): /v1
#   requests must carry 'Authorization: Bearer KEY' (docs/openai.md). The key reaches the OpenAI
#   server through its environment only, never its command line, and not tritonserver at all.
# Environment: VENV (default <repo>/.venv); SPECDEC_MODELS_DIR (default <repo>/models: where
# the shipped configs' ${SPECDEC_MODELS_DIR}/... checkpoints are); TORCHINDUCTOR_CACHE_DIR
# (default <repo>/.cache/torchinductor: cpu_compile's compiled code, which scripts/setup.sh
# fills through scripts/warm_cache.py, so a first start does not compile); OMP_NUM_THREADS
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
    # Triton 2.51's stub is built against numpy 1.x: under numpy 2 it hands BYTES tensors over
    # corrupted (a request's text fails in deserialize_bytes_tensor), so refuse to start instead.
    echo "serve.sh: the Python backend stub of Triton 2.51 needs numpy<2 in $VENV (pip install 'numpy<2')" >&2
    exit 1
fi

# --openai-port and --speculative-config are ours; --grpc-port is read (not taken) to point the OpenAI server at Triton.
OPENAI_PORT="${SPECDEC_OPENAI_PORT:-9000}"
GRPC_PORT=8001
openai_args=()
passed=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --openai-port=*) OPENAI_PORT="${1#*=}" ;;
        --openai-port) OPENAI_PORT="${2:?serve.sh: --openai-port needs a port (0: off)}"; shift ;;
        --openai-chat-template=*) openai_args+=(--chat-template "${1#*=}") ;;
        --openai-chat-template) openai_args+=(--chat-template "${2:?serve.sh: --openai-chat-template needs a file}"); shift ;;
        --openai-api-key=*) OPENAI_API_KEY_ARG="${1#*=}"; key_given=1 ;;
        --openai-api-key) OPENAI_API_KEY_ARG="${2:?serve.sh: --openai-api-key needs a key}"; key_given=1; shift ;;
        --speculative-config=*) spec_config="${1#*=}" ;;
        --speculative-config) spec_config="${2:?serve.sh: --speculative-config needs a JSON object or @file.json}"; shift ;;
        --grpc-port=*) GRPC_PORT="${1#*=}"; passed+=("$1") ;;
        --grpc-port) GRPC_PORT="${2:-}"; passed+=("$1" "${2:-}"); shift ;;
        *) passed+=("$1") ;;
    esac
    shift
done
set -- ${passed[@]+"${passed[@]}"}
if [[ -n "${spec_config:-}" ]]; then
    SPECDEC_SPECULATIVE_CONFIG="$("$PYTHON" -m specdec_triton.speculative_config --check "$spec_config")" || exit 2
    export SPECDEC_SPECULATIVE_CONFIG
    echo "serve.sh: speculative_config $SPECDEC_SPECULATIVE_CONFIG" >&2
fi
if ! [[ "$OPENAI_PORT" =~ ^[0-9]+$ ]]; then
    echo "serve.sh: --openai-port must be a port number (0: no OpenAI server), got '$OPENAI_PORT'" >&2
    exit 1
fi
if [[ -n "${key_given:-}" ]]; then
    if [[ -z "${OPENAI_API_KEY_ARG//[[:space:]]/}" ]]; then
        echo "serve.sh: --openai-api-key needs a key (it is empty); leave it out to serve without one" >&2
        exit 1
    fi
    if [[ "$OPENAI_PORT" == 0 ]]; then
        echo "serve.sh: --openai-api-key is for the OpenAI server, which --openai-port=0 turns off" >&2
        exit 1
    fi
    SPECDEC_OPENAI_API_KEY="$OPENAI_API_KEY_ARG"
fi
if [[ ${#openai_args[@]} -gt 0 && ! -f "${openai_args[1]}" ]]; then
    echo "serve.sh: --openai-chat-template: no file '${openai_args[1]}'" >&2
    exit 1
fi
if [[ "$OPENAI_PORT" != 0 ]]; then
    if ! PYTHONPATH="$ROOT" "$PYTHON" -c "import specdec_openai, fastapi, uvicorn" 2>/dev/null; then
        echo "serve.sh: the OpenAI server needs fastapi and uvicorn in $VENV: run scripts/setup.sh" \
            "(or $VENV/bin/pip install -e '$ROOT[serve]'), or pass --openai-port=0" >&2
        exit 1
    fi
    if ! "$PYTHON" -c "import socket, sys; s = socket.socket(); s.bind(('', int(sys.argv[1])))" "$OPENAI_PORT" 2>/dev/null; then
        echo "serve.sh: port $OPENAI_PORT (the OpenAI server) is taken: pass --openai-port N, or 0 for none" >&2
        exit 1
    fi
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
    args+=(--exit-timeout-secs=20)
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
    # Replaced by rename where they differ: a running server's stub stays its own (cp onto it: "Text file busy").
    for f in "$DIST/backends/python/libtriton_python.so" "$DIST/backends/python/triton_python_backend_utils.py" \
             "$DIST/python_backend_stubs/$PYVER/triton_python_backend_stub"; do
        dest="$BACKENDS/python/$(basename "$f")"
        if ! cmp -s "$f" "$dest"; then
            cp -p "$f" "$dest.$$" && mv -f "$dest.$$" "$dest"
        fi
    done
    args+=(--backend-directory "$BACKENDS" --cache-directory "$DIST/caches")
    LIBPYTHON_DIR="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
    export LD_LIBRARY_PATH="$SITE/nvidia_pytriton.libs:$LIBPYTHON_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

export PATH="$VENV/bin:$PATH"
export SPECDEC_MODELS_DIR="${SPECDEC_MODELS_DIR:-$ROOT/models}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$ROOT/.cache/torchinductor}"  # scripts/warm_cache.py's
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
if [[ "$OPENAI_PORT" != 0 ]]; then
    # This checkout's server, a child of this process, which becomes tritonserver: it exits when tritonserver does.
    SPECDEC_OPENAI_API_KEY="${SPECDEC_OPENAI_API_KEY:-}" PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        "$PYTHON" -m specdec_openai --triton-url "127.0.0.1:$GRPC_PORT" \
        --port "$OPENAI_PORT" --exit-with $$ ${openai_args[@]+"${openai_args[@]}"} &
fi
unset SPECDEC_OPENAI_API_KEY OPENAI_API_KEY_ARG  # the OpenAI server's alone: not in Triton's or its stubs' environment
exec "$SERVER" "${args[@]}" "$@"
