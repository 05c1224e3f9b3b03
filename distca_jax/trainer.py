"""The training system: sharded state, the pure train step, and the loop around it.

`train_and_evaluate(config, workdir)` is the whole job; every piece it uses is importable on its own
(notebooks build a model with `make_model`, state with `create_train_state`, and step with
`make_train_step`). A workdir that holds a checkpoint resumes by itself: parameters, optimizer
state, step (which is also the data position, since every source is a pure function of the step)
and the RNG.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
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
from distca_jax import checkpoint as ckpt_lib
from distca_jax import config as config_lib
from distca_jax import metrics as metrics_lib
from distca_jax import pipeline
from distca_jax import profiling
from distca_jax import sharding as shard_lib
from distca_jax.data import make_source
from distca_jax.model import Transformer

BATCH_KEYS = ("inputs", "targets", "loss_mask", "segment_ids", "positions")


@flax.struct.dataclass
class TrainState:
  step: jax.Array        # int32 scalar: optimizer steps taken (= index of the next batch)
  params: Any            # float32 master weights
  opt_state: Any         # optax state (float32)
  rng: jax.Array         # uint32 key data; step keys are fold_in(rng, step)


# ----------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------
def make_backend(c: ml_collections.ConfigDict) -> attn_lib.Backend:
  """The configured core-attention backend (options from `config.attention`)."""
  options = {}
  if c.attention.backend == "local":
    options = dict(block_q=c.attention.block_q, block_k=c.attention.block_k)
  elif c.attention.backend == "distca":
    # The plan's byte model uses the model's shapes; rows_per_rank fixes the plan's layout.
    m = config_lib.model_config(c)
    from distca_jax import dispatch  # pylint: disable=import-outside-toplevel
    options = dict(c.attention.distca.to_dict())
    for name in ("caps_from_batches", "caps_headroom"):
      options.pop(name)
    pipe = c.mesh.pipe > 1  # a call is one tick: rows_per_rank / M rows of every pipe x data rank
    if not pipe:  # (caps under the pipeline: set them, or default_capacity's fractions)
      options.update(dispatch.startup_capacity(c))
    rows_per_call = c.rows_per_rank // (pipeline.resolve_microbatches(
        c.pipeline.microbatches, c.mesh.pipe) if pipe else 1)
    options = dict(options, rows_per_rank=rows_per_call,
                   data_axis=(pipeline.PIPE_AXIS, "data") if pipe else "data",
                   nano_batches=c.attention.nano_batches, q_heads=m.n_heads,
                   kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                   dtype_bytes=jnp.dtype(m.dtype).itemsize,
                   linear_pairs_per_token=metrics_lib.linear_pairs_per_token(m))
  elif c.attention.backend in ("packed_dp", "cp", "wlb"):
    b = c.attention.baselines
    options = dict(kernel=b.kernel, max_docs_per_row=b.max_docs_per_row)
    if c.attention.backend != "packed_dp":
      options.update(cp_size=b.cp_size, rows_per_rank=c.rows_per_rank)
    if c.attention.backend == "wlb":
      from distca_jax.baselines import ModelDims  # imported lazily like the backend itself
      options.update(alpha=b.wlb_alpha,
                     balance_len=ModelDims.from_model(config_lib.model_config(c)).balance_len)
  backend = attn_lib.get_backend(c.attention.backend, **options)
  if c.mesh.pipe > 1:  # host plans per pipeline tick
    backend = pipeline.per_tick_backend(backend, stages=c.mesh.pipe, rows_per_rank=c.rows_per_rank,
                                        microbatches=c.pipeline.microbatches)
  return backend


def make_model(c: ml_collections.ConfigDict, backend: attn_lib.Backend | None = None) -> Transformer:
  """The model with the configured core-attention backend bound in."""
  backend = backend or make_backend(c)
  return Transformer(config_lib.model_config(c), backend.fn, c.attention.nano_batches,
                     c.pipeline.microbatches)


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


def _init_attention(q, k, v, layout, *, softmax_scale):
  """Stand-in core attention for `init`: core attention has no parameters, so any function of
  the right shape gives the same parameters, and this one needs no plan or kernel."""
  del k, v, layout, softmax_scale
  return q


def _init_fn(c, model, tx, *, boxed: bool):
  def init():
    t = 8  # parameter shapes do not depend on the sequence length
    tokens = jnp.zeros((1, t), jnp.int32)
    layout = attn_lib.Layout(jnp.ones((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None])
    init_model = model.clone(core_attention=_init_attention, nano_batches=1)
    key = jax.random.key(c.seed)
    params = init_model.init(jax.random.fold_in(key, 1), tokens, layout)["params"]
    if not boxed:
      params = nn.meta.unbox(params)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                      rng=jax.random.key_data(jax.random.fold_in(key, 2)))
  return init


@contextlib.contextmanager
def mesh_context(mesh):
  """Mesh + logical-axis rules, active while tracing model code."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(shard_lib.RULES):
    yield


