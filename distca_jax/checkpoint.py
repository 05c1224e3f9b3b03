"""Orbax checkpoints of the train state in WORKDIR/checkpoints: asynchronous, verified, keep last k.

What is saved is everything a resumed run needs to continue exactly: the TrainState (step,
parameters, optimizer state, RNG) plus a small JSON record of the run (the data source settings
and seed). Data needs no cursor of its own: every source is a pure function of (config, seed,
step), so the restored step is the data position. Resuming with different data settings or seed is
refused, because it would silently change the batches.

Layouts. A checkpoint restores into any mesh layout and number of processes: the arrays have one
global shape in every (pipe, data, tensor) layout, and orbax reads each into the shardings of the
abstract state it is given (each process reads the pieces its devices hold). The data record
holds the global batch's rows (`batch_rows`), not `mesh.data`, so a run may resume on other
`data` sizes when `mesh.data x rows_per_rank` stays the same (e.g. data=8 x 1 row -> data=4 x 2
rows, tensor=2).

Integrity. Every checkpoint also holds an `integrity` item: two 32-bit hashes of every array's
bytes, computed on the devices from the state being saved (one extra read of the state, no host
copy, so saves stay asynchronous), committed atomically with the arrays by orbax. A state with a
non-finite parameter or optimizer moment is never saved. `restore_verified` recomputes the hashes
and finiteness of what it restored and, when a checkpoint fails (damaged bytes, unreadable files,
wrong hashes), reports its step and path and falls back to the next older one; the ones that
failed are moved to WORKDIR/checkpoints_failed/ so new saves can reuse their step numbers. The
hash of an array is a function of its global value, not of its sharding: a checkpoint verifies
on any mesh, and on many processes each process's shards contribute to one global reduction.

A checkpoint interrupted mid-write is never seen: orbax writes into a temporary directory and
renames it only when every item is written (`DISTCA_TEST_SLOW_COMMIT=STEP:SECONDS` holds that
rename for SECONDS at step STEP, so tests can kill a run inside the window).
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from distca_jax import config as config_lib
from distca_jax.errors import UserError

# Config keys whose change would make a resumed run see other data than the original one (with
# the batch's rows, `batch_rows`).
_DATA_KEYS = ("seed", "tokens_per_rank")
HASH_FORMAT = "distca-u32x2-v1"  # names the hash below; a record in another format fails to verify
SLOW_COMMIT_ENV = "DISTCA_TEST_SLOW_COMMIT"


class CheckpointError(UserError):
  """No checkpoint in the workdir verifies, or a state is not fit to be saved."""


def batch_rows(c: ml_collections.ConfigDict) -> int:
  """Rows of one step's global batch: data ranks (``mesh.data``; -1 resolved over every device
  of the job, as ``sharding.make_mesh`` does) x ``rows_per_rank``. The batches of a run depend on
  it, not on how the rows are spread over data ranks, devices or processes."""
  return config_lib.data_ranks(c) * c.rows_per_rank


def _data_record(c: ml_collections.ConfigDict) -> dict:
  """The settings a checkpoint's batches depend on (a resume with others is refused). Of the
  held-out keys only a non-zero ``data.eval_fraction`` is recorded (it takes documents out of
  training); ``data.eval_path`` changes no training batch."""
  rec = {k: c[k] for k in _DATA_KEYS}
  rec["batch_rows"] = batch_rows(c)
  rec["data"] = {k: v for k, v in c.data.to_dict().items()
                 if k != "eval_path" and not (k == "eval_fraction" and not v)}
  return rec


# ----------------------------------------------------------------------------------------------
# Integrity: hashes and finiteness of a state, on the devices
# ----------------------------------------------------------------------------------------------
def _words_u32(x: jax.Array) -> jax.Array:
  """The array's bytes as uint32 words, same shape (64-bit types: a trailing dim of 2)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  bits = jnp.dtype(x.dtype).itemsize * 8
  u = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
  if bits == 64:
    return jax.lax.bitcast_convert_type(u, jnp.uint32)
  return u.astype(jnp.uint32)


