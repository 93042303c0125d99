#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests, then end-to-end tests
# against a real tritonserver. Extra arguments go to pytest (e.g. -k greedy, -m "not server").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -ra "$@"
