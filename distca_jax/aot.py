"""Ahead-of-time compilation of the train step on abstract shapes: will this config fit?

Nothing is materialized: the state comes from `jax.eval_shape` with its shardings, the batch from
ShapeDtypeStructs, and the trainer's `compile_train_step` (the one place the step is built and
compiled, as the training loop's pre-flight does) gives XLA's per-device memory analysis.
Works for a mesh you do not have by faking devices on the CPU (`--xla_force_host_platform_device_
count`); CPU numbers approximate the GPU's (same shapes and shardings, different fusion and
scheduling), so use a GPU host of the target kind for the final word.
"""

from __future__ import annotations

import contextlib

import jax
import ml_collections

from custom_ops import KernelUnavailableError
from custom_ops import flash3_attention as fa3
from distca_jax import config as config_lib
from distca_jax import memory
from distca_jax import trainer
from distca_jax.memory import MEMORY_FIELDS, memory_fields  # noqa: F401  (aot's API)


def compile_train_step(c: ml_collections.ConfigDict, devices=None):
  """(compiled step, info dict) for config `c` on `devices` (default: all visible)."""
  config_lib.validate(c)
  run = trainer.setup_run(c, devices=devices)
  # Batch shapes (a backend's plan arrays included) from one real host batch: cheap, and the
  # shapes never depend on the batch.
  np_batch = trainer.add_host_plan(run.source.batch(0), run.backend, run.source.doclens(0),
                                   c.tokens_per_rank)
  compiled, workspace, times = trainer.compile_train_step(c, run, run.abstract_state, np_batch)
  mesh = run.mesh
  info = {
      "mesh": dict(mesh.shape),
      "device_kind": mesh.devices.flat[0].device_kind,
      "params": run.model.cfg.num_params(),
      **times,
  }
  info.update(memory_fields(compiled))
  info["kernel_workspace_bytes"] = workspace
  if "total_per_device_bytes" in info:
    info["need_per_device_bytes"] = (info["total_per_device_bytes"]
                                     + info["kernel_workspace_bytes"])
  return compiled, info



def needs_flash3_stand_in(c: ml_collections.ConfigDict) -> bool:
  """Whether config ``c`` names the 'flash3' kernel and this host cannot run it."""
  if c.attention.kernel != "flash3":
    return False
  try:
    fa3.check_available()
  except KernelUnavailableError:
    return True
  return False


def flash3_stand_in(c: ml_collections.ConfigDict):
  """A context for compiling config ``c`` ahead of time: ``flash3_attention.shape_only`` where
  ``needs_flash3_stand_in`` (the kernel's outputs in XLA's plan, its backward workspace by
  ``memory.kernel_workspace_bytes``), else nothing. The compiled step must not run under the
  stand-in."""
  return fa3.shape_only() if needs_flash3_stand_in(c) else contextlib.nullcontext()


def baseline_need_bytes(c: ml_collections.ConfigDict, backend: str, cp_size: int,
                        alpha: float = 1.0, tasks: int = 0, devices=None) -> int:
  """Bytes per device the train step of config ``c`` needs as the ``backend`` baseline ('wlb'
  or 'cp') with CP size ``cp_size`` and ``tasks`` task slots per row (wlb:
  ``wlb_tasks_per_row``, with alpha ``alpha``; cp: ``max_docs_per_row``, alpha unused): XLA's
  buffer assignment plus the kernels' workspace (``compile_train_step``'s
  ``need_per_device_bytes``, what the trainer's pre-flight checks). A 'flash3' step is compiled
  with the kernel's shape-only stand-in (``flash3_stand_in``) where FlashAttention-3 cannot run
  (CPU AOT: XLA:CPU's plan approximates the GPU's)."""
  over = {"attention.backend": backend, "attention.baselines.cp_size": int(cp_size)}
  if backend == "wlb":
    over.update({"attention.baselines.wlb_alpha": float(alpha),
                 "attention.baselines.wlb_tasks_per_row": int(tasks)})
  elif backend == "cp":
    over["attention.baselines.max_docs_per_row"] = int(tasks)
  else:
    raise ValueError(f"baseline_need_bytes: backend={backend!r} must be 'wlb' or 'cp'")
  v = config_lib.with_overrides(c, over)
  with flash3_stand_in(v):
    _, info = compile_train_step(v, devices=devices)
  if "need_per_device_bytes" not in info:
    raise ValueError(f"{backend}'s memory check: this platform's compiler reports no memory "
                     "analysis; give the configuration (attention.baselines.cp_size, and "
                     "wlb_alpha for wlb) instead of 0")
  return int(info["need_per_device_bytes"])


def knob_variants(c: ml_collections.ConfigDict, n_devices: int) -> list[tuple[str, dict]]:
  """(label, overrides) of the single-knob changes that lower a step's memory: FSDP (weights and
  optimizer state over `data`, when there are several data ranks and they divide model.dim),
  full remat, twice the tensor parallelism (when it divides the devices and the kv heads), half
  the tokens per rank, and for distca the 'resend' memory mode (servers keep no attention
  inputs)."""
  out = []
  data = config_lib.data_ranks(c, n_devices)
  if not c.mesh.fsdp and data > 1 and c.model.dim % data == 0:
    out.append(("mesh.fsdp=True", {"mesh.fsdp": True}))
  if c.attention.backend == "distca" and c.attention.distca.memory_mode == "keep":
    out.append(("attention.distca.memory_mode=resend",
                {"attention.distca.memory_mode": "resend"}))
  if c.model.remat != "full":
    out.append(("model.remat=full", {"model.remat": "full"}))
  t = c.mesh.tensor * 2
  if n_devices % (t * c.mesh.pipe) == 0 and c.model.n_kv_heads % t == 0:
    if c.mesh.data == -1:
      out.append((f"mesh.tensor={t}", {"mesh.tensor": t}))
    elif c.mesh.data % 2 == 0:  # the device count stays: half the data ranks
      out.append((f"mesh.tensor={t} with mesh.data={c.mesh.data // 2}",
                  {"mesh.tensor": t, "mesh.data": c.mesh.data // 2}))
  if c.tokens_per_rank >= 2 and c.tokens_per_rank % 2 == 0:
    out.append((f"tokens_per_rank={c.tokens_per_rank // 2}",
                {"tokens_per_rank": c.tokens_per_rank // 2}))
  return out


def explain_does_not_fit(c: ml_collections.ConfigDict, err: memory.DoesNotFit,
                         devices=None) -> memory.DoesNotFit:
  """`err` with the estimated need of each `knob_variants` change (compiled ahead of time on
  abstract shapes; a change that fails to compile says so). distca's memory_mode 'auto' has
  tried 'resend' before failing, so its changes are estimated on top of 'resend'."""
  devices = devices if devices is not None else jax.devices()
  if c.attention.backend == "distca" and c.attention.distca.memory_mode == "auto":
    c = config_lib.with_overrides(c, {"attention.distca.memory_mode": "resend"})
  parts = []
  for label, over in knob_variants(c, len(devices)):
    try:
      _, info = compile_train_step(config_lib.with_overrides(c, over), devices=devices)
      need = info.get("need_per_device_bytes")
      parts.append(f"{label} needs {memory.format_bytes(need)}"
                   + (" (fits)" if need <= err.capacity else ""))
    except Exception as e:  # pylint: disable=broad-except  # report the knob, keep the others
      parts.append(f"{label}: does not compile ({type(e).__name__})")
  return err.with_knobs("estimated with one change each: " + ", ".join(parts) if parts
                        else "no single knob change to try")