def state_shardings(c, model, tx, mesh):
  """(abstract state, shardings): shapes from eval_shape, shardings from the logical names."""
  with mesh_context(mesh):
    boxed = jax.eval_shape(_init_fn(c, model, tx, boxed=True))
  specs = nn.get_partition_spec(boxed)
  shardings = shard_lib.tree_shardings(mesh, specs)
  abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          nn.meta.unbox(boxed), shardings)
  return abstract, shardings


def create_train_state(c, model, tx, mesh):
  """Fresh state, born sharded: jit(init, out_shardings=...) never materializes a full copy."""
  _, shardings = state_shardings(c, model, tx, mesh)
  with mesh_context(mesh):
    return jax.jit(_init_fn(c, model, tx, boxed=False), out_shardings=shardings)()


EXTRA_PREFIX = attn_lib.EXTRA_PREFIX  # batch keys holding a backend's host-made arrays


def layout_of(batch) -> attn_lib.Layout:
  extra = {k[len(EXTRA_PREFIX):]: v for k, v in batch.items() if k.startswith(EXTRA_PREFIX)}
  return attn_lib.Layout(batch["segment_ids"], batch["positions"], extra)


def add_host_plan(np_batch: dict, backend: attn_lib.Backend, doclens, tokens_per_row: int) -> dict:
  """Runs the backend's host work (if any): rearranging the batch's tokens (`host_arrange`, the
  `cp` and `wlb` baselines) or adding plan arrays (`host_prepare`)."""
  if backend.host_arrange is not None:
    return backend.host_arrange(np_batch, doclens)
  if backend.host_prepare is None:
    return np_batch
  extra = backend.host_prepare(doclens, tokens_per_row)
  return {**np_batch, **{EXTRA_PREFIX + k: v for k, v in extra.items()}}


def make_train_step(c, model, tx) -> Callable:
  """Pure `train_step(state, batch) -> (state, metrics)`; jit and shardings go at the call site."""

  def loss_fn(params, batch):
    total, count = model.apply({"params": params}, batch["inputs"], batch["targets"],
                               batch["loss_mask"], layout_of(batch), method=Transformer.loss)
    return total / jnp.maximum(count, 1.0), count

  def train_step(state: TrainState, batch):
    (loss, count), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "loss_tokens": count,
               "lr": learning_rate(c, state.step)}
    return new_state, metrics

  return train_step


def jit_train_step(c, model, tx, mesh, state_sh, batch_keys=BATCH_KEYS):
  batch_sh = {k: rows_sharding(mesh) for k in batch_keys}
  step = make_train_step(c, model, tx)
  return jax.jit(step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, shard_lib.replicated(mesh)), donate_argnums=(0,))


def rows_sharding(mesh):
  """Leading (rows) dimension over `data`, the rest replicated: any rank of array."""
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))


def device_batch(np_batch: dict, mesh) -> dict:
  """Host numpy batch -> global arrays, rows sharded over `data` (each process fills its own)."""
  sh = rows_sharding(mesh)
  return {k: jax.make_array_from_callback(a.shape, sh, lambda idx, a=a: a[idx])
          for k, a in np_batch.items()}


class Prefetcher:
  """Builds host batches (and their FLOP counts) for upcoming steps on a background thread."""

  def __init__(self, source, model_cfg, start: int, stop: int, depth: int = 2,
               backend: attn_lib.Backend | None = None):
    self._q: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = stop
    # Host seconds per batch spent in the backend's planning (`add_host_plan`), in step order:
    # benchmarks compare it with the main thread's wait in `next` (planning off the critical
    # path shows up as planning time > 0 with ~0 wait).
    self.host_plan_s: list[float] = []

    def work():
      for step in range(start, stop):
        try:
          doclens = source.doclens(step)
          batch = source.batch(step)
          if backend is not None:
            t0 = time.perf_counter()
            batch = add_host_plan(batch, backend, doclens, source.tokens_per_row)
            self.host_plan_s.append(time.perf_counter() - t0)
          item = (step, batch, doclens)
        except Exception as e:  # surfaced in the main thread, never swallowed
          self._q.put(e)
          return
        self._q.put(item)

    self._thread = threading.Thread(target=work, daemon=True)
    self._thread.start()
    self.model_cfg = model_cfg

  def next(self):
    item = self._q.get()
    if isinstance(item, Exception):
      raise item
    step, batch, doclens = item
    return step, batch, metrics_lib.step_flops(self.model_cfg, doclens), sum(map(sum, doclens))


