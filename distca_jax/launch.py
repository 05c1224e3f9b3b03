"""Process setup before any JAX computation: distributed init and the XLA/NCCL settings we need.

Flags must be in the environment before the first backend call, so `run` sets them and only then
touches devices. Settings already present in the environment are kept (the user's word wins).
"""

from __future__ import annotations

import os

import ml_collections

# NVLink multicast (NVLS) is kept off: see the device notes; it destabilized shared GPU hosts.
# No XLA overlap flags are set, by measurement: CAD's all-to-alls are async collectives that XLA
# schedules around the linear layers of the other nano-batch (`attention.nano_batches=2`,
# model.ping_pong_layers: post-CA of layer i and pre-CA of layer i+1), and on 2 H200s the step
# was within 0.6-1.1% of its signal-only twin (tiny all-to-alls) while ping-pong changed nothing
# (results/archive/7310cdf/e2e_v5_summary.md; that run had the within-layer schedule);
# docs/design.md Sec. 13 measured `--xla_gpu_enable_latency_hiding_scheduler` hiding 37% vs 30% of
# an all-to-all. Pass any XLA flags through the environment (XLA_FLAGS) and they are kept.
# XLA_PYTHON_CLIENT_MEM_FRACTION: JAX preallocates 75% of GPU memory by default; Llama-3-8B layers
# at 128K tokens per GPU with remat 'none' plan ~105-113 GiB of an H200's 140
# (results/archive/7310cdf/e2e_v5_summary.md), which failed at 75% and fits at 92% (NCCL and
# kernel workspaces live in the rest).
GPU_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
# XLA flags added to XLA_FLAGS unless it already sets them (the user's value wins):
# --xla_gpu_enable_dynamic_slice_fusion=false: in the layer scan, XLA's dynamic-slice fusion
# cloned FlashAttention-3's forward custom call so that one copy wrote O straight into the stacked
# residual, so every layer ran the forward kernel twice (two flash_mha_fwd calls in the compiled
# step's HLO, one without the flag). On one H200, 2 layers of Llama-3-8B: 2 rows of 64K steps
# 1725 -> 1646 ms (packed_dp), 64K Pretrain 809 -> 785 ms, ProLong 732 -> 720 ms
# (results/archive/4b6459c/pingpong_v6_summary.md).
XLA_FLAG_DEFAULTS = {"xla_gpu_enable_dynamic_slice_fusion": "false"}


def xla_flags_with_defaults(flags: str) -> str:
  """``flags`` (an XLA_FLAGS value) plus every ``XLA_FLAG_DEFAULTS`` entry it does not set."""
  out = flags.split()
  for name, value in XLA_FLAG_DEFAULTS.items():
    if not any(f.lstrip("-").split("=")[0] == name for f in out):
      out.append(f"--{name}={value}")
  return " ".join(out)


def configure_environment() -> None:
  """Sets ``GPU_ENV_DEFAULTS`` and ``XLA_FLAG_DEFAULTS`` where the environment does not; call
  before the first JAX backend call (the flags are read when the backend starts)."""
  for k, v in GPU_ENV_DEFAULTS.items():
    os.environ.setdefault(k, v)
  os.environ["XLA_FLAGS"] = xla_flags_with_defaults(os.environ.get("XLA_FLAGS", ""))


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
  from distca_jax import memory, trainer
  try:
    return trainer.train_and_evaluate(config, workdir, device_memory_bytes=_injected_capacity())
  except memory.DoesNotFit as e:  # add what each knob would need (compiles variants: slow path)
    from distca_jax import aot
    raise aot.explain_does_not_fit(config, e) from e.__cause__


# Test hook: pretend each device has this many bytes (the memory pre-flight on CPUs).
DEVICE_MEMORY_ENV = "DISTCA_TEST_DEVICE_MEMORY_BYTES"


def _injected_capacity() -> int | None:
  value = os.environ.get(DEVICE_MEMORY_ENV)
  return int(value) if value else None
