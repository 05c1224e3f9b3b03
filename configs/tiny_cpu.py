"""Tiny Llama on synthetic packed documents: the default job, a few minutes on a 2-core CPU.

Run:
  .venv/bin/python -m distca_jax.train --config configs/tiny_cpu.py --workdir /tmp/distca_tiny

Expect: a progress line every 20 steps, with the held-out loss and perplexity every 100; the loss
falls from about 5.6 (ln 256) to below 0.5 by step 300 as the model learns the synthetic
documents' arithmetic patterns in context; a checkpoint
every 100 steps (rerunning the command resumes, and finishes at once when done); metrics.jsonl and
TensorBoard events in the workdir. Uses every visible device along `data`.
"""

from distca_jax.config import base_config


def get_config():
  c = base_config()
  c.model.vocab_size = 256
  c.model.dim = 128
  c.model.n_layers = 4
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 32
  c.model.mlp_dim = 384
  c.model.dtype = "float32"     # bf16 matmuls are emulated (slow) on CPUs
  c.model.remat = "none"        # tiny activations: nothing to gain from recomputation
  c.model.loss_chunk = 256
  c.attention.block_q = 128
  c.attention.block_k = 128
  c.tokens_per_rank = 256
  c.rows_per_rank = 8
  c.data.workload = "pretrain"
  c.data.context_length = 4096  # the recipe's scale: documents of tens to thousands of tokens
  c.optim.lr = 3e-3
  c.optim.warmup_steps = 20
  # Non-finite steps are still skipped (and 3 in a row stop the run), but no spike band: with
  # 256-token rows and documents scaled to 4096 tokens, the pieces of one long document fill
  # whole consecutive batches, and the batch loss of this tiny model swings 5-10x between such
  # batches and mixed ones, which a band of 6 running deviations calls spikes.
  c.train.spike_sigmas = 0.0
  c.num_steps = 300
  c.log_every = 20
  c.eval_every = 100            # held-out loss and perplexity (a stream of another seed)
  c.eval_steps = 4
  c.checkpoint_every = 100
  return c
