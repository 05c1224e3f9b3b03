"""Llama-3-8B (Llama-3.1 RoPE scaling) at the paper's 128K-token context per rank.

Run (a GPU host with 8 devices; multi-host: add --multihost):
  .venv/bin/python -m distca_jax.train --config configs/llama3_8b_128k.py --workdir /ckpt/llama8b

Check memory before launching (compiles ahead of time on abstract shapes, no parameters made):
  .venv/bin/python -m experiments.aot_memory --config configs/llama3_8b_128k.py --devices 8
(on 8 fake CPU devices: 22.4 GiB of arguments, 92.6 GiB in all per device, about 10 s on 2 cores).

Expect: on 8 H200s, data=2 x tensor=4, 128K tokens per data rank of Pretrain-workload documents;
the AOT script prints the compiled per-device memory (arguments, temporaries, total).
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
  c.mesh.data = 2
  c.mesh.tensor = 4
  c.tokens_per_rank = 131_072
  c.rows_per_rank = 1
  c.data.workload = "pretrain"
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 100
  c.num_steps = 1000
  c.log_every = 1
  c.checkpoint_every = 200
  c.attention.kernel = "flash3"            # FlashAttention-3 (pip install -e ".[gpu]")
  return c
