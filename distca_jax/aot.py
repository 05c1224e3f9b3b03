"""Ahead-of-time compilation of the train step on abstract shapes: will this config fit?

Nothing is materialized: the state comes from `jax.eval_shape` with its shardings, the batch from
ShapeDtypeStructs, and `jax.jit(...).lower(...).compile()` gives XLA's per-device memory analysis.
Works for a mesh you do not have by faking devices on the CPU (`--xla_force_host_platform_device_
count`); CPU numbers approximate the GPU's (same shapes and shardings, different fusion and
scheduling), so use a GPU host of the target kind for the final word.
"""

from __future__ import annotations

import time

import jax
import ml_collections

from distca_jax import config as config_lib
from distca_jax import trainer


def compile_train_step(c: ml_collections.ConfigDict, devices=None):
  """(compiled step, info dict) for config `c` on `devices` (default: all visible)."""
  config_lib.validate(c)
  run = trainer.setup_run(c, devices=devices)
  mesh, model, tx, source = run.mesh, run.model, run.tx, run.source
  # Batch shapes (a backend's plan arrays included) from one real host batch: cheap, and the
  # shapes never depend on the batch.
  np_batch = trainer.add_host_plan(source.batch(0), run.backend, source.doclens(0),
                                   c.tokens_per_rank)
  sh = trainer.rows_sharding(mesh)  # the batch's sharding
  batch = {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for k, a in np_batch.items()}
  t0 = time.time()
  with trainer.mesh_context(mesh):
    step = trainer.jit_train_step(c, model, tx, mesh, run.state_shardings, tuple(batch))
    lowered = step.lower(run.abstract_state, batch)
  t1 = time.time()
  compiled = lowered.compile()
  t2 = time.time()
  info = {
      "mesh": dict(mesh.shape),
      "device_kind": mesh.devices.flat[0].device_kind,
      "params": model.cfg.num_params(),
      "lower_s": t1 - t0,
      "compile_s": t2 - t1,
  }
  info.update(memory_fields(compiled))
  return compiled, info


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                 "alias_size_in_bytes", "generated_code_size_in_bytes")


def memory_fields(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled program, bytes per device ({} when not reported):
  MEMORY_FIELDS and ``total_per_device_bytes`` = arguments + outputs + temporaries - aliases
  (donated state aliases its output, so this bounds the live peak)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  out = {f: int(getattr(mem, f, 0) or 0) for f in MEMORY_FIELDS}
  out["total_per_device_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                   + out["temp_size_in_bytes"] - out["alias_size_in_bytes"])
  return out
