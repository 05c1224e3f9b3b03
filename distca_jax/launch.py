"""Process setup before any JAX computation: distributed init and the XLA/NCCL settings we need.

Flags must be in the environment before the first backend call, so `run` sets them and only then
touches devices. Settings already present in the environment are kept (the user's word wins).
"""

from __future__ import annotations

import os

import ml_collections

# NVLink multicast (NVLS) is kept off: see the device notes; it destabilized shared GPU hosts.
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}


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
