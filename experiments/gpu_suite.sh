#!/usr/bin/env bash
# The GPU tables of results/README.md, each stage writing the table's current name, in one call
# on a 2-GPU H200 host (run from the repository root):
#   bash experiments/gpu_suite.sh OUTDIR                 # every stage
#   SUITE=one bash experiments/gpu_suite.sh OUTDIR       # one group: one | two | derived | tests
#   SUITE=four-a bash experiments/gpu_suite.sh OUTDIR    # 4-GPU host: four-a | four-r1..r5 |
#                                                         # four-b | four-4d | four-f | four-f2 |
#                                                         # four-8b | four-8b-mfu | four-n1 |
#                                                         # four-n3 | four-base | four-x |
#                                                         # four-64k; four-trees (not in 'all');
#                                                         # four-n3x, four-n1p, four-keep,
#                                                         # four-n3w; not yet run: four-8b-xla,
#                                                         # four-deep-a, four-deep-b, four-lean;
#                                                         # one GPU: one-trees, one-defaults,
#                                                         # one-window, one-mosaic, one-house
#                                                         # (BEFORE=tree)
#                                                         # (not in 'all');
#                                                         # two GPUs: two-skip (not in 'all')
# Several groups in one call: SUITE=four-base,four-4d,four-x (run in that order). The 4-GPU tables
# of results/four/README.md in two calls of about 9 minutes each on 4 x H100:
# SUITE=four-base,four-4d,four-x and SUITE=four-n1,four-64k,four-n3; the 2 x 2 aborts' and the
# ping-pong shortfall's diagnostics in two more: SUITE=four-n3x (7 min) and SUITE=four-n1p (9 min).
# 'one': single-GPU tables (CUDA_VISIBLE_DEVICES=0); 'two': the 2-GPU tables; 'derived': tables
# computed from the e2e JSONs of 'two' (plot, per-batch bound); 'tests': the GPU-only tests.
# Needs the wheels the GPU image lacks in .whl/ (flash-attn3-jax, ml_collections, tensorboardX).
# Every stage has its own time limit; a stage that fails or times out is logged and the rest run.
set -u
FINAL=${1:?usage: gpu_suite.sh OUTDIR}
OUT=/tmp/gpu_suite  # everything lands here, then one archive in OUTDIR (few files travel back)
mkdir -p "$OUT" "$FINAL"
# One archive (<= 16 MiB comes back): logs, tables, reports; raw profiler traces stay behind.
# Re-packed after every stage, so a call stopped at its time limit still returns what finished.
pack() { tar -C /tmp --exclude='*.trace.json.gz' --exclude='*.xplane.pb' -czf "$FINAL/gpu_suite.tgz" gpu_suite; }
trap pack EXIT
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
  pack
}
nvidia-smi -L | tee "$OUT/gpus.txt"  # the GPUs' UUIDs: which host ran the call
ONE="env CUDA_VISIBLE_DEVICES=0"
E2E20="--layers 2 --steps 20 --warmup 2"  # gpu_bench defaults: flash3 kernels for every backend
# wlb's CP size and alpha: e2e_bench's default, choose_wlb on batches the run never times.
WLB=""
# Compiled programs persist across the suite's processes (Pretrain and ProLong share shapes).
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
# The faults' and multi-process runs' model: 2 layers small enough that a checkpoint of an
# interrupted step is quick (the tokens per GPU differ per stage).
SMALL_MODEL="--config.model.n_layers=2 --config.model.dim=2048 --config.model.mlp_dim=7168 --config.model.n_heads=16 --config.model.n_kv_heads=4 --config.model.vocab_size=32768"
# The multi-process stages' run: 10 steps of that model at 32K tokens per GPU, distca.
MP_T="python3 -m distca_jax.train --config configs/gpu_bench.py $SMALL_MODEL --config.tokens_per_rank=32768 --config.num_steps=10 --config.optim.warmup_steps=2 --config.log_every=1 --config.checkpoint_every=0 --config.tensorboard=False"
# Each process has its own time limit (85 s): a stage's limit ends only its shell, and a process
# left waiting on a lost peer (no watchdog) would keep its GPUs and port from the next stage.
mp() {  # mp NAME PROCS GPUS_PER_PROC: PROCS processes of $MP_T, workdir $OUT/mp_NAME
  local n=$2 g=$3 i
  for ((i = 0; i < n; i++)); do
    CUDA_VISIBLE_DEVICES=$(seq -s, $((i * g)) $((i * g + g - 1))) timeout -k 5 85 $MP_T --workdir "$OUT/mp_$1" \
      --coordinator_address=127.0.0.1:1235$n --num_processes=$n --process_id=$i > "$OUT/mp_$1_$i.log" 2>&1 &
  done
  wait
}
# $OUT/train_no_watchdog.py: the trainer with the watchdog's poll interval past the run (one
# heartbeat, then none), the control of the multi-process stages.
no_watchdog_script() {
  printf '%s\n' 'import runpy' 'from distca_jax import launch' \
    'init = launch.Watchdog.__init__  # poll_s past the run: one beat, then none' \
    'launch.Watchdog.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "poll_s": 1e9})' \
    'runpy.run_module("distca_jax.train", run_name="__main__")' > "$OUT/train_no_watchdog.py"
}
run_group() {
case "$1" in
  tests|all)
