#!/bin/bash
# The Mosaic GPU attention kernels on one GPU, in one call of the device tool: the GPU tests
# (log: $OUT/mosaic_tests.log), then experiments/kernel_bench.py with the mosaic variants beside
# flash3 (and pallas) in the same run ($OUT/kernel_bench_mosaic.{json,md}), then a summary.
# Run from the repository root (or a copy of it):  OUT=/tmp/out bash experiments/mosaic_suite.sh
# Environment: BACKENDS, WORKLOADS (kernel_bench lists), TESTS=0 skips the tests.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mosaic_out}
mkdir -p "$OUT"
if ls ../.whl/*.whl >/dev/null 2>&1; then  # wheels the GPU image lacks (flash-attn3-jax)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site ../.whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
BACKENDS=${BACKENDS:-mosaic,mosaic:nopp,flash3}
WORKLOADS=${WORKLOADS:-dense-4096,dense-16384,ca-s128,ca-s512,ca-s4096}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-240}" env JAX_PLATFORMS=cuda python3 -m pytest -q -s -rs \
    tests/test_mosaic_attention.py 2>&1 | tee "$OUT/mosaic_tests.log" | grep -v "^$" | tail -25
fi
timeout "${BENCH_TIMEOUT:-420}" python3 experiments/kernel_bench.py \
  --out "$OUT/kernel_bench_mosaic.json" --backends "$BACKENDS" --workloads "$WORKLOADS" \
  --child-timeout-s "${CHILD_TIMEOUT:-200}" > "$OUT/kernel_bench_mosaic.log" 2>&1
echo "kernel_bench exit $?"
grep -i "error" "$OUT/kernel_bench_mosaic.log" | cut -c1-600 | tail -6
sed -n '/^TFLOP/,/^Output/p' "$OUT/kernel_bench_mosaic.md" 2>/dev/null
