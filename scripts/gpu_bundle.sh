#!/usr/bin/env bash
# Pack what a served run needs on a GPU machine that has CUDA and torch but no tritonserver and no
# network (the lent machines' image): run here, on a machine with this checkout's .venv (scripts/setup.sh),
# then carry .gpuserve/ to that machine and run scripts/gpu_serve_check.sh there.
#
#   scripts/gpu_bundle.sh [PYTHON_VERSION]     # default 3.12, the version of the GPU machine's python3
#
# Writes .gpuserve/ (git-ignored, ~30 MB):
#   tritonserver.tar.xz  the nvidia-pytriton wheel's server, Python backend, the stub for PYTHON_VERSION and
#                        the bundled libraries they load (ldd), laid out as site-packages;
#   numpy.tar.xz         numpy 1.26 for PYTHON_VERSION: Triton 2.51's stub is built against numpy 1.x;
#   wheels/              the client's packages that image lacks: tritonclient, python-rapidjson, protobuf.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYVER="${1:-3.12}"
CP="cp${PYVER/./}"
OUT="$ROOT/.gpuserve"
PY="$ROOT/.venv/bin/python"
SITE="$("$PY" -c 'import pytriton, os; print(os.path.dirname(os.path.dirname(pytriton.__file__)))')"
DIST="$SITE/pytriton/tritonserver"
[[ -x "$DIST/python_backend_stubs/$PYVER/triton_python_backend_stub" ]] ||
    { echo "gpu_bundle.sh: the nvidia-pytriton wheel in .venv has no stub for Python $PYVER" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT/wheels" "$work/site/pytriton" "$work/site/nvidia_pytriton.libs"

echo "[bundle] tritonserver from $SITE (stub for Python $PYVER)"
files=(bin/tritonserver backends/python/libtriton_python.so backends/python/triton_python_backend_utils.py
       caches/local/libtritoncache_local.so "python_backend_stubs/$PYVER/triton_python_backend_stub")
for f in "${files[@]}"; do
    mkdir -p "$work/site/pytriton/tritonserver/$(dirname "$f")"
    cp "$DIST/$f" "$work/site/pytriton/tritonserver/$f"
done
: > "$work/site/pytriton/__init__.py"  # serve.sh imports pytriton only to find the server beside it
libs="$(for f in "${files[@]}"; do [[ "$f" == *.py ]] || LD_LIBRARY_PATH="$SITE/nvidia_pytriton.libs" ldd "$DIST/$f"; done |
        awk '/nvidia_pytriton.libs/ {print $3}' | sort -u)"
for lib in $libs; do cp "$lib" "$work/site/nvidia_pytriton.libs/"; done
# ICU's 29 MB data library is loaded (through libxml2) but never read on a server's path: an empty
# library with the same name and data symbol keeps the bundle within what a device call carries.
for icu in "$work"/site/nvidia_pytriton.libs/libicudata-*.so.*; do
    [[ -e "$icu" ]] && command -v gcc > /dev/null || continue
    symbol="$(nm -D --defined-only "$icu" | awk '/icudt[0-9]+_dat/ {print $3}')"
    echo "const char ${symbol}[16] = {0};" > "$work/icu.c"
    gcc -shared -o "$icu" -Wl,-soname,"$(basename "$icu")" "$work/icu.c"
done
# The server's library and binary carry their symbol tables (10 MB and 5 MB): a device call carries at most
# 64 MiB with the checkout, and its shipped models take half of that. The backend and stub keep theirs.
! command -v strip > /dev/null || strip --strip-unneeded "$work"/site/nvidia_pytriton.libs/libtritonserver-*.so "$work/site/pytriton/tritonserver/bin/tritonserver"
echo "[bundle] $(echo "$libs" | wc -l) bundled libraries; compressing (a minute) ..."
tar cf - -C "$work/site" . | xz -9e -T0 > "$OUT/tritonserver.tar.xz"

echo "[bundle] numpy 1.26 and the client's wheels for $CP"
download() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$1" "$2"
}
download "$work/numpy" "numpy==1.26.4"
mkdir -p "$work/numpy/site"
"$PY" -m zipfile -e "$work"/numpy/numpy-*.whl "$work/numpy/site"
find "$work/numpy/site" -type d -name tests -prune -exec rm -rf {} +  # numpy's own test suite, never imported here
tar cf - -C "$work/numpy/site" . | xz -9e -T0 > "$OUT/numpy.tar.xz"
rm -f "$OUT"/wheels/*.whl
for req in "tritonclient[grpc]==$("$PY" -c 'import importlib.metadata as m; print(m.version("tritonclient"))')" \
           "python-rapidjson" "protobuf>=5,<7"; do
    download "$OUT/wheels" "$req"
done
du -sh "$OUT"/*.tar.xz "$OUT/wheels"
echo "[bundle] done: carry .gpuserve (run: bash scripts/gpu_serve_check.sh)"