stage gpu_tests 150 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_ops.py -k "flash3 or hints or buckets"
;;& one|all)
stage kernel_bench 600 $ONE python3 -m experiments.kernel_bench --kernels mosaic,flash3 --workloads dense-4096,dense-16384,ca-s128,ca-s512,ca-s4096 --child-timeout-s 120 --out "$OUT/kernel_bench.json"
stage kernel_profile 300 $ONE python3 -m experiments.kernel_profile --workloads dense-16384,ca-s512,ca-s128 --out "$OUT/kernel_profile.json"
stage cost_table 120 $ONE python3 -m experiments.cost_table --kernel flash3 --repeats 2 --tokens 65536 --q-lens 128,512,2048,8192 --kv-lens 4096,16384,65536,131072 --out "$OUT/cost_table_flash3_h200.json"
stage flash3_grid_bench 150 $ONE python3 -m experiments.flash3_grid_bench --out "$OUT/flash3_grid_bench"
stage e2e_1gpu_64k 200 $ONE python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads prolong,pretrain --tokens 65536 --layers 2 --steps 6 --warmup 2 --out "$OUT/e2e_1gpu_64k"
stage e2e_1gpu_pingpong 240 $ONE python3 -m experiments.e2e_bench --backends packed_dp,distca --nano-batches 1,2 --workloads pretrain --tokens 65536 --rows-per-rank 2 --warmup 2 --steps 6 --layers 2 --out "$OUT/e2e_1gpu_pingpong"
;;& one-defaults)
# distca with every setting at its default on one GPU ('auto' -> 'remote', one server: no
# exchange kernel): the tests of tests/test_one_gpu.py, then the shipped GPU config for 6 steps.
stage one_gpu_defaults 420 $ONE env JAX_PLATFORMS=cuda python3 -m pytest -q -s -rA tests/test_one_gpu.py
stage one_gpu_smoke 200 $ONE python3 -m distca_jax.train --config configs/gpu_bench.py --workdir "$OUT/one_gpu_smoke" --config.num_steps=6 --config.log_every=1 --config.optim.warmup_steps=2 --config.tensorboard=False
;;& one-window)
# Sliding-window attention on one GPU: FA3 and our Mosaic kernel against the float64 oracle
# (tests/test_window_gpu.py), kernel_bench's windowed rows (about 9 minutes).
stage window_gpu_tests 150 $ONE env JAX_PLATFORMS=cuda python3 -m pytest -q -rA tests/test_window_gpu.py
# The Mosaic backend compiles every task-table shape: 10 of its 12 rows took 235 s on an H100.
stage kernel_bench_window 420 $ONE python3 -m experiments.kernel_bench --quick-windows --child-timeout-s 330 --out "$OUT/kernel_bench_window.json"
;;& one-mosaic)
# The Mosaic kernel's GPU tests (tests/test_mosaic_attention.py; 58 of its 72 took 165 s).
stage mosaic_gpu_tests 420 $ONE env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_mosaic_attention.py
;;& one-house)
# One GPU's step time before and after a change of the house: the same e2e run in BEFORE (a
# tree of the older commit: git archive COMMIT | tar -x -C .before, carried) and here, alternating.
for i in 1 2; do
  stage e2e_before_$i 180 $ONE env -C "${BEFORE:?set BEFORE=the older tree}" PYTHONPATH="/tmp/site:$(cd "$BEFORE" && pwd)" python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads pretrain --tokens 65536 --layers 2 --steps 6 --warmup 2 --out "$OUT/e2e_before_$i"
  stage e2e_after_$i 180 $ONE python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads pretrain --tokens 65536 --layers 2 --steps 6 --warmup 2 --out "$OUT/e2e_after_$i"
