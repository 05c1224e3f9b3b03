"""The ``distca`` core-attention backend of the trainer: plan each batch on the input thread
(``distca_jax.plan``), run the data plane inside the step (``distca_jax.dataplane``).

Reading the options (``Options.from_config``) only reads the config. The caps a config leaves at
0 are sized at startup by an explicit step, ``from_first_batches`` (``backends.build`` runs it):
it samples the run's first batches (``startup_capacity``), plans them without caps and adds
headroom; it is the one part of this backend that reads the data pipeline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import config as config_lib
from distca_jax import metrics as metrics_lib
from distca_jax import pipeline, side_pingpong
from distca_jax.baselines import device as baselines_device
from distca_jax.baselines import packing
from distca_jax.checks import check_float, check_int
from distca_jax.data import run_source
from distca_jax.dataplane import side
from distca_jax.dataplane import (DEFAULT_EXCHANGE_BUCKETS, MEMORY_MODES, DispatchOptions,
                                  ExchangeOptions, dispatch_attention, mesh_and_servers,
                                  resolve_collective)
from distca_jax.plan import cost, ticks
from distca_jax.plan.buckets import DEFAULT_BUCKETS, bucket_specs
from distca_jax.plan.capacity import (CAP_FIELDS, EXCHANGE_FIELDS, Capacity, caps_with_headroom,
                                      default_capacity, resolve_capacity, row_multiple)
from distca_jax.plan.options import PlanOptions
from distca_jax.plan.spec import (HostPlan, PlanSpec, device_layout, host_plan, nano_batch_rows,
                                  suggest_caps)
from distca_jax.plan.two_level import TwoLevel, safe_relay

# The two-level exchange's relay rows (``Options``; 0 = auto).
RELAY_FIELDS = ("q_relay", "kv_relay")
PLAN_KEY = "distca_plan"  # the key of ``layout.extra`` the CAD step reads
DOC_LENS_KEY = "doc_lens"  # the local step's (``packed_dp``'s) table
# With ``Options.plan_stats``: float32 [rows, 4], every row the batch's PLAN_STATS of its plans
# (the host logs them; the step does not read them).
PLAN_STATS_KEY = "plan_stats"
PLAN_STATS = ("imbalance_before", "imbalance_after", "moved_rows", "crosses")


def plan_stats(plans: list[HostPlan]) -> np.ndarray:
  """[4] float32 ``PLAN_STATS`` of one batch's plans: the largest max / mean load before and
  after balancing, the query plus key/value rows sent between devices, and whether any moves."""
  return np.array([max(hp.plan.imbalance_before for hp in plans),
                   max(hp.plan.imbalance_after for hp in plans),
                   sum(int(hp.plan.pair_q_rows.sum() + hp.plan.pair_kv_rows.sum()) for hp in plans),
                   float(any(hp.plan.crosses for hp in plans))], np.float32)


@dataclasses.dataclass(frozen=True)
class Options:
  """Options of the ``distca`` backend (``from_config``: ``config.attention.distca``, the kernel
  and the model's shapes; caps left at 0 are sized by ``from_first_batches``).

  Attributes:
    tolerance, min_shard, min_gain: the balancer's (``plan.PlanOptions``); ``min_shard`` None
      takes ``plan.auto_min_shard`` of the batch's tokens per row (the config's 0).
    intra_host_gbps, inter_host_gbps: the link rates the balancer prices moves with
      (``plan.PlanOptions``); its hosts are ``servers_per_host``'s (below).
    q_send, kv_send, q_recv, kv_recv, q_tokens, kv_tokens, tasks: caps per device for one call
      (``R/n`` rows of ``tokens_per_row``); 0 takes ``plan.default_capacity``'s value.
    kernel, memory_mode: ``dataplane.DispatchOptions``.
    rows_per_rank, nano_batches: the rows of one call per device (the trainer's ``R``; ``R / M``
      under a pipeline of M microbatches) and ``n``.
    q_heads, kv_heads, head_dim, dtype_bytes: the byte model.
    linear_pairs_per_token: the linear layers' work per token in pair units, for the gate
      (``metrics.linear_pairs_per_token`` of the model).
    data_axis, head_axis: the mesh axes the rows are sharded over (a tuple: their product; a
      pipeline's ``('pipe', 'data')``) and of the heads.
    server_axis, server_groups: the axis every exchange runs over (None = ``data_axis``: every
      row device is a server of one group) and the number of server groups: a call's rows form
      ``server_groups`` consecutive equal blocks of devices, each planned on its own over its own
      ``server_axis`` ranks (``dataplane.DispatchOptions.server_axis``). Per-stage CAD under a
      pipeline (``attention.distca.pool_stages=False``): ``'data'`` and P, each stage's data
      ranks serve only that stage's rows.
    collective, exchange_buckets, signal_only: ``dataplane.ExchangeOptions`` (the second is its
      ``buckets``). Training takes the config's ``collective`` (default 'auto') and
      ``exchange_buckets`` and ``signal_only=False``; benchmarks pass others to
      ``backends.build(c, ...)``.
    servers_per_host, q_relay, kv_relay: servers per host (0 = auto: servers / processes in a
      multi-process job, all servers otherwise; ``servers_per_host_for``), which the balancer
      balances inside first (``plan_options_for``) and the two-level exchange (the collective
      resolves to 'two_level'; ``plan.two_level``) runs its legs over, and the relay
      buffers' rows (0 = the safe bound ``plan.two_level.safe_relay``, unless
      ``from_first_batches`` sized them).
    cost_table: a measured ``plan.CostTable`` JSON: plans then also predict per-server kernel
      time (benchmarks pass it to ``backends.build``; balancing stays in pairs).
    local_steps: a batch whose plans move no row runs the train step's second branch, with
      ``packed_dp``'s attention (each device its own rows, no exchange, no plan buffers);
      without a pipeline only (``data_axis`` 'data').
    window: the layers' sliding window (0 = full causal): the plans' (``plan.PlanOptions``)
      and the kernel's (``dataplane.DispatchOptions``).
    side_stream_blocks: > 0: the exchange of one server per group runs on a side CUDA stream
      with this many CTAs (``dataplane.side``; ``ExchangeOptions.side_blocks``) and the backend
      offers ``beside_fn`` (``DistcaBackend``); 0 = off.
    local_gain: with the local branch, a batch whose every plan (nano-batch, server group)
      could gain less than this (``plan.predicted_step_gain`` of its layout) moves nothing and
      runs that branch; 0 = only batches whose plans move nothing anyway. ``min_gain`` gates
      each plan of the other batches, whose exchange runs whatever their plans move.
    buckets: compiled exchange capacities (``plan.buckets``): each call runs the smallest its
      plans fit; 1 = the caps' buffers always.
    plan_stats: ``host_prepare`` also returns ``PLAN_STATS_KEY`` (the trainer logs them per
      layer type); on for models with local layers (``model.layer_pattern``).
  """
  tolerance: float = cost.DEFAULT_TOLERANCE
  min_shard: int | None = None
  min_gain: float = 0.0
  intra_host_gbps: float = cost.INTRA_HOST_GBPS
  inter_host_gbps: float = cost.INTER_HOST_GBPS
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
  server_axis: str | tuple[str, ...] | None = None
  server_groups: int = 1
  head_axis: str | None = "tensor"
  collective: str = "auto"
  exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS
  signal_only: bool = False
  servers_per_host: int = 0
  q_relay: int = 0
  kv_relay: int = 0
  cost_table: str = ""
  local_steps: bool = True
  local_gain: float = 0.0
  window: int = 0
  side_stream_blocks: int = 0
  buckets: int = DEFAULT_BUCKETS
  plan_stats: bool = False

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    """The run's options as its config states them (no planning, no data: caps left at 0 stay
    0 until ``from_first_batches``)."""
    d = c.attention.distca
    m = config_lib.model_config(c)
    # Under a pipeline (mesh.pipe > 1) one call is one tick: rows_per_rank / M rows of every
    # pipe x data rank, all of them servers (pooled), or each stage's data ranks the servers of
    # that stage's rows (pool_stages=False).
    pipe = c.mesh.pipe > 1
    per_stage = pipe and not d.pool_stages
    rows = c.rows_per_rank // (ticks.resolve_microbatches(c.pipeline.microbatches, c.mesh.pipe)
                               if pipe else 1)
    return cls(tolerance=d.tolerance, min_shard=d.min_shard or None, min_gain=d.min_gain,
               intra_host_gbps=d.intra_host_gbps, inter_host_gbps=d.inter_host_gbps,
               **{f: d[f] for f in CAP_FIELDS},
               kernel=c.attention.kernel, memory_mode=d.memory_mode,
               rows_per_rank=rows, nano_batches=c.attention.nano_batches,
               data_axis=(pipeline.PIPE_AXIS, "data") if pipe else "data",
               server_axis="data" if per_stage else None,
               server_groups=int(c.mesh.pipe) if per_stage else 1,
               q_heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim,
               dtype_bytes=jnp.dtype(m.dtype).itemsize,
               linear_pairs_per_token=metrics_lib.linear_pairs_per_token(m),
               collective=d.collective, exchange_buckets=d.exchange_buckets,
               servers_per_host=d.servers_per_host, q_relay=d.q_relay, kv_relay=d.kv_relay,
               local_steps=d.local_steps, side_stream_blocks=d.side_stream_blocks,
               buckets=d.buckets,
               # 'price' (price_branch.PriceBranch) decides the branch of batches whose plans
               # move rows by the step model, in place of the local_gain threshold.
               local_gain=d.local_gain if d.branch == "gain" else 0.0,
               plan_stats=any(t.kind != "full" for t in m.layer_types))

  def plan_options_for(self, num_servers: int) -> PlanOptions:
    """The planner's options of every batch over ``num_servers`` servers (``min_shard`` None:
    per the batch's rows)."""
    return PlanOptions(tolerance=self.tolerance, min_shard=self.min_shard,
                       min_gain=self.min_gain, cost_model=self.cost_table or None,
                       linear_pairs_per_token=self.linear_pairs_per_token, q_heads=self.q_heads,
                       kv_heads=self.kv_heads, head_dim=self.head_dim,
                       dtype_bytes=self.dtype_bytes, window=self.window,
                       **self.host_options(num_servers))

  def host_options(self, num_servers: int) -> dict[str, Any]:
    """The planner's hosts over ``num_servers`` servers (``servers_per_host_for``; None: one
    host) and link rates (``plan.PlanOptions`` fields)."""
    per_host = servers_per_host_for(self, num_servers)
    return {"servers_per_host": per_host if per_host < num_servers else None,
            "intra_host_gbps": self.intra_host_gbps, "inter_host_gbps": self.inter_host_gbps}

  @property
  def caps(self) -> dict[str, int]:
    return {f: getattr(self, f) for f in CAP_FIELDS}


