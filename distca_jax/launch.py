"""Process setup before any JAX computation: distributed init and the XLA/NCCL settings we need.

Flags must be in the environment before the first backend call, so `run` sets them and only then
touches devices. Settings already present in the environment are kept (the user's word wins).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

import ml_collections

from distca_jax.errors import UserError

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


@dataclasses.dataclass(frozen=True)
class Distributed:
  """How this process joins a multi-process job (``jax.distributed.initialize`` arguments).

  ``coordinator_address``, ``num_processes`` and ``process_id`` name the job explicitly (all
  three, or none: then the cluster is detected, SLURM / Open MPI / Kubernetes). A process that
  misses heartbeats for ``heartbeat_timeout_s`` seconds is declared dead and the others stop with
  an error; ``initialization_timeout_s`` bounds the wait for every process to join.
  """

  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  heartbeat_timeout_s: int = 100
  initialization_timeout_s: int = 300

  @property
  def explicit(self) -> bool:
    return self.coordinator_address is not None

  def check(self) -> None:
    given = {k: getattr(self, k) for k in ("coordinator_address", "num_processes", "process_id")}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
      raise UserError(f"multi-process flags {given}: pass all three of --coordinator_address, "
                       "--num_processes and --process_id, or none (cluster auto-detection "
                       "with --multihost)")
    if self.explicit:
      if ":" not in self.coordinator_address:
        raise UserError(f"--coordinator_address={self.coordinator_address!r} must be HOST:PORT")
      if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
        raise UserError(f"--process_id={self.process_id} must be in [0, --num_processes="
                         f"{self.num_processes})")
    for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
      if getattr(self, name) < 1:
        raise UserError(f"--{name}={getattr(self, name)} must be >= 1 (seconds)")

  def initialize(self) -> None:
    import jax
    kwargs = dict(initialization_timeout=self.initialization_timeout_s,
                  heartbeat_timeout_seconds=self.heartbeat_timeout_s)
    if self.explicit:
      kwargs.update(coordinator_address=self.coordinator_address,
                    num_processes=self.num_processes, process_id=self.process_id)
    jax.distributed.initialize(**kwargs)


def run(config: ml_collections.ConfigDict, workdir: str, *, multihost: bool = False,
        verbose: bool = False, distributed: Distributed | None = None):
  """Sets up the process and trains; `verbose` keeps library INFO logs (orbax is chatty).

  ``multihost`` (or an explicit ``distributed.coordinator_address``) joins a multi-process job
  first. Every process logs its own errors (with its process index) to stderr before raising.
  """
  configure_environment()
  distributed = distributed or Distributed()
  distributed.check()
  if not verbose:
    from absl import logging
    logging.set_verbosity(logging.WARNING)
  import jax
  if multihost or distributed.explicit:
    distributed.initialize()
  from distca_jax import memory, trainer
  try:
    try:
      return trainer.train_and_evaluate(config, workdir, device_memory_bytes=_injected_capacity())
    except memory.DoesNotFit as e:  # add what each knob would need (compiles variants: slow path)
      from distca_jax import aot
      raise aot.explain_does_not_fit(config, e) from e.__cause__
  except BaseException as e:
    # Every process names itself in its own error line (user errors: train.py prints the one
    # line; internal errors: their traceback follows when the exception leaves the process).
    # A runtime error of a multi-process job (a collective whose peer is gone) also names the
    # processes the coordination service no longer counts as live.
    if not isinstance(e, (SystemExit, KeyboardInterrupt, UserError)):
      me = f"process {jax.process_index()}/{jax.process_count()}"
      print(f"{me} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
      if jax.process_count() > 1 and isinstance(e, jax.errors.JaxRuntimeError):
        print(f"{me}: {lost_processes(1.5 * distributed.heartbeat_timeout_s + 5)}",
              file=sys.stderr, flush=True)
    raise


def lost_processes(timeout_s: float) -> str:
  """Which processes of the job the coordination service no longer counts as live, asked after
  a runtime error: 'lost process [1] (...)', 'lost process 0 (the coordinator ... does not
  answer ...)', 'every process is live' or 'no process was declared lost within N s'.

  The service declares a process dead when its heartbeats stop for the heartbeat timeout, so the
  answer takes up to that long (``timeout_s`` bounds the wait; live processes that ask answer
  at once). The same declaration makes JAX stop every live process with a fatal error of its own
  that names the task ("stopped sending heartbeats): 1", or "the leader task was preempted/died"
  for the coordinator), which races with this answer and often stops the process first: either
  way the wait keeps this process alive until the lost one is named, where exiting at once would
  name only this one.
  """
  import jax
  from jax._src import distributed as jax_distributed  # the client has no public accessor
  client = jax_distributed.global_state.client
  everyone = list(range(jax.process_count()))
  answer: dict = {}

  def ask():
    try:
      answer["live"] = client.get_live_nodes(everyone)
    except Exception as e:  # pylint: disable=broad-except  # the coordinator's RPC failed
      answer["error"] = e

  asker = threading.Thread(target=ask, daemon=True)
  asker.start()
  asker.join(timeout_s)
  if "error" in answer:
    address = jax_distributed.global_state.coordinator_address
    why = str(answer["error"]).strip().splitlines()[0][:200]
    return f"lost process 0 (the coordinator at {address} does not answer: {why})"
  if "live" not in answer:
    return f"no process was declared lost within {timeout_s:.0f} s"
  lost = sorted(set(everyone) - set(answer["live"]))
  if not lost:
    return "every process is live"
  return (f"lost process{'es' if len(lost) > 1 else ''} {lost} (stopped sending heartbeats to "
          "the coordination service)")


# Test hook: pretend each device has this many bytes (the memory pre-flight on CPUs).
DEVICE_MEMORY_ENV = "DISTCA_TEST_DEVICE_MEMORY_BYTES"


def _injected_capacity() -> int | None:
  value = os.environ.get(DEVICE_MEMORY_ENV)
  return int(value) if value else None