def _array_hash(x: jax.Array) -> jax.Array:
  """[2] uint32: sums mod 2^32 of word_i x odd_i and mix(word_i) x odd'_i, where odd_i are odd
  multipliers made from the element index i and mix is a bijection of uint32. Any change of one
  word changes both sums (a nonzero word difference times an odd number is nonzero mod 2^32);
  several changes cancel in both with probability ~2^-64. Sums are exact in any order, so the
  value does not depend on sharding; no reshape, so no resharding."""
  w = _words_u32(x)
  idx = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(w.ndim)):
    idx = idx + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % (1 << 32))
    stride *= w.shape[d]
  odd1 = (idx * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)) | jnp.uint32(1)
  odd2 = ((idx ^ jnp.uint32(0x85EBCA6B)) * jnp.uint32(0xC2B2AE35)) | jnp.uint32(1)
  mixed = (w ^ (w >> 15)) * jnp.uint32(0x2C1B3C6D)
  mixed = mixed ^ (mixed >> 12)
  return jnp.stack([jnp.sum(w * odd1, dtype=jnp.uint32), jnp.sum(mixed * odd2, dtype=jnp.uint32)])


def _finite(x: jax.Array) -> jax.Array:
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.all(jnp.isfinite(x))
  return jnp.array(True)


@jax.jit
def _integrity(state):
  """(hashes [n, 2] uint32, finite [n] bool), one row per leaf in tree order."""
  leaves = jax.tree.leaves(state)
  return (jnp.stack([_array_hash(x) for x in leaves]), jnp.stack([_finite(x) for x in leaves]))


def leaf_names(state) -> list[str]:
  return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def integrity_record(state) -> dict:
  """{'format', 'arrays': {leaf name: [h1, h2]}, 'nonfinite': [leaf names]} of a state (one
  device pass, then a few bytes to the host)."""
  hashes, finite = jax.device_get(_integrity(state))
  names = leaf_names(state)
  return {"format": HASH_FORMAT,
          "arrays": {n: [int(a), int(b)] for n, (a, b) in zip(names, hashes)},
          "nonfinite": [n for n, ok in zip(names, finite) if not ok]}


def verify(state, record: dict) -> list[str]:
  """Problems of a restored `state` against its saved integrity `record` ([] = verified)."""
  if record.get("format") != HASH_FORMAT:
    return [f"integrity record format {record.get('format')!r} != {HASH_FORMAT!r}"]
  now = integrity_record(state)
  problems = [f"{n} is not finite" for n in now["nonfinite"]]
  saved = record.get("arrays", {})
  if set(saved) != set(now["arrays"]):
    problems.append(f"arrays differ: saved {sorted(set(saved) - set(now['arrays']))[:3]}, "
                    f"restored {sorted(set(now['arrays']) - set(saved))[:3]}")
  problems += [f"{n}: hash {now['arrays'][n]} != saved {saved[n]}"
               for n in now["arrays"] if n in saved and saved[n] != now["arrays"][n]]
  return problems


def _first_words(e: Exception) -> str:
  """The start of an exception's message, without the reprs of bound methods and TensorStore
  specs that orbax's and TensorStore's messages carry (everything from the first '<' or '({')."""
  text = " ".join(str(e).split())
  cut = min([i for i in (text.find("<"), text.find("({")) if i >= 0] + [len(text)])
  return text[:cut].rstrip(" :,;([{") [:300] or type(e).__name__


