#!/usr/bin/env bash
# The images' entry point: serve the image's model repository, or a copy made for mounted checkpoints.
#
#   SPECDEC_TARGET=/models/target [SPECDEC_DRAFT=/models/draft] [SPECDEC_METHOD=method]
#   [SPECDEC_PARAMS="MODEL.KEY=VALUE ..."]
#
# With SPECDEC_TARGET set, scripts/new_repository.sh writes a repository for it under /tmp and
# that one is served. SPECDEC_METHOD: draft_model (the default with SPECDEC_DRAFT), eagle3,
# mlp_speculator or medusa (SPECDEC_DRAFT names the head), ngram (the default without) or suffix. Arguments
# go to scripts/serve.sh and on to tritonserver (a --model-repository among them serves a mounted one).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

args=()
if [[ -n "${SPECDEC_TARGET:-}" ]]; then
    repository="${TMPDIR:-/tmp}/specdec_model_repository"
    rm -rf "$repository"
    options=(--target "$SPECDEC_TARGET")
    draft="${SPECDEC_DRAFT:-}"
    method="${SPECDEC_METHOD:-$([[ -n "$draft" ]] && echo draft_model || echo ngram)}"
    case "$method" in
        draft_model) options+=(--draft "$draft") ;;
        eagle3) options+=(--eagle3 "$draft") ;;
        mlp_speculator) options+=(--mlp-speculator "$draft") ;;
        medusa) options+=(--medusa "$draft") ;;
        ngram | suffix) options+=("--$method") ;;
        *)
            echo "entrypoint: SPECDEC_METHOD must be draft_model, eagle3, mlp_speculator, medusa, ngram or suffix," \
                "got '$method'" >&2
            exit 2 ;;
    esac
    if [[ "$method" == ngram || "$method" == suffix ]]; then
        if [[ -n "$draft" ]]; then
            echo "entrypoint: SPECDEC_METHOD=$method drafts without a checkpoint; unset SPECDEC_DRAFT" >&2
            exit 2
        fi
    elif [[ -z "$draft" ]]; then
        echo "entrypoint: SPECDEC_METHOD=$method needs SPECDEC_DRAFT (its checkpoint)" >&2
        exit 2
    fi
    read -r -a settings <<< "${SPECDEC_PARAMS:-}"  # split on spaces, no glob: a value may be a regex
    for setting in "${settings[@]}"; do
        options+=(--param "$setting")
    done
    "$ROOT/scripts/new_repository.sh" "$repository" "${options[@]}"
    args+=(--model-repository "$repository")
fi
exec "$ROOT/scripts/serve.sh" "${args[@]}" "$@"
