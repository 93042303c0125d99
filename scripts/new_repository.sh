#!/usr/bin/env bash
# Write a copy of model_repository/ with absolute checkpoint paths and edited parameters:
#   scripts/new_repository.sh DIR [--target CKPT] [--draft CKPT | --eagle3 HEAD | --mlp-speculator HEAD
#                                 | --medusa HEAD | --ngram | --suffix] [--param MODEL.KEY=VALUE ...]
# (scripts/new_repository.py --help says more). VENV: the virtualenv (default <repo>/.venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
exec "$VENV/bin/python" "$ROOT/scripts/new_repository.py" "$@"
