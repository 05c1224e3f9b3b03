#!/usr/bin/env bash
# Builds the side-stream copy's libraries into OUTDIR (default build/side_stream, from the
# repository root): libside_copy_cuda.so (nvcc, Hopper sm_90a) and libside_copy_cpu.so (g++).
#   bash custom_ops/side_stream/build.sh [OUTDIR] [cuda|cpu|all]
# PYTHON (default python3) names the interpreter whose jax provides the FFI headers.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-build/side_stream}
WHAT=${2:-all}
PY=${PYTHON:-python3}
INC=$("$PY" -c 'import jax.ffi; print(jax.ffi.include_dir())')
mkdir -p "$OUT"
if [[ $WHAT == cpu || $WHAT == all ]]; then
  g++ -std=c++17 -O2 -shared -fPIC -w -I"$INC" "$HERE/side_copy_cpu.cc" -o "$OUT/libside_copy_cpu.so"
  echo "built $OUT/libside_copy_cpu.so"
fi
if [[ $WHAT == cuda || $WHAT == all ]]; then
  nvcc -std=c++17 -w -gencode=arch=compute_90a,code=sm_90a -O3 -shared -Xcompiler -fPIC \
    -I"$INC" "$HERE/side_copy.cu" -o "$OUT/libside_copy_cuda.so"
  echo "built $OUT/libside_copy_cuda.so"
fi
