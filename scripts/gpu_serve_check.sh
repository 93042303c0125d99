#!/usr/bin/env bash
# Serve the repository on a GPU machine with CUDA and torch but no tritonserver (the lent machines'
# image), from the bundle scripts/gpu_bundle.sh packed, and measure it: one call of a few minutes.
#
#   bash scripts/gpu_serve_check.sh        # after scripts/gpu_bundle.sh here, with .gpuserve/ carried
#
# 1. a server venv (VENV, default /tmp/specdec-serve-venv) over the machine's python3, so it sees its
#    torch: the bundled tritonserver and numpy 1.26 (Triton 2.51's stub hands BYTES tensors over
#    corrupted under numpy 2). Packages of that image built against numpy 2 (scikit-learn, scipy, ...)
#    are hidden from the server's processes, or transformers fails to import GenerationMixin under 1.26.
#    The client's packages go into python3 itself, which runs the benchmark with its own numpy;
# 2. random-weight checkpoints of Llama-3.2-1B's shape (128k vocabulary), its draft, an EAGLE-3 head and
#    a 3-stage MLP speculator;
# 3. the served benchmark: k = 0 against EAGLE-3 and the draft model (METHODS, KS) on one server per method
#    (METHODS=eagle3+beside,mlp_speculator+beside,eagle3,draft_model BENCH_SECONDS=480 adds the heads in
#    target_verifier's process; a 3-stage random MLP speculator, so KS at most 3).
# Results go to OUT_DIR (default $OUT/gpu-served, or runs/gpu-served): the JSON, its log, the servers' logs.
# COMMIT, where set, is the commit the JSON records (a copy of the checkout may carry no .git, or a stale one).
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpuserve
OUT_DIR=${OUT_DIR:-${OUT:-runs}/gpu-served}  # under $OUT where a device call collects it
MODELS=${MODELS:-/tmp/specdec-random}
export VENV=${VENV:-/tmp/specdec-serve-venv}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
HIDDEN_MODULES='"sklearn", "scipy", "pandas", "pyarrow", "numba", "jax", "jaxlib", "cupy", "tensorflow", "flax",
  "torchvision", "torchaudio", "cv2", "h5py", "matplotlib", "skimage", "statsmodels", "seaborn", "onnxruntime",
  "sentence_transformers", "timm", "peft", "tensorstore", "xarray", "numpyro"'
[[ -f "$BUNDLE/tritonserver.tar.xz" ]] || { echo "gpu_serve_check.sh: no $BUNDLE/tritonserver.tar.xz (run scripts/gpu_bundle.sh first)" >&2; exit 1; }
mkdir -p "$OUT_DIR/logs" "$MODELS"
start=$(date +%s)
elapsed() { echo "[+$(( $(date +%s) - start ))s]"; }

echo "=== server venv $VENV $(elapsed)"
base_site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -m venv --without-pip "$VENV"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$base_site')" > "$site/zz-base-site.pth"  # after the venv's own numpy
echo "$PWD" > "$site/specdec-checkout.pth"
echo "import sys; [sys.modules.setdefault(m, None) for m in ($HIDDEN_MODULES)]" | tr -d '\n' > "$site/00-hide-numpy2-builds.pth"
tar xJf "$BUNDLE/tritonserver.tar.xz" -C "$site"
tar xJf "$BUNDLE/numpy.tar.xz" -C "$site"
for wheel in "$BUNDLE"/wheels/*.whl; do  # replace the image's versions of these in python3 itself
    name=$(basename "$wheel" | cut -d- -f1)
    rm -rf "$base_site/$name" "$base_site"/"$name"-*.dist-info
    [[ $name == protobuf ]] && rm -rf "$base_site/google/protobuf"
    [[ $name == python_rapidjson ]] && rm -rf "$base_site"/rapidjson*
    python3 -m zipfile -e "$wheel" "$base_site"
done
echo "$PWD" > "$base_site/specdec-checkout.pth"
"$VENV/bin/python" -c "import numpy, torch, transformers, specdec_triton.model_stages
from transformers import GenerationMixin
print('server venv: numpy', numpy.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 1
python3 -c "import numpy, tritonclient.grpc.aio, bench; print('client: numpy', numpy.__version__)" || exit 1

echo "=== checkpoints in $MODELS $(elapsed)"
[[ -f $MODELS/llama-1b-eagle3/config.json ]] || timeout 120 bash -c "
  python3 scripts/make_random_model.py --preset llama-1b --vocab-size 128256 --out $MODELS/llama-1b &&
  python3 scripts/make_random_model.py --preset llama-125m --vocab-size 128256 --out $MODELS/llama-125m &&
  python3 scripts/make_random_model.py --head eagle3 --target $MODELS/llama-1b --out $MODELS/llama-1b-eagle3" \
  > "$OUT_DIR/logs/checkpoints.log" 2>&1 || { tail -5 "$OUT_DIR/logs/checkpoints.log"; exit 1; }
[[ -f $MODELS/llama-1b-mlp/config.json ]] || timeout 90 python3 scripts/make_random_model.py --head mlp_speculator \
  --n-predict 3 --target "$MODELS/llama-1b" --out "$MODELS/llama-1b-mlp" >> "$OUT_DIR/logs/checkpoints.log" 2>&1 ||
  { tail -5 "$OUT_DIR/logs/checkpoints.log"; exit 1; }

echo "=== served benchmark $(elapsed)"
timeout "${BENCH_SECONDS:-300}" python3 scripts/benchmark.py --target "$MODELS/llama-1b" --draft "$MODELS/llama-125m" \
  --eagle3 "$MODELS/llama-1b-eagle3" --mlp-speculator "$MODELS/llama-1b-mlp" \
  --methods "${METHODS:-eagle3,draft_model}" --ks "${KS:-3}" --concurrency "${CONCURRENCY:-1,4}" \
  --num-prompts 8 --max-tokens 64 --rounds "${ROUNDS:-2}" --no-hf --synthetic-acceptance-rate 0.7 \
  ${COMMIT:+--commit "$COMMIT"} --note "tritonserver 2.51 from the nvidia-pytriton wheel in a numpy 1.26 venv (scripts/gpu_serve_check.sh)" \
  --out-dir "$OUT_DIR" --log-dir "$OUT_DIR/logs" 2>&1 | grep -v '%|' | tee "$OUT_DIR/benchmark.log"
status=${PIPESTATUS[0]}
echo "=== done, exit $status $(elapsed)"
exit "$status"
