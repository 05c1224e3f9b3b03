"""The training system: sharded state, the pure train step, and the loop around it.

`train_and_evaluate(config, workdir)` is the whole job; every piece it uses is importable on its own
(notebooks build a model with `make_model`, state with `create_train_state`, and step with
`make_train_step`). A workdir that holds a checkpoint resumes by itself: parameters, optimizer
state, step (which is also the data position, since every source is a pure function of the step)
and the RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import tempfile
import time
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import linen as nn

from distca_jax import attention as attn_lib
from distca_jax import backends
from distca_jax.backends import distca as distca_backend
from distca_jax import checkpoint as ckpt_lib
from distca_jax import config as config_lib
from distca_jax import memory as memory_lib
from distca_jax import metrics as metrics_lib
from distca_jax import ops
from distca_jax import price_branch as price_branch_lib
from distca_jax import profiling
from distca_jax import sharding as shard_lib
from distca_jax.price_branch import runs_local
from distca_jax.health import (HEALTH_FIELDS, BadStepWatch, TrainingDiverged,
                               spike_check)
from distca_jax.data import BATCH_KEYS, run_source
from distca_jax.errors import UserError
from distca_jax.feed import (EXTRA_PREFIX, LocalBatch, Prefetcher, add_host_plan,  # noqa: F401
                             check_plans_agree, device_batch, local_batch, local_row_ranges,
                             plan_digest, rows_sharding)
from distca_jax.memory import AUTO_KEEP_SPARE
from distca_jax.model import Transformer, execution_plan
from distca_jax.stop import StopRequest, stop_signal


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # int32 scalar: optimizer steps taken (= index of the next batch)
  params: Any            # float32 master weights
  opt_state: Any         # optax state (float32)
  rng: jax.Array         # uint32 key data; step keys are fold_in(rng, step)
  bad_steps: jax.Array   # int32 scalar: consecutive skipped steps (non-finite or spiking)
  skipped_steps: jax.Array  # int32 scalar: skipped steps in all
  health: jax.Array      # float32 [5]: running statistics of the good steps (`HEALTH_FIELDS`)


# ---- Building blocks ------------------------------------------------------------------------
def make_backend(c: ml_collections.ConfigDict, **overrides) -> attn_lib.Backend:
  """The configured core-attention backend (``backends.build``: options from the config, keyword
  ``overrides`` for options that are no config keys, e.g. a benchmark's ``signal_only``)."""
  return backends.build(c, **overrides)


def make_model(c: ml_collections.ConfigDict, backend: attn_lib.Backend | None = None) -> Transformer:
  """The model with the configured backend's core attention and the config's execution plan."""
  cfg = config_lib.model_config(c)
  return Transformer(cfg, (backend or make_backend(c)).fn, execution_plan(
      cfg, nano_batches=c.attention.nano_batches, stages=c.mesh.pipe,
      microbatches=c.pipeline.microbatches))


def make_optimizer(c: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with linear warmup + cosine decay; clipping by global norm; no decay on norm scales."""
  o = c.optim
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
      decay_steps=max(c.num_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "scale" not in jax.tree_util.keystr(path), params)

  chain = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  chain.append(optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                           mask=decay_mask))
  return optax.chain(*chain)


def learning_rate(c: ml_collections.ConfigDict, step):
  o = c.optim
  return optax.warmup_cosine_decay_schedule(
      0.0, o.lr, o.warmup_steps, max(c.num_steps, o.warmup_steps + 1), o.lr * o.min_lr_ratio)(step)


def _init_attention(q, k, v, layout, *, softmax_scale, window=0):
  """Stand-in core attention for `init` (no parameters: any function of its shape will do)."""
  del k, v, layout, softmax_scale, window
  return q


def _init_fn(c, model, tx, *, boxed: bool):
  def init():
    t = 8  # parameter shapes do not depend on the sequence length
    tokens = jnp.zeros((1, t), jnp.int32)
    layout = attn_lib.Layout(jnp.ones((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None])
    init_model = model.clone(attend=_init_attention, plan=execution_plan(model.cfg))
    key = jax.random.key(c.seed)
    params = init_model.init(jax.random.fold_in(key, 1), tokens, layout)["params"]
    if not boxed:
      params = nn.meta.unbox(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.fold_in(key, 2)),
                      bad_steps=jnp.zeros((), jnp.int32), skipped_steps=jnp.zeros((), jnp.int32),
                      health=jnp.zeros((len(HEALTH_FIELDS),), jnp.float32))
  return init


@contextlib.contextmanager
def mesh_context(mesh, fsdp: bool = False):
  """Mesh + logical-axis rules (``sharding.rules(fsdp)``), active while tracing model code."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(shard_lib.rules(fsdp)):
    yield


def state_shardings(c, model, tx, mesh):
  """(abstract state, shardings): shapes from eval_shape, shardings from the logical names
  (parameters and optimizer state over `data` too with ``mesh.fsdp``)."""
  with mesh_context(mesh, c.mesh.fsdp):
    boxed = jax.eval_shape(_init_fn(c, model, tx, boxed=True))
  specs = nn.get_partition_spec(boxed)
  shardings = shard_lib.tree_shardings(mesh, specs, c.mesh.fsdp)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          nn.meta.unbox(boxed), shardings)
  return abstract, shardings


def create_train_state(c, model, tx, mesh):
  """Fresh state, born sharded: jit(init, out_shardings=...) never materializes a full copy."""
  _, shardings = state_shardings(c, model, tx, mesh)
  with mesh_context(mesh, c.mesh.fsdp):
    return jax.jit(_init_fn(c, model, tx, boxed=False), out_shardings=shardings)()


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """What a run is made of before its first step (`setup_run`): the train job, the AOT compile
  and the benchmarks build it the same way."""
  mesh: jax.sharding.Mesh
  backend: attn_lib.Backend
  model: Transformer
  tx: optax.GradientTransformation
  abstract_state: Any    # TrainState of ShapeDtypeStructs carrying their shardings
  state_shardings: Any   # TrainState of NamedShardings
  source: Any            # the data source: batch(step), doclens(step), tokens_per_row


def setup_run(c: ml_collections.ConfigDict, devices=None, **backend_overrides) -> RunSetup:
  """Mesh (over `devices`, default all), backend (``backends.build(c, **backend_overrides)``),
  model, optimizer, abstract state with its shardings, and the data source of config `c`; nothing
  is materialized (`create_train_state` or a checkpoint restore makes the state). A config that
  cannot run (``config.validate``, or an attention kernel this host cannot run:
  ``ops.check_kernel_runs``) stops here with its one line. Host-only uses of a backend (plans
  of a GPU config on a CPU) call ``make_backend`` and skip the kernel check."""
  config_lib.validate(c)
  if backends.kernel_of(c) is not None:
    ops.check_kernel_runs(backend_overrides.get("kernel", c.attention.kernel))
  devices = list(devices) if devices is not None else jax.devices()
  mesh = shard_lib.make_mesh(data=config_lib.data_ranks(c, len(devices)), tensor=c.mesh.tensor,
                             pipe=c.mesh.pipe, devices=devices)
  if c.mesh.fsdp:
    shard_lib.check_fsdp(c.model.dim, mesh)
  backend = make_backend(c, **backend_overrides)
  model = make_model(c, backend)
  tx = make_optimizer(c)
  abstract, state_sh = state_shardings(c, model, tx, mesh)
  source = run_source(c, mesh.shape["data"])
  return RunSetup(mesh, backend, model, tx, abstract, state_sh, source)


def layout_of(batch) -> attn_lib.Layout:
  extra = {k[len(EXTRA_PREFIX):]: v for k, v in batch.items() if k.startswith(EXTRA_PREFIX)}
  return attn_lib.Layout(batch["segment_ids"], batch["positions"], extra)


def loss_sums(c, params, batch, model) -> tuple[jax.Array, jax.Array]:
  """(summed token loss, loss tokens) of ``model`` on ``batch``: the train step's loss is their
  ratio, evaluation sums both over its batches."""
  # The config's rules table, whatever rules the caller traces under: with mesh.fsdp the layers
  # gather their weights (sharding.gathered).
  with nn.logical_axis_rules(shard_lib.rules(c.mesh.fsdp)):
    return model.apply({"params": params}, batch["inputs"], batch["targets"],
                       batch["loss_mask"], layout_of(batch), method=Transformer.loss)


def make_train_step(c, model, tx, local_model=None) -> Callable:
  """Pure `train_step(state, batch) -> (state, metrics)`; jit and shardings go at the call site.

  With ``local_model`` (the model with its backend's ``local_fn``: distca without a pipeline)
  the step has two branches, each a whole step (forward, backward, update): a batch whose
  ``attention.CROSSES_KEY`` rows are all zero runs ``local_model`` (no row crosses devices), any
  other ``model``. One ``lax.cond`` per step, one compiled program: nothing is live across the
  branch boundary but the state and the batch.

  A step is skipped inside the step when its loss or gradient norm is not finite or spikes
  (`spike_check`, `train.spike_sigmas`): parameters and optimizer state stay as they were (a
  select per element, fused into the update), `step` still advances (the next batch is another
  one), and `bad_steps` (consecutive skips) and `skipped_steps` count it; the metrics carry both,
  `skipped` and `spiked` (0 or 1) and the spike limits. The loop stops the run after
  `train.max_bad_steps` consecutive skips.

  The running statistics keep their old values after a non-finite value or a gradient-norm
  spike (the update would have moved the weights abnormally: its size must not widen the band).
  A loss spike with a finite gradient norm inside its band is a hard batch, not a bad update: the
  step is still skipped, but its loss enters the statistics, so a lasting rise of the loss (a
  long document whose pieces fill several consecutive batches, a harder stretch of data) widens
  the band after one skip instead of ending the run as if it had diverged."""

  def loss_fn(params, batch, model):
    total, count = loss_sums(c, params, batch, model)
    return total / jnp.maximum(count, 1.0), count

  def train_step(state: TrainState, batch):
    if local_model is None:
      return model_step(state, batch, model)
    crosses = jnp.any(batch[EXTRA_PREFIX + attn_lib.CROSSES_KEY] != 0)
    return jax.lax.cond(crosses, functools.partial(model_step, model=model),
                        functools.partial(model_step, model=local_model), state, batch)

  def model_step(state: TrainState, batch, model):
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, model)
    with jax.named_scope(profiling.OPTIMIZER_SCOPE):  # the step breakdown's 'optimizer' class
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      (loss_spike, grad_spike), (loss_limit, grad_limit), health = spike_check(
          state.health, loss, grad_norm, c.train.spike_sigmas, c.train.spike_warmup_steps)
      spike = loss_spike | grad_spike
      ok = finite & ~spike
      updates, opt_state = tx.update(grads, state.opt_state, state.params)
      params = optax.apply_updates(state.params, updates)
      keep_if_bad = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
      params, opt_state = keep_if_bad((params, opt_state), (state.params, state.opt_state))
      health = jnp.where(finite & ~grad_spike, health, state.health)
    bad_steps = jnp.where(ok, 0, state.bad_steps + 1)
    skipped_steps = state.skipped_steps + (~ok).astype(jnp.int32)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              bad_steps=bad_steps, skipped_steps=skipped_steps, health=health)
    metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": count,
               "lr": learning_rate(c, state.step), "skipped": (~ok).astype(jnp.float32),
               "spiked": (finite & spike).astype(jnp.float32), "loss_limit": loss_limit,
               "grad_norm_limit": grad_limit, "bad_steps": bad_steps,
               "skipped_steps": skipped_steps}
    return new_state, metrics

  return train_step


