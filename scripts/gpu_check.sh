#!/usr/bin/env bash
# What a GPU machine checks, in one run of a few minutes (the image's own python3 with torch,
# transformers and triton; no tritonserver needed):
#   1. the GPU tests: CUDA graphs against eager, the Triton rejection-sampling and attention
#      kernels compiled for the device;
#   2. losslessness on the GPU: the shipped pair and heads in float32 (and the head behind suffix
#      decoding), every method's greedy output against k = 0 of the same engine and against HF
#      generate (benchmark_engine.py fails on any difference);
#   3. speed on a 1.5 B random-weight target (Llama-3.2-1B's shape, untied 128k vocabulary, bfloat16,
#      synthetic acceptance): k = 0 against
#      a draft model, EAGLE-3 and the MLP speculator at one and four streams, with CUDA graphs
#      (and, with "eager" in STEPS, EAGLE-3 against k = 0 without them).
#   4. where EAGLE-3's time goes at four streams: each propose and verify timed apart (profile_steps.py);
#   5. ("trees" in STEPS) the shipped drafters' trees and the one-pass drafters (PARD, MTP, DFlash,
#      Medusa) on the GPU in float32, lossless as in 2, timed against EAGLE-3's chain;
#   6. ("plan" in STEPS) the fastest EAGLE-3 tree for this GPU (plan_tree.py), then that tree against
#      the chain in benchmark_engine.py.
# STEPS picks the steps (default "tests lossless checkpoints graphs profile"; "eager", "trees" and "plan" add theirs), so a
# lease of 15 minutes can run them around the served check (scripts/gpu_serve_check.sh, after
# scripts/gpu_bundle.sh here), which makes or reuses the same random checkpoints; in two calls of
# under 10 minutes each, the second right after the first (the machine and /tmp stay while warm):
#   export COMMIT=$(git rev-parse --short HEAD) OUT=/tmp/gpu
#   STEPS="tests lossless" bash scripts/gpu_check.sh; bash scripts/gpu_serve_check.sh   # ~6 min
#   STEPS="checkpoints graphs profile" bash scripts/gpu_check.sh                        # ~3 min
# Results go to $OUT (default runs/gpu): one JSON per benchmark, the logs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
PY=${PYTHON:-python3}
MODELS=${MODELS:-/tmp/specdec-random}
COMMIT=${COMMIT:-unknown}
RATE=${RATE:-0.7}
STEPS=" ${STEPS:-tests lossless checkpoints graphs profile} "
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT" "$MODELS"
status=0
step() {  # step KEY NAME SECONDS CMD...: run KEY (if in STEPS) with a time limit, log to $OUT/run.log
  local key=$1 name=$2 limit=$3
  shift 3
  [[ $STEPS == *" $key "* ]] || return 0
  echo "=== $name ($(date -u +%T))" | tee -a "$OUT/run.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/run.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc" | tee -a "$OUT/run.log"
  [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/run.log"
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/run.log"

step tests "gpu tests" 90 $PY -m pytest -q -p no:cacheprovider -m gpu -ra \
  tests/test_fast_cuda_graphs.py tests/test_rejection_kernel.py tests/test_fast_attention_kernel.py \
  tests/test_rejection_sampler.py tests/test_eagle3.py tests/test_peagle.py tests/test_mlp_speculator.py

step lossless "lossless on GPU (shipped models, float32)" 80 $PY scripts/benchmark_engine.py --device cuda --dtype float32 \
  --configs k0,draft_model:4,eagle3:4,mlp_speculator:3,suffix:4,eagle3+suffix:8 --model-k 4 --concurrency 1,4 \
  --num-prompts 8 --max-tokens 64 --rounds 1 --commit "$COMMIT" --out-dir "$OUT/tiny"

step trees "trees and one-pass drafters on GPU (shipped models, float32)" 90 bash -ec "
  $PY scripts/benchmark_engine.py --device cuda --dtype float32 --no-hf --commit $COMMIT --out-dir $OUT/trees \
    --configs k0,eagle3:3,eagle3+tree:8,draft_model+tree:8,medusa+tree:8,draft_model+pard:4,eagle3+pard:4,mtp:2,dflash:4 \
    --concurrency 1,4 --num-prompts 8 --max-tokens 64 --rounds 1
  $PY scripts/benchmark_engine.py --device cuda --dtype float32 --no-hf --commit $COMMIT --out-dir $OUT/trees \
    --configs k0,mlp_speculator:3,mlp_speculator+tree:7 --concurrency 1,4 --num-prompts 8 --max-tokens 64 \
    --rounds 1 --token-tree '[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]'"

step plan "a tree planned for this GPU (shipped EAGLE-3, float32), then timed against the chain" 150 bash -ec "
  mkdir -p $OUT/plan
  $PY scripts/plan_tree.py --device cuda --dtype float32 --num-prompts 16 --max-nodes 24 --out-dir $OUT/plan \
    --best-out $OUT/plan/best.txt
  { read -r nodes; read -r tree; } < $OUT/plan/best.txt
  $PY scripts/benchmark_engine.py --device cuda --dtype float32 --no-hf --commit $COMMIT --out-dir $OUT/plan \
    --configs k0,eagle3:3,eagle3:4,eagle3+tree:\$nodes --token-tree \"\$tree\" --concurrency 1,4 \
    --num-prompts 8 --max-tokens 64 --rounds 3"

step checkpoints "random checkpoints (those not made yet)" 90 bash -ec "
  [ -f $MODELS/llama-1b/config.json ] ||
    $PY scripts/make_random_model.py --preset llama-1b --vocab-size 128256 --out $MODELS/llama-1b
  [ -f $MODELS/llama-125m/config.json ] ||
    $PY scripts/make_random_model.py --preset llama-125m --vocab-size 128256 --out $MODELS/llama-125m
  [ -f $MODELS/llama-1b-eagle3/config.json ] ||
    $PY scripts/make_random_model.py --head eagle3 --target $MODELS/llama-1b --out $MODELS/llama-1b-eagle3
  [ -f $MODELS/llama-1b-mlp/config.json ] ||
    $PY scripts/make_random_model.py --head mlp_speculator --n-predict 3 --target $MODELS/llama-1b --out $MODELS/llama-1b-mlp"

RANDOM_PAIR=(--device cuda --dtype bfloat16 --target "$MODELS/llama-1b" --draft "$MODELS/llama-125m"
  --eagle3 "$MODELS/llama-1b-eagle3" --mlp-speculator "$MODELS/llama-1b-mlp" --prompts random
  --synthetic-acceptance-rate "$RATE" --commit "$COMMIT")
step graphs "1B, CUDA graphs" 180 $PY scripts/benchmark_engine.py "${RANDOM_PAIR[@]}" --cuda-graphs on \
  --configs k0,draft_model:4,eagle3:4,mlp_speculator:3 --concurrency 1,4 \
  --num-prompts 16 --max-tokens 64 --rounds ${ROUNDS:-2} --out-dir "$OUT/1b"

step profile "1B, each propose and verify of EAGLE-3 k 4 at four streams timed apart" 90 $PY scripts/profile_steps.py \
  --target "$MODELS/llama-1b" --eagle3 "$MODELS/llama-1b-eagle3" --method eagle3 --k 4 --concurrency 4 \
  --device cuda --dtype bfloat16 --synthetic-acceptance-rate "$RATE"

step eager "1B, eager" 90 $PY scripts/benchmark_engine.py "${RANDOM_PAIR[@]}" --cuda-graphs off --no-hf \
  --configs k0,eagle3:4 --concurrency 1 --num-prompts 8 --max-tokens 64 --rounds 1 \
  --out-dir "$OUT/1b-eager"

echo "=== done, status $status" | tee -a "$OUT/run.log"
exit $status
