"""Process setup before any JAX computation: distributed init and the XLA/NCCL settings we need.

Flags must be in the environment before the first backend call, so `run` sets them and only then
touches devices. Settings already present in the environment are kept (the user's word wins).
"""

from __future__ import annotations

import os

import ml_collections

# NVLink multicast (NVLS) is kept off: see the device notes; it destabilized shared GPU hosts.
# No XLA overlap flags are set, by measurement: CAD's all-to-alls are async collectives that XLA
# schedules around the linear layers of the other nano-batch (`attention.nano_batches=2`), and on
# 2 H200s the step with them was within 1.1% of its signal-only twin (tiny all-to-alls) while
# ping-pong changed nothing (results/e2e_2gpu_summary.md); DESIGN_NOTES Sec. 6 measured
# `--xla_gpu_enable_latency_hiding_scheduler` hiding 37% vs 30% of an all-to-all. Pass any XLA
# flags through the environment (XLA_FLAGS) and they are kept.
# XLA_PYTHON_CLIENT_MEM_FRACTION: JAX preallocates 75% of GPU memory by default; Llama-3-8B layers
# at 128K tokens per GPU with remat 'none' plan ~105-113 GiB of an H200's 140 (results/
# e2e_v5_summary.md), which failed at 75% and fits at 92% (NCCL and kernel workspaces live in the
# rest).
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}


def configure_environment() -> None:
  for k, v in GPU_ENV_DEFAULTS.items():
    os.environ.setdefault(k, v)


def run(config: ml_collections.ConfigDict, workdir: str, *, multihost: bool = False,
        verbose: bool = False):
  """Sets up the process and trains; `verbose` keeps library INFO logs (orbax is chatty)."""
  configure_environment()
  if not verbose:
    from absl import logging
    logging.set_verbosity(logging.WARNING)
  import jax
  if multihost:
    jax.distributed.initialize()
  from distca_jax import trainer
  return trainer.train_and_evaluate(config, workdir)