def make(options: Options) -> "DistcaBackend":
  """The ``distca`` core-attention backend.

  ``host_prepare(doclens, tokens_per_row)`` plans each batch on the input thread (one list of
  document lengths per row; ``len(doclens) = data ranks x rows_per_rank``) and returns
  ``{'distca_plan': int32 [rows, W]}`` (with ``buckets > 1``: packed for the smallest capacity
  bucket each call's plans fit, its index in the last column, ``plan.buckets.BucketSpecs``);
  ``fn`` reads it from ``layout.extra`` and runs
  ``dataplane.dispatch_attention`` over the mesh set by ``trainer.mesh_context``. With
  ``local_steps`` (no pipeline) it also returns each row's document lengths (``'doc_lens'``)
  and ``attention.CROSSES_KEY``: a batch in which no plan moves a row (every plan gated, or
  balanced as it lies; a batch whose every plan could gain less than ``local_gain`` is planned
  that way) runs ``local_fn``, ``packed_dp``'s attention, on the train step's second branch
  (``trainer.make_train_step``): no exchange and no pass over the plan's buffers.

  With ``nano_batches = n`` (ping-pong, ``model.split_rows``) the model calls core attention once
  per nano-batch, on rows ``[i R/n, (i+1) R/n)`` of every rank's block; each nano-batch is planned
  and balanced on its own, and its plan is stored in exactly those rows of ``distca_plan``, so
  ``split_rows`` hands every call its own plan.
  """
  o = options
  try:
    exchange = ExchangeOptions(collective=o.collective, signal_only=o.signal_only,
                               buckets=o.exchange_buckets, side_blocks=o.side_stream_blocks)
    if o.memory_mode not in ("auto",) + MEMORY_MODES:
      raise ValueError(f"memory_mode={o.memory_mode!r}; choose 'auto' or one of {MEMORY_MODES}")
    # 'auto' builds 'keep' and offers 'resend' (``DistcaBackend.resend_fn``) to the pre-flight.
    dispatch = DispatchOptions(kernel=o.kernel,
                               memory_mode="keep" if o.memory_mode == "auto" else o.memory_mode,
                               data_axis=o.data_axis, server_axis=o.server_axis,
                               exchange=exchange, window=o.window)
  except ValueError as e:
    raise ValueError(f"{e} (config.attention.distca)") from e
  r = check_int("rows_per_rank", o.rows_per_rank, 1)
  n = check_int("nano_batches", o.nano_batches, 1)
  g = check_int("server_groups", o.server_groups, 1)
  # Checked here, not only by each plan's schedule(): a bad value fails at startup.
  check_float("config.attention.distca.min_gain", o.min_gain,
              hint="0 = always balance; default 0.02")
  check_float("linear_pairs_per_token", o.linear_pairs_per_token,
              hint="the trainer derives it: metrics.linear_pairs_per_token")
  check_float("config.attention.distca.local_gain", o.local_gain,
              hint="0 = only batches whose plans move nothing anyway; default 0.05")
  if r % n:
    raise ValueError(f"rows_per_rank={o.rows_per_rank!r} must be a multiple of "
                     f"nano_batches={o.nano_batches!r}")
  caps = o.caps
  for name, v in caps.items():
    check_int(f"config.attention.distca.{name} (0 = auto)", v, 0)
  rn = r // n  # rows per device in one core-attention call
  rows_per_rank, nano_batches = o.rows_per_rank, o.nano_batches
  data_axis, head_axis = o.data_axis, o.head_axis
  server_axis = dispatch.exchange_axis

  for name in ("servers_per_host", "q_relay", "kv_relay"):
    check_int(f"config.attention.distca.{name} (0 = auto)", getattr(o, name), 0)
  nb = check_int("config.attention.distca.buckets (1 = no buckets)", o.buckets, 1)
  if o.side_stream_blocks and nb > 1:
    raise ValueError(f"config.attention.distca.buckets={nb} with side_stream_blocks="
                     f"{o.side_stream_blocks}: the side-stream exchange runs one capacity; set "
                     "attention.distca.buckets=1")

  def spec_for(num_servers: int, tokens_per_row: int) -> PlanSpec:
    cap = resolve_capacity(caps, rn * tokens_per_row, rn)
    return PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_row, rows_per_device=rn,
                    capacity=cap, two_level=two_level_for(o, cap, num_servers))

  if not isinstance(o.local_steps, (bool, np.bool_)):
    raise ValueError(f"config.attention.distca.local_steps={o.local_steps!r} must be True or "
                     "False (True: batches whose plans move nothing run without the exchange)")
  # The step branch of batches in which no row crosses: packed_dp's attention (rows over 'data'
  # only).
  local = bool(o.local_steps) and data_axis == "data"

  def calls_of(doclens) -> tuple[int, list]:
    """(servers of one group, each plan's rows): group k is devices [k s, (k + 1) s); its
    nano-batch i rows [i rn, (i + 1) rn) of every device's block (model.split_rows)."""
    rows = len(doclens)
    if rows % (r * g):
      raise ValueError(f"the batch has {rows} rows, not a multiple of {rows_per_rank=} x "
                       f"server_groups={g}")
    s = rows // (r * g)
    return s, [[list(doclens[k * s * r + x]) for x in nano_batch_rows(s, r, n, i)]
               for k in range(g) for i in range(n)]

  def host_plans(doclens, tokens_per_row: int) -> list[HostPlan]:
    s, calls = calls_of(doclens)
    spec = spec_for(s, int(tokens_per_row))
    plan_options = options = o.plan_options_for(s)
    if local and o.local_gain > 0.0 and max(
        _layout_gain([sum(c[d * rn:(d + 1) * rn], []) for d in range(s)],
                     spec.tokens_per_device, o.linear_pairs_per_token, o.window)
        for c in calls) < o.local_gain:
      # Too little to win anywhere in the batch: every plan moves nothing (the local branch).
      options = dataclasses.replace(plan_options, min_gain=max(o.min_gain, o.local_gain))
    return [host_plan(c, spec, options) for c in calls]

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
    packed = [hp.packed for hp in plans]
    if nb > 1:  # each call in the smallest bucket all of its server groups' plans fit
      spec = bucket_specs(spec, nb)
      calls = calls_of(doclens)[1]
      for i in range(n):
        k = spec.choose(*[plans[j].plan for j in range(i, g * n, n)])
        for j in range(i, g * n, n):
          packed[j] = spec.pack(spec.in_bucket(calls[j], plans[j], k).packed, k)
    out = np.zeros((g, s, r, spec.width), np.int32)
    for j, p in enumerate(packed):  # group-major: plan j is group j // n, nano-batch j % n
      i = j % n
      out[j // n, :, i * rn:(i + 1) * rn] = p.reshape(s, rn, spec.width)
    extra = {PLAN_KEY: out.reshape(g * s * r, spec.width)}
    if o.plan_stats:
      extra[PLAN_STATS_KEY] = np.broadcast_to(plan_stats(plans), (len(doclens), 4)).copy()
    if local:  # what the local step reads: each row's document lengths (no row has more
      # documents than a device's task slots), and whether any plan of the step crosses
      extra[DOC_LENS_KEY] = packing.packed_doc_lens(doclens, tokens_per_row,
                                                    spec.capacity.tasks)
      extra[attn_lib.CROSSES_KEY] = np.full(len(doclens), any(hp.plan.crosses for hp in plans),
                                            np.int32)
    return extra

  def call_for(q_BxTxHxD, layout: attn_lib.Layout, softmax_scale: float,
               memory_mode: str | None):
    """The call's plan spec and ``DispatchOptions`` (checked against the mesh)."""
    if PLAN_KEY not in layout.extra:
      raise ValueError(f"the 'distca' backend needs layout.extra['{PLAN_KEY}'] (got keys "
                       f"{sorted(layout.extra)}); run backend.host_prepare on the batch "
                       "(trainer.add_host_plan)")
    mesh, devices = mesh_and_servers(None, data_axis)
    _, s = mesh_and_servers(mesh, server_axis)
    if q_BxTxHxD.shape[0] != devices * rn:
      raise ValueError(f"core attention got {q_BxTxHxD.shape[0]} rows on {data_axis}={devices}; "
                       f"the backend was built for {rows_per_rank=} / {nano_batches=} = {rn} rows "
                       "per device and call (build it with backends.build(config))")
    if devices != g * s:
      raise ValueError(f"the backend plans server_groups={g} groups but {data_axis}={devices} "
                       f"holds {devices // s} groups of {server_axis}={s} servers (build it with "
                       "backends.build(config) for this mesh)")
    spec = spec_for(s, q_BxTxHxD.shape[1])
    if nb > 1:
      spec = bucket_specs(spec, nb)
    hax = head_axis if head_axis in mesh.axis_names and mesh.shape[head_axis] > 1 else None
    # Documents never cross a row, so no task has more than a row's query or key rows: the bound
    # for flash3 (its grid is tasks x ceil(max_seqlen / 128) blocks; the buffers are up to 3x
    # longer); other kernels ignore it.
    kopts = {"max_seqlen_q": spec.tokens_per_row, "max_seqlen_k": spec.tokens_per_row}
    call = dataclasses.replace(dispatch, softmax_scale=softmax_scale, head_axis=hax,
                               kernel_options=kopts,
                               memory_mode=memory_mode or dispatch.memory_mode)
    return spec, call, mesh

  def fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *, softmax_scale: float,
         memory_mode: str | None = None):
    spec, call, _ = call_for(q_BxTxHxD, layout, softmax_scale, memory_mode)
    return dispatch_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.extra[PLAN_KEY], spec,
                              call)

  def beside_fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *,
                softmax_scale: float, send=None, back=None, order: str = "overlap"):
    spec, call, mesh = call_for(q_BxTxHxD, layout, softmax_scale, "keep")
    return side.dispatch_beside(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.extra[PLAN_KEY], spec,
                                call, mesh, send=send, back=back, order=order)

  if o.side_stream_blocks:  # the model runs its ping-pong with these (model.Transformer)
    fn.beside_fn = beside_fn
    fn.ping_pong = lambda plan, pieces, layers, x, layout, *, head_dim: (
        side_pingpong.ping_pong_beside(plan, pieces, beside_fn, layers, x, layout,
                                       head_dim=head_dim))
  resend = functools.partial(fn, memory_mode="resend") if o.memory_mode == "auto" else None
  local_fn = (functools.partial(baselines_device.packed_dp_attention, kernel=o.kernel,
                                window=o.window) if local else None)
  return DistcaBackend(fn=fn, host_prepare=host_prepare, host_plans=host_plans, caps=caps,
                       memory_mode=dispatch.memory_mode, resend_fn=resend, local_fn=local_fn,
                       beside_fn=beside_fn if o.side_stream_blocks else None)


