"""Benchmark-sized job for 1-2 GPUs: Llama-3-8B layer shapes, 4 layers, 64K tokens per GPU.

Hardware: one or two GPUs of 80 GB or more (58.51 GiB per device by CPU AOT on one device,
results/configs/aot_shipped_configs.md; the MFU below was measured on H200s).

Run (one or two GPUs; every visible GPU goes on `data`):
  .venv/bin/python -m distca_jax.train --config configs/gpu_bench.py --workdir /tmp/distca_bench

Expect: steps of the real 8B layer shapes (4 of 32 layers) on Pretrain-workload documents with
CAD (`distca`, FlashAttention-3 kernel: pip install -e ".[gpu]"), with
tokens/s and MFU (document-masked FLOPs) printed every 5 steps; loss starts near 12.6 and falls.
Expect on one H200: about 50% MFU with `--config.model.n_layers=16` (49.7-50.7% Pretrain over
two calls, 49.4-51.3% ProLong; results/one_gpu/step_breakdown.md), 51.5% on Pretrain with
`--config.model.remat_mlp_layers=3` added (the first 3 layers keep their MLP activations: the
most that fit at 64K tokens; single stream only; no measurable gain on ProLong); 4 layers read higher because the LM head, fast
matmuls, is a larger share of the counted FLOPs.
"""

import importlib.util
import os


def _base():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama3_8b_128k.py")
  spec = importlib.util.spec_from_file_location("llama3_8b_128k", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


def get_config():
  c = _base()
  c.model.n_layers = 4
  c.model.remat = "save_attention"       # no attention rerun in the backward (e2e_v5_summary)
  c.mesh.data = -1
  c.mesh.tensor = 1
  c.mesh.fsdp = False
  c.tokens_per_rank = 65_536
  c.num_steps = 30
  c.log_every = 5
  c.checkpoint_every = 0
  c.optim.warmup_steps = 5
  c.attention.backend = "distca"           # CAD; compare: packed_dp, cp, wlb, local
  c.attention.kernel = "flash3"            # FlashAttention-3 (pip install -e ".[gpu]")
  return c