done
;;& two|all)
stage collective_bench 90 python3 -m experiments.collective_bench --out "$OUT/collective_bench"
stage dispatch_bench 150 python3 -m experiments.dispatch_bench --kernel flash3 --iters 20 --batches 2 --exchange-only --caps suggest --collective ppermute --out "$OUT/dispatch_bench"
stage aot_memory 60 python3 -m experiments.aot_memory --config configs/gpu_bench.py --devices 2 --out "$OUT/aot_gpu_bench_2gpu.json"
stage e2e_2gpu_128k 350 python3 -m experiments.e2e_bench --backends packed_dp,distca,wlb --workloads pretrain --tokens 131072 $E2E20 $WLB --variant signal@distca:backend.signal_only=true --profile --plan-stats --out "$OUT/e2e_2gpu_128k"
stage e2e_2gpu_128k_wlb 200 python3 -m experiments.e2e_bench --backends wlb --workloads pretrain --tokens 131072 $E2E20 $WLB --out "$OUT/e2e_2gpu_128k_wlb"
stage e2e_2gpu_prolong_128k 200 python3 -m experiments.e2e_bench --backends packed_dp,distca,wlb --workloads prolong --tokens 131072 $E2E20 $WLB --plan-stats --out "$OUT/e2e_2gpu_prolong_128k"
stage e2e_2gpu_64k 340 python3 -m experiments.e2e_bench --backends packed_dp,distca,wlb --workloads pretrain,prolong --tokens 65536 $E2E20 $WLB --plan-stats --out "$OUT/e2e_2gpu_64k"
;;& four-a)
# The exchange alone on real 4-server plans (ragged vs dense, XLA's default ragged path vs its
# one-shot peer kernel), then Pretrain 128K with each backend in its own process (the allocator
# peak is per process).
ONESHOT="--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true"
stage exchange_bench 300 python3 -m experiments.exchange_bench --workloads pretrain,prolong --tokens 131072 --batches 2 --iters 10 --collectives ragged,dense --xla-flags ";$ONESHOT" --out "$OUT/exchange_bench"
for b in packed_dp distca; do
  stage "e2e_4gpu_pretrain_128k_$b" 200 python3 -m experiments.e2e_bench --backends $b --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_128k_$b"
done
stage e2e_4gpu_pretrain_128k_distca_oneshot 200 env XLA_FLAGS="$ONESHOT" python3 -m experiments.e2e_bench --backends distca --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_128k_distca_oneshot"
;;& four-r1)
# The device-initiated exchange ('remote'): GPU tests, the exchange alone against 'dense' and a
# raw all-to-all, then Pretrain 64K with packed_dp, distca ('auto') and distca over 'remote'.
stage gpu_tests_remote 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -x tests/test_remote_exchange.py
stage exchange_bench_remote 170 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 2 --iters 10 --collectives remote,dense --out "$OUT/exchange_bench_remote"
stage e2e_4gpu_pretrain_64k_remote 250 python3 -m experiments.e2e_bench --backends packed_dp,distca --variant remote@distca:attention.distca.collective=remote --workloads pretrain --tokens 65536 --layers 2 --steps 10 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_64k_remote"
;;& four-r2)
# The 'remote' kernel's grid (CTAs x chunk lines) on one real plan, then Pretrain 128K with the
# defaults ('auto' = remote, memory_mode 'auto'), each backend in its own process.
stage exchange_bench_grid 170 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 1 --iters 10 --collectives remote,dense --remote-grids 132x64,264x128,264x64,396x64 --out "$OUT/exchange_bench_grid"
for b in packed_dp distca; do
  stage "e2e_4gpu_pretrain_128k_$b" 200 python3 -m experiments.e2e_bench --backends $b --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_128k_$b"
done
;;& four-r3)
# The 'remote' kernel with SMEM slots (tests, grid sweep), Pretrain 128K distca in 'resend', and
# ProLong 64K packed_dp vs distca ('auto' = remote).
stage gpu_tests_remote 120 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_remote_exchange.py
stage exchange_bench_grid 150 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 1 --iters 10 --caps-from-batches 4 --collectives remote,dense --remote-grids 132x128x1,132x64,264x64,264x128,132x256 --out "$OUT/exchange_bench_grid"
stage e2e_4gpu_pretrain_128k_distca_resend 150 python3 -m experiments.e2e_bench --backends distca --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --extra attention.distca.memory_mode=resend --out "$OUT/e2e_4gpu_pretrain_128k_distca_resend"
stage e2e_4gpu_prolong_64k 180 python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads prolong --tokens 65536 --layers 2 --steps 10 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_prolong_64k"
;;& four-r4)
# The 'remote' kernel's grid on one real plan (random rows made on the devices), then Pretrain
# 128K with the defaults (memory_mode 'auto' keeps a spare) against packed_dp, each in its own
# process, and ProLong 128K.
stage exchange_bench_grid 120 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 1 --iters 10 --caps-from-batches 4 --collectives remote,dense --remote-grids 132x128x1,132x64,264x64,264x128 --out "$OUT/exchange_bench_grid"
for b in packed_dp distca; do
  stage "e2e_4gpu_pretrain_128k_$b" 140 python3 -m experiments.e2e_bench --backends $b --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_128k_$b"
