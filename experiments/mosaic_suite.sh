#!/bin/bash
# The Mosaic GPU attention kernels on one GPU, in one call of the device tool: the GPU tests
# (log: $OUT/mosaic_tests.log), then experiments.kernel_bench with the mosaic variants beside
# flash3 in the same run ($OUT/kernel_bench_mosaic.{json,md}), then a summary.
# Run from the repository root (or a copy of it):  OUT=/tmp/out bash experiments/mosaic_suite.sh
# Environment: BACKENDS, WORKLOADS (kernel_bench lists), TESTS=0 skips the tests, TEST_K (a pytest
# -k expression, e.g. "kernels_match and fused"), ROWS1_WORKLOADS (also run those with
# --row-multiple 1: buffers ending at the last task instead of the data plane's 128-row multiples).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/mosaic_out}
mkdir -p "$OUT"
WHL=.whl; [ -d "$WHL" ] || WHL=../.whl  # wheels the GPU image lacks (flash-attn3-jax)
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
BACKENDS=${BACKENDS:-mosaic,mosaic:two-kernel,flash3}
WORKLOADS=${WORKLOADS:-dense-4096,dense-16384,ca-s128,ca-s512,ca-s4096}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "commit: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
# Smoke first, each kernel alone under a short timeout, so a hang names its kernel.
timeout "${SMOKE_TIMEOUT:-120}" env JAX_PLATFORMS=cuda python3 - <<'PY' 2>&1 | grep -v Warning | tail -8 | tee "$OUT/smoke.log"
import time, jax, jax.numpy as jnp
from custom_ops import mosaic_attention as ma
T, H, K, D = 1024, 4, 2, 128
q = jax.random.normal(jax.random.key(0), (T, H, D), jnp.bfloat16)
k = jax.random.normal(jax.random.key(1), (T, K, D), jnp.bfloat16)
cu = jnp.asarray([0, 300, 300, 1000], jnp.int32)
ref = ma.mosaic_attention_reference(*(x.astype(jnp.float32) for x in (q, k, k)), cu, cu)
def grad(bs):
  return jax.grad(lambda q, k, v: jnp.sum(ma.mosaic_attention(
      q, k, v, cu, cu, block_sizes=bs)[0].astype(jnp.float32)), (0, 1, 2))
for name, fn in [("fwd", lambda q, k, v: ma.mosaic_attention(q, k, v, cu, cu)),
                 ("fwd+bwd one kernel", grad(ma.BlockSizes())),
                 ("fwd+bwd two kernels", grad(ma.BlockSizes(fused_bwd=False))),
                 ("fwd+bwd gather", grad(ma.BlockSizes(fused_bwd=False, dkv_in_place=False)))]:
  t = time.time()
  out = jax.block_until_ready(jax.jit(fn)(q, k, k))
  print(f"smoke {name}: ran in {time.time() - t:.1f} s", flush=True)
  if name == "fwd":
    err = jnp.linalg.norm(out[0].astype(jnp.float32) - ref[0]) / jnp.linalg.norm(ref[0])
    print(f"smoke fwd: rel err {float(err):.2e}", flush=True)
print("smoke ok")
PY
grep -q "smoke ok" "$OUT/smoke.log" || { echo "smoke failed: no tests, no benchmark"; exit 1; }
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-200}" env JAX_PLATFORMS=cuda python3 -m pytest -q -s -rs \
    tests/test_mosaic_attention.py ${TEST_K:+-k "$TEST_K"} 2>&1 | tee "$OUT/mosaic_tests.log" | grep -v "^$" | tail -25
fi
timeout "${BENCH_TIMEOUT:-400}" python3 -m experiments.kernel_bench \
  --out "$OUT/kernel_bench_mosaic.json" --kernels "$BACKENDS" --workloads "$WORKLOADS" \
  --child-timeout-s "${CHILD_TIMEOUT:-120}" > "$OUT/kernel_bench_mosaic.log" 2>&1
echo "kernel_bench exit $?"
grep -i "error" "$OUT/kernel_bench_mosaic.log" | cut -c1-600 | tail -6
sed -n '/^TFLOP/,/^Output/p' "$OUT/kernel_bench_mosaic.md" 2>/dev/null
if [ -n "${ROWS1_WORKLOADS:-}" ]; then  # the same tables in buffers ending at the last task
  timeout "${BENCH_TIMEOUT:-400}" python3 -m experiments.kernel_bench --row-multiple 1 \
    --out "$OUT/kernel_bench_mosaic_rows1.json" --kernels "$BACKENDS" \
    --workloads "$ROWS1_WORKLOADS" --child-timeout-s "${CHILD_TIMEOUT:-120}" \
    > "$OUT/kernel_bench_mosaic_rows1.log" 2>&1
  sed -n '/^TFLOP/,/^Output/p' "$OUT/kernel_bench_mosaic_rows1.md" 2>/dev/null
fi
