"""The ``distca`` core-attention backend of the trainer: plan each batch on the input thread
(``distca_jax.plan``), run the data plane inside the step (``distca_jax.dataplane``)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Mapping

import jax.numpy as jnp
import ml_collections
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import config as config_lib
from distca_jax import metrics as metrics_lib
from distca_jax import pipeline
from distca_jax.checks import check_float, check_int
from distca_jax.dataplane import (DEFAULT_EXCHANGE_BUCKETS, DispatchOptions, ExchangeOptions,
                                  dispatch_attention,
                                  mesh_and_servers)
from distca_jax.plan import cost, sizing
from distca_jax.plan.capacity import CAP_FIELDS, resolve_capacity
from distca_jax.plan.spec import (HostPlan, PlanSpec, host_plan,
                                  nano_batch_rows)

PLAN_KEY = "distca_plan"  # the one key of ``layout.extra`` this backend reads


@dataclasses.dataclass(frozen=True)
class Options:
  """Options of the ``distca`` backend (``from_config``: ``config.attention.distca``, the kernel,
  the model's shapes and the run's startup caps).

  Attributes:
    tolerance, min_shard, min_gain: the balancer's (``plan.schedule``); ``min_shard`` 0 takes
      ``plan.auto_min_shard``.
    q_send, kv_send, q_recv, kv_recv, q_tokens, kv_tokens, tasks: caps per device for one call
      (``R/n`` rows of ``tokens_per_row``); 0 takes ``plan.default_capacity``'s value.
    kernel, memory_mode: ``dataplane.DispatchOptions``.
    rows_per_rank, nano_batches: the rows of one call per device (the trainer's ``R``; ``R / M``
      under a pipeline of M microbatches) and ``n``.
    q_heads, kv_heads, head_dim, dtype_bytes: the byte model.
    linear_pairs_per_token: the linear layers' work per token in pair units, for the gate
      (``metrics.linear_pairs_per_token`` of the model).
    data_axis, head_axis: the mesh axes of the servers (a tuple: their product; a pipeline's
      ``('pipe', 'data')``) and of the heads.
    collective, exchange_buckets, signal_only: ``dataplane.ExchangeOptions`` (the second is its
      ``buckets``). Training takes the config's ``collective`` (default 'auto') and
      ``exchange_buckets`` and ``signal_only=False``; benchmarks pass others to
      ``backends.build(c, ...)``.
    cost_table: a measured ``plan.CostTable`` JSON: plans then also predict per-server kernel
      time (benchmarks pass it to ``backends.build``; balancing stays in pairs).
  """
  tolerance: float = cost.DEFAULT_TOLERANCE
  min_shard: int = 0
  min_gain: float = 0.0
  q_send: int = 0
  kv_send: int = 0
  q_recv: int = 0
  kv_recv: int = 0
  q_tokens: int = 0
  kv_tokens: int = 0
  tasks: int = 0
  kernel: str = "auto"
  memory_mode: str = "keep"
  rows_per_rank: int = 1
  nano_batches: int = 1
  q_heads: int = cost.DEFAULT_Q_HEADS
  kv_heads: int = cost.DEFAULT_KV_HEADS
  head_dim: int = cost.DEFAULT_HEAD_DIM
  dtype_bytes: int = cost.DEFAULT_DTYPE_BYTES
  linear_pairs_per_token: float = 0.0
  data_axis: str | tuple[str, ...] = "data"
  head_axis: str | None = "tensor"
  collective: str = "auto"
  exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS
  signal_only: bool = False
  cost_table: str = ""

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    """The run's options; caps left at 0 come from its first batches (``sizing``)."""
    d = c.attention.distca
    m = config_lib.model_config(c)
    # Under a pipeline (mesh.pipe > 1) one call is one tick: rows_per_rank / M rows of every
    # pipe x data rank, all of them servers; startup caps are sampled from the ticks' calls.
    caps = {**{f: d[f] for f in CAP_FIELDS}, **sizing.startup_capacity(c)}
    pipe = c.mesh.pipe > 1
    rows = c.rows_per_rank // (pipeline.resolve_microbatches(c.pipeline.microbatches, c.mesh.pipe)
                               if pipe else 1)
    return cls(tolerance=d.tolerance, min_shard=d.min_shard, min_gain=d.min_gain, **caps,
               kernel=c.attention.kernel, memory_mode=d.memory_mode,
               rows_per_rank=rows, nano_batches=c.attention.nano_batches,
               data_axis=(pipeline.PIPE_AXIS, "data") if pipe else "data",
               q_heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim,
               dtype_bytes=jnp.dtype(m.dtype).itemsize,
               linear_pairs_per_token=metrics_lib.linear_pairs_per_token(m),
               collective=d.collective, exchange_buckets=d.exchange_buckets)

  @property
  def caps(self) -> dict[str, int]:
    return {f: getattr(self, f) for f in CAP_FIELDS}