done
stage e2e_4gpu_prolong_128k 150 python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads prolong --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_prolong_128k"
;;& one-trees)
# Issue 39's gate: one-GPU step time of the trees before (b1678cf^1) and after (b170395) the
# plan-boundary refactor, same batches, old and new alternating (experiments/compare_trees.sh).
# Export both trees before the call and carry them with the wheels (carry: .whl, .carry):
#   for t in old:b1678cf^1 new:b170395; do mkdir -p .carry/${t%%:*}; git archive ${t#*:} \
#     distca_jax custom_ops configs experiments data | tar -x -C .carry/${t%%:*}; done
stage compare_trees_39 580 env CUDA_VISIBLE_DEVICES=0 NEW_TREE=.carry/new bash experiments/compare_trees.sh .carry/old "$OUT/compare_trees_39"
;;& two-skip)
# A batch whose plans move no row runs the step's branch without the exchange (packed_dp's
# attention; trainer.make_train_step): the tree before (.carry/old, an export of
# the commit before it: git archive REV distca_jax custom_ops configs experiments data | tar -x
# -C .carry/old; carry .whl and .carry) against this one on the same batches, 2 GPUs, 128K per
# GPU, 2 layers, one workload per call (WORKLOAD, default prolong): the old distca, then
# packed_dp, distca and distca with the gate at min_gain 0.06. About 80 s per run on 2 x H100.
W=${WORKLOAD:-prolong}
SKIP="--workloads $W --tokens 131072 --layers 2 --steps 6 --warmup 2 --plan-stats"
stage "e2e_2gpu_skip_old_$W" 170 bash -c "cd .carry/old && PYTHONPATH=/tmp/site:\$PWD python3 -m experiments.e2e_bench --backends distca $SKIP --out $OUT/e2e_2gpu_skip_old_$W"
stage "e2e_2gpu_skip_new_$W" 400 python3 -m experiments.e2e_bench --backends packed_dp,distca --variant gate06@distca:attention.distca.min_gain=0.06 $SKIP --out "$OUT/e2e_2gpu_skip_new_$W"
;;& four-trees)
# Two trees on the same batches, 4 GPUs, 128K per GPU, 2 layers, both workloads: the tree in
# .carry/old (an export of an earlier commit: git archive REV distca_jax custom_ops configs
# experiments data | tar -x -C .carry/old; carry .whl and .carry) runs packed_dp and distca, then
# this tree runs them (old and new in turn per backend, each in its own process: the allocator
# peak is per process). First use: the masking and fills kept in the layer loop (896cb7a,
# a50bd43) against 63a9720. About 9 minutes on 4 x H100.
T128="--workloads pretrain,prolong --tokens 131072 --layers 2 --steps 6 --warmup 2 --plan-stats"
for b in distca packed_dp; do
  stage "e2e_4gpu_trees_old_$b" 140 bash -c "cd .carry/old && PYTHONPATH=/tmp/site:\$PWD python3 -m experiments.e2e_bench --backends $b $T128 --out $OUT/e2e_4gpu_trees_old_$b"
  stage "e2e_4gpu_trees_new_$b" 140 python3 -m experiments.e2e_bench --backends $b $T128 --out "$OUT/e2e_4gpu_trees_new_$b"
done
;;& four-r5)
# Pretrain 128K with CUDA's stream-ordered allocator (XLA's BFC allocator needs the step's
# temporaries as one contiguous block; buffers made during a step split it): distca then
# packed_dp, each in its own process.
for b in distca packed_dp; do
  stage "e2e_4gpu_pretrain_128k_async_$b" 120 env TF_GPU_ALLOCATOR=cuda_malloc_async python3 -m experiments.e2e_bench --backends $b --workloads pretrain --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pretrain_128k_async_$b"
