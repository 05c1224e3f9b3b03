#!/usr/bin/env bash
# 2 x 2 processes with the watchdog armed after the first step, attempts until the call ends.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
SMALL_MODEL="--config.model.n_layers=2 --config.model.dim=2048 --config.model.mlp_dim=7168 --config.model.n_heads=16 --config.model.n_kv_heads=4 --config.model.vocab_size=32768"
MP_T="python3 -m distca_jax.train --config configs/gpu_bench.py $SMALL_MODEL --config.tokens_per_rank=32768 --config.num_steps=10 --config.optim.warmup_steps=2 --config.log_every=1 --config.checkpoint_every=0 --config.tensorboard=False"
nvidia-smi -L; mkdir -p /tmp/w
for a in 1 2 3 4 5 6 7 8; do
  t0=$SECONDS
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2*i)),$((2*i+1)) timeout -k 5 55 $MP_T --workdir /tmp/w/a$a --coordinator_address=127.0.0.1:12352 --num_processes=2 --process_id=$i > /tmp/w/a${a}_$i.log 2>&1 &
  done
  wait
  line="attempt $a: $(grep -c loss /tmp/w/a$a/metrics.jsonl 2>/dev/null) logged losses, $(ls /tmp/w/a$a/crash 2>/dev/null | wc -l) crash dumps, $((SECONDS - t0)) s"
  echo "$line" | tee -a $OUT/summary.txt
  grep -hv '^\[#' /tmp/w/a${a}_0.log /tmp/w/a${a}_1.log | grep -i 'error\|abort\|free\|malloc' | head -4 >> $OUT/summary.txt
done
