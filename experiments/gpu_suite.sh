#!/usr/bin/env bash
# The GPU measurements of this repository's results/, in one call on a 2-GPU H200 host:
#   bash experiments/gpu_suite.sh OUTDIR
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
stage() {  # stage NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s): $*"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"; tail -n 25 "$OUT/$name.log"
  pack
}
nvidia-smi -L
E2E="--layers 2 --steps 6 --warmup 2 --extra attention.kernel=flash3"
E2E20="--layers 2 --steps 20 --warmup 2"  # gpu_bench defaults: flash3 kernels for every backend
# Compiled programs persist across the suite's processes (Pretrain and ProLong share shapes).
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
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
;;& checks|all)
# flash3 / distca correctness on the GPU (the same tests as CPU CI plus the GPU-only cases).
stage gpu_tests 120 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_ops.py -k "flash3 or hints"
stage e2e_64k_pretrain 240 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 65536 $E2E20 --variant signal@distca:backend.signal_only=true --profile --plan-stats --out "$OUT/e2e_64k_pretrain"
stage dispatch2 150 python3 experiments/dispatch_bench.py --kernel flash3 --iters 5 --batches 3 --caps default --out "$OUT/dispatch_bench"
stage kernel_profile 150 env CUDA_VISIBLE_DEVICES=0 python3 experiments/kernel_profile.py --workloads dense-16384,ca-s512,ca-s128 --out "$OUT/kernel_profile.json"
;;& e2e128|all)
stage e2e_128k_20 560 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain,prolong --tokens 131072 $E2E20 --profile --plan-stats --out "$OUT/e2e_128k"
;;& ablations|all)
stage dispatch_hints 120 python3 experiments/dispatch_bench.py --kernel flash3 --iters 5 --batches 3 --caps default --out "$OUT/dispatch_bench_hints"
stage e2e_pingpong_2x64k 260 python3 experiments/e2e_bench.py --backends distca --workloads pretrain --tokens 65536 --rows-per-rank 2 --nano-batches 1,2 $E2E20 --out "$OUT/e2e_pingpong_2x64k"
stage e2e_64k_eps 200 python3 experiments/e2e_bench.py --backends distca --workloads pretrain --tokens 65536 $E2E20 --variant eps0@distca:attention.distca.tolerance=0 --variant eps03@distca:attention.distca.tolerance=0.3 --plan-stats --out "$OUT/e2e_64k_eps"
stage e2e_64k_prolong 160 python3 experiments/e2e_bench.py --backends packed_dp,distca,wlb --workloads prolong --tokens 65536 $E2E20 --extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2 --out "$OUT/e2e_64k_prolong"
;;& v2)
# results/archive/039a22a/e2e_v2_summary.md (not part of 'all': its runs repeat e2e128 / wlb /
# dispatch with newer code under other output names).: flash3 launch buckets + gather backward
# (the "before" dispatch table
# came from the previous commit's tree, run the same way right after).
stage flash3_grid 150 env CUDA_VISIBLE_DEVICES=0 python3 experiments/flash3_grid_bench.py --out "$OUT/flash3_grid_bench"
stage gather 90 env CUDA_VISIBLE_DEVICES=0 python3 experiments/gather_bench.py --out "$OUT/gather_bench"
stage dispatch_direct 150 python3 experiments/dispatch_bench.py --kernel flash3 --iters 5 --batches 2 --caps default --profile --out "$OUT/dispatch_bench_direct"
stage dispatch_suggest 170 python3 experiments/dispatch_bench.py --kernel flash3 --iters 5 --batches 2 --caps suggest --out "$OUT/dispatch_bench_suggest"
stage e2e_64k_v2 330 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain,prolong --tokens 65536 $E2E20 --out "$OUT/e2e_2gpu_64k_v2"
stage e2e_128k_v2 570 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain,prolong --tokens 131072 $E2E20 --plan-stats --out "$OUT/e2e_2gpu_128k_v2"
stage e2e_64k_wlb_v2 330 python3 experiments/e2e_bench.py --backends distca,wlb --workloads pretrain --tokens 65536 $E2E20 --extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2 --out "$OUT/e2e_2gpu_64k_wlb_v2"
# One GPU (CUDA_VISIBLE_DEVICES=0): one attention server, CAD's fixed cost.
stage e2e_1gpu_64k 540 env CUDA_VISIBLE_DEVICES=0 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain,prolong --tokens 65536 $E2E20 --out "$OUT/e2e_1gpu_64k"
stage e2e_1gpu_128k 560 env CUDA_VISIBLE_DEVICES=0 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain,prolong --tokens 131072 $E2E20 --out "$OUT/e2e_1gpu_128k"
;;& v3)
# results/archive/039a22a/dispatch_v3_summary.md (not part of 'all'): own rows placed before the
# all-to-all lands,
# the empty bucket, ppermute rounds. The "old" runs time the previous commit's library (a
# `git archive` of it in .old/, with this tree's dispatch_bench.py for --exchange-only).
stage gpu_tests 150 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_ops.py -k "flash3 or hints or buckets"
stage collectives 90 python3 experiments/collective_bench.py --out "$OUT/collective_bench"
stage collectives_lhs 90 env XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python3 experiments/collective_bench.py --out "$OUT/collective_bench_lhs"
X="--kernel flash3 --iters 20 --batches 2 --exchange-only"
if [ -d .old/distca_jax ]; then
stage ex_old_suggest 120 bash -c "cd .old && PYTHONPATH=$PWD/.old:/tmp/site python3 experiments/dispatch_bench.py $X --caps suggest --out $OUT/dispatch_v3_old_suggest"
fi
stage ex_a2a_suggest 100 python3 experiments/dispatch_bench.py $X --caps suggest --out "$OUT/dispatch_v3_a2a_suggest"
stage ex_perm_suggest 100 python3 experiments/dispatch_bench.py $X --caps suggest --collective ppermute --out "$OUT/dispatch_v3_perm_suggest"
stage ex_a2a_default 100 python3 experiments/dispatch_bench.py $X --caps default --out "$OUT/dispatch_v3_a2a_default"
stage ex_perm_default 100 python3 experiments/dispatch_bench.py $X --caps default --collective ppermute --out "$OUT/dispatch_v3_perm_default"
;;& v3e2e)
# The issue-7 ablations again with the v3 data plane (results/archive/039a22a/dispatch_v3_summary.md), 2 GPUs.
stage e2e_64k_v3 585 python3 experiments/e2e_bench.py --backends packed_dp,distca,cp --workloads pretrain --tokens 65536 $E2E20 --extra attention.baselines.cp_size=2 --variant signal@distca:backend.signal_only=true --variant eps0@distca:attention.distca.tolerance=0 --variant eps005@distca:attention.distca.tolerance=0.05 --plan-stats --out "$OUT/e2e_2gpu_64k_v3"
;;& v3e2e2)
stage e2e_128k_v3 330 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 $E2E20 --profile --plan-stats --out "$OUT/e2e_2gpu_128k_v3"
stage e2e_pingpong_v3 250 python3 experiments/e2e_bench.py --backends distca --workloads pretrain --tokens 65536 --rows-per-rank 2 --nano-batches 1,2 $E2E20 --out "$OUT/e2e_2gpu_pingpong_v3"
;;& v3prolong)
stage e2e_prolong_64k_v3 200 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong --tokens 65536 $E2E20 --plan-stats --out "$OUT/e2e_2gpu_prolong_64k_v3"
stage e2e_prolong_128k_v3 330 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong --tokens 131072 $E2E20 --plan-stats --out "$OUT/e2e_2gpu_prolong_128k_v3"
;;& v3caps)
# Startup caps (config.attention.distca.caps_from_batches, the default now) vs the fixed fractions.
stage e2e_prolong_64k_caps 300 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong --tokens 65536 $E2E20 --variant fixedcaps@distca:attention.distca.caps_from_batches=0 --plan-stats --out "$OUT/e2e_2gpu_prolong_64k_caps"
;;& v4)
# results/archive/7310cdf/e2e_v5_summary.md (its 'before the fused loss' rows): the layer's remat
# policy 'save_attention' (core attention
# never reruns in the backward; 'none' did not fit at 128K in JAX's default 75% of GPU memory)
# and tolerance 0, Pretrain 128K.
stage e2e_128k_v4 560 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 $E2E20 --extra model.remat=save_attention --variant eps0@distca:attention.distca.tolerance=0 --profile --plan-stats --out "$OUT/e2e_2gpu_128k_v4"
;;& v4b)
stage e2e_128k_v4_4l 560 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 --layers 4 --steps 20 --warmup 2 --extra model.remat=save_attention --extra attention.distca.tolerance=0 --plan-stats --out "$OUT/e2e_2gpu_128k_v4_4l"
;;& v5)
# results/archive/7310cdf/e2e_v5_summary.md: the fused LM-head cross-entropy (logits once per
# chunk), remat 'none'
# in 92% of GPU memory (launch.GPU_ENV_DEFAULTS) against 'save_attention', tolerance 0.02.
stage e2e_128k_v5 240 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 $E2E20 --extra model.remat=none --extra attention.distca.tolerance=0.02 --profile --plan-stats --out "$OUT/e2e_2gpu_128k_v5"
stage e2e_prolong_128k_v5 170 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong --tokens 131072 $E2E20 --extra model.remat=none --extra attention.distca.tolerance=0.02 --plan-stats --out "$OUT/e2e_2gpu_prolong_128k_v5"
stage e2e_128k_v5_sa 170 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 131072 $E2E20 --extra model.remat=save_attention --extra attention.distca.tolerance=0.02 --out "$OUT/e2e_2gpu_128k_v5_sa"
;;& v5b)
# The same with the new defaults (gpu_bench: remat 'save_attention', tolerance 0.02), the WLB
# baseline and the signal-only twin; HLO of each profiled step in the *_profiles folders.
WLB="--extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2"
stage e2e_128k_v5b 350 python3 experiments/e2e_bench.py --backends packed_dp,distca,wlb --workloads pretrain --tokens 131072 $E2E20 $WLB --variant signal@distca:backend.signal_only=true --profile --plan-stats --out "$OUT/e2e_2gpu_128k_v5b"
stage e2e_prolong_128k_v5b 200 python3 experiments/e2e_bench.py --backends packed_dp,distca,wlb --workloads prolong --tokens 131072 $E2E20 $WLB --plan-stats --out "$OUT/e2e_2gpu_prolong_128k_v5b"
;;& v5c)
WLB="--extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2"
stage e2e_128k_v5c_wlb 200 python3 experiments/e2e_bench.py --backends wlb --workloads pretrain --tokens 131072 $E2E20 $WLB --out "$OUT/e2e_2gpu_128k_v5c_wlb"
stage e2e_64k_v5c 340 python3 experiments/e2e_bench.py --backends packed_dp,distca,wlb --workloads pretrain,prolong --tokens 65536 $E2E20 $WLB --plan-stats --out "$OUT/e2e_2gpu_64k_v5c"
;;& v5d)
stage e2e_pingpong_2x64k_v5 270 python3 experiments/e2e_bench.py --backends distca --workloads pretrain --tokens 65536 --rows-per-rank 2 --nano-batches 1,2 $E2E20 --out "$OUT/e2e_2gpu_pingpong_2x64k_v5"
;;& v6probe)
# Next leads of results/archive/7310cdf/e2e_v5_summary.md: the MemcpyD2D time of 128K steps (the
# profile report
# now gives each memcpy name's bytes and GB/s) and CAD's fixed cost on ProLong, per GPU.
stage e2e_prolong_128k_profile 260 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong --tokens 131072 $E2E20 --steps 5 --profile --plan-stats --out "$OUT/e2e_2gpu_prolong_128k_profile"
;;& v6pp)
# results/archive/4b6459c/pingpong_v6_summary.md, on ONE GPU (2-GPU kinds were withheld): the
# cross-layer
# ping-pong schedule (model.ping_pong_layers) against the single stream and against the previous
# commit's within-layer schedule (a `git archive` of it in .old/). Nothing crosses a wire on one
# GPU: this measures what the schedule costs when there is nothing to hide, and its memory.
PP="--workloads pretrain --tokens 65536 --rows-per-rank 2 --layers 2 --steps 10 --warmup 2"
stage e2e_1gpu_pingpong_v6 300 python3 experiments/e2e_bench.py --backends packed_dp,distca --nano-batches 1,2 $PP --out "$OUT/e2e_1gpu_pingpong_v6"
if [ -d .old/distca_jax ]; then
stage e2e_1gpu_pingpong_v6_old 150 bash -c "cd .old && PYTHONPATH=$PWD/.old:/tmp/site python3 experiments/e2e_bench.py --backends distca --nano-batches 2 $PP --out $OUT/e2e_1gpu_pingpong_v6_old"
fi
;;& v6pp2)
# Why ping-pong is faster on one GPU (v6pp): profiles of both schedules, the previous commit's
# within-layer schedule, and 4 layers (3 scanned units instead of 1).
PP="--workloads pretrain --tokens 65536 --rows-per-rank 2 --steps 6 --warmup 2"
stage e2e_1gpu_pingpong_v6_prof 200 python3 experiments/e2e_bench.py --backends packed_dp --nano-batches 1,2 $PP --layers 2 --profile --out "$OUT/e2e_1gpu_pingpong_v6_prof"
if [ -d .old/distca_jax ]; then
stage e2e_1gpu_pingpong_v6_old 120 bash -c "cd .old && PYTHONPATH=$PWD/.old:/tmp/site python3 experiments/e2e_bench.py --backends packed_dp --nano-batches 1,2 $PP --layers 2 --out $OUT/e2e_1gpu_pingpong_v6_old"
fi
stage e2e_1gpu_pingpong_v6_4l 200 python3 experiments/e2e_bench.py --backends packed_dp --nano-batches 1,2 $PP --layers 4 --out "$OUT/e2e_1gpu_pingpong_v6_4l"
;;& v6pp3)
# Which attention kernels the single stream loses on 2 rows per call (v6pp2: 713 vs 479 ms).
stage rows_per_call 200 python3 experiments/rows_per_call_bench.py --batches 2 --out "$OUT/rows_per_call_bench"
PP="--workloads pretrain --tokens 65536 --rows-per-rank 2 --steps 4 --warmup 2 --layers 2"
stage e2e_1gpu_pingpong_v6_prof2 260 python3 experiments/e2e_bench.py --backends packed_dp,distca --nano-batches 1,2 $PP --profile --out "$OUT/e2e_1gpu_pingpong_v6_prof2"
;;& v6pp4)
# After the fixes v6pp3 pointed at (flash3's compact LSE saved instead of its raw buffer;
# packed_dp's empty task slots last): single stream vs ping-pong again, the one-row runs of the
# first probe, and 4 layers.
PP="--workloads pretrain --tokens 65536 --rows-per-rank 2 --warmup 2"
stage e2e_1gpu_pingpong_v6_fixed 240 python3 experiments/e2e_bench.py --backends packed_dp,distca --nano-batches 1,2 $PP --steps 6 --layers 2 --profile --out "$OUT/e2e_1gpu_pingpong_v6_fixed"
stage e2e_1gpu_64k_v6 200 python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong,pretrain --tokens 65536 --layers 2 --steps 8 --warmup 2 --out "$OUT/e2e_1gpu_64k_v6"
stage e2e_1gpu_pingpong_v6_fixed_4l 150 python3 experiments/e2e_bench.py --backends distca --nano-batches 1,2 $PP --steps 4 --layers 4 --out "$OUT/e2e_1gpu_pingpong_v6_fixed_4l"
;;& v6pp5)
# The single stream's scanned layer still ran FA3's forward twice (two custom calls in the HLO:
# XLA's dynamic-slice fusion cloned the call to write O straight into the stacked residual).
# The same runs with that fusion off.
NODSF="XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false"
stage e2e_1gpu_2x64k_nodsf 200 env $NODSF python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads pretrain --tokens 65536 --rows-per-rank 2 --warmup 2 --steps 6 --layers 2 --profile --out "$OUT/e2e_1gpu_2x64k_nodsf"
stage e2e_1gpu_64k_nodsf 150 env $NODSF python3 experiments/e2e_bench.py --backends packed_dp,distca --workloads prolong,pretrain --tokens 65536 --layers 2 --steps 8 --warmup 2 --out "$OUT/e2e_1gpu_64k_nodsf"
;;& v6final)
# The committed state (launcher default --xla_gpu_enable_dynamic_slice_fusion=false, compact
# LSE residual, packed_dp slots): GPU tests of the flash3 path, single stream vs ping-pong.
stage gpu_tests_v6 90 env JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_ops.py -k "flash3 or hints"
stage e2e_1gpu_pingpong_v6_final 170 python3 experiments/e2e_bench.py --backends packed_dp,distca --nano-batches 1,2 --workloads pretrain --tokens 65536 --rows-per-rank 2 --warmup 2 --steps 6 --layers 2 --out "$OUT/e2e_1gpu_pingpong_v6_final"
;;& v7place)
# One GPU: where the key/value attention buffers are built (all after the wire, or own rows
# first), from real 2- and 4-server plans' routing, forward and forward+backward.
stage placement_2 150 python3 experiments/placement_bench.py --servers 2 --out "$OUT/placement_bench"
stage placement_4 150 python3 experiments/placement_bench.py --servers 4 --out "$OUT/placement_bench_4"
;;& v7copy|v7place)
# One GPU: how fast XLA copies rows by index, in the forms the data plane could write it.
stage row_copy 120 python3 experiments/row_copy_bench.py --out "$OUT/row_copy_bench"
;;& v7words)
# One GPU: the data plane's row copies as 32-bit words. Placement of the attention buffers with
# the previous commit's library (.old/, a git archive of it with this tree's placement_bench.py)
# and with this tree's, then one-GPU training steps (nothing moves; CAD builds its buffers).
stage placement_old 120 python3 .old/experiments/placement_bench.py --servers 2 --batches 2 --iters 10 --out "$OUT/placement_bench_old"
stage placement_new 120 python3 experiments/placement_bench.py --servers 2 --batches 2 --iters 10 --out "$OUT/placement_bench_new"
V7E2E="--backends packed_dp,distca --workloads prolong,pretrain --tokens 65536 --layers 2 --steps 6 --warmup 2"
stage e2e_1gpu_64k_v7 200 python3 experiments/e2e_bench.py $V7E2E --out "$OUT/e2e_1gpu_64k_v7"
stage e2e_1gpu_64k_v7_old 200 python3 .old/experiments/e2e_bench.py $V7E2E --out "$OUT/e2e_1gpu_64k_v7_old"
;;& v7words2)
# One GPU: the key/value select on words too (dataplane.copies._take_two), old vs new again.
stage placement_old 120 python3 .old/experiments/placement_bench.py --servers 2 --batches 2 --iters 10 --out "$OUT/placement_bench_old"
stage placement_new 120 python3 experiments/placement_bench.py --servers 2 --batches 2 --iters 10 --out "$OUT/placement_bench_new"
stage placement_new_4 120 python3 experiments/placement_bench.py --servers 4 --batches 2 --iters 10 --out "$OUT/placement_bench_new_4"
;;& v7words3)
# One GPU: row copies again, round-robin (order effects cancel), and the placements with more
# calls per timing, old library vs new.
stage row_copy_rr 120 python3 experiments/row_copy_bench.py --out "$OUT/row_copy_bench"
stage placement_old_30 120 python3 .old/experiments/placement_bench.py --servers 2 --batches 2 --iters 30 --out "$OUT/placement_bench_old_30"
stage placement_new_30 120 python3 experiments/placement_bench.py --servers 2 --batches 2 --iters 30 --out "$OUT/placement_bench_new_30"
;;& v7e2e)
# One GPU: training steps with the final word copies (dataplane.copies._take_two) against the previous
# commit's library (.old/), same call.
V7E2E="--backends packed_dp,distca --workloads prolong,pretrain --tokens 65536 --layers 2 --steps 6 --warmup 2"
stage e2e_1gpu_64k_v7_final 200 python3 experiments/e2e_bench.py $V7E2E --out "$OUT/e2e_1gpu_64k_v7_final"
stage e2e_1gpu_64k_v7_old2 200 python3 .old/experiments/e2e_bench.py $V7E2E --out "$OUT/e2e_1gpu_64k_v7_old2"
;;& wlb|all)
stage e2e_64k_wlb 400 python3 experiments/e2e_bench.py --backends packed_dp,wlb --workloads pretrain --tokens 65536 $E2E20 --extra attention.baselines.cp_size=1 --extra attention.baselines.wlb_alpha=1.2 --out "$OUT/e2e_64k_wlb"
;;
esac
