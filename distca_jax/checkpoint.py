"""Orbax checkpoints of the train state in WORKDIR/checkpoints: asynchronous, keep the last k.

What is saved is everything a resumed run needs to continue exactly: the TrainState (step,
parameters, optimizer state, RNG) plus a small JSON record of the run (the data source settings
and seed). Data needs no cursor of its own: every source is a pure function of (config, seed,
step), so the restored step is the data position. Resuming with different data settings or seed is
refused, because it would silently change the batches.
"""

from __future__ import annotations

import os

import jax
import ml_collections
import orbax.checkpoint as ocp

# Config keys whose change would make a resumed run see other data than the original one.
_DATA_KEYS = ("seed", "tokens_per_rank", "rows_per_rank")


def _data_record(c: ml_collections.ConfigDict) -> dict:
  rec = {k: c[k] for k in _DATA_KEYS}
  rec["data"] = c.data.to_dict()
  rec["mesh_data"] = c.mesh.data
  return rec


class CheckpointManager:
  """Thin wrapper: save every `checkpoint_every` steps, keep `keep_checkpoints`, restore latest."""

  def __init__(self, workdir: str, c: ml_collections.ConfigDict):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self._record = _data_record(c)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=c.keep_checkpoints, enable_async_checkpointing=c.async_checkpoint, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "run"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), run=ocp.args.JsonSave(self._record)))

  def restore(self, abstract_state, step: int | None = None):
    """The state at `step` (latest by default), placed with the shardings of `abstract_state`."""
    step = self.latest_step() if step is None else step
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), run=ocp.args.JsonRestore()))
    saved = restored["run"]
    if saved != self._record:
      diff = {k: (saved.get(k), v) for k, v in self._record.items() if saved.get(k) != v}
      raise ValueError(
          f"checkpoint at step {step} in {self.directory} was written with other data settings "
          f"(saved vs now: {diff}); resuming would change the batches. Use a new --workdir or the "
          "original settings.")
    return restored["state"]

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
