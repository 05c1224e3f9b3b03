"""The whole Llama-3-8B (all 32 layers) on one 4-GPU host: FSDP over `data`, CAD on every GPU.

Run (one host with 4 GPUs; needs `.[gpu]` for the FlashAttention-3 kernel):
  .venv/bin/python -m distca_jax.train --config configs/llama3_8b_4gpu.py --workdir /ckpt/llama8b_4gpu

Hardware: one host with 4 GPUs of 80 GB (H100 80GB or larger).

Check memory before launching (compiles ahead of time on abstract shapes, no parameters made):
  .venv/bin/python -m experiments.aot_memory --config configs/llama3_8b_4gpu.py --devices 4
(on a host without FlashAttention-3, e.g. 4 fake CPU devices, the kernel's shape-only stand-in
is compiled and its backward workspace counted by formula: 62.34 GiB per device; 63.42 GiB with
--override attention.kernel=blockwise, the CPU kernel in its place;
results/configs/aot_shipped_configs.md).

Layout: mesh data=4 x tensor=1 with `mesh.fsdp`: the f32 weights, their gradients and both Adam
moments are split over the 4 GPUs (8.03B x 12 bytes / 4 = 22.4 GiB of state per GPU instead of
89.7), each layer all-gathers its weights inside the layer scan just before use, and every GPU
is a data rank and a CAD attention server (`distca`). Remat 'full' keeps one [tokens, 4096]
residual per layer. TOKENS_PER_GPU = 48K is the largest multiple of 16K tokens whose AOT
estimate fits an 80 GB card's allocator limit (72.85 GiB on an H100 80GB at
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92): 66.17 GiB of XLA's plan on 4 fake CPU devices plus an
estimated 2.75 GiB of FlashAttention-3 backward workspace; 64K plans 74.07 GiB before the
workspace (results/fsdp/aot_8b_4gpu.md).

Expect (measured on 4 x H100 80GB, results/fsdp/e2e_8b_4gpu.md): loss starting near 12.5 and
falling; about 8.1 s per step on Pretrain (40% MFU, document-masked; 1.21x packed_dp on the same
batches) and 5.7 s on ProLong (42%; packed_dp is 6% faster there, its batches being nearly
balanced already); allocator peak about 65 GB. MFU stays under 50%, likely (not profiled)
because remat 'full' reruns each layer's forward (1.30x the counted FLOPs are executed)
and each layer all-gathers its weights (0.44 GB bf16, forward and rematerialized backward) and
reduce-scatters its gradients.
"""

import os

from distca_jax import configs_io

TOKENS_PER_GPU = 49_152


def get_config():
  # Llama-3-8B, 32 layers, bf16 compute, f32 state
  c = configs_io.load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "llama3_8b_128k.py"))
  c.model.remat = "full"
  c.mesh.data = 4
  c.mesh.tensor = 1
  c.mesh.fsdp = True
  c.tokens_per_rank = TOKENS_PER_GPU
  c.rows_per_rank = 1
  c.attention.backend = "distca"           # CAD; compare: packed_dp, cp, wlb, local
  c.attention.kernel = "flash3"            # FlashAttention-3 (pip install -e ".[gpu]")
  c.num_steps = 1000
  c.log_every = 1
  c.checkpoint_every = 200
  return c