def jit_train_step(c, model, tx, mesh, state_sh, batch_keys=BATCH_KEYS, local_model=None):
  return jax.jit(make_train_step(c, model, tx, local_model),
                 in_shardings=(state_sh, {k: rows_sharding(mesh) for k in batch_keys}),
                 out_shardings=(state_sh, shard_lib.replicated(mesh)), donate_argnums=(0,))


def compile_train_step(c, run: RunSetup, state, batch: dict, rows: int | None = None):
  """(compiled step, kernel workspace bytes, {'lower_s', 'compile_s'}): the one place the step is
  compiled (loop pre-flight, `aot`, benchmarks); `batch` as `rows` rows (default its own)."""
  batch = {k: jax.ShapeDtypeStruct((rows or a.shape[0],) + a.shape[1:], a.dtype,
                                   sharding=rows_sharding(run.mesh)) for k, a in batch.items()}
  local_fn = run.backend.local_fn
  local_model = run.model.clone(attend=local_fn) if local_fn is not None else None
  t0 = time.perf_counter()
  with mesh_context(run.mesh, c.mesh.fsdp):
    traced = jit_train_step(c, run.model, run.tx, run.mesh, run.state_shardings,
                            tuple(batch), local_model).trace(state, batch)
    lowered, t1 = traced.lower(), time.perf_counter()
  return (lowered.compile(), memory_lib.kernel_workspace_bytes(traced.jaxpr.jaxpr),
          {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1})