done
;;& four-n1)
# Ping-pong vs single stream on both workloads, 2 rows of 32K per GPU (at 2 x 64K distca with
# ping-pong needs 75.07 GiB of an H100's 72.84). Needs about 240 s on 4 x H100, over 270 s on
# 4 x H200 (s6: the limit stopped the last run).
stage e2e_4gpu_pingpong 360 python3 -m experiments.e2e_bench --backends packed_dp,distca --nano-batches 1,2 --workloads pretrain,prolong --tokens 32768 --rows-per-rank 2 --layers 2 --steps 6 --warmup 2 --out "$OUT/e2e_4gpu_pingpong"
;;& four-keep)
# 'keep' against 'resend' at 4 servers, 128K per GPU, Pretrain, one process, the same batches:
# 'keep' stacks the server's Q, O, K and V buffers in the layer scan (5.5 GB per layer each way,
# results/four/README.md s7), 'resend' moves them again in the backward.
stage e2e_4gpu_keep_resend 260 python3 -m experiments.e2e_bench --backends packed_dp,distca --variant resend@distca:attention.distca.memory_mode=resend --extra attention.distca.memory_mode=keep --workloads pretrain --tokens 131072 --layers 2 --steps 6 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_keep_resend"
;;& four-n1p)
# Profiles of the ping-pong step against its single stream, ProLong 2 x 32K, distca (s7: its
# ping-pong 1.1% slower than its single stream) and packed_dp, one more step each; then
# ping-pong with 'heavy_first' rows. About 9 minutes.
stage e2e_4gpu_pingpong_profile 300 python3 -m experiments.e2e_bench --backends packed_dp,distca --nano-batches 1,2 --workloads prolong --tokens 32768 --rows-per-rank 2 --layers 2 --steps 6 --warmup 2 --profile --out "$OUT/e2e_4gpu_pingpong_profile"
# Ping-pong with each rank's rows heaviest first (attention.distca.nano_rows): its plans move
# less per step (experiments.replan); its step time against 'given', the same batches.
stage e2e_4gpu_pingpong_heavy_first 240 python3 -m experiments.e2e_bench --backends packed_dp,distca --nano-batches 2 --variant hf@distca:attention.distca.nano_rows=heavy_first --workloads pretrain,prolong --tokens 32768 --rows-per-rank 2 --layers 2 --steps 6 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_pingpong_heavy_first"
;;& four-f2)
# The faults whose GPU rows predate the supervisor keeping JAX's task-watch warning (divergence,
# read-only workdir) and SIGINT to every process once more.
stage faults_4gpu_rerun 200 python3 -m experiments.peer_death --procs 4 --gpu --faults diverge readonly int:all --timeout 60 --config configs/gpu_bench.py --out "$OUT/faults_4gpu_rerun" -- $SMALL_MODEL --config.tokens_per_rank=16384
;;& four-base)
# Issue 36's table: the four strategies at 128K per GPU on the same batches, one process per
# backend (the allocator peak is per process), both workloads in each: packed_dp, wlb at the
# configuration its backend chooses (fastest first among those whose compiled step fits the
# device; cp likewise its CP size), distca at its defaults; wlb and distca also profile one more step.
B128="--workloads pretrain,prolong --tokens 131072 --layers 2 --steps 6 --warmup 2"
stage e2e_4gpu_128k_packed_dp 110 python3 -m experiments.e2e_bench --backends packed_dp $B128 --out "$OUT/e2e_4gpu_128k_packed_dp"
stage e2e_4gpu_128k_wlb 190 python3 -m experiments.e2e_bench --backends wlb $B128 --profile --out "$OUT/e2e_4gpu_128k_wlb"
stage e2e_4gpu_128k_distca 160 python3 -m experiments.e2e_bench --backends distca $B128 --profile --plan-stats --out "$OUT/e2e_4gpu_128k_distca"
stage e2e_4gpu_128k_cp 120 python3 -m experiments.e2e_bench --backends cp $B128 --out "$OUT/e2e_4gpu_128k_cp"
;;& four-n3)
# Multi-process on one host: 1 x 4, 4 x 1 and 2 x 2 processes x GPUs train the same 10 steps of
# a small model (losses compared from metrics.jsonl; results/four/README.md ran these commands
# one by one). Faults under NCCL: stage four-f.
stage mp_1x4 110 $MP_T --workdir "$OUT/mp_1x4"
stage mp_4x1 110 bash -c "$(declare -f mp); MP_T='$MP_T' OUT='$OUT'; mp 4x1 4 1"
# 2 x 2 aborts in about 4 of 10 attempts on 4 x H200 (results/four/README.md, s6-s7): three
# attempts, each in its own workdir (an abort's dump lands in its crash/ folder).
for a in 1 2 3; do
  stage "mp_2x2_$a" 110 bash -c "$(declare -f mp); MP_T='$MP_T' OUT='$OUT'; mp 2x2_$a 2 2"
