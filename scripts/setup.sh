#!/usr/bin/env bash
# Create .venv and install the project with everything the server, client and tests need.
#
#   scripts/setup.sh [--dry-run]
#
# Idempotent: a second run only checks (a stamp in the venv holds the hash of this script
# and pyproject.toml). torch comes first and only where the venv has none, as the build that
# fits the machine: the CPU build from PyTorch's CPU index where no NVIDIA GPU answers
# `nvidia-smi -L` (PyPI's Linux torch is the CUDA build and pulls ~3 GB of CUDA libraries),
# the CUDA build from PyPI where one does. An existing torch is never replaced.
#
# Environment:
#   SPECDEC_TORCH        auto (default) | cpu | cuda: which torch build to install
#   SPECDEC_TORCH_INDEX  the index to install it from (default: the CPU index for cpu, PyPI
#                        for cuda; e.g. https://download.pytorch.org/whl/cu126 for another CUDA)
#   SPECDEC_VENV         the virtualenv (default .venv); PYTHON: the interpreter that creates it
#   SPECDEC_WARM_CACHE   0: do not warm the compile cache (below)
# --dry-run prints what would be installed and changes nothing.
#
# Last, also when the venv is up to date, scripts/warm_cache.py compiles the shipped repository's
# models into the cache scripts/serve.sh reads (.cache/torchinductor), so the first start is quick;
# it is a no-op (a stamp) while nothing that shapes the compiled code changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SPECDEC_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
CPU_INDEX="https://download.pytorch.org/whl/cpu"
DRY_RUN=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY_RUN=1 ;;
  *) echo "setup.sh: unknown argument '$1'; allowed: --dry-run" >&2; exit 2 ;;
esac

warm_cache() {  # the compile cache of the shipped repository (scripts/warm_cache.py), unless told not to
  if [ "${SPECDEC_WARM_CACHE:-1}" = 0 ]; then
    echo "[setup] not warming the compile cache (SPECDEC_WARM_CACHE=0)"
  elif [ "$DRY_RUN" = 1 ]; then
    echo "[setup] would run: $VENV/bin/python scripts/warm_cache.py"
  elif ! "$VENV/bin/python" scripts/warm_cache.py; then
    echo "[setup] warning: warming the compile cache failed (above): the server's first start compiles" \
         "instead, and fails its load the same way if the fault is there too" >&2
  fi
}

stamp="$VENV/.specdec-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] $VENV is up to date"
  warm_cache
  exit 0
fi

started=$SECONDS
phase() { echo "[setup] ($1/5) $2"; phase_started=$SECONDS; }
took() { [ "$DRY_RUN" = 1 ] || echo "[setup]       done in $((SECONDS - phase_started)) s"; }
run() {  # run a command, or only print it with --dry-run
  if [ "$DRY_RUN" = 1 ]; then echo "[setup] would run: $*"; else "$@"; fi
}

index_answers() {  # the package index at $1 answers within 10 s
  "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)' "$1/torch/" >/dev/null 2>&1
}
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }
torch_build="${SPECDEC_TORCH:-auto}"
case "$torch_build" in
  auto) if has_gpu; then torch_build=cuda; else torch_build=cpu; fi ;;
  cpu | cuda) ;;
  *) echo "setup.sh: SPECDEC_TORCH must be one of auto, cpu, cuda; got '$torch_build'" >&2; exit 2 ;;
esac

phase 1 "virtualenv $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  run "$PY" -m venv "$VENV"
fi
pip_install=("$VENV/bin/python" -m pip install --disable-pip-version-check)
pip=("${pip_install[@]}" -q)

phase 2 "torch $TORCH_VERSION ($torch_build build)"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  have="$("$VENV/bin/python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
  echo "[setup]       keeping the installed torch $have"
  if [ "$torch_build" = cuda ] && [ "${have##* }" = None ]; then
    echo "[setup]       warning: this torch is the CPU build; to get the CUDA build: $VENV/bin/pip install --force-reinstall torch==$TORCH_VERSION"
  fi
else
  if [ "$torch_build" = cpu ] && [ -z "${SPECDEC_TORCH_INDEX:-}" ] && ! index_answers "$CPU_INDEX"; then
    # no CPU index here: a torch wheel of this version among pip's own sources (find-links,
    # a local index) is taken if there is one, its dependencies from PyPI; PyPI's own torch is
    # the CUDA build, so without such a wheel the user decides
    echo "[setup]       $CPU_INDEX does not answer: looking for a torch $TORCH_VERSION wheel among pip's own sources"
    if ! run "${pip[@]}" --no-index --no-deps "torch==$TORCH_VERSION"; then
      echo "setup.sh: no CPU build of torch $TORCH_VERSION can be had: $CPU_INDEX does not answer and pip's own" \
           "sources hold no such wheel. Set SPECDEC_TORCH_INDEX to a mirror of that index, or SPECDEC_TORCH=cuda" \
           "to take PyPI's CUDA build (about 3 GB)" >&2
      exit 1
    fi
    index=""
  elif [ "$torch_build" = cpu ]; then
    index="${SPECDEC_TORCH_INDEX:-$CPU_INDEX}"
  else
    index="${SPECDEC_TORCH_INDEX:-}"
    echo "[setup]       the CUDA build downloads about 3 GB; this takes minutes"
  fi
  # --index-url, PyTorch's documented form: the CPU index also serves torch's dependencies, so
  # nothing is taken from PyPI, whose torch of the same version is the CUDA build. On a
  # terminal pip shows its download bar (the wheel is hundreds of MB at least).
  quiet=(-q)
  if [ -t 1 ]; then quiet=(); fi
  run "${pip_install[@]}" "${quiet[@]}" ${index:+--index-url "$index"} "torch==$TORCH_VERSION"
  took
fi

phase 3 "the project, tritonclient, nvidia-pytriton (tritonserver), the OpenAI server (fastapi, uvicorn), test and benchmark tools"
run "${pip[@]}" "numpy<2" -e ".[serve,test,bench]"
took

phase 4 "check"
if [ "$DRY_RUN" = 0 ]; then
  echo "$want" > "$stamp"
  if ! command -v g++ >/dev/null && ! command -v c++ >/dev/null && ! command -v clang++ >/dev/null; then
    echo "[setup] warning: no C++ compiler on PATH: the shipped configs' cpu_compile (on CPU) needs one;" \
         "install g++ (apt-get install g++), or set cpu_compile false in target_verifier and draft_proposer" >&2
  fi
  echo "[setup]       $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
fi

phase 5 "the compile cache of model_repository/ (scripts/warm_cache.py; SPECDEC_WARM_CACHE=0 skips it)"
warm_cache
took
if [ "$DRY_RUN" = 1 ]; then
  echo "[setup] dry run: nothing was installed"
  exit 0
fi
echo "[setup] done in $((SECONDS - started)) s"