# ----------------------------------------------------------------------------------------------
# The job
# ----------------------------------------------------------------------------------------------
def train_and_evaluate(c: ml_collections.ConfigDict, workdir: str) -> list[dict]:
  """Trains for `c.num_steps` steps in `workdir` (resuming if it holds a checkpoint).

  Returns the log records written during this call (one per `log_every` steps).
  """
  config_lib.validate(c)
  workdir = os.path.abspath(workdir)
  os.makedirs(workdir, exist_ok=True)
  log = metrics_lib.RunLog(workdir, c.num_steps, tensorboard=c.tensorboard)

  # Set up mesh
  mesh = shard_lib.make_mesh(data=c.mesh.data, tensor=c.mesh.tensor, pipe=c.mesh.pipe)
  data_size = mesh.shape["data"]
  rows = data_size * c.rows_per_rank
  log.info(f"mesh {dict(mesh.shape)} on {jax.device_count()} x {jax.devices()[0].device_kind}; "
           f"{rows} rows x {c.tokens_per_rank} tokens per step")

  # Model, optimizer, data
  backend = make_backend(c)
  if getattr(backend, "caps", None):
    auto = (f" (row caps from the first {c.attention.distca.caps_from_batches} batches x "
            f"{c.attention.distca.caps_headroom})"
            if c.attention.distca.caps_from_batches and c.mesh.pipe == 1 else "")
    log.info("distca caps per device and call (0 = dispatch.default_capacity): "
             + ", ".join(f"{k}={v}" for k, v in backend.caps.items()) + auto)
  model = make_model(c, backend)
  model_cfg = model.cfg
  tx = make_optimizer(c)
  source = make_source(c.data, rows=rows, tokens_per_row=c.tokens_per_rank,
                       vocab_size=model_cfg.vocab_size, seed=c.seed)
  log.info(f"model: {model_cfg.num_params() / 1e6:.2f}M params; attention backend "
           f"'{c.attention.backend}'; data: {source.describe()}")

  # Load checkpoint (or create fresh sharded state)
  abstract, state_sh = state_shardings(c, model, tx, mesh)
  manager = ckpt_lib.CheckpointManager(workdir, c) if c.checkpoint_every > 0 else None
  state = None
  if manager is not None and manager.latest_step() is not None:
    state = manager.restore(abstract)
    log.info(f"resumed from checkpoint at step {int(state.step)} in {workdir}")
  if state is None:
    state = create_train_state(c, model, tx, mesh)
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
  prefetch = Prefetcher(source, model_cfg, start, c.num_steps, backend=backend)
  step_fn = None
  log.info(f"compiling the train step (first step includes compilation) ...")
  window_t0, window_flops, window_tokens, window_steps = None, 0.0, 0, 0
  profile_dir = os.path.join(workdir, "profile")
  if jax.process_count() > 1:  # each process traces (and reports) its own devices
    profile_dir = os.path.join(profile_dir, f"process_{jax.process_index()}")
  if 0 <= c.profile_step < start:
    log.info(f"profile_step={c.profile_step} was done before the checkpoint (step {start}); "
             "not profiling")
  last_step_time_s = None  # of the last logged window: the unprofiled step time for idle time
  for _ in range(start, c.num_steps):
    step, np_batch, flops, tokens = prefetch.next()
    if step_fn is None:  # batch keys (a backend's plan arrays included) are known now
      with mesh_context(mesh):
        step_fn = jit_train_step(c, model, tx, mesh, state_sh, tuple(np_batch))
    profiled = step == c.profile_step
    with mesh_context(mesh):
      if profiled:  # idle time against the last unprofiled step time when there is one
        state, m, report = profiling.profile_train_step(
            step_fn, state, device_batch(np_batch, mesh), profile_dir,
            step_time_s=last_step_time_s)
        basis = ("the profiled call's wall time" if last_step_time_s is None
                 else "the last logged step_time_s")
        log.info(f"profiled step {step} (idle = step time - busy; step time is {basis}); "
                 f"report in {profile_dir}/report.md\n" + profiling.format_report(report))
      else:
        state, m = step_fn(state, device_batch(np_batch, mesh))
    if window_t0 is None or profiled:  # time from the end of the first (compiling) or profiled
      jax.block_until_ready(m)         # step: those are not representative
      window_t0, window_flops, window_tokens, window_steps = time.time(), 0.0, 0, 0
    else:
      window_flops += flops
      window_tokens += tokens
      window_steps += 1
    done = step + 1
    if done % c.log_every == 0 or done == c.num_steps:
      m = jax.device_get(m)
      rec = {k: float(v) for k, v in m.items()}
      elapsed = time.time() - window_t0
      if window_steps:
        rec["step_time_s"] = elapsed / window_steps
        rec["tokens_per_s"] = window_tokens / elapsed
        if peak:
          rec["mfu"] = window_flops / elapsed / (peak * jax.device_count())
      log.write(done, rec)
      records.append({"step": done, **rec})
      last_step_time_s = rec.get("step_time_s", last_step_time_s)
      window_t0, window_flops, window_tokens, window_steps = time.time(), 0.0, 0, 0
    if manager is not None and (done % c.checkpoint_every == 0 or done == c.num_steps):
      manager.save(done, state)
  if manager is not None:
    manager.close()
  log.close()
  return records
