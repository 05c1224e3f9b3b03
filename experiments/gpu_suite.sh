#!/usr/bin/env bash
# The GPU measurements of this repository's results/, in one call on a 2-GPU H200 host:
#   bash experiments/gpu_suite.sh OUTDIR
# Needs the wheels the GPU image lacks in .whl/ (flash-attn3-jax, ml_collections, tensorboardX).
# Every stage has its own time limit; a stage that fails or times out is logged and the rest run.
set -u
FINAL=${1:?usage: gpu_suite.sh OUTDIR}
OUT=/tmp/gpu_suite  # everything lands here, then one archive in OUTDIR (few files travel back)
mkdir -p "$OUT" "$FINAL"
trap 'tar -C /tmp -czf "$FINAL/gpu_suite.tgz" gpu_suite' EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
}
nvidia-smi -L
E2E="--layers 2 --steps 6 --warmup 2 --extra attention.distca.kernel=flash3 --extra attention.baselines.kernel=flash3"
case "${SUITE:-all}" in
  first|all)
stage dispatch 150 python3 experiments/dispatch_bench.py --kernel flash3 --iters 5 --batches 2 --out "$OUT/dispatch_bench"
stage aot 60 python3 experiments/aot_memory.py --config configs/gpu_bench.py --devices 2 --out "$OUT/aot_gpu_bench_2gpu.json"
;;& second|all)
stage e2e_64k 200 python3 experiments/e2e_bench.py --backends packed_dp,distca,cp,wlb --workloads pretrain,prolong --tokens 65536 $E2E --extra attention.baselines.cp_size=2 --out "$OUT/e2e_64k"
stage e2e_64k_wlb_dp2 70 python3 experiments/e2e_bench.py --backends wlb --workloads pretrain,prolong --tokens 65536 $E2E --extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2 --out "$OUT/e2e_64k_wlb_dp2"
stage cost_table 60 env CUDA_VISIBLE_DEVICES=0 python3 experiments/cost_table.py --backend flash3 --repeats 2 --tokens 65536 --q-lens 128,512,2048,8192 --kv-lens 4096,16384,65536,131072 --out "$OUT/cost_table_flash3.json"
stage e2e_pingpong 120 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 32768 --rows-per-rank 2 --nano-batches 1,2 $E2E --out "$OUT/e2e_pingpong"
stage e2e_128k 100 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 $E2E --out "$OUT/e2e_128k"
;;
esac
