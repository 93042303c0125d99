#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: unit tests on every core, then the
# end-to-end tests against a real tritonserver, one at a time.
#
#   scripts/test.sh              # both phases; the exit status fails if either does
#   scripts/test.sh ARGS...      # pytest ARGS as given, in one process (e.g. -k greedy, -m "not server")
#
# The unit tests run one torch thread each (tests/conftest.py), so pytest-xdist spreads their
# tests over the cores (`SPECDEC_TEST_WORKERS`, default: one per core, at most 4, as each worker
# holds its own models and compiled graphs in memory). The end-to-end tests
# stay serial: each starts tritonservers of six model processes, and their fault tests time
# how fast a server answers, which a second server starting beside it would distort.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
pytest=(.venv/bin/python -m pytest -q -ra)
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
cores="$(nproc 2>/dev/null || echo 2)"
workers="${SPECDEC_TEST_WORKERS:-$((cores < 4 ? cores : 4))}"
status=0
echo "[test] unit tests ($workers workers)"
"${pytest[@]}" -n "$workers" --dist worksteal tests --ignore=tests/e2e || status=$?
echo "[test] end-to-end tests"
"${pytest[@]}" tests/e2e || status=$?
exit "$status"