def has_held_out(c) -> bool:
  """Whether config ``c`` has held-out data to evaluate on: synthetic data always (a stream of
  another seed), files with ``data.eval_path`` or ``data.eval_fraction``."""
  return c.data.source != "files" or bool(c.data.eval_path) or bool(c.data.eval_fraction)


class Evaluator:
  """The held-out loss of a run (``eval_every`` / ``eval_steps``): the mean token loss over the
  first ``eval_steps`` batches of the held-out split (``run_source(c, data, 'eval')``, the same
  batches every time, each with the backend's host plan, this process's rows only), computed
  forward only by the model the train step runs (``loss_sums``), and its perplexity."""

  def __init__(self, c, run: RunSetup, row_ranges):
    self.c, self.mesh = c, run.mesh
    self.rows = run.mesh.shape["data"] * c.rows_per_rank
    source = run_source(c, run.mesh.shape["data"], split="eval")
    self.describe = source.describe()
    self.batches = [local_batch(source, k, row_ranges, run.backend, source.doclens(k))[0]
                    for k in range(c.eval_steps)]
    self._params_sharding = run.state_shardings.params
    self._fns: dict[int, Callable] = {}

  def __call__(self, params, model) -> dict[str, float]:
    """{'eval_loss', 'eval_ppl'} of ``params`` under ``model`` (compiled once per model)."""
    fn = self._fns.get(id(model))
    if fn is None:
      keys = self.batches[0][0][2].keys()
      fn = self._fns[id(model)] = jax.jit(
          functools.partial(loss_sums, self.c, model=model),
          in_shardings=(self._params_sharding, {k: rows_sharding(self.mesh) for k in keys}),
          out_shardings=shard_lib.replicated(self.mesh))
    with mesh_context(self.mesh, self.c.mesh.fsdp):
      sums = [fn(params, device_batch(b, self.mesh, self.rows)) for b in self.batches]
    total, count = (float(sum(np.float64(x) for x in col)) for col in zip(*jax.device_get(sums)))
    loss = total / max(count, 1.0)
    return {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 700.0)))}