# ----------------------------------------------------------------------------------------------
# The manager
# ----------------------------------------------------------------------------------------------
class CheckpointManager:
  """Save every `checkpoint_every` steps, keep `keep_checkpoints`, restore the newest that
  verifies."""

  def __init__(self, workdir: str, c: ml_collections.ConfigDict):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.failed_directory = os.path.join(os.path.abspath(workdir), "checkpoints_failed")
    self.diverged_directory = os.path.join(os.path.abspath(workdir), "checkpoints_diverged")
    self._record = _data_record(c)
    self._saving_step = None
    self.last_good_step: int | None = None  # newest step restored and verified, or saved here
    slow = os.environ.get(SLOW_COMMIT_ENV)
    self._slow_commit = bool(slow)
    async_options = None
    if slow:  # test hook: runs after every item is written, before the directory is renamed
      slow_step, seconds = (int(v) for v in slow.split(":"))
      async_options = ocp.AsyncOptions(post_finalization_callback=lambda: (
          time.sleep(seconds) if self._saving_step == slow_step else None))
    options = ocp.CheckpointManagerOptions(
        max_to_keep=c.keep_checkpoints, enable_async_checkpointing=c.async_checkpoint, create=True,
        async_options=async_options)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "run", "integrity"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state) -> None:
    """Saves `state` as `step`, or raises CheckpointError (saving nothing) if any of its
    parameters or optimizer moments is not finite."""
    record = integrity_record(state)
    if record["nonfinite"]:
      good = self.describe_last_good()
      raise CheckpointError(
          f"not saving step {step}: {', '.join(record['nonfinite'][:4])} "
          f"{'is' if len(record['nonfinite']) == 1 else 'are'} not finite (the run diverged); "
          f"{good}; lower optim.lr or raise optim.warmup_steps and resume from it")
    if self._slow_commit:  # test hook: the commit callback reads _saving_step, so no save of
      self._manager.wait_until_finished()  # another step may be in flight when it changes
    self._saving_step = step
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), run=ocp.args.JsonSave(self._record),
        integrity=ocp.args.JsonSave(record)))
    self.last_good_step = step

  def describe_last_good(self) -> str:
    if self.last_good_step is None:
      return "no checkpoint of this run verifies yet"
    return f"the last good checkpoint is step {self.last_good_step} at {self.path(self.last_good_step)}"

  def _restore_checked(self, abstract_state, step: int):
    """(state, problems) of one checkpoint; a data-settings mismatch raises (the user's fix)."""
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), run=ocp.args.JsonRestore(),
          integrity=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except  # damaged files fail in many ways
      return None, [f"restore failed: {type(e).__name__}: {_first_words(e)}"]
    saved = restored["run"]
    if saved != self._record:
      diff = {k: (saved.get(k), v) for k, v in self._record.items() if saved.get(k) != v}
      raise UserError(
          f"checkpoint at step {step} in {self.directory} was written with other data settings "
          f"(saved vs now: {diff}); resuming would change the batches. Use a new --workdir or the "
          "original settings (batch_rows = mesh.data x rows_per_rank: another mesh.data resumes "
          "with rows_per_rank scaled to keep the product).")
    state = restored["state"]
    return state, verify(state, restored["integrity"] or {})

  def restore(self, abstract_state, step: int | None = None):
    """The state at `step` (latest by default), placed with the shardings of `abstract_state`;
    raises CheckpointError if it does not verify."""
    step = self.latest_step() if step is None else step
    state, problems = self._restore_checked(abstract_state, step)
    if problems:
      raise CheckpointError(f"checkpoint step {step} at {self.path(step)} does not verify: "
                            + "; ".join(problems[:3]))
    return state

  def restore_verified(self, abstract_state, report=print):
    """The newest checkpoint that verifies (None if the directory has none). Each one that fails
    is reported (`report(line)`) and moved to `failed_directory`; if none verifies, raises
    CheckpointError listing them and moves nothing."""
    failed = []
    for step in reversed(self.all_steps()):
      state, problems = self._restore_checked(abstract_state, step)
      if not problems:
        for bad_step, _ in failed:
          self._move_aside(bad_step)
        self.last_good_step = step
        return state
      line = (f"checkpoint step {step} at {self.path(step)} does not verify: "
              + "; ".join(problems[:3]))
      report(line + "; trying an older one")
      failed.append((step, line))
    if not failed:
      return None
    raise CheckpointError(
        f"no checkpoint in {self.directory} verifies ({len(failed)} tried, newest first: "
        + " | ".join(line for _, line in failed)
        + "); restore the directory from a backup, or use a new --workdir to start fresh")

  def set_aside_from(self, first_step: int) -> list[int]:
    """Moves every checkpoint at step >= ``first_step`` to ``diverged_directory`` (a rerun then
    resumes from the newest one before it); returns their steps. Call after `wait`."""
    steps = [s for s in self.all_steps() if s >= first_step]
    for step in steps:
      self._move_aside(step, self.diverged_directory)
    if self.last_good_step is not None and self.last_good_step >= first_step:
      self.last_good_step = self.latest_step()
    return steps

  def _move_aside(self, step: int, directory: str | None = None) -> None:
    directory = directory or self.failed_directory
    if jax.process_index() == 0:
      os.makedirs(directory, exist_ok=True)
      dest = os.path.join(directory, f"{step}.{int(time.time())}")
      shutil.move(self.path(step), dest)
    self._manager.reload()

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()