def _layout_gain(server_doc_lens, tokens_per_rank: int, linear_pairs_per_token: float,
                 window: int) -> float:
  """``cost.layout_step_gain`` of the documents as they lie, in the pairs of a ``window``
  layer (0: full causal)."""
  if not window:
    return cost.layout_step_gain(server_doc_lens, tokens_per_rank, linear_pairs_per_token)
  loads = [int(cost.pairs(0, np.asarray(lens, np.int64), window).sum())
           for lens in server_doc_lens]
  return cost.predicted_step_gain(loads, tokens_per_rank, linear_pairs_per_token)


def batch_plan_stats(np_batch) -> dict[str, np.ndarray]:
  """{layer type name: ``PLAN_STATS`` [4]} of a host batch (a dict, or a process's
  ``LocalBatch`` blocks) planned with ``plan_stats`` (``PLAN_STATS_KEY@type`` arrays; a batch
  without them gives {})."""
  block = np_batch if isinstance(np_batch, dict) else np_batch[0][2]
  head = attn_lib.EXTRA_PREFIX + PLAN_STATS_KEY + "@"
  return {k[len(head):]: np.asarray(v[0], np.float64) for k, v in block.items()
          if k.startswith(head)}


def plan_stats_record(window: list[dict[str, np.ndarray]]) -> dict[str, float]:
  """The log record of a window of steps' ``batch_plan_stats``: per layer type ``t`` and field
  ``f`` of ``PLAN_STATS``, ``plan_<t>_<f>`` averaged over the steps (``crosses``: the share of
  steps whose plans of that type moved rows)."""
  out = {}
  for name in sorted({n for stats in window for n in stats}):
    rows = np.stack([stats[name] for stats in window if name in stats])
    out.update({f"plan_{name}_{f}": float(x) for f, x in zip(PLAN_STATS, rows.mean(axis=0))})
  return out