class Interrupted(Exception):
  """The run stopped on a signal; the message says what was saved. ``signum``: the signal."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum


# ModelConfig fields a Hugging Face checkpoint fixes (the RoPE scaling's own fields only where
# the scaling is on).
HF_ARCHITECTURE = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim",
                   "norm_eps", "tie_embeddings", "rope_theta", "rope_scaling_factor")
HF_ROPE_SCALING = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")


def check_hf_architecture(c) -> None:
  """Raises a `UserError` unless the Hugging Face checkpoint ``c.init_from_hf`` has ``c.model``'s
  architecture (its config.json only), naming each field that differs and the override that
  matches the checkpoint."""
  from distca_jax import hf_import
  cfg = config_lib.model_config(c)
  try:
    theirs = hf_import.model_config_from_hf(c.init_from_hf)
  except hf_import.HFImportError as e:
    raise UserError(f"init_from_hf={c.init_from_hf}: {' '.join(str(e).split())}") from e
  fields = HF_ARCHITECTURE + (HF_ROPE_SCALING if cfg.rope_scaling_factor
                              or theirs.rope_scaling_factor else ())
  diff = [f for f in fields if getattr(cfg, f) != getattr(theirs, f)]
  if diff:
    raise UserError(
        f"init_from_hf={c.init_from_hf}: the checkpoint's model differs from config.model ("
        + ", ".join(f"model.{f}={getattr(cfg, f)!r} vs {getattr(theirs, f)!r}" for f in diff)
        + "); set " + " ".join(f"--config.model.{f}={getattr(theirs, f)}" for f in diff))


def params_from_hf(c, shardings):
  """The parameters of the Hugging Face Llama checkpoint ``c.init_from_hf``
  (``check_hf_architecture`` first), placed with ``shardings`` (the state's parameter
  shardings) one tensor at a time (``hf_import.load_hf_params``: every tensor's name and shape
  checked) in ``model.param_dtype``."""
  from distca_jax import hf_import
  check_hf_architecture(c)
  try:
    return hf_import.load_hf_params(c.init_from_hf, config_lib.model_config(c),
                                    shardings={"params": shardings})["params"]
  except hf_import.HFImportError as e:
    raise UserError(f"init_from_hf={c.init_from_hf}: {' '.join(str(e).split())}") from e


# ---- The job --------------------------------------------------------------------------------
def check_workdir(workdir: str) -> None:
  """Raises a UserError unless files can be created in ``workdir`` (or, when it does not exist
  yet, in its nearest existing parent, where it will be made); probes with a temporary file."""
  where = workdir
  while not os.path.exists(where):
    where = os.path.dirname(where)
  problem = None
  if not os.path.isdir(where):
    problem = f"{where} is not a directory"
  else:
    try:
      with tempfile.TemporaryFile(dir=where):
        pass
    except OSError as e:
      problem = f"cannot create files in {where}: {e.strerror}"
  if problem:
    raise UserError(f"--workdir={workdir} is not writable ({problem}); pass a --workdir you can "
                    "write to (checkpoints, metrics.jsonl and config.json go there)")


def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str,
                       device_memory_bytes: int | None = None,
                       stop: StopRequest | None = None) -> list[dict]:
  """Trains for `c.num_steps` steps in `workdir` (resuming if it holds a checkpoint).

  Returns the log records written during this call (one per `log_every` steps). The workdir is
  made only once the config and mesh are valid. On every exit, errors included, the batch
  prefetcher stops, a pending save completes, and the checkpoint manager and the log close, in
  that order. `device_memory_bytes` replaces the device's memory for the pre-flight check
  (tests). When `stop` is set (by a signal handler) the loop saves the current step, verifies
  that checkpoint and raises `Interrupted`.
  """
  workdir = os.path.abspath(workdir)
  check_workdir(workdir)
  run = setup_run(c)  # bad config, mesh or backend: an error before the workdir is made
  if c.init_from_hf:
    check_hf_architecture(c)
  try:
    os.makedirs(workdir, exist_ok=True)
  except OSError as e:
    raise UserError(f"--workdir={workdir} cannot be made ({e.strerror}); pass a --workdir you "
                    "can write to") from e
  with contextlib.ExitStack() as closers:
    log = metrics_lib.RunLog(workdir, c.num_steps, tensorboard=c.tensorboard)
    closers.callback(log.close)
    return _train(c, run, workdir, log, closers, device_memory_bytes, stop or StopRequest())


def preflight(c, run: RunSetup, state, batch: dict, rows: int | None = None,
              capacity: int | None = None, log=print):
  """The memory pre-flight: the step compiled ahead of its first call (``compile_train_step``)
  and stopped with `memory.DoesNotFit` if its need (XLA's plan plus the kernels' workspace)
  exceeds the device's memory (``capacity`` replaces it). With the distca backend in
  ``memory_mode='auto'`` (its ``resend_fn``) a step that does not fit with ``AUTO_KEEP_SPARE``
  of the memory to spare is compiled again with the servers re-sending Q/K/V in the backward
  instead of keeping them ('resend'), and runs that way if it fits (else 'keep', if it fits);
  either way one line says which mode runs. Returns (compiled step, workspace bytes, need
  bytes, the run whose model the step runs)."""
  device, resend_fn = run.mesh.devices.flat[0], getattr(run.backend, "resend_fn", None)
  step_fn, workspace, _ = compile_train_step(c, run, state, batch, rows)
  if resend_fn is None:
    return step_fn, workspace, memory_lib.check_fits(step_fn, device, capacity, workspace), run
  cap = capacity if capacity is not None else memory_lib.device_capacity_bytes(device)
  keep_need = memory_lib.step_need_bytes(step_fn, workspace)
  fmt = memory_lib.format_bytes
  if keep_need is None or cap is None or keep_need <= cap * (1 - AUTO_KEEP_SPARE):
    fits = (f"fits: {fmt(keep_need)}" if keep_need is not None and cap is not None
            else "device memory unknown")
    log(f"distca memory_mode 'auto': 'keep' ({fits} per device)")
    return step_fn, workspace, keep_need, run
  resend_run = dataclasses.replace(run, model=run.model.clone(attend=resend_fn))
  resend_step, resend_ws, _ = compile_train_step(c, resend_run, state, batch, rows)
  need = memory_lib.step_need_bytes(resend_step, resend_ws)
  if need > cap:
    if keep_need > cap:
      raise memory_lib.DoesNotFit(need, cap, workspace=resend_ws)
    log(f"distca memory_mode 'auto': 'keep' ({fmt(keep_need)} per device; 'resend' does not fit)")
    return step_fn, workspace, keep_need, run
  why = (f"over {fmt(cap)}" if keep_need > cap
         else f"leaves less than {AUTO_KEEP_SPARE:.0%} of {fmt(cap)} spare")
  log(f"distca memory_mode 'auto': 'keep' needs {fmt(keep_need)} per device, {why}; running "
      f"'resend' (servers re-send Q/K/V in the backward): {fmt(need)}")
  return resend_step, resend_ws, need, resend_run


def _train(c, run, workdir, log, closers, device_memory_bytes, stop) -> list[dict]:
  # Mesh, model, optimizer, data
  mesh, backend, model, tx, source = run.mesh, run.backend, run.model, run.tx, run.source
  rows = mesh.shape["data"] * c.rows_per_rank
  log.info(f"mesh {dict(mesh.shape)} on {jax.device_count()} x {jax.devices()[0].device_kind}; "
           f"{rows} rows x {c.tokens_per_rank} tokens per step")

  if getattr(backend, "caps", None):
    auto = (f" (row caps from the first {c.attention.distca.caps_from_batches} batches x "
            f"{c.attention.distca.caps_headroom})"
            if c.attention.distca.caps_from_batches else "")
    log.info("distca caps per device and call (0 = plan.default_capacity): "
             + ", ".join(f"{k}={v}" for k, v in backend.caps.items()) + auto
             + ("; a batch whose plans move no row (every plan's gain below local_gain="
                f"{c.attention.distca.local_gain:g}, or none moved) runs the step without the "
                "exchange (packed_dp's attention)" if backend.local_fn is not None else ""))
  elif backend.chosen:  # a baseline's configuration chosen at startup (cp, wlb)
    log.info(f"attention backend '{c.attention.backend}' options chosen at startup on sampled "
             "batches the run never trains (a positive value in the config keeps its own): "
             + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in backend.chosen))
  model_cfg = model.cfg
  log.info(f"model: {model_cfg.num_params() / 1e6:.2f}M params; attention backend "
           f"'{c.attention.backend}'; data: {source.describe()}")

  # Load checkpoint (or create fresh sharded state)
  abstract, state_sh = run.abstract_state, run.state_shardings
  manager = ckpt_lib.CheckpointManager(workdir, c) if c.checkpoint_every > 0 else None
  state = None
  if manager is not None:
    closers.callback(manager.close)
    state = manager.restore_verified(abstract, report=log.info)
    if state is not None:
      log.info(f"resumed from checkpoint at step {int(state.step)} in {workdir} (verified)")
      # A new streak of skipped steps starts here (a checkpoint written by an older version may
      # carry one).
      state = state.replace(bad_steps=jax.device_put(np.int32(0), state_sh.bad_steps))
  if state is None:
    state = create_train_state(c, model, tx, mesh)
    if c.init_from_hf:
      state = state.replace(params=params_from_hf(c, state_sh.params))
      log.info(f"parameters from the Hugging Face checkpoint {c.init_from_hf} (architecture, "
               "tensor names and shapes checked against config.model)")
  elif c.init_from_hf:
    log.info(f"init_from_hf={c.init_from_hf} not used: the run resumes from its checkpoint")
  start = int(state.step)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(c.to_json_best_effort(indent=2))

  # Update step
  peak = metrics_lib.peak_flops_per_device(c.peak_tflops)
  records: list[dict] = []
  if start >= c.num_steps:
    log.info(f"nothing to do: the checkpoint is at step {start} >= num_steps={c.num_steps}")
    return records
  row_ranges = local_row_ranges(mesh, rows)
  if jax.process_count() > 1:
    print(f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} "
          f"devices, batch rows {row_ranges} of {rows}", flush=True)
  evaluator = None
  if c.eval_every and not has_held_out(c):
    log.info(f"no evaluation (eval_every={c.eval_every}): data.source='files' has no held-out "
             "data; set data.eval_path=PREFIX or data.eval_fraction=F")
  elif c.eval_every:
    evaluator = Evaluator(c, run, row_ranges)
  if evaluator is not None:
    log.info(f"evaluation every {c.eval_every} steps on {c.eval_steps} held-out batches: "
             f"{evaluator.describe}")
  prefetch = Prefetcher(source, model_cfg, start, c.num_steps, backend=backend,
                        row_ranges=row_ranges)
  closers.callback(prefetch.close)  # runs after the wait below, before the manager and log close
  closers.callback(wait_for_dispatched_work)  # runs first
  step_fn = None
  log.info(f"compiling the train step (first step includes compilation) ...")
  # window_local: steps of the window on the train step's local branch (runs_local);
  # window_plans: the window's distca plan statistics per layer type (batch_plan_stats)
  window_t0, window_flops, window_tokens, window_steps, window_local = None, 0.0, 0, 0, 0
  window_plans = []
  profile_dir = os.path.join(workdir, "profile")
  if jax.process_count() > 1:  # each process traces (and reports) its own devices
    profile_dir = os.path.join(profile_dir, f"process_{jax.process_index()}")
  if 0 <= c.profile_step < start:
    log.info(f"profile_step={c.profile_step} was done before the checkpoint (step {start}); "
             "not profiling")
  last_step_time_s = None  # of the last logged window: the unprofiled step time for idle time
  # attention.distca.branch='price': the step's branch chosen by price (PriceBranch), built once
  # the pre-flight has chosen the memory mode.
  price_branch, pricing = price_branch_lib.wanted(c, backend), None
  watch = BadStepWatch(c.train.max_bad_steps)
  weight_rms = float(np.median(jax.device_get(_leaf_rms(state.params))))
  memory_need, workspace = None, 0
  try:
    for step in range(start, c.num_steps):
      signum = stop_signal(step, stop.signum)
      if signum is not None:
        stop.acknowledge()
        _save_on_interrupt(signum, step, state, manager, watch, abstract)
      step_, np_batch, flops, tokens = prefetch.next()
      assert step_ == step, (step_, step)
      digest = prefetch.plan_digests.pop(step)
      if step == start or (c.checkpoint_every > 0 and step % c.checkpoint_every == 0):
        check_plans_agree(step, digest)
      if step_fn is None:  # pre-flight (batch keys now known): compile, stop if it cannot fit
        step_fn, workspace, memory_need, run = preflight(c, run, state, np_batch[0][2], rows,
                                                         device_memory_bytes, log.info)
        model = run.model
        if price_branch:
          pricing = price_branch_lib.PriceBranch.start(c, backend, source, run.model, workdir,
                                                       log.info)
          closers.callback(pricing.close)
      if pricing is not None:
        pricing.decide(step, np_batch)
      profiled = step == c.profile_step
      with mesh_context(mesh, c.mesh.fsdp):
        if profiled:  # idle time against the last unprofiled step time when there is one
          state, m, report = profiling.profile_train_step(
              step_fn, state, device_batch(np_batch, mesh, rows), profile_dir,
              step_time_s=last_step_time_s)
          basis = ("the profiled call's wall time" if last_step_time_s is None
                   else "the last logged step_time_s")
          log.info(f"profiled step {step} (idle = step time - busy; step time is {basis}); "
                   f"report in {profile_dir}/report.md\n" + profiling.format_report(report))
        else:
          try:
            state, m = step_fn(state, device_batch(np_batch, mesh, rows))
          except jax.errors.JaxRuntimeError as e:
            memory_lib.raise_if_out_of_memory(e, memory_need, mesh.devices.flat[0],
                                              device_memory_bytes, workspace)
            raise
      if pricing is not None:
        pricing.after_dispatch(m, timed=step != start and not profiled)
      window_plans.append(distca_backend.batch_plan_stats(np_batch))
      watch.add(step, m)
      watch.poll()
      if window_t0 is None or profiled:  # time from the end of the first (compiling) or
        jax.block_until_ready(m)         # profiled step: those are not representative
        window_t0, window_flops, window_tokens, window_steps, window_local = (
            time.time(), 0.0, 0, 0, 0)
      else:
        window_flops += flops
        window_tokens += tokens
        window_steps += 1
        window_local += runs_local(np_batch)
      done = step + 1
      evaluate = evaluator is not None and done % c.eval_every == 0
      if done % c.log_every == 0 or done == c.num_steps or evaluate:
        m = jax.device_get(m)
        rec = {k: float(v) for k, v in m.items()}
        elapsed = time.time() - window_t0
        if window_steps:
          rec["step_time_s"] = elapsed / window_steps
          rec["tokens_per_s"] = window_tokens / elapsed
          if peak:
            rec["mfu"] = window_flops / elapsed / (peak * jax.device_count())
          if run.backend.local_fn is not None:  # distca's local branch
            rec["local_step_share"] = window_local / window_steps
        if pricing is not None:
          rec.update(pricing.record())
        rec.update(distca_backend.plan_stats_record(window_plans))  # per layer type
        window_plans = []
        if evaluate:  # after the window's timing
          rec.update(evaluator(state.params, model))
        log.write(done, rec)
        records.append({"step": done, **rec})
        last_step_time_s = rec.get("step_time_s", last_step_time_s)
        window_t0, window_flops, window_tokens, window_steps, window_local = (
            time.time(), 0.0, 0, 0, 0)
      if manager is not None and (done % c.checkpoint_every == 0 or done == c.num_steps):
        watch.poll(wait=True)
        if watch.streak:  # the state may come from the update that started the streak
          log.info(f"not saving step {done}: steps {watch.streak_start + 1}..{done} were "
                   f"skipped ({watch.first_reason})")
        else:
          manager.save(done, state)
    watch.poll(wait=True)
    if pricing is not None:
      log.info(pricing.summary())
  except TrainingDiverged as e:
    raise _diverged(e, c, manager, weight_rms) from None
  return records


def wait_for_dispatched_work() -> None:
  """Waits for every computation still running (steps are dispatched ahead of the host): an
  exit while XLA runs one destroys its thread pool under it, which aborts the process
  ('terminate called without an active exception'). Errors of those computations are not this
  wait's to report."""
  for x in jax.live_arrays():
    try:
      x.block_until_ready()
    except Exception:  # pylint: disable=broad-except  # the step's own error is already raised
      pass