def make(options: Options) -> "DistcaBackend":
  """The ``distca`` core-attention backend.

  ``host_prepare(doclens, tokens_per_row)`` plans each batch on the input thread (one list of
  document lengths per row; ``len(doclens) = data ranks x rows_per_rank``) and returns
  ``{'distca_plan': int32 [rows, W]}``; ``fn`` reads it from ``layout.extra`` and runs
  ``dataplane.dispatch_attention`` over the mesh set by ``trainer.mesh_context``.

  With ``nano_batches = n`` (ping-pong, ``model.split_rows``) the model calls core attention once
  per nano-batch, on rows ``[i R/n, (i+1) R/n)`` of every rank's block; each nano-batch is planned
  and balanced on its own, and its plan is stored in exactly those rows of ``distca_plan``, so
  ``split_rows`` hands every call its own plan.
  """
  o = options
  try:
    exchange = ExchangeOptions(collective=o.collective, signal_only=o.signal_only,
                               buckets=o.exchange_buckets)
    dispatch = DispatchOptions(kernel=o.kernel, memory_mode=o.memory_mode,
                               data_axis=o.data_axis, exchange=exchange)
  except ValueError as e:
    raise ValueError(f"{e} (config.attention.distca)") from e
  r = check_int("rows_per_rank", o.rows_per_rank, 1)
  n = check_int("nano_batches", o.nano_batches, 1)
  # Checked here, not only by each plan's schedule(): a bad value fails at startup.
  check_float("config.attention.distca.min_gain", o.min_gain,
              hint="0 = always balance; default 0.02")
  check_float("linear_pairs_per_token", o.linear_pairs_per_token,
              hint="the trainer derives it: metrics.linear_pairs_per_token")
  if r % n:
    raise ValueError(f"rows_per_rank={o.rows_per_rank!r} must be a multiple of "
                     f"nano_batches={o.nano_batches!r}")
  caps = o.caps
  for name, v in caps.items():
    check_int(f"config.attention.distca.{name} (0 = auto)", v, 0)
  rn = r // n  # rows per device in one core-attention call
  byte_model = dict(q_heads=o.q_heads, kv_heads=o.kv_heads, head_dim=o.head_dim,
                    dtype_bytes=o.dtype_bytes)
  tolerance, min_shard, min_gain = o.tolerance, o.min_shard, o.min_gain
  cost_table, linear_pairs_per_token = o.cost_table, o.linear_pairs_per_token
  rows_per_rank, nano_batches = o.rows_per_rank, o.nano_batches
  data_axis, head_axis = o.data_axis, o.head_axis

  def spec_for(num_servers: int, tokens_per_row: int) -> PlanSpec:
    return PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_row, rows_per_device=rn,
                    capacity=resolve_capacity(caps, rn * tokens_per_row, rn))

  def host_plans(doclens, tokens_per_row: int) -> list[HostPlan]:
    rows = len(doclens)
    if rows % r:
      raise ValueError(f"the batch has {rows} rows, not a multiple of {rows_per_rank=}")
    s = rows // r
    spec = spec_for(s, int(tokens_per_row))
    # Nano-batch i: rows [i rn, (i + 1) rn) of every device's block (model.split_rows).
    return [host_plan([list(doclens[x]) for x in nano_batch_rows(s, r, n, i)], spec,
                      tolerance=tolerance, min_shard=min_shard or None,
                      cost_model=cost_table or None, min_gain=min_gain,
                      linear_pairs_per_token=linear_pairs_per_token, **byte_model)
            for i in range(n)]

  warned = []

  def host_prepare(doclens, tokens_per_row: int) -> dict[str, np.ndarray]:
    plans = host_plans(doclens, tokens_per_row)
    capped = [hp.plan.degraded_reason for hp in plans
              if hp.plan.degraded and "capacity" in hp.plan.degraded_reason]
    if capped and not warned:  # once per backend: the caps are the same for every batch
      warned.append(True)
      warnings.warn(f"distca: a batch's plan stopped short of its tolerance: {capped[0]} (caps "
                    f"{caps}; raise them in config.attention.distca, or caps_headroom / "
                    "caps_from_batches). Training goes on with that balance; this warning is "
                    "shown once.", stacklevel=2)
    spec = plans[0].spec
    s = spec.num_servers
    out = np.zeros((s, r, spec.width), np.int32)
    for i, hp in enumerate(plans):
      out[:, i * rn:(i + 1) * rn] = hp.packed.reshape(s, rn, spec.width)
    return {PLAN_KEY: out.reshape(s * r, spec.width)}

  def fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *, softmax_scale: float):
    if PLAN_KEY not in layout.extra:
      raise ValueError(f"the 'distca' backend needs layout.extra['{PLAN_KEY}'] (got keys "
                       f"{sorted(layout.extra)}); run backend.host_prepare on the batch "
                       "(trainer.add_host_plan)")
    mesh, s = mesh_and_servers(None, data_axis)
    if q_BxTxHxD.shape[0] != s * rn:
      raise ValueError(f"core attention got {q_BxTxHxD.shape[0]} rows on {data_axis}={s}; the "
                       f"backend was built for {rows_per_rank=} / {nano_batches=} = {rn} rows per "
                       "device and call (build it with backends.build(config))")
    spec = spec_for(s, q_BxTxHxD.shape[1])
    hax = head_axis if head_axis in mesh.axis_names and mesh.shape[head_axis] > 1 else None
    # Documents never cross a row, so no task has more than a row's query or key rows: the bound
    # for flash3 (its grid is tasks x ceil(max_seqlen / 128) blocks; the buffers are up to 3x
    # longer); other kernels ignore it.
    kopts = {"max_seqlen_q": spec.tokens_per_row, "max_seqlen_k": spec.tokens_per_row}
    call = dataclasses.replace(dispatch, softmax_scale=softmax_scale, head_axis=hax,
                               kernel_options=kopts)
    return dispatch_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.extra[PLAN_KEY], spec,
                              call)

  return DistcaBackend(fn=fn, host_prepare=host_prepare, host_plans=host_plans, caps=caps)


@dataclasses.dataclass(frozen=True)
class DistcaBackend(attn_lib.Backend):
  """The ``distca`` backend; ``host_plans(doclens, tokens_per_row) -> [HostPlan]`` (one per
  nano-batch) is the planning ``host_prepare`` packs, for benchmarks and diagnostics; ``caps``
  the capacity options it was built with (0 = ``default_capacity``'s value)."""
  host_plans: Callable[..., list[HostPlan]] | None = None
  caps: Mapping[str, int] | None = None


