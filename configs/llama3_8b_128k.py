"""Llama-3-8B (Llama-3.1 RoPE scaling) at the paper's 128K-token context per data rank, with CAD.

Hardware: 8 GPUs of 80 GB (H100 80GB or larger: H200) per node, one node or several
(scripts/slurm_train.sbatch); the FlashAttention-3 kernel (pip install -e ".[gpu]").

Run (one 8-GPU host):
  .venv/bin/python -m distca_jax.train --config configs/llama3_8b_128k.py --workdir /ckpt/llama8b
Several nodes under SLURM (one process per node):
  sbatch --nodes=4 scripts/slurm_train.sbatch configs/llama3_8b_128k.py /shared/runs/8b

Layout: mesh tensor=4 within a node, `data` = every other device (2 on one 8-GPU node, 8 on four
nodes; mesh.data=-1), FSDP over `data` (f32 weights, gradients and Adam moments split over it),
remat 'full', `distca` core attention disaggregation on every data rank.

Check memory before launching (compiles ahead of time on abstract shapes, no parameters made;
on a host without FlashAttention-3 the kernel's shape-only stand-in is used and its backward
workspace counted by formula):
  .venv/bin/python -m experiments.aot_memory --config configs/llama3_8b_128k.py --devices 8
On 8 fake CPU devices (about 20 s on 2 cores): 11.22 GiB of arguments, 67.60 GiB in XLA's plan
plus 1.32 GiB of FlashAttention-3 backward workspace = 68.92 GiB per device, under the 72.85 GiB an
H100 80GB's allocator may use at XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
(results/configs/aot_shipped_configs.md). Without FSDP (22.4 GiB of arguments) or with
tensor=2 (78.80 GiB) it does not fit an 80 GB card. Not yet run on GPUs in this layout.

Expect: the memory pre-flight's line (distca memory mode 'keep'), then a progress line every
step; loss starting near 12.5 and falling.
"""

from distca_jax.config import base_config


def get_config():
  c = base_config()
  c.model.vocab_size = 128_256
  c.model.dim = 4096
  c.model.n_layers = 32
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 14_336
  c.model.rope_theta = 500_000.0
  c.model.rope_scaling_factor = 8.0
  c.model.rope_low_freq_factor = 1.0
  c.model.rope_high_freq_factor = 4.0
  c.model.rope_original_max_position = 8192
  c.model.norm_eps = 1e-5
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.model.loss_chunk = 4096
  c.attention.block_q = 1024
  c.attention.block_k = 1024
  c.mesh.data = -1                         # every device not on `tensor`
  c.mesh.tensor = 4
  c.mesh.fsdp = True
  c.tokens_per_rank = 131_072
  c.rows_per_rank = 1
  c.data.workload = "pretrain"
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 100
  c.num_steps = 1000
  c.log_every = 1
  c.checkpoint_every = 200
  c.eval_every = 200                       # held-out loss / perplexity on 2 batches
  c.eval_steps = 2
  c.attention.backend = "distca"           # CAD; compare: packed_dp, cp, wlb, local
  c.attention.kernel = "flash3"            # FlashAttention-3 (pip install -e ".[gpu]")
  return c