def _save_on_interrupt(signum, step, state, manager, watch, abstract):
  """Saves the state after ``step`` steps (unless that checkpoint exists or the state follows
  skipped steps), reads it back to verify it, and raises `Interrupted` saying what was kept."""
  name = signal.Signals(signum).name
  watch.poll(wait=True)  # a diverged run reports that instead
  if manager is None:
    raise Interrupted(f"interrupted by {name} after step {step}; checkpointing is off "
                      "(checkpoint_every=0): nothing was saved", signum)
  if watch.streak:
    raise Interrupted(
        f"interrupted by {name} after step {step}; not saving it: steps "
        f"{watch.streak_start + 1}..{step} were skipped ({watch.first_reason}); "
        f"{manager.describe_last_good()}; rerun to resume from it", signum)
  if manager.latest_step() != step:
    manager.save(step, state)
  manager.wait()
  jax.tree.map(lambda x: x.delete(), state)  # room for the copy read back
  manager.restore(abstract, step)  # raises CheckpointError unless it verifies
  raise Interrupted(f"interrupted by {name} after step {step}: saved checkpoint step {step} at "
                    f"{manager.path(step)} and verified it (read back, hashes and finiteness); "
                    "rerun the same command to resume from it", signum)


@jax.jit
def _leaf_rms(params):
  return jnp.stack([jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
                    for x in jax.tree.leaves(params)])


