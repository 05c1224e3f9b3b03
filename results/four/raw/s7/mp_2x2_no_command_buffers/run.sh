#!/usr/bin/env bash
# 2 x 2 processes x GPUs, N attempts, with XLA_FLAGS from the environment.
set -u
O=$1; N=${N:-4}; mkdir -p $O
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SMALL="--config.model.n_layers=2 --config.model.dim=2048 --config.model.mlp_dim=7168 --config.model.n_heads=16 --config.model.n_kv_heads=4 --config.model.vocab_size=32768"
T="python3 -m distca_jax.train --config configs/gpu_bench.py $SMALL --config.tokens_per_rank=32768 --config.num_steps=10 --config.optim.warmup_steps=2 --config.log_every=1 --config.checkpoint_every=0 --config.tensorboard=False"
for a in $(seq 1 $N); do
  t0=$SECONDS
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$((2*i)),$((2*i+1)) timeout 75 $T --workdir $O/w$a --coordinator_address=127.0.0.1:1236$a --num_processes=2 --process_id=$i > $O/a${a}_$i.log 2>&1 &
  done
  wait
  echo "attempt $a: $((SECONDS-t0)) s, losses logged: $(grep -c loss $O/w$a/metrics.jsonl 2>/dev/null)"
  tar -C $O/.. -czf $OUT/mp.tgz $(basename $O)
done
