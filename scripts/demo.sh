#!/usr/bin/env bash
# The main job on a fresh machine: set up, start tritonserver on the shipped tiny pair,
# stream one completion with speculation, compare it with the same request at
# num_speculative_tokens = 0, stop the server. Extra arguments go to scripts/demo.py
# (e.g. --prompt "def fib(n):" --max-tokens 128).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python scripts/demo.py "$@"