def _diverged(e: TrainingDiverged, c, manager, weight_rms: float) -> TrainingDiverged:
  """The divergence error with its advice: the checkpoints from the first skipped step on move to
  WORKDIR/checkpoints_diverged/, so a rerun resumes from the newest one before it, and the rerun
  lowers the learning rate to a tenth, and to at most a tenth of the weights' median RMS
  ``weight_rms`` (Adam moves every weight by about the learning rate per step)."""
  lr = float(f"{min(c.optim.lr / 10, weight_rms / 10):.2g}")
  if manager is None:
    where = "checkpointing is off (checkpoint_every=0): start over"
  else:
    manager.wait()
    moved = manager.set_aside_from(e.first_bad)
    good = manager.latest_step()
    where = (f"checkpoint step {good} at {manager.path(good)} precedes them: resume from it"
             if good is not None else f"no checkpoint precedes step {e.first_bad + 1}: start over")
    if moved:
      where = (f"checkpoint{'s' if len(moved) > 1 else ''} {', '.join(map(str, moved))} (from the "
               f"skipped steps on) moved to {manager.diverged_directory}; " + where)
  return TrainingDiverged(
      f"{e}: the run diverged; {where} with a lower learning rate (optim.lr={lr:g}: a tenth of "
      f"{c.optim.lr:g}, at most a tenth of the weights' median RMS {weight_rms:.2g}; lower it "
      "again if this diverges too)", e.first_bad, e.last_bad, {"optim.lr": lr})
