"""Step-time simulation of packed_dp, cp, wlb (WLB-ideal) and distca on sampled batches.

The strategies run the project's own host code on every sampled micro-batch: the workload
sampler (``data.WorkloadSampler``), the baselines' placements and WLB packer
(``baselines.packing``, ``baselines.metrics``) and the CAD planner (``plan.schedule``).
Their per-rank tasks, tokens and bytes become seconds through ``costs`` (measured kernel table,
fitted matmul rate, fitted collectives, stated inter-node bandwidth):

  layer_r  = linear (6 N_layer x remat x tokens / rate) + attention (kernel table on the rank's
             tasks, plus one forward under remat 'full') + tensor-parallel traffic + the exposed part of the strategy's exchange
  stage_r  = layers of the stage x layer_r (+ LM head on the last stage)

Ranks that synchronize inside a layer (a CP group; every server of a CAD plan) wait for their
slowest member each micro-batch; micro-batches follow each other (gradient accumulation) or run
through a 1F1B pipeline (``costs.pipeline_seconds``). Exposed exchange: CAD with ping-pong
hides its all_to_alls behind the other nano-batch's linear layers (``max(0, comm - linear)``),
without it ``Calibration.single_stream_hidden`` of it; cp / wlb overlap their K/V all-gather with
attention (ring attention's overlap, granted to the baselines). Gradient synchronization is the
same for every strategy and is left out (ratios are what the tables compare).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from distca_jax import plan as plan_lib
from distca_jax.baselines import metrics as bm
from distca_jax.baselines import packing
from distca_jax.checks import check_int
from distca_jax.data.workloads import WorkloadSampler
from distca_jax.sim import costs

STRATEGIES = ("packed_dp", "cp", "wlb", "distca")
WLB_ALPHAS = (1.0, 1.1, 1.2, 1.5, 2.0)


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


@dataclasses.dataclass(frozen=True)
class Options:
  """Strategy knobs.

  Attributes:
    tolerance: CAD's epsilon.
    min_gain: CAD's gate (0 = always balance).
    nano_batches: 2 = CAD with ping-pong (exchange behind the other nano-batch), 1 = single stream.
    wlb_alphas: WLB-ideal's alpha grid; cp_sizes: CP group sizes tried (None = powers of two
      dividing ``data``).
    cp_overlap: cp / wlb hide their K/V traffic behind attention (ring attention, as the paper's
      baselines); False = exposed, as this project's all-gather implementation runs it.
    wlb_padded: wlb rows padded to ``Lmax = alpha T`` token slots (this project's backend: the
      linear layers run on the padding too); False = variable-length rows (the paper's WLB).
    remat: the model's rematerialization policy (``costs.REMAT_POLICIES``): what the backward
      reruns (time) and what the layers keep (memory).
  """
  tolerance: float = plan_lib.DEFAULT_TOLERANCE
  min_gain: float = 0.0
  nano_batches: int = 2
  wlb_alphas: Sequence[float] = WLB_ALPHAS
  cp_sizes: Sequence[int] | None = None
  cp_overlap: bool = True
  wlb_padded: bool = False
  remat: str = "save_attention"

  def __post_init__(self):
    costs.check_remat(self.remat)


def sample_batches(workload: str, tokens: int, layout: Layout, batches: int, *, seed: int = 0,
                   context: int = 0, first_step: int = 0) -> list[list[list[list[int]]]]:
  """[batch][micro-batch][rank] -> document lengths (the trainer's split rule at rows)."""
  sampler = WorkloadSampler(workload, tokens, seed, context or None)
  m = layout.micro_batches
  return [[sampler.step_doclens((first_step + b) * m + i, layout.data) for i in range(m)]
          for b in range(batches)]


# ----------------------------------------------------------------------------------------------
# One micro-batch: per-rank attention seconds and metrics of each strategy.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class MicroResult:
  """One strategy on one micro-batch: ``metrics`` (pairs, tokens, bytes per rank) and the
  rank's attention seconds per layer (``attn_s``, measured kernel table), its sync group size."""
  metrics: bm.RankMetrics
  attn_s: np.ndarray
  group: int
  plan: plan_lib.Plan | None = None


def placement_attn_s(pl: packing.Placement, spec: costs.ModelSpec, km: costs.KernelModel
                     ) -> np.ndarray:
  """[S] kernel-model seconds (one layer, forward + backward) of each rank's pieces."""
  sec = km.task_seconds(pl.end_P - pl.start_P, pl.end_P, spec.dims)
  by_row = np.bincount(pl.row_P, weights=sec, minlength=pl.num_rows)
  return by_row.reshape(-1, pl.rows_per_rank).sum(1)


def run_packed_dp(rows, tokens, spec, km) -> MicroResult:
  pl = packing.natural_placement(rows, tokens)
  return MicroResult(bm.placement_metrics(pl, spec.dims, "packed_dp"),
                     placement_attn_s(pl, spec, km), 1)


def run_cp(rows, tokens, spec, km, cp_size: int) -> MicroResult:
  lanes = bm.lanes_from_rows(rows, cp_size)
  pl = packing.cp_placement(lanes, cp_size, tokens)
  return MicroResult(bm.placement_metrics(pl, spec.dims, "cp"), placement_attn_s(pl, spec, km),
                     cp_size)


def run_wlb(rows, tokens, spec, km, cp_size: int, alpha: float) -> MicroResult:
  flat = [int(x) for r in rows for x in r]
  pk = packing.wlb_pack(flat, len(rows) // cp_size, cp_size, bm.wlb_row_tokens(alpha, tokens),
                        spec.dims.balance_len)
  pl = packing.wlb_placement(pk)
  m = bm.wlb_metrics(pk, spec.dims, alpha=alpha)
  return MicroResult(m, placement_attn_s(pl, spec, km), cp_size)


def run_distca(rows, tokens, spec, km, opts: Options) -> MicroResult:
  d = spec.dims
  options = plan_lib.PlanOptions(tolerance=opts.tolerance, q_heads=d.q_heads,
                                 kv_heads=d.kv_heads, head_dim=d.head_dim,
                                 dtype_bytes=d.dtype_bytes, min_gain=opts.min_gain,
                                 linear_pairs_per_token=costs.linear_pairs_per_token(d))
  plan = plan_lib.schedule([list(r) for r in rows], len(rows), tokens_per_rank=tokens,
                           options=options)
  t = plan.tasks
  sec = km.task_seconds(t[:, 2] - t[:, 1], t[:, 2], d)
  attn = np.bincount(t[:, 3], weights=sec, minlength=plan.num_servers)
  return MicroResult(bm.distca_metrics(plan), attn, len(rows), plan)


# ----------------------------------------------------------------------------------------------
# Seconds.
# ----------------------------------------------------------------------------------------------
def rank_seconds(mr: MicroResult, spec: costs.ModelSpec, cal: costs.Calibration, layout: Layout,
                 opts: Options, tokens_per_rank: int) -> dict[str, np.ndarray]:
  """[S] seconds of one micro-batch on each rank's slowest (last) pipeline stage, by part.

  The linear layers and the LM head run on every token slot of a rank's rows, padding included
  (``tokens_per_rank``; ``wlb``: ``Lmax`` slots when padded, its tokens when variable-length).
  """
  m, d, tp = mr.metrics, spec.dims, layout.tensor
  rate = cal.matmul_tflops * 1e12 * tp
  tokens = np.full(m.num_ranks, float(tokens_per_rank))
  if m.strategy == "wlb":
    tokens = (np.full_like(tokens, float(m.info["row_tokens"])) if opts.wlb_padded
              else m.tokens_S.astype(np.float64))
  linear = 6.0 * d.layer_matmul_params * cal.remat_factor * tokens / rate
  attn = mr.attn_s * cal.attention_scale * costs.attention_remat_factor(opts.remat) / tp
  tp_bytes = 8.0 * (tp - 1) / tp * tokens * spec.dim * d.dtype_bytes
  tp_comm = cal.collective_s(tp_bytes, tp, calls=8)
  comm = cal.collective_s(2.0 * m.bytes_S / tp, m.comm_span * tp, calls=4 if
                          m.strategy == "distca" else 2)
  if m.strategy == "distca":
    exposed = (np.maximum(0.0, comm - linear) if opts.nano_batches > 1
               else comm * (1.0 - cal.single_stream_hidden))
  elif m.strategy in ("cp", "wlb"):
    exposed = np.maximum(0.0, comm - attn) if opts.cp_overlap else comm
  else:  # packed_dp moves nothing
    comm = exposed = np.zeros_like(linear)
  layers = costs.ceil_div(d.n_layers, layout.pipe)
  head = 6.0 * spec.head_params * tokens / rate
  out = {"linear": layers * linear, "attention": layers * attn, "tp_comm": layers * tp_comm,
         "exchange": layers * comm, "exchange_exposed": layers * exposed, "lm_head": head}
  out["total"] = (out["linear"] + out["attention"] + out["tp_comm"] + out["exchange_exposed"]
                  + head)
  return out


def step_seconds(stage_s_MxS: np.ndarray, group: int, stages: int) -> float:
  """A step from per-(micro-batch, rank) stage seconds: ranks synchronize in consecutive groups
  of ``group`` every micro-batch; groups run independently; pipeline or accumulation."""
  mb, s = stage_s_MxS.shape
  per_group = stage_s_MxS.reshape(mb, s // group, group).max(2)  # [M, G]
  if stages > 1:
    return max(costs.pipeline_seconds(per_group[:, g], stages) for g in range(per_group.shape[1]))
  return float(per_group.sum(0).max())


def strategy_memory(mr_list: Sequence[MicroResult], spec: costs.ModelSpec,
                    cal: costs.Calibration, layout: Layout, tokens: int,
                    alpha: float = 1.0, remat: str = "save_attention") -> dict[str, Any]:
  """Per-GPU memory of the busiest rank: activations of the tokens it holds, strategy buffers."""
  m0 = mr_list[0].metrics
  d = spec.dims
  # Arrays are sized by token slots: T per rank, Lmax = alpha T for wlb's padded rows.
  held = max(float(mr.metrics.tokens_S.max()) for mr in mr_list)
  held = max(held, float(bm.wlb_row_tokens(alpha, tokens) if m0.strategy == "wlb" else tokens))
  extra = 0.0
  if m0.strategy in ("cp", "wlb") and m0.cp > 1:  # one layer's gathered K/V of the group
    extra = m0.cp * held * d.kv_row_bytes / layout.tensor
  elif m0.strategy == "distca":
    caps = [plan_lib.required_capacity(mr.plan) for mr in mr_list]
    env = plan_lib.Capacity.envelope(caps)
    extra = env.memory_bytes(layout.data, q_heads=d.q_heads, kv_heads=d.kv_heads,
                             head_dim=d.head_dim, dtype_bytes=d.dtype_bytes)["total"]
    extra /= layout.tensor
  layers = costs.ceil_div(d.n_layers, layout.pipe)
  in_flight = min(layout.pipe, layout.micro_batches)
  return costs.memory_bytes(spec, cal, tokens=held, layers=layers, tp=layout.tensor,
                            pp=layout.pipe, in_flight=in_flight, extra_bytes=extra,
                            remat=remat)


def evaluate(results: Sequence[Sequence[MicroResult]], spec, cal, layout, opts, tokens,
             alpha: float = 1.0) -> dict[str, Any]:
  """Aggregates one strategy setting over batches [batch][micro-batch] -> the report dict."""
  steps, parts, ranks = [], {}, []
  for batch in results:
    secs = [rank_seconds(mr, spec, cal, layout, opts, tokens) for mr in batch]
    total = np.stack([s["total"] for s in secs])  # [M, S]
    steps.append(step_seconds(total, batch[0].group, layout.pipe) + cal.step_fixed_s)
    for k in secs[0]:
      parts.setdefault(k, []).append(np.mean([s[k] for s in secs], axis=0))
    ranks.append(total.sum(0))
  flat = [mr for b in results for mr in b]
  mets = [mr.metrics for mr in flat]
  work = [costs.step_work(spec.dims, m.tokens_S, m.pairs_S) for m in mets]
  mem = strategy_memory(flat, spec, cal, layout, tokens, alpha, opts.remat)
  m0 = mets[0]
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
    out.update(tolerance=opts.tolerance, nano_batches=opts.nano_batches,
               imbalance_before=float(np.mean([p.imbalance_before for p in plans])),
               degraded_plans=int(sum(p.degraded for p in plans)),
               gated_plans=int(sum(p.gated for p in plans)))
  return out


def _cp_sizes(data: int, opts: Options) -> list[int]:
  if opts.cp_sizes is not None:
    return [c for c in opts.cp_sizes if data % c == 0]
  return [c for c in (2 ** i for i in range(12)) if c <= data and data % c == 0]


def _best(cands: list[dict[str, Any]]) -> dict[str, Any]:
  """Fastest setting that fits memory (else the fastest, marked as not fitting)."""
  fit = [c for c in cands if c["fits_memory"]]
  best = min(fit or cands, key=lambda c: c["step_s"])
  best = dict(best)
  best["searched"] = [{k: c[k] for k in ("dp", "cp", "alpha", "step_s", "fits_memory")
                       if k in c} for c in cands]
  return best


def simulate(batches, spec: costs.ModelSpec, layout: Layout, tokens: int, *,
             cal: costs.Calibration | None = None, km: costs.KernelModel | None = None,
             opts: Options | None = None, strategies: Sequence[str] = STRATEGIES
             ) -> dict[str, dict[str, Any]]:
  """Every strategy on ``batches`` ([batch][micro-batch][rank] document lengths).

  ``cp`` is the best CP size >= 2 (or 1 when ``data`` is 1) that fits; ``wlb`` is WLB-ideal: the
  best (CP size, alpha) that fits.
  """
  cal = cal or costs.Calibration()
  km = km or costs.KernelModel()
  opts = opts or Options()
  run = lambda fn, *a: [[fn(rows, tokens, spec, km, *a) for rows in b] for b in batches]
  out = {}
  for name in strategies:
    if name == "packed_dp":
      out[name] = evaluate(run(run_packed_dp), spec, cal, layout, opts, tokens)
    elif name == "distca":
      out[name] = evaluate(run(run_distca, opts), spec, cal, layout, opts, tokens)
    elif name == "cp":
      sizes = [c for c in _cp_sizes(layout.data, opts) if c >= 2] or [1]
      out[name] = _best([evaluate(run(run_cp, c), spec, cal, layout, opts, tokens)
                         for c in sizes])
    elif name == "wlb":
      out[name] = _best([evaluate(run(run_wlb, c, a), spec, cal, layout, opts, tokens, a)
                         for c in _cp_sizes(layout.data, opts) for a in opts.wlb_alphas])
    else:
      raise ValueError(f"unknown strategy {name!r}; choose from {STRATEGIES}")
  return out