done
stage mp_losses 30 python3 -c "
import json, os
def losses(k):
  f = f'$OUT/mp_{k}/metrics.jsonl'
  return [json.loads(x)['loss'] for x in open(f) if 'loss' in x] if os.path.exists(f) else []
l = {k: losses(k) for k in ('1x4', '4x1', '2x2_1', '2x2_2', '2x2_3')}
print(json.dumps(l))
for k in ('4x1', '2x2_1', '2x2_2', '2x2_3'):
  full = len(l[k]) == len(l['1x4']) > 0
  r = max((abs(a - b) / abs(a) for a, b in zip(l['1x4'], l[k])), default=float('nan'))
  print(k, 'steps', len(l[k]), 'of', len(l['1x4']), 'max relative difference', r if full else 'n/a')"
;;& four-n3x)
# Where the 2 x 2 aborts come from: 2 x 2 with packed_dp (no exchange), 1 x 4 with the 'dense'
# exchange (the multi-process exchange in one process), 2 x 2 distca under glibc's heap checks
# and NCCL's warnings, and 2 x 2 distca without the watchdog's polls of the coordination service
# (a thread beside XLA's; the run's script sets its poll interval past the run); three attempts
# each (the aborts came in about 4 of 10). About 7 minutes.
no_watchdog_script
for a in 1 2 3; do
  stage "mpx_2x2_no_watchdog_$a" 90 bash -c "$(declare -f mp); MP_T='${MP_T/-m distca_jax.train/$OUT/train_no_watchdog.py}' OUT='$OUT'; mp x2x2_no_watchdog_$a 2 2"
  stage "mpx_2x2_packed_dp_$a" 90 bash -c "$(declare -f mp); MP_T='$MP_T --config.attention.backend=packed_dp' OUT='$OUT'; mp x2x2_packed_dp_$a 2 2"
  stage "mpx_1x4_dense_$a" 90 $MP_T --config.attention.distca.collective=dense --workdir "$OUT/mp_x1x4_dense_$a"
  stage "mpx_2x2_checked_$a" 90 env MALLOC_CHECK_=3 NCCL_DEBUG=WARN bash -c "$(declare -f mp); MP_T='$MP_T' OUT='$OUT'; mp x2x2_checked_$a 2 2"
done
stage mpx_summary 30 bash -c "for d in $OUT/mp_x*/; do echo \"\$(basename \$d): \$(grep -c loss \$d/metrics.jsonl 2>/dev/null) logged losses, \$(ls \$d/crash 2>/dev/null | wc -l) crash dumps\"; done"
;;& four-x)
# The exchange alone on a real 4-server Pretrain 128K plan ('remote' at its default grid against
# a raw all-to-all of the same bytes).
stage exchange_4gpu 120 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 1 --iters 10 --caps-from-batches 4 --collectives remote --out "$OUT/exchange_4gpu"
;;& four-64k)
# packed_dp and distca at 64K per GPU, both workloads, one process.
stage e2e_4gpu_64k 200 python3 -m experiments.e2e_bench --backends packed_dp,distca --workloads pretrain,prolong --tokens 65536 --layers 2 --steps 6 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_64k"
;;& four-8b)
# The whole Llama-3-8B with FSDP (configs/llama3_8b_4gpu.py), each run in its own process (the
# state of one run must be gone before the next): distca trains 20 steps of Pretrain; packed_dp
# and ProLong time 6 steps after the same 2 warm-up steps (the same first batches).
E8="python3 -m experiments.e2e_bench --config configs/llama3_8b_4gpu.py --tokens 49152 --layers 32 --warmup 2 --plan-stats"
stage e2e_8b_pretrain_distca 260 $E8 --backends distca --workloads pretrain --steps 20 --out "$OUT/e2e_8b_pretrain_distca"
stage e2e_8b_pretrain_packed_dp 170 $E8 --backends packed_dp --workloads pretrain --steps 6 --out "$OUT/e2e_8b_pretrain_packed_dp"
for b in packed_dp distca; do
  stage "e2e_8b_prolong_$b" 150 $E8 --backends $b --workloads prolong --steps 6 --out "$OUT/e2e_8b_prolong_$b"
