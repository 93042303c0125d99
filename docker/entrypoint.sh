#!/usr/bin/env bash
# The images' entry point: serve the image's model repository, or a copy made for mounted checkpoints.
#
#   SPECDEC_TARGET=/models/target [SPECDEC_DRAFT=/models/draft] [SPECDEC_PARAMS="MODEL.KEY=VALUE ..."]
#
# With SPECDEC_TARGET set, scripts/new_repository.sh writes a repository for it under /tmp (the
# draft: SPECDEC_DRAFT, or n-gram prompt lookup when unset) and that one is served. Arguments go
# to scripts/serve.sh and on to tritonserver (a --model-repository among them serves a mounted one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

args=()
if [[ -n "${SPECDEC_TARGET:-}" ]]; then
    repository="${TMPDIR:-/tmp}/specdec_model_repository"
    rm -rf "$repository"
    options=(--target "$SPECDEC_TARGET")
    if [[ -n "${SPECDEC_DRAFT:-}" ]]; then
        options+=(--draft "$SPECDEC_DRAFT")
    else
        options+=(--ngram)
    fi
    read -r -a settings <<< "${SPECDEC_PARAMS:-}"  # split on spaces, no glob: a value may be a regex
    for setting in "${settings[@]}"; do
        options+=(--param "$setting")
    done
    "$ROOT/scripts/new_repository.sh" "$repository" "${options[@]}"
    args+=(--model-repository "$repository")
fi
exec "$ROOT/scripts/serve.sh" "${args[@]}" "$@"
