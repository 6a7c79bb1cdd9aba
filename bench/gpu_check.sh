#!/usr/bin/env bash
# The GPU check, in one run of 4-7 minutes on one CUDA GPU: the tests marked cuda, then
# bench/bench_gpu.py (YOLOv5n and YOLOv5n-seg trained on coco128 at 640 with AMP, validated and
# run by predict.py), then the whole test suite on that machine. Logs and the table go to $OUT.
#   OUT=/tmp/gpu bash bench/gpu_check.sh
# It needs ../shared (data and fixtures) beside the repository, or a copy in ./shared; and
# pycocotools for the test suite (wheels in ./.whl are installed if it is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=$(command -v python3 || command -v python)
[ -e ../shared ] || [ ! -d shared ] || ln -s "$PWD/shared" ../shared  # a device copy
if ! $PY -c "import pycocotools" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $PY -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)"
    nproc
} >"$OUT/env.txt" 2>&1
timeout "${TESTS_S:-180}" $PY -m pytest -q -s -m cuda tests/test_cuda.py 2>&1 \
    | grep -v "^epoch " | tee "$OUT/cuda_tests.log"
bench=(--out "$OUT" --epochs "${EPOCHS:-5}" --device "${DEVICE:-0}" --imgsz "${IMGSZ:-640}")
timeout "${BENCH_S:-200}" $PY bench/bench_gpu.py "${bench[@]}" 2>&1 \
    | tee "$OUT/bench_gpu.log" | grep -v "^epoch "
suite=(-v -rfE -m "not cuda" -p no:cacheprovider)  # in parallel where pytest-xdist is installed
$PY -c "import xdist, pytest_timeout" 2>/dev/null && suite+=(-n "${WORKERS:-8}" --timeout 90)
timeout "${SUITE_S:-120}" $PY -m pytest "${suite[@]}" >"$OUT/suite.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | tail -40