done
;;& four-8b-mfu)
# The 8B with FSDP at the layouts results/fsdp/mfu_candidates.md estimates to fit 80 GB and
# change MFU, Pretrain, each run in its own process, most informative first: remat
# 'save_attention' at 16K tokens per GPU (estimated 70.2 GiB of 72.85 with distca) with distca
# and packed_dp, full remat at 64K (68.9 GiB), and full remat at 16K (the same batches without
# the policy). A run over the card stops at the pre-flight with one line.
M8="python3 -m experiments.e2e_bench --config configs/llama3_8b_4gpu.py --layers 32 --warmup 2 --steps 6 --plan-stats --workloads pretrain"
stage e2e_8b_mfu_sa16k_distca 130 $M8 --tokens 16384 --backends distca --extra model.remat=save_attention --out "$OUT/e2e_8b_mfu_sa16k_distca"
stage e2e_8b_mfu_sa16k_packed_dp 120 $M8 --tokens 16384 --backends packed_dp --extra model.remat=save_attention --out "$OUT/e2e_8b_mfu_sa16k_packed_dp"
stage e2e_8b_mfu_full64k_distca 210 $M8 --tokens 65536 --backends distca --out "$OUT/e2e_8b_mfu_full64k_distca"
stage e2e_8b_mfu_full16k_distca 100 $M8 --tokens 16384 --backends distca --out "$OUT/e2e_8b_mfu_full16k_distca"
;;& four-n3w)
# The key-value watchdog (launch.Watchdog's heartbeats) on 2 x 2 processes, distca, 9 attempts,
# with 3 interleaved attempts without it (its poll interval past the run: one beat, then none)
# as the control: s8 saw aborts in about 4 of 10 attempts while the earlier watchdog polled the
# service's liveness barrier from the start. About 5 minutes.
no_watchdog_script
for a in 1 2 3 4 5 6 7 8 9; do
  stage "mpw_2x2_watchdog_$a" 60 bash -c "$(declare -f mp); MP_T='$MP_T' OUT='$OUT'; mp w2x2_watchdog_$a 2 2"
  if [ $((a % 3)) -eq 0 ]; then
    stage "mpw_2x2_no_watchdog_$a" 60 bash -c "$(declare -f mp); MP_T='${MP_T/-m distca_jax.train/$OUT/train_no_watchdog.py}' OUT='$OUT'; mp w2x2_no_watchdog_$a 2 2"
  fi
done
stage mpw_summary 30 bash -c "for d in $OUT/mp_w*/; do echo \"\$(basename \$d): \$(grep -c loss \$d/metrics.jsonl 2>/dev/null) logged losses, \$(ls \$d/crash 2>/dev/null | wc -l) crash dumps\"; done"
;;& four-lean)
# 'resend' at 128K per GPU, Pretrain, with the caps' margin over the sampled batches' envelope at
# 1.0 against the default 1.1, each in its own process (the allocator peak is per process), the
# same batches: on the s8 batches the host's plans are the same at both margins (no degraded
# plan) and CPU AOT puts the need 1.4 GiB lower at 1.0 (FA3's accumulators follow the servers'
# buffers); s8's 'resend' peaked at 1.16x packed_dp's (issue 35 asks for 1.15x). packed_dp first.
stage e2e_4gpu_lean_packed_dp 110 python3 -m experiments.e2e_bench --backends packed_dp --workloads pretrain --tokens 131072 --layers 2 --steps 6 --warmup 2 --out "$OUT/e2e_4gpu_lean_packed_dp"
for h in 1.1 1.0; do
  stage "e2e_4gpu_lean_resend_$h" 130 python3 -m experiments.e2e_bench --backends distca --extra attention.distca.memory_mode=resend --extra attention.distca.caps_headroom=$h --workloads pretrain --tokens 131072 --layers 2 --steps 6 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_lean_resend_$h"