def servers_per_host_for(options: Options, num_servers: int) -> int:
  """``L`` of the two-level exchange: ``options.servers_per_host``, or with 0 the servers over
  the processes in a multi-process job (each process drives one host's GPUs, servers numbered
  host-major) and all servers in a one-process job. Raises unless it divides the servers."""
  s, procs = int(num_servers), jax.process_count()
  l = int(options.servers_per_host) or (s // procs if procs > 1 else s)
  if l < 1 or s % l:
    raise ValueError(f"config.attention.distca.servers_per_host={options.servers_per_host} gives "
                     f"{l} servers per host, which must divide the {s} servers of an exchange "
                     f"({procs} processes); set it to the data ranks one host holds")
  return l


def uses_two_level(options: Options) -> bool:
  """Whether the options' collective resolves to 'two_level' here (``resolve_collective``)."""
  try:
    return resolve_collective(options.collective) == "two_level"
  except ValueError as e:
    raise ValueError(f"{e} (config.attention.distca)") from e


def two_level_for(options: Options, cap: Capacity, num_servers: int) -> TwoLevel | None:
  """The plans' two-level shape when the collective resolves to 'two_level' (else None): its
  servers per host (``servers_per_host_for``) and relay rows (the options', 0 = the safe bound
  ``plan.two_level.safe_relay`` of the caps ``cap``)."""
  if not uses_two_level(options):
    return None
  l = servers_per_host_for(options, num_servers)
  return TwoLevel(l, options.q_relay or safe_relay(cap.q_send, cap.q_recv, num_servers, l),
                  options.kv_relay or safe_relay(cap.kv_send, cap.kv_recv, num_servers, l))


@dataclasses.dataclass(frozen=True)
class DistcaBackend(attn_lib.Backend):
  """The ``distca`` backend; ``host_plans(doclens, tokens_per_row) -> [HostPlan]`` (one per
  server group and nano-batch, group-major: one per nano-batch with one group) is the planning
  ``host_prepare`` packs, for benchmarks and diagnostics; ``caps`` the capacity options it was
  built with (0 = ``default_capacity``'s value); ``memory_mode`` the data plane's ('keep' or
  'resend'); ``resend_fn``, built for ``memory_mode='auto'``, is ``fn`` in the 'resend' mode,
  which the memory pre-flight takes when 'keep' does not fit (``trainer.preflight``);
  ``beside_fn(q, k, v, layout, *, softmax_scale, send, back, order)``, built with
  ``side_stream_blocks > 0``, is ``fn`` with its exchanges on the side stream spanning other
  work (``dataplane.side.dispatch_beside``; the ping-pong of ``distca_jax.side_pingpong``)."""
  host_plans: Callable[..., list[HostPlan]] | None = None
  caps: Mapping[str, int] | None = None
  memory_mode: str = "keep"
  resend_fn: Callable[..., Any] | None = None
  beside_fn: Callable[..., Any] | None = None


# ---------------------------------------------------------------------------------------------
# Startup: caps from the run's own first batches.
# ---------------------------------------------------------------------------------------------
def from_first_batches(c: ml_collections.ConfigDict, options: Options) -> Options:
  """``options`` with the caps left at 0 sized from the run's first batches
  (``startup_capacity``); ``backends.build`` calls this once per run, after ``from_config``."""
  return dataclasses.replace(options, **startup_capacity(c, options))


def startup_capacity(c: ml_collections.ConfigDict, options: Options | None = None, *,
                     data: int | None = None) -> dict[str, int]:
  """Row caps for a run: those its options leave at 0, from its own first batches.

  ``config.attention.distca.caps_from_batches = N > 0``: ``suggest_config_capacity`` over the
  run's first N batches, times ``caps_headroom``, rounded up to whole row multiples. Each cap is
  at least what the no-move layout needs: ``q_tokens`` and ``kv_tokens`` hold a device's rows
  of one call, so every batch can be planned. A later batch that would need more only moves
  less (``Plan.degraded``). ``tasks`` is never derived: a batch with more documents than task
  slots cannot be planned at all, so it keeps ``default_capacity``'s value. With the two-level
  exchange, ``q_relay`` / ``kv_relay`` left at 0 likewise (at most ``plan.two_level.safe_relay``
  of the final caps); a later batch that would relay more moves nothing (``host_plan``). Returns the
  overrides (name -> value) for the caps left at 0, or ``{}`` when N is 0 or every row cap is
  set. ``options`` default: ``Options.from_config(c)``.
  """
  options = options if options is not None else Options.from_config(c)
  d = c.attention.distca
  n = check_int("config.attention.distca.caps_from_batches", d.caps_from_batches, 0)
  headroom = float(d.caps_headroom)
  if not headroom >= 1.0:
    raise ValueError(f"config.attention.distca.caps_headroom={d.caps_headroom} must be >= 1 (a "
                     "margin over the sampled batches)")
  auto = [f for f in EXCHANGE_FIELDS + ("q_tokens", "kv_tokens") if not getattr(options, f)]
  servers = _servers(c, options, data)
  two = uses_two_level(options)
  relay = [f for f in RELAY_FIELDS if two and not getattr(options, f)]
  if n == 0 or not (auto or relay):
    return {}
  sugg = suggest_config_capacity(c, options, num_batches=n, data=data)
  rows = int(c.tokens_per_rank) * _call_rows(options)
  out = caps_with_headroom(sugg, rows, headroom, auto)
  if relay:  # the sampled relay rows with headroom, within the safe bound of the final caps
    cap = resolve_capacity({**options.caps, **out}, rows, _call_rows(options))
    l, mult = servers_per_host_for(options, servers), row_multiple(rows)
    for f, send, recv in (("q_relay", cap.q_send, cap.q_recv),
                          ("kv_relay", cap.kv_send, cap.kv_recv)):
      if f in relay:
        out[f] = min(safe_relay(send, recv, servers, l),
                     max(mult, -(-math.ceil(sugg[f] * headroom) // mult) * mult))
  return out


def _servers(c: ml_collections.ConfigDict, options: Options, data: int | None = None) -> int:
  """Servers of one exchange: data ranks (``data`` or the config's) x pipe stages over the
  server groups."""
  data = config_lib.data_ranks(c) if data is None else data
  return data * max(int(c.mesh.pipe), 1) // int(options.server_groups)


def _call_rows(options: Options) -> int:
  """Rows a device holds in one core-attention call: ``rows_per_rank / nano_batches`` (under a
  pipeline ``from_config`` already divided ``rows_per_rank`` by the microbatches)."""
  return int(options.rows_per_rank) // int(options.nano_batches)


def _calls(c, doclens, data: int, groups: int = 1) -> list[list]:
  """The rows of each plan of one batch, as ``host_prepare`` plans them: one per nano-batch,
  or under a pipeline one per tick (``plan.ticks.tick_rows``: every stage's rows, on ``pipe x
  data`` servers) and, with ``groups`` P (per-stage CAD), one per tick and stage (that stage's
  rows, on its ``data`` servers)."""
  r = int(c.rows_per_rank)
  if c.mesh.pipe > 1:
    per_tick = ticks.tick_rows(doclens, stages=c.mesh.pipe, rows_per_rank=r,
                               microbatches=c.pipeline.microbatches)
    size = len(per_tick[0]) // groups
    return [rows[k * size:(k + 1) * size] for rows in per_tick for k in range(groups)]
  n = int(c.attention.nano_batches)
  return [[doclens[x] for x in nano_batch_rows(data, r, n, i)] for i in range(n)]


def suggest_config_capacity(c: ml_collections.ConfigDict, options: Options | None = None, *,
                            num_batches: int = 32, quantile: float = 1.0,
                            data: int | None = None) -> dict[str, int]:
  """Caps for a run config from its own data source: ``config.attention.distca`` overrides.

  Plans ``num_batches`` batches of ``c.data`` (the steps a run starts with) the way
  ``host_prepare`` will (per nano-batch; under a pipeline per tick, over ``pipe x data``
  servers, or per tick and stage over ``data`` servers with ``pool_stages=False``), without
  caps, and returns ``suggest_capacity``'s envelope as a dict of ``plan.CAP_FIELDS``, with
  ``q_relay`` / ``kv_relay`` when the collective resolves to 'two_level'
  (``plan.spec.suggest_caps``; e.g. print them as ``--config.attention.distca.<name>=<value>``
  flags).

  Args:
    c: the run config (``config.base_config`` tree).
    options: the backend's options (default ``Options.from_config(c)``): the balancer's
      tolerance and ``min_shard`` and the attention shapes.
    num_batches: batches to sample.
    quantile: per-field quantile over the batches (1.0 = the maximum seen).
    data: the data-axis size; default ``config.data_ranks(c)``.
  """
  o = options if options is not None else Options.from_config(c)
  if data is None:
    data = config_lib.data_ranks(c)
  t, rn = int(c.tokens_per_rank), _call_rows(o)
  groups = int(o.server_groups)
  servers = _servers(c, o, data)
  src = run_source(c, data)
  spec = PlanSpec(num_servers=servers, tokens_per_row=t, rows_per_device=rn,
                  capacity=default_capacity(rn * t, rn))
  layouts = [device_layout(rows, spec)[0]
             for step in range(num_batches)
             for rows in _calls(c, src.doclens(step), data, groups)]
  # The balancer's tolerance and min_shard and the attention shapes. No gate (min_gain): every
  # sampled batch is balanced, so the caps also hold the batches a gate leaves unmoved.
  sizing = PlanOptions(tolerance=o.tolerance, min_shard=o.min_shard, q_heads=o.q_heads,
                       kv_heads=o.kv_heads, head_dim=o.head_dim,
                       **o.host_options(servers)).for_rows(t)
  two = uses_two_level(o)
  cap, relay = suggest_caps(layouts, servers, rn * t, quantile=quantile,
                            multiple=row_multiple(rn * t), options=sizing,
                            servers_per_host=servers_per_host_for(o, servers) if two else 0)
  return dict(dataclasses.asdict(cap), **dict(zip(RELAY_FIELDS, relay or ())))
