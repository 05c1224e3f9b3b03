"""Step-time simulation of packed_dp, cp, wlb (WLB-ideal) and distca on sampled batches.

The strategies run the project's own host code on every sampled micro-batch: the workload
sampler (``data.WorkloadSampler``), the baselines' placements and WLB packer
(``baselines.packing``, ``baselines.metrics``) and the CAD planner (``plan.schedule``).
Their per-rank tasks, tokens and bytes become seconds through ``costs`` (measured kernel table,
fitted matmul rate, fitted collectives, stated inter-node bandwidth):

  layer_r  = linear (6 N_layer x remat x tokens / rate) + attention (kernel table on the rank's
             tasks, plus one forward under remat 'full') + tensor-parallel traffic + the exposed
             part of the strategy's communication (+ distca's dispatch over its buffers)
  stage_r  = layers of the stage x layer_r (+ LM head)

distca's exchange is priced as built (``dataplane.exchange``), the collective resolved as the
system resolves 'auto' (``resolve_collective``): 'remote' (device-initiated copies, one process
driving every GPU: a job within one node) puts the busiest device's useful rows on the wire,
each row once; 'dense' (multi-process jobs: every job that spans nodes) ``S`` blocks of the
bucket ``dense_wire_rows`` picks per exchange (caps: the envelope of the sampled plans x
``caps_headroom``, as training samples them); 'ragged' the useful rows, its time set by the
largest (sender, server) group (``ragged_group_bytes``). Seconds from the 4-GPU exchange
measurements (``Calibration.remote_*``, ``dense_*``, ``ragged_*``), with
``Calibration.exchange_hidden`` of them hidden (0: no overlap measured); around them the data
plane's gathers, scatters and selects run over the whole capped send and receive buffers
(``dispatch_buffer_bytes`` / ``Calibration.dispatch_bw``). The memory mode is
resolved as the trainer's pre-flight resolves 'auto' ('keep' with ``AUTO_KEEP_SPARE`` of the
device to spare, else 'resend', whose backward runs the Q and K/V exchanges once more).
cp / wlb overlap their K/V all-gather with attention when ``cp_overlap`` (ring attention, the
paper's WLB-ideal), else expose it (this project's backend).

distca without a pipeline runs a step in which no plan moves a row (``Plan.crosses`` False for
every plan of the step: each gated by ``min_gain``, or balanced as it lies) on the train step's
local branch (``attention.distca.local_steps``, ``Options.local_steps``): packed_dp's attention
on each device's own rows, so it is priced as packed_dp's step (the plans' loads, which equal
packed_dp's; no exchange, no dispatch; every rank its own sync group). Memory is the exchange
branch's either way (XLA plans the larger branch). Under a pipeline every tick runs the exchange.

Steps: ranks that synchronize inside a layer (a CP group; every server of a CAD plan) wait for
their slowest member; without a pipeline micro-batches accumulate; with ``pipe = S > 1`` the
step is a GPipe scan of ``M + S - 1`` ticks in lockstep (``distca_jax.pipeline``), each tick as
long as its slowest device, and distca plans each tick once over every stage's rows (pipe x data
servers, bubble slots serve the others), as the trainer does, or per stage on its data ranks
(``Options.pool_stages`` False); the LM head runs after the
pipeline over pipe x data. The balance bound of a step is the same schedule with every rank at
the mean of packed_dp's per-rank compute (no communication): every strategy's
``bound_fraction`` is bound / step. Gradient synchronization is the same for every strategy and
is left out (ratios are what the tables compare).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from distca_jax import config as config_lib
from distca_jax import plan as plan_lib
from distca_jax.plan import ticks
from distca_jax.plan.buckets import bucket_capacities
from distca_jax.plan.capacity import CAP_FIELDS
from distca_jax.baselines import DEFAULT_MAX_DOCS_PER_ROW
from distca_jax.baselines import metrics as bm
from distca_jax.baselines import packing
from distca_jax.checks import check_float, check_int
from distca_jax.data.workloads import WorkloadSampler
from distca_jax.dataplane.exchange import DEFAULT_EXCHANGE_BUCKETS
from distca_jax.memory import AUTO_KEEP_SPARE, flash3_bwd_workspace_bytes
from distca_jax.sim import costs, overlap, windows
from distca_jax.sim.exchange import (KV_EXCHANGES, Q_EXCHANGES, SIM_COLLECTIVES,  # noqa: F401
                                     dispatch_buffer_bytes, distca_caps, exchange_counts,
                                     exchange_seconds, exchange_wire_bytes, ragged_group_bytes,
                                     relay_rows, resolve_collective, two_level_seconds,
                                     two_level_wire_bytes)

STRATEGIES = ("packed_dp", "cp", "wlb", "distca")
# CAD's gate and local branch as the training config sets them by default
# (``attention.distca.min_gain``, ``attention.distca.local_steps``).
_DISTCA_DEFAULTS = config_lib.base_config().attention.distca
DEFAULT_MIN_GAIN = float(_DISTCA_DEFAULTS.min_gain)
DEFAULT_LOCAL_STEPS = bool(_DISTCA_DEFAULTS.local_steps)
DEFAULT_LOCAL_GAIN = float(_DISTCA_DEFAULTS.local_gain)
WLB_ALPHAS = (1.0, 1.1, 1.2, 1.5, 2.0)
# distca's memory modes (``attention.distca.memory_mode``); 'auto' as the trainer's pre-flight.
SIM_MEMORY_MODES = ("auto", "keep", "resend")
@dataclasses.dataclass(frozen=True)
class Layout:
  """GPUs and their axes: ``gpus = data x tensor x pipe``.

  Attributes:
    gpus: GPUs in the job.
    tensor: tensor-parallel GPUs per rank (consecutive, inside a node).
    pipe: pipeline stages.
    micro_batches: micro-batches per data rank per step (pipelined when ``pipe > 1``, else
      accumulated one after the other).
  """
  gpus: int
  tensor: int = 1
  pipe: int = 1
  micro_batches: int = 1

  def __post_init__(self):
    for f in ("gpus", "tensor", "pipe", "micro_batches"):
      check_int(f, getattr(self, f), 1)
    if self.gpus % (self.tensor * self.pipe):
      raise ValueError(f"gpus={self.gpus} must be a multiple of tensor={self.tensor} x "
                       f"pipe={self.pipe}")

  @property
  def data(self) -> int:
    """Ranks of the data dimension (DP x CP for cp / wlb; the attention servers of CAD)."""
    return self.gpus // (self.tensor * self.pipe)

  @property
  def ticks(self) -> int:
    """Ticks of the GPipe scan (``M + S - 1``; ``M`` accumulated micro-batches at pipe 1)."""
    return self.micro_batches + self.pipe - 1

  @property
  def in_flight(self) -> int:
    """Micro-batch activations a stage keeps for the backward: every tick's under the GPipe
    scan (``distca_jax.pipeline``), one at pipe 1."""
    return self.ticks if self.pipe > 1 else 1


@dataclasses.dataclass(frozen=True)
class Options:
  """Strategy knobs.

  Attributes:
    tolerance: CAD's epsilon.
    min_gain: CAD's gate (0 = always balance).
    nano_batches: CAD's nano-batches (1 single stream, 2 ping-pong); the exchange's exposure is
      ``Calibration.exchange_hidden`` either way (no overlap has been measured on GPUs). The
      nano-batches' plans are the batches' micro-batches when the caller splits them
      (``step_is_local``).
    collective: distca's exchange (``SIM_COLLECTIVES``): 'auto' (the system's default:
      ``resolve_collective``), 'remote', 'dense', 'ragged' or 'two_level'.
    servers_per_host: attention servers of one host (``attention.distca.servers_per_host``):
      0 = the servers one node holds (``Calibration.gpus_per_node`` over the tensor-parallel
      GPUs of a server, as the launcher's one process per node drives them; servers are
      numbered host-major). Sets the two-level exchange's legs and, with ``host_aware``, the
      planner's hosts.
    side_stream_blocks: distca's exchange on the side stream at this SM budget
      (``attention.distca.side_stream_blocks``): the measured credit of ``sim.overlap``
      (one server only); 0 = off.
    buckets: compiled exchange capacities (``attention.distca.buckets``): a step's exchange
      and dispatch passes price the smallest bucket its plan fits (``bucket_capacity``); 1 =
      the caps' buffers always, as every measured run before buckets ran.
    host_aware: the planner balances inside hosts first and prices moves by link
      (``plan.PlanOptions.servers_per_host``, as the system's planner runs in a multi-process
      job); False plans as if every server shared one host.
    memory_mode: distca's 'keep' / 'resend' / 'auto' (the pre-flight's choice:
      ``resolve_distca``).
    exchange_buckets: the dense exchange's block sizes (``attention.distca.exchange_buckets``).
    caps_headroom: distca's caps over the sampled plans' envelope
      (``attention.distca.caps_headroom``).
    wlb_alphas: WLB-ideal's alpha grid; cp_sizes: CP group sizes tried (None = powers of two
      dividing ``data``).
    cp_overlap: cp / wlb hide their K/V traffic behind attention (ring attention, as the paper's
      baselines); False = exposed, as this project's all-gather implementation runs it.
    wlb_padded: wlb rows padded to ``Lmax = alpha T`` token slots (this project's backend: the
      linear layers run on the padding too); False = variable-length rows (the paper's WLB).
    remat: the model's rematerialization policy (``costs.REMAT_POLICIES``): what the backward
      reruns (time) and what the layers keep (memory).
    pool_stages: under a pipeline, distca plans each tick once over every stage's rows (pipe x
      data servers: ``attention.distca.pool_stages``, the default); False plans each stage's rows
      of the tick on that stage's data ranks alone (per-stage CAD).
    local_steps: without a pipeline, a distca step whose plans all move nothing
      (``step_is_local``) is priced as the system's local branch runs it: packed_dp's step, no
      exchange and no dispatch (``attention.distca.local_steps``, on by default); False: every
      step through the exchange.
    window_layers_local: distca runs the model's window layers (``ModelSpec.attention_layers``)
      on each rank's own rows, no exchange (``sim.windows``); False: every layer through the
      batch's plan.
    local_gain: with ``local_steps`` and no pipeline, a step whose every micro-batch could gain
      less than this (``plan.predicted_step_gain`` of its layout) is planned to move nothing,
      so it runs the local branch (``attention.distca.local_gain``); 0 = only steps whose plans
      move nothing anyway.
  """
  tolerance: float = plan_lib.DEFAULT_TOLERANCE
  min_gain: float = DEFAULT_MIN_GAIN
  nano_batches: int = 2
  collective: str = "auto"
  memory_mode: str = "auto"
  exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS
  caps_headroom: float = 1.1
  wlb_alphas: Sequence[float] = WLB_ALPHAS
  cp_sizes: Sequence[int] | None = None
  cp_overlap: bool = True
  wlb_padded: bool = False
  remat: str = "save_attention"
  pool_stages: bool = True
  local_steps: bool = DEFAULT_LOCAL_STEPS
  local_gain: float = DEFAULT_LOCAL_GAIN
  servers_per_host: int = 0
  host_aware: bool = True
  window_layers_local: bool = False
  side_stream_blocks: int = 0
  buckets: int = 1

  def __post_init__(self):
    check_int("servers_per_host", self.servers_per_host, 0)
    check_int("buckets", self.buckets, 1)
    if not isinstance(self.host_aware, (bool, np.bool_)):
      raise ValueError(f"host_aware={self.host_aware!r} must be True or False (True: plans "
                       "balance inside hosts first)")
    costs.check_remat(self.remat)
    if not isinstance(self.local_steps, (bool, np.bool_)):
      raise ValueError(f"local_steps={self.local_steps!r} must be True or False (True: a step "
                       "whose plans move nothing is priced without the exchange)")
    check_float("min_gain", self.min_gain, 0.0, "0: no gate")
    check_float("local_gain", self.local_gain, 0.0, "0: only steps whose plans move nothing")
    if self.collective not in SIM_COLLECTIVES:
      raise ValueError(f"collective={self.collective!r} is not priced by the simulator; use one "
                       f"of {SIM_COLLECTIVES}")
    if self.memory_mode not in SIM_MEMORY_MODES:
      raise ValueError(f"memory_mode={self.memory_mode!r} is not modelled by the simulator; use "
                       f"one of {SIM_MEMORY_MODES}")
    if not self.caps_headroom >= 1.0:
      raise ValueError(f"caps_headroom={self.caps_headroom!r} must be >= 1 (a margin over the "
                       "sampled plans' envelope)")


def sample_batches(workload: str, tokens: int, layout: Layout, batches: int, *, seed: int = 0,
                   context: int = 0, first_step: int = 0) -> list[list[list[list[int]]]]:
  """[batch][micro-batch][rank] -> document lengths (the trainer's split rule at rows)."""
  sampler = WorkloadSampler(workload, tokens, seed, context or None)
  m = layout.micro_batches
  return [[sampler.step_doclens((first_step + b) * m + i, layout.data) for i in range(m)]
          for b in range(batches)]


# ----------------------------------------------------------------------------------------------
# One micro-batch (or one pooled tick of distca): per-rank attention seconds and metrics.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MicroResult:
  """One strategy on one micro-batch: ``metrics`` (pairs, tokens, bytes per rank) and the
  rank's attention seconds per layer (``attn_s``, measured kernel table), its sync group size;
  distca: the ``plan`` (of one micro-batch, or of one tick over pipe x data servers)."""
  metrics: bm.RankMetrics
  attn_s: np.ndarray
  group: int
  plan: plan_lib.Plan | None = None


def placement_attn_s(pl: packing.Placement, spec: costs.ModelSpec, km: costs.KernelModel
                     ) -> np.ndarray:
  """[S] kernel-model seconds (one layer, forward + backward) of each rank's pieces."""
  sec = windows.mixed_task_seconds(km, pl.start_P, pl.end_P, spec)
  by_row = np.bincount(pl.row_P, weights=sec, minlength=pl.num_rows)
  return by_row.reshape(-1, pl.rows_per_rank).sum(1)


def run_packed_dp(rows, tokens, spec, km) -> MicroResult:
  pl = packing.natural_placement(rows, tokens)
  return MicroResult(bm.placement_metrics(pl, spec.dims, "packed_dp"),
                     placement_attn_s(pl, spec, km), 1)


def run_cp(rows, tokens, spec, km, cp_size: int) -> MicroResult:
  windows.check_no_windows(spec, "cp")
  lanes = bm.lanes_from_rows(rows, cp_size)
  pl = packing.cp_placement(lanes, cp_size, tokens)
  return MicroResult(bm.placement_metrics(pl, spec.dims, "cp"), placement_attn_s(pl, spec, km),
                     cp_size)


def run_wlb(rows, tokens, spec, km, cp_size: int, alpha: float) -> MicroResult:
  windows.check_no_windows(spec, "wlb")
  flat = [int(x) for r in rows for x in r]
  pk = packing.wlb_pack(flat, len(rows) // cp_size, cp_size, bm.wlb_row_tokens(alpha, tokens),
                        spec.dims.balance_len)
  pl = packing.wlb_placement(pk)
  m = bm.wlb_metrics(pk, spec.dims, alpha=alpha)
  return MicroResult(m, placement_attn_s(pl, spec, km), cp_size)


def plan_hosts(servers: int, opts: Options) -> int | None:
  """The planner's ``servers_per_host`` for ``servers`` servers (None: one host, or
  ``opts.host_aware`` off); ``opts.servers_per_host`` must be resolved (``servers_per_host``)."""
  per_host = opts.servers_per_host
  if not opts.host_aware or per_host <= 0 or per_host >= servers:
    return None
  return per_host


def servers_per_host(layout: Layout, cal: costs.Calibration, servers: int,
                     asked: int = 0) -> int:
  """Servers of one host: ``asked``, or (0) the servers one node holds (``gpus_per_node`` over
  a server's tensor-parallel GPUs, at least 1), at most ``servers``; it must divide them."""
  per_host = asked or max(1, cal.gpus_per_node // layout.tensor)
  per_host = min(per_host, servers)
  if servers % per_host:
    raise ValueError(f"servers_per_host={per_host} must divide the {servers} servers")
  return per_host


def run_distca(rows, tokens, spec, km, opts: Options) -> MicroResult:
  d = spec.dims
  options = plan_lib.PlanOptions(tolerance=opts.tolerance, q_heads=d.q_heads,
                                 kv_heads=d.kv_heads, head_dim=d.head_dim,
                                 dtype_bytes=d.dtype_bytes, min_gain=opts.min_gain,
                                 linear_pairs_per_token=costs.linear_pairs_per_token(d),
                                 servers_per_host=plan_hosts(len(rows), opts))
  plan = plan_lib.schedule([list(r) for r in rows], len(rows), tokens_per_rank=tokens,
                           options=options)
  return distca_result(plan, spec, km, opts.window_layers_local)


def distca_result(plan: plan_lib.Plan, spec: costs.ModelSpec, km: costs.KernelModel,
                  window_layers_local: bool = False) -> MicroResult:
  """A distca plan's ``MicroResult``: each server's kernel-model seconds over its tasks (with
  ``window_layers_local``, window layers over each rank's own rows: ``windows.local_seconds``);
  every server is in one sync group."""
  if window_layers_local and windows.has_windows(spec):
    attn = windows.local_seconds(plan, spec, km)
  else:
    t = plan.tasks
    sec = windows.mixed_task_seconds(km, t[:, 1], t[:, 2], spec)
    attn = np.bincount(t[:, 3], weights=sec, minlength=plan.num_servers)
  return MicroResult(bm.distca_metrics(plan), attn, plan.num_servers, plan)


def run_distca_step(batch, tokens, spec, km, opts: Options, layout) -> list[MicroResult]:
  """``run_distca`` over a step's micro-batches (or a pipeline's ticks); without a pipeline and
  with ``opts.local_steps``, a step whose every micro-batch could gain less than
  ``opts.local_gain`` is planned to move nothing (the system's ``attention.distca.local_gain``)."""
  if opts.local_steps and layout.pipe == 1 and opts.local_gain > 0.0:
    lin = costs.linear_pairs_per_token(spec.dims)
    gain = max(plan_lib.layout_step_gain(rows, tokens, lin) for rows in batch)
    if gain < opts.local_gain:
      opts = dataclasses.replace(opts, min_gain=max(opts.min_gain, opts.local_gain))
  return [run_distca(rows, tokens, spec, km, opts) for rows in batch]


def tick_rows(batch: Sequence[Sequence[Sequence[int]]], stages: int, pooled: bool = True
              ) -> list[list[list[int]]]:
  """The row sets distca plans under a pipeline: at tick ``t`` stage ``s`` holds micro-batch
  ``t - s`` (none in the bubble: an empty row); the schedule is the pipeline's own
  (``plan.ticks.schedule_table``). ``pooled``: [tick][stage x data rank], one plan per tick;
  else [tick x stage][data rank], one plan per stage and tick (tick-major)."""
  m, data = len(batch), len(batch[0])
  stage_rows = lambda mb: [list(batch[mb][r]) if mb >= 0 else [] for r in range(data)]
  table = ticks.schedule_table(stages, m)
  if pooled:
    return [[row for mb in held for row in stage_rows(mb)] for held in table]
  return [stage_rows(mb) for held in table for mb in held]


def step_is_local(step_results: Sequence[MicroResult], layout: Layout, opts: Options) -> bool:
  """Whether a distca step runs the train step's local branch: ``opts.local_steps``, no
  pipeline, and no plan of the step moves a row (``Plan.crosses``). Each micro-batch is planned
  once: a ping-pong step's nano-batches are planned apart, as the system plans them, when the
  caller gives them as the step's micro-batches (``validate.run_batches(nano=True)``), and
  together otherwise (``sample_batches``: one row per rank)."""
  return (opts.local_steps and layout.pipe == 1
          and not any(mr.plan.crosses for mr in step_results))


# ----------------------------------------------------------------------------------------------
# Seconds.
# ----------------------------------------------------------------------------------------------
def bucket_capacity(caps: plan_lib.Capacity, plan, buckets: int,
                    tokens_per_device: int) -> plan_lib.Capacity:
  """The capacity a step's exchange runs in: the smallest of ``buckets`` capacities
  (``plan.buckets.bucket_capacities``) that ``plan`` fits (``plan.required_capacity``), as the
  host chooses per call (the last bucket is ``caps``; a plan above ``caps`` prices ``caps``, as
  with one bucket). The two-level exchange's relay rows stay ``relay``'s (the full caps')."""
  if buckets <= 1:
    return caps
  need = plan_lib.required_capacity(plan)
  for cap in bucket_capacities(caps, buckets, tokens_per_device):
    if all(getattr(need, f) <= getattr(cap, f) for f in CAP_FIELDS):
      return cap
  return caps


def rank_seconds(mr: MicroResult, spec: costs.ModelSpec, cal: costs.Calibration, layout: Layout,
                 opts: Options, tokens_per_rank: int,
                 caps: plan_lib.Capacity | None = None, local: bool = False,
                 relay: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
  """[S] seconds of one micro-batch (distca under a pipeline: one tick) on each rank's stage,
  by part.

  The linear layers and the LM head run on every token slot of a rank's rows, padding included
  (``tokens_per_rank``; ``wlb``: ``Lmax`` slots when padded, its tokens when variable-length).
  ``caps``: distca's buffers (``distca_caps``), which set the dense exchange's blocks;
  ``relay``: the two-level exchange's relay rows (``relay_rows``). ``local``: distca on the step's local branch (``step_is_local``): its plan's attention, no
  exchange and no dispatch (packed_dp's seconds).
  """
  m, d, tp = mr.metrics, spec.dims, layout.tensor
  rate = cal.matmul_tflops * 1e12 * tp
  dispatch = np.zeros(m.num_ranks)
  tokens = np.full(m.num_ranks, float(tokens_per_rank))
  if m.strategy == "wlb":
    tokens = (np.full_like(tokens, float(m.info["row_tokens"])) if opts.wlb_padded
              else m.tokens_S.astype(np.float64))
  linear = 6.0 * d.layer_matmul_params * cal.remat_factor * tokens / rate
  attn = mr.attn_s * cal.attention_scale * costs.attention_remat_factor(opts.remat) / tp
  tp_bytes = 8.0 * (tp - 1) / tp * tokens * spec.dim * d.dtype_bytes
  tp_comm = cal.collective_s(tp_bytes, tp, calls=8)
  if m.strategy == "distca" and local:  # packed_dp's attention: nothing moves, no buffers
    comm = exposed = np.zeros_like(linear)
  elif m.strategy == "distca":
    if caps is None:
      raise ValueError("rank_seconds: distca needs caps (distca_caps of the run's plans)")
    two = opts.collective == "two_level"
    if two and relay is None:
      raise ValueError("rank_seconds: the two-level exchange needs its relay rows (relay_rows)")
    used = bucket_capacity(caps, mr.plan, opts.buckets, tokens_per_rank)

    def comm_of(plan):
      if two:
        return two_level_seconds(plan, used, relay, d, cal, tp, opts.servers_per_host,
                                 opts.exchange_buckets, opts.memory_mode)[0]
      if opts.collective == "ragged":  # its time follows the largest group, not the wire
        wire = np.full(m.num_ranks, ragged_group_bytes(plan, d, opts.memory_mode))
      else:
        wire = exchange_wire_bytes(plan, used, d, opts.collective, opts.exchange_buckets,
                                   opts.memory_mode)
      return exchange_seconds(wire, m.num_ranks, cal, opts.collective, tp, opts.memory_mode)

    if m.num_ranks <= 1:  # one server moves nothing: no exchange, no dispatch
      comm = np.zeros(m.num_ranks)
    else:  # each layer type's exchange: a window layer moves its tasks' key ranges only
      comm = windows.mixed_exchange_seconds(comm_of, mr.plan, spec, opts.window_layers_local)
    exposed = comm * (1.0 - cal.exchange_hidden)
    exposed, linear = overlap.credit(exposed, linear, opts.side_stream_blocks, m.num_ranks)
    if m.num_ranks > 1:  # local window layers fill no buffers
      dispatch = np.full(m.num_ranks, dispatch_buffer_bytes(
          used, d, opts.memory_mode, relay if two else None) / tp / cal.dispatch_bw
          * windows.exchanged_share(spec, opts.window_layers_local))
  elif m.strategy in ("cp", "wlb"):
    comm = cal.collective_s(2.0 * m.bytes_S / tp, m.comm_span * tp, calls=2)
    exposed = np.maximum(0.0, comm - attn) if opts.cp_overlap else comm
  else:  # packed_dp moves nothing
    comm = exposed = np.zeros_like(linear)
  layers = costs.ceil_div(d.n_layers, layout.pipe)
  head = 6.0 * spec.head_params * tokens / rate
  out = {"linear": layers * linear, "attention": layers * attn, "tp_comm": layers * tp_comm,
         "exchange": layers * comm, "exchange_exposed": layers * exposed,
         "dispatch": layers * dispatch, "lm_head": head}
  out["layers_total"] = (out["linear"] + out["attention"] + out["tp_comm"]
                         + out["exchange_exposed"] + out["dispatch"])
  out["total"] = out["layers_total"] + head
  return out


def step_seconds(stage_s_MxS: np.ndarray, group: int, stages: int) -> float:
  """A step from per-(micro-batch, rank) stage seconds: ranks synchronize in consecutive groups
  of ``group`` every micro-batch. Without a pipeline groups run independently and accumulate
  their micro-batches; with one, every tick of the GPipe scan (``M + S - 1``, stage ``s`` holding
  micro-batch ``t - s``) lasts as long as the slowest active micro-batch on any device."""
  mb, s = stage_s_MxS.shape
  per_group = stage_s_MxS.reshape(mb, s // group, group).max(2)  # [M, G]
  if stages > 1:
    slowest = per_group.max(1)
    return float(sum(slowest[max(0, t - stages + 1):t + 1].max()
                     for t in range(mb + stages - 1)))
  return float(per_group.sum(0).max())


def bound_seconds(packed: Sequence[dict[str, np.ndarray]], layout: Layout) -> float:
  """The balance bound of one batch: ``step_seconds``' schedule with every rank at the mean of
  packed_dp's per-rank compute (``packed``: ``rank_seconds`` of each micro-batch; LM head after
  the pipeline over pipe x data when ``pipe > 1``)."""
  if layout.pipe > 1:
    per_tick = float(np.mean([p["layers_total"] for p in packed]))
    head = float(sum(np.mean(p["lm_head"]) for p in packed)) / layout.pipe
    return layout.ticks * per_tick + head
  return float(sum(np.mean(p["total"]) for p in packed))

def _workspace(nq: float, nk: float, sequences: int, dims, tp: int) -> float:
  """FlashAttention-3's backward workspace of one call (``memory.flash3_bwd_workspace_bytes``)
  with this device's heads (split over ``tp``)."""
  return float(flash3_bwd_workspace_bytes(int(nq), int(nk), dims.q_heads // tp,
                                          max(1, dims.kv_heads // tp), dims.head_dim, sequences))


def strategy_memory(mr_list: Sequence[MicroResult], spec: costs.ModelSpec,
                    cal: costs.Calibration, layout: Layout, tokens: int,
                    alpha: float = 1.0, remat: str = "save_attention",
                    caps: plan_lib.Capacity | None = None, collective: str = "remote",
                    memory_mode: str = "keep", relay: tuple[int, int] | None = None
                    ) -> dict[str, Any]:
  """Per-GPU memory of the busiest rank: state, activations of the tokens it holds (every tick
  the pipeline keeps), the strategy's buffers, and the attention kernel's backward workspace
  (outside XLA's plan: ``memory.flash3_bwd_workspace_bytes``).

  cp / wlb keep each layer's key buffer (``(cp + 1) x`` the rows held: the lane's gathered K/V
  plus the row's own, ``packing.default_kv_rows``) for the backward.
  distca (``caps``, ``collective`` and ``memory_mode`` resolved): with 'keep' each layer keeps
  its server's attention inputs and outputs (``Capacity.memory_bytes`` ``attention_*`` and
  ``lse``) beyond the own rows' Q/K/V/O the fitted activations hold, with 'resend' its outputs
  (O, LSE) only; one layer's exchange buffers (send / receive of the capped totals, metadata),
  which is all 'remote' and 'ragged' hold; 'dense' adds the largest part's ``S`` send and ``S``
  receive blocks of the full bucket (XLA sizes a switch by its largest branch), which grow with
  ``S``; 'two_level' adds each part's relay buffer and leg B's send buffer (``relay`` rows and
  send + ``relay`` rows), which do not.
  """
  m0 = mr_list[0].metrics
  d, tp = spec.dims, layout.tensor
  # Arrays are sized by token slots: T per rank, Lmax = alpha T for wlb's padded rows.
  held = max(float(mr.metrics.tokens_S.max()) for mr in mr_list)
  held = max(held, float(bm.wlb_row_tokens(alpha, tokens) if m0.strategy == "wlb" else tokens))
  layers = costs.ceil_div(d.n_layers, layout.pipe)
  keep = layers * layout.in_flight
  parts: dict[str, float] = {}
  if m0.strategy in ("cp", "wlb"):
    # The backends' key buffer as built (packing.default_kv_rows: (cp + 1) x the row, the
    # lane's tokens plus the row's own), a kernel input every layer keeps for the backward and
    # the backward's key rows.
    kv_rows = packing.default_kv_rows(m0.cp, int(held))
    parts["group_kv_kept"] = keep * kv_rows * d.kv_row_bytes / tp
    workspace = _workspace(held, kv_rows, DEFAULT_MAX_DOCS_PER_ROW, d, tp)
  elif m0.strategy == "distca":
    if caps is None:
      raise ValueError("strategy_memory: distca needs caps (distca_caps of the run's plans)")
    s = mr_list[0].plan.num_servers
    mem = caps.memory_bytes(s, q_heads=d.q_heads, kv_heads=d.kv_heads, head_dim=d.head_dim,
                            dtype_bytes=d.dtype_bytes)
    bq = d.q_heads * d.head_dim * d.dtype_bytes
    exchange_counts(memory_mode)  # checks the mode is resolved
    if memory_mode == "resend":  # the kernel's outputs (O, LSE) beyond the own rows'
      kept = mem["attention_q_o"] / 2 + mem["lse"] - tokens * (bq + 4 * d.q_heads)
    else:  # Q, O, K, V, LSE beyond the own rows'
      kept = (mem["attention_q_o"] + mem["attention_kv"] + mem["lse"]
              - tokens * (2 * bq + d.kv_row_bytes + 4 * d.q_heads))
    parts["server_buffers_kept"] = keep * max(0.0, kept) / tp
    parts["exchange_buffers"] = (mem["q_exchange"] + mem["o_exchange"] + mem["kv_exchange"]
                                 + mem["metadata"]) / tp
    if collective not in ("remote", "dense", "ragged", "two_level"):
      raise ValueError(f"strategy_memory: collective={collective!r} must be resolved "
                       "(resolve_collective)")
    if collective == "two_level":
      if relay is None:
        raise ValueError("strategy_memory: the two-level exchange needs its relay rows "
                         "(relay_rows)")
      parts["relay_buffers"] = ((caps.q_send + 2 * relay[0]) * bq
                                + (caps.kv_send + 2 * relay[1]) * d.kv_row_bytes) / tp
    if collective == "dense":
      parts["dense_blocks"] = 2.0 * s * max(min(caps.q_send, caps.q_recv) * bq,
                                            min(caps.kv_send, caps.kv_recv) * d.kv_row_bytes) / tp
    workspace = _workspace(caps.q_tokens, caps.kv_tokens, caps.tasks, d, tp)
  else:
    workspace = _workspace(held, held, DEFAULT_MAX_DOCS_PER_ROW, d, tp)
  out = costs.memory_bytes(spec, cal, tokens=held, layers=layers, tp=tp, pp=layout.pipe,
                           in_flight=layout.in_flight,
                           micro_batches=layout.micro_batches,
                           extra_bytes=sum(parts.values()),
                           remat=remat, workspace_bytes=workspace)
  out.update({k: float(v) for k, v in parts.items()})
  return out


def _step_of_batch(secs: Sequence[dict[str, np.ndarray]], group: int, layout: Layout,
                   per_tick: int) -> float:
  """One batch's step from its micro-batches' (or distca's ticks') ``rank_seconds``.
  ``per_tick`` > 0: distca under a pipeline, ``per_tick`` plans per tick (1 pooled over every
  device, ``pipe`` per stage), tick-major; a tick lasts as long as its slowest device."""
  if per_tick:
    ticks = sum(max(float(np.max(x["layers_total"])) for x in secs[i:i + per_tick])
                for i in range(0, len(secs), per_tick))
    return ticks + layout.micro_batches * float(np.max(secs[0]["lm_head"])) / layout.pipe
  if layout.pipe > 1:
    body = step_seconds(np.stack([x["layers_total"] for x in secs]), group, layout.pipe)
    return body + float(np.max(sum(x["lm_head"] for x in secs))) / layout.pipe
  return step_seconds(np.stack([x["total"] for x in secs]), group, 1)


def resolve_distca(flat: Sequence[MicroResult], spec, cal, layout, opts: Options, tokens: int,
                   caps: plan_lib.Capacity, relay: tuple[int, int] | None = None) -> Options:
  """``opts`` with distca's collective (``resolve_collective``) and memory mode resolved as the
  trainer's pre-flight resolves 'auto' (``memory.AUTO_KEEP_SPARE``): 'keep' when its memory
  leaves that fraction of ``cal.hbm_bytes`` spare, else 'resend'."""
  coll = resolve_collective(opts.collective, layout, cal)
  mode = opts.memory_mode
  if mode == "auto":
    keep = strategy_memory(flat, spec, cal, layout, tokens, remat=opts.remat, caps=caps,
                           collective=coll, memory_mode="keep", relay=relay)
    mode = "keep" if keep["total"] <= cal.hbm_bytes * (1.0 - AUTO_KEEP_SPARE) else "resend"
  return dataclasses.replace(opts, collective=coll, memory_mode=mode)


def with_hosts(opts: Options, layout: Layout, cal: costs.Calibration, servers: int) -> Options:
  """``opts`` with ``servers_per_host`` resolved for ``servers`` servers
  (``servers_per_host``)."""
  return dataclasses.replace(opts, servers_per_host=servers_per_host(
      layout, cal, servers, opts.servers_per_host))


def evaluate(results: Sequence[Sequence[MicroResult]], spec, cal, layout, opts, tokens,
             alpha: float = 1.0, caps: plan_lib.Capacity | None = None,
             relay: tuple[int, int] | None = None) -> dict[str, Any]:
  """Aggregates one strategy setting over batches [batch][micro-batch] (distca under a
  pipeline: [batch][tick]) -> the report dict. distca: ``caps`` (default: ``distca_caps`` of
  these plans) and, for the two-level exchange, ``relay`` (default: ``relay_rows`` of these
  plans); its collective and memory mode as ``resolve_distca`` resolves them; a batch whose
  plans all move nothing priced on the local branch (``step_is_local``; ``local_batches``
  counts them)."""
  flat = [mr for b in results for mr in b]
  m0 = flat[0].metrics
  asked = opts.collective
  if m0.strategy == "distca":
    opts = with_hosts(opts, layout, cal, flat[0].plan.num_servers)
    if caps is None:
      caps = distca_caps([mr.plan for mr in flat], tokens, opts.caps_headroom)
    if relay is None:
      relay = relay_rows([mr.plan for mr in flat], opts.servers_per_host, opts.caps_headroom)
    opts = resolve_distca(flat, spec, cal, layout, opts, tokens, caps, relay)
  pooled = m0.strategy == "distca" and layout.pipe > 1
  per_tick = (1 if opts.pool_stages else layout.pipe) if pooled else 0
  steps, parts, ranks, n_local = [], {}, [], 0
  for batch in results:
    # distca's step on its local branch: packed_dp's, every rank its own sync group.
    local = m0.strategy == "distca" and step_is_local(batch, layout, opts)
    n_local += local
    secs = [rank_seconds(mr, spec, cal, layout, opts, tokens, caps, local, relay)
            for mr in batch]
    group = 1 if local else batch[0].group
    steps.append(_step_of_batch(secs, group, layout, per_tick) + cal.step_fixed_s)
    for k in secs[0]:
      parts.setdefault(k, []).append(np.mean([x[k] for x in secs], axis=0))
    ranks.append(np.stack([x["total"] for x in secs]).sum(0))
  mets = [mr.metrics for mr in flat]
  work = [costs.step_work(spec.dims, m.tokens_S, m.pairs_S) for m in mets]
  mem = strategy_memory(flat, spec, cal, layout, tokens, alpha, opts.remat, caps,
                        opts.collective, opts.memory_mode, relay)
  out = {
      "step_s": float(np.mean(steps)), "step_s_per_batch": [float(x) for x in steps],
      "dp": m0.dp, "cp": m0.cp, "fits_memory": mem["fits"], "memory_gb": {
          k: (v / 1e9 if isinstance(v, float) else v) for k, v in mem.items()},
      "attention_imbalance": float(np.mean([bm.imbalance(m.pairs_S) for m in mets])),
      "compute_imbalance": float(np.mean([bm.imbalance(w) for w in work])),
      "token_imbalance": float(np.mean([bm.imbalance(m.tokens_S) for m in mets])),
      "bytes_per_layer_mean_mb": float(np.mean([m.bytes_S.mean() for m in mets]) / 1e6),
      "bytes_per_layer_max_mb": float(np.mean([m.bytes_S.max() for m in mets]) / 1e6),
      "per_rank_s": {k: np.mean(v, axis=0).tolist() for k, v in parts.items()},
      "per_rank_step_s": np.mean(ranks, axis=0).tolist(),
  }
  if m0.strategy == "wlb":
    out["alpha"] = alpha
  if m0.strategy == "distca":
    plans = [mr.plan for mr in flat]
    if opts.collective == "two_level":
      legs = [two_level_wire_bytes(p, caps, relay, spec.dims, opts.servers_per_host,
                                   opts.exchange_buckets, opts.memory_mode) for p in plans]
      wire = [np.array([a + b]) for a, b in legs]
      out.update(leg_a_bytes_per_layer_mb=float(np.mean([a for a, _ in legs]) / 1e6),
                 leg_b_bytes_per_layer_mb=float(np.mean([b for _, b in legs]) / 1e6),
                 relay_rows=list(relay), servers_per_host=opts.servers_per_host)
    else:
      wire = [exchange_wire_bytes(p, caps, spec.dims, opts.collective, opts.exchange_buckets,
                                  opts.memory_mode) for p in plans]
    per_host = plan_hosts(plans[0].num_servers, opts) or opts.servers_per_host
    link = np.array([p.link_bytes(per_host) for p in plans], np.float64)
    out.update(plan_intra_host_mb=float(link[:, 0].mean() / 1e6),
               plan_inter_host_mb=float(link[:, 1].mean() / 1e6), host_aware=opts.host_aware)
    out.update(tolerance=opts.tolerance, nano_batches=opts.nano_batches,
               collective=opts.collective, collective_asked=asked,
               memory_mode=opts.memory_mode, caps=dataclasses.asdict(caps),
               pooled_ticks=per_tick == 1, servers=plans[0].num_servers,
               wire_bytes_per_layer_mb=float(np.mean([w.max() for w in wire]) / 1e6),
               imbalance_before=float(np.mean([p.imbalance_before for p in plans])),
               degraded_plans=int(sum(p.degraded for p in plans)),
               gated_plans=int(sum(p.gated for p in plans)), min_gain=opts.min_gain,
               local_steps=opts.local_steps, local_batches=n_local)
  return out


def _cp_sizes(data: int, opts: Options) -> list[int]:
  if opts.cp_sizes is not None:
    return [c for c in opts.cp_sizes if data % c == 0]
  return [c for c in (2 ** i for i in range(12)) if c <= data and data % c == 0]


def _pick(cands: list[dict[str, Any]], budget_bytes: float) -> dict[str, Any]:
  """Fastest candidate whose memory is within ``budget_bytes`` (else the one needing the least
  memory, which then reports ``fits_memory`` False)."""
  fit = [c for c in cands if c["memory_gb"]["total"] * 1e9 <= budget_bytes]
  if fit:
    return min(fit, key=lambda c: c["step_s"])
  return min(cands, key=lambda c: c["memory_gb"]["total"])


def simulate(batches, spec: costs.ModelSpec, layout: Layout, tokens: int, *,
             cal: costs.Calibration | None = None, km: costs.KernelModel | None = None,
             opts: Options | None = None, strategies: Sequence[str] = STRATEGIES,
             select_batches=None, caps_batches=None) -> dict[str, dict[str, Any]]:
  """Every strategy on ``batches`` ([batch][micro-batch][rank] document lengths).

  ``cp`` (CP size >= 2, or 1 when ``data`` is 1) and ``wlb`` (WLB-ideal: CP size and alpha) take
  the setting that is fastest on ``select_batches`` (other batches of the same workload; None =
  the scored batches themselves, marked ``chosen_on``) within a memory budget: the device's for
  cp, distca's need (at most the device's) for wlb when distca is simulated too. distca: where
  its collective resolves to another than 'remote' (jobs across nodes), ``priced_as_remote``
  holds the same plans priced with 'remote'. distca's caps
  are sized on the plans of ``caps_batches`` (default: the scored and selection batches), as
  training sizes them on its first batches. Every
  strategy carries ``balance_bound_s`` (``bound_seconds`` over packed_dp's compute) and
  ``bound_fraction`` = bound / step.
  """
  cal = cal or costs.Calibration()
  km = km or costs.KernelModel()
  opts = opts or Options()
  for name in strategies:
    if name not in STRATEGIES:
      raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
  run = lambda bs, fn, *a: [[fn(rows, tokens, spec, km, *a) for rows in b] for b in bs]
  ev = lambda res, a=1.0: evaluate(res, spec, cal, layout, opts, tokens, a)
  sel = batches if select_batches is None else select_batches
  chosen_on = "scored batches" if select_batches is None else f"{len(sel)} other batches"
  out = {}
  if "packed_dp" in strategies:
    out["packed_dp"] = ev(run(batches, run_packed_dp))
  if "distca" in strategies:
    as_ticks = lambda bs: bs if layout.pipe == 1 else [tick_rows(b, layout.pipe,
                                                                 opts.pool_stages) for b in bs]
    sizing = list(batches) + (list(select_batches or []) if caps_batches is None
                              else list(caps_batches))

    def planned(o):
      """(scored plans, caps, relay rows, sized batches) of distca under options ``o``."""
      scored = [run_distca_step(b, tokens, spec, km, o, layout) for b in as_ticks(batches)]
      # Training sizes its caps on plans without the gate (backends.distca.startup_capacity):
      # the caps also hold the batches a gate leaves unmoved.
      ungated = dataclasses.replace(o, min_gain=0.0)
      sized = (scored if o.min_gain == 0.0 and o.local_gain == 0.0
               else run(as_ticks(batches), run_distca, ungated))
      sized = sized + run(as_ticks(sizing[len(batches):]), run_distca, ungated)
      sized_plans = [mr.plan for b in sized for mr in b]
      return (scored, distca_caps(sized_plans, tokens, o.caps_headroom),
              relay_rows(sized_plans, o.servers_per_host, o.caps_headroom), len(sized))

    servers = layout.data * (layout.pipe if layout.pipe > 1 and opts.pool_stages else 1)
    opts = with_hosts(opts, layout, cal, servers)
    scored, caps, relay, n_sized = planned(opts)
    out["distca"] = evaluate(scored, spec, cal, layout, opts, tokens, caps=caps, relay=relay)
    out["distca"]["caps_from_batches"] = n_sized
    if out["distca"]["collective"] != "remote":
      # The same plans priced with the 'remote' exchange (each row once at the in-node rate,
      # scaled across nodes), and the system before the two-level exchange: host-blind plans
      # through the dense exchange.
      alt = evaluate(scored, spec, cal, layout, dataclasses.replace(opts, collective="remote"),
                     tokens, caps=caps, relay=relay)
      blind = dataclasses.replace(opts, host_aware=False, collective="dense")
      b_scored, b_caps, b_relay, _ = planned(blind)
      old = evaluate(b_scored, spec, cal, layout, blind, tokens, caps=b_caps, relay=b_relay)
      for key, r in (("priced_as_remote", alt), ("host_blind_dense", old)):
        out["distca"][key] = {
            k: r[k] for k in ("step_s", "fits_memory", "memory_mode", "wire_bytes_per_layer_mb",
                              "plan_inter_host_mb")
        } | {"memory_gb": r["memory_gb"]["total"],
             "exchange_exposed_s": r["per_rank_s"]["exchange_exposed"]}
  if "cp" in strategies:
    sizes = [c for c in _cp_sizes(layout.data, opts) if c >= 2] or [1]
    cands = [dict(ev(run(sel, run_cp, c)), cp_size=c) for c in sizes]
    best = _pick(cands, cal.hbm_bytes)
    out["cp"] = dict(ev(run(batches, run_cp, best["cp_size"])), chosen_on=chosen_on,
                     searched=_searched(cands))
  if "wlb" in strategies:
    budget = cal.hbm_bytes
    if "distca" in out:
      budget = min(budget, out["distca"]["memory_gb"]["total"] * 1e9)
    cands = [dict(ev(run(sel, run_wlb, c, a), a), cp_size=c)
             for c in _cp_sizes(layout.data, opts) for a in opts.wlb_alphas]
    best = _pick(cands, budget)
    res = ev(run(batches, run_wlb, best["cp_size"], best["alpha"]), best["alpha"])
    res["fits_memory"] = bool(res["fits_memory"] and res["memory_gb"]["total"] * 1e9 <= budget)
    out["wlb"] = dict(res, chosen_on=chosen_on, memory_budget_gb=budget / 1e9,
                      searched=_searched(cands))
  pk_secs = [[rank_seconds(mr, spec, cal, layout, opts, tokens) for mr in b]
             for b in run(batches, run_packed_dp)]
  bound = float(np.mean([bound_seconds(x, layout) for x in pk_secs])) + cal.step_fixed_s
  for r in out.values():
    r["balance_bound_s"] = bound
    r["bound_fraction"] = bound / r["step_s"]
  return {k: out[k] for k in strategies}


def _searched(cands: list[dict[str, Any]]) -> list[dict[str, Any]]:
  return [{k: c[k] for k in ("dp", "cp", "alpha", "step_s", "fits_memory") if k in c}
          | {"memory_gb": c["memory_gb"]["total"]} for c in cands]