done
;;& four-deep-a|four-deep-b)
# 128K per GPU with enough layers that the LM head is under 25% of the counted FLOPs, packed_dp
# and distca at their defaults, each backend in its own process (the allocator peak is per
# process), the same batches: four-deep-a Pretrain with 4 layers (LM head about 23%),
# four-deep-b ProLong with 6 (about 23%), one call each. An H200 only: CPU AOT (4 fake devices,
# scaled by the 2-layer runs' measured peaks) puts distca at about 97 GB (Pretrain, 4 layers)
# and 116 GB (ProLong, 6 layers).
case "$1" in four-deep-a) WL=pretrain:4 ;; *) WL=prolong:6 ;; esac
for b in packed_dp distca; do
  stage "e2e_4gpu_deep_${WL%:*}_$b" 280 python3 -m experiments.e2e_bench --backends $b --workloads ${WL%:*} --tokens 131072 --layers ${WL#*:} --steps 6 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_deep_${WL%:*}_$b"
done
;;& four-8b-xla)
# The whole 8B's FSDP collectives: save_attention at 16K per GPU (the best MFU of four-8b-mfu,
# 42.5%), packed_dp then distca, each profiled for one more step (how much of the all-gathers
# and reduce-scatters is exposed), with XLA's defaults and with the collectives pipelined
# across the layer scan's iterations (the next layer's gather beside this layer's compute).
M8="python3 -m experiments.e2e_bench --config configs/llama3_8b_4gpu.py --layers 32 --warmup 2 --steps 6 --plan-stats --workloads pretrain --tokens 16384 --extra model.remat=save_attention --profile"
PIPELINED="--xla_gpu_enable_pipelined_all_gather=true --xla_gpu_enable_pipelined_reduce_scatter=true --xla_gpu_enable_pipelined_all_reduce=true --xla_gpu_enable_while_loop_double_buffering=true"
for b in packed_dp distca; do
  stage "e2e_8b_xla_default_$b" 150 $M8 --backends $b --out "$OUT/e2e_8b_xla_default_$b"
  stage "e2e_8b_xla_pipelined_$b" 150 env XLA_FLAGS="$PIPELINED" $M8 --backends $b --out "$OUT/e2e_8b_xla_pipelined_$b"
done
;;& four-f)
# Faults under NCCL (4 processes x 1 GPU, a 2-layer model small enough that a checkpoint of the
# interrupted step is quick), then the 'remote' kernel's GPU tests and its zeroing CTAs on a
# real Pretrain 128K plan.
stage faults_4gpu 320 python3 -m experiments.peer_death --procs 4 --gpu --faults term:1 int:all diverge readonly kill:1 kill:0 --config configs/gpu_bench.py --out "$OUT/faults_4gpu" -- $SMALL_MODEL --config.tokens_per_rank=16384
stage gpu_remote_tests 120 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_remote_exchange.py
stage exchange_zero_blocks 120 python3 -m experiments.exchange_bench --workloads pretrain --tokens 131072 --batches 1 --iters 10 --caps-from-batches 4 --collectives remote --remote-grids 132x128x2x33,132x128x2x66,132x128x2x132 --out "$OUT/exchange_zero_blocks"
;;& four-b)
for b in packed_dp distca; do
  stage "e2e_4gpu_prolong_128k_$b" 200 env XLA_FLAGS="${FOUR_XLA_FLAGS:-}" python3 -m experiments.e2e_bench --backends $b --workloads prolong --tokens 131072 --layers 2 --steps 8 --warmup 2 --plan-stats --out "$OUT/e2e_4gpu_prolong_128k_$b"
done
;;& four-4d)
# The 4D row: pipe 2 x data 2, Pretrain, on the same batches in one process: packed_dp, distca
# with CAD pooled over both stages per tick, and distca+perstage (each stage's 2 data ranks its
# own servers). A row per microbatch (M = 4), 32K tokens each: 128K tokens per data rank.
stage e2e_4gpu_4d_pretrain 330 python3 -m experiments.e2e_bench --backends packed_dp,distca --variant perstage@distca:attention.distca.pool_stages=false --workloads pretrain --tokens 32768 --layers 4 --steps 5 --warmup 2 --extra mesh.pipe=2 --extra mesh.data=2 --plan-stats --out "$OUT/e2e_4gpu_4d_pretrain"
;;& derived|all)
E2E_JSON="$OUT/e2e_2gpu_64k.json $OUT/e2e_2gpu_128k.json $OUT/e2e_2gpu_128k_wlb.json $OUT/e2e_2gpu_prolong_128k.json"
stage e2e_2gpu_plot 60 python3 -m experiments.plot_e2e $E2E_JSON --out "$OUT/e2e_2gpu.png"
stage per_batch_bound 300 python3 -m experiments.per_batch_bound "$OUT/e2e_2gpu_64k.json" "$OUT/e2e_2gpu_prolong_128k.json" "$OUT/e2e_2gpu_128k.json" --fixed-cost 0.004 --out "$OUT/per_batch_bound"
;;
esac
}
GROUPS_=${SUITE:-all}
for group in ${GROUPS_//,/ }; do run_group "$group"; done
