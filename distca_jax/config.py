"""Every configuration key, defined and documented once.

Config files under `configs/` call `base_config()` and override what they need; command lines
override further with `--config.section.key=value`. A key that is not defined here is an error
(ml_collections ConfigDicts are locked), so a typo never passes silently.
"""

from __future__ import annotations

import ml_collections

from distca_jax.model import ModelConfig


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # --- model: the Llama-3 family decoder; every field of distca_jax.model.ModelConfig (see its
  # comments for meaning): vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, mlp_dim,
  # rope_theta, rope_scaling_factor (0 = off; Llama-3.1 uses 8), rope_low_freq_factor,
  # rope_high_freq_factor, rope_original_max_position, norm_eps, tie_embeddings, dtype (compute),
  # param_dtype (master weights), remat ('none' | 'full' | 'save_dots' | 'save_qkv_out'),
  # scan_layers, init_std, loss_chunk (tokens per LM-head chunk).
  c.model = ml_collections.ConfigDict(vars(ModelConfig()).copy())

  # --- attention: core attention, the pluggable middle of every layer.
  c.attention = ml_collections.ConfigDict()
  c.attention.backend = "local"   # 'local' (blockwise jnp, each row its own documents) or
                                  # 'reference' (dense O(T^2) jnp; tests only)
  c.attention.block_q = 512       # `local`: query block (clamped to a divisor of tokens_per_rank)
  c.attention.block_k = 512       # `local`: key block

  # --- mesh: named axes; data x tensor x pipe must equal the device count.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1                # data-parallel ranks (= CAD attention servers); -1: all the rest
  c.mesh.tensor = 1               # tensor parallelism over heads, MLP and vocab
  c.mesh.pipe = 1                 # pipeline stages (only 1 for now)

  # --- batch: every data-parallel rank gets `rows_per_rank` rows of `tokens_per_rank` tokens.
  c.tokens_per_rank = 256         # the per-rank token budget (the context window that is packed)
  c.rows_per_rank = 1             # rows (sequences) per rank per step

  # --- data
  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"     # 'synthetic' (document layouts from the paper's length samples,
                                  # learnable token patterns) or 'files' (tokenized dataset)
  c.data.workload = "pretrain"    # synthetic: 'pretrain' or 'prolong'
  c.data.context_length = 0       # synthetic: length the recipe scales to; 0 = tokens_per_rank
  c.data.path = ""                # files: dataset prefix (PREFIX.tokens.npy + PREFIX.offsets.npy)
  c.data.shuffle = True           # files: a seeded document permutation per epoch

  # --- optimizer: AdamW, linear warmup then cosine decay, global-norm clipping.
  c.optim = ml_collections.ConfigDict()
  c.optim.lr = 3e-4               # peak learning rate
  c.optim.min_lr_ratio = 0.1      # final lr = lr * min_lr_ratio
  c.optim.warmup_steps = 20
  c.optim.b1 = 0.9
  c.optim.b2 = 0.95
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0         # max global gradient norm; 0 disables clipping

  # --- run
  c.seed = 0                      # seeds parameters, data and the step RNG
  c.num_steps = 100               # total optimizer steps (also the cosine decay length)
  c.log_every = 10                # steps between progress lines / log records
  c.checkpoint_every = 50         # steps between checkpoints; 0 disables checkpointing
  c.keep_checkpoints = 3          # keep the last k checkpoints
  c.async_checkpoint = True       # orbax saves in the background while training goes on
  c.peak_tflops = 0.0             # per-device peak for MFU; 0 = look up by device kind (H100/H200:
                                  # 989 dense bf16), unknown devices report no MFU
  c.tensorboard = True            # write TensorBoard event files under WORKDIR/tb
  return c


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The typed, validated model config of a run config."""
  return ModelConfig(**c.model.to_dict())


def validate(c: ml_collections.ConfigDict) -> None:
  """Errors for values that would fail late (or silently) inside a run."""
  if c.tokens_per_rank <= 0:
    raise ValueError(f"tokens_per_rank={c.tokens_per_rank} must be positive")
  if c.rows_per_rank <= 0:
    raise ValueError(f"rows_per_rank={c.rows_per_rank} must be positive")
  if c.num_steps <= 0:
    raise ValueError(f"num_steps={c.num_steps} must be positive")
  if c.optim.warmup_steps < 0 or c.optim.warmup_steps > c.num_steps:
    raise ValueError(f"optim.warmup_steps={c.optim.warmup_steps} must be in [0, num_steps="
                     f"{c.num_steps}]")
  model_config(c)
