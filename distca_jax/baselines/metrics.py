"""Per-rank metrics of every strategy (host, NumPy): attention work, tokens held, bytes moved.

One ``RankMetrics`` per (strategy, batch) with, for each of the ``S`` ranks:

* ``pairs_S``: causal query-key pairs its core attention computes (work; forward FLOPs are
  ``4 * q_heads * head_dim * pairs`` per layer, ``BWD_FWD_RATIO`` times that in the backward:
  the work model ``metrics.work_flops``);
* ``tokens_S``: tokens whose layer activations it holds (the token-linear part of the layer, the
  bulk of activation memory: ``packed_dp`` / ``distca`` keep tokens where the data put them,
  ``cp`` holds exactly ``T`` per rank, ``wlb`` up to ``alpha T``);
* ``bytes_S``: bytes it receives in one layer's forward core attention (``cp`` / ``wlb``: the K and
  V rows of the other ranks of its CP group; ``distca``: query and K/V rows sent to it as a server
  plus the output rows returned to it as an owner; ``packed_dp``: none). Useful bytes: fixed-shape
  buffers move padding too. The backward moves about as much again (reduce-scatter of dK/dV,
  returned dQ);
* ``kv_rows_S``: K/V rows in its fused kernel call's input, the sum of its tasks' key ranges
  (attention working memory: a task with queries ``[a, b)`` of a document reads keys ``[0, b)``).

Imbalance is max / mean over ranks. ``estimate_layer_seconds`` turns the three into a per-layer
time of the slowest rank under a stated hardware model; the benchmark uses it only to pick the
best DP x CP split for ``cp`` and ``wlb``, as the paper picks the fastest one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from distca_jax import metrics as metrics_lib
from distca_jax import plan as plan_lib
from distca_jax.baselines import packing


@dataclasses.dataclass(frozen=True)
class ModelDims:
  """What the metrics need of the model (defaults: Llama-3-8B in bf16).

  Attributes:
    q_heads, kv_heads, head_dim: attention shapes (H, K, D).
    n_layers: L.
    matmul_params: N, weights in matmuls per token (all layers + LM head; `metrics.matmul_params`).
    layer_matmul_params: weights in matmuls of one layer.
    dtype_bytes: bytes per activation element.
  """
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  n_layers: int = 32
  matmul_params: int = 7_504_658_432
  layer_matmul_params: int = 218_103_808
  dtype_bytes: int = 2

  @staticmethod
  def from_model(cfg) -> "ModelDims":
    """From a `distca_jax.model.ModelConfig`."""
    n = metrics_lib.matmul_params(cfg)
    per_layer = (n - cfg.dim * cfg.vocab_size) // cfg.n_layers
    return ModelDims(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers, n, per_layer,
                     2 if cfg.dtype in ("bfloat16", "float16") else 4)

  @property
  def balance_len(self) -> float:
    """B: the document length whose attention FLOPs equal its token-linear FLOPs.

    `metrics.step_flops`: a document of l tokens costs 6 N l (token-linear) + 6 L H D l^2
    (attention), equal at l = N / (L H D) (about 57K tokens for Llama-3-8B).
    """
    return self.matmul_params / (self.n_layers * self.q_heads * self.head_dim)

  @property
  def q_row_bytes(self) -> int:
    return self.q_heads * self.head_dim * self.dtype_bytes

  @property
  def kv_row_bytes(self) -> int:
    """Bytes of one token's K and V rows together."""
    return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The hardware model of ``estimate_layer_seconds`` (defaults: H100/H200-class nodes of 8).

  Attributes:
    peak_flops: dense bf16 peak per GPU.
    efficiency: fraction of peak reached by both matmuls and attention kernels.
    intra_node_bw: bytes/s per GPU for collectives inside a node (NVLink; measured all-to-all
      132-262 GB/s on 2 H200s, docs/design.md Sec. 11).
    inter_node_bw: bytes/s per GPU once a collective spans nodes (400 Gb/s NIC per GPU).
    gpus_per_node: ranks per node; groups are consecutive ranks, so a group of at most this many
      stays inside one node.
  """
  peak_flops: float = 989e12
  efficiency: float = 0.5
  intra_node_bw: float = 150e9
  inter_node_bw: float = 50e9
  gpus_per_node: int = 8

  def bandwidth(self, span: int) -> float:
    return self.intra_node_bw if span <= self.gpus_per_node else self.inter_node_bw


@dataclasses.dataclass(frozen=True)
class RankMetrics:
  """Per-rank attention work, tokens held and bytes received of one strategy on one batch.

  Attributes:
    strategy: 'packed_dp', 'wlb', 'cp' or 'distca'.
    dp, cp: the DP x CP split (``distca``: dp = S, cp = 1; its exchange spans all S ranks).
    pairs_S, tokens_S, bytes_S, kv_rows_S: [S] per rank (see the module docstring).
    comm_span: ranks one collective spans (sets the bandwidth in ``estimate_layer_seconds``).
    info: strategy-specific extras (JSON-friendly).
  """
  strategy: str
  dp: int
  cp: int
  pairs_S: np.ndarray
  tokens_S: np.ndarray
  bytes_S: np.ndarray
  kv_rows_S: np.ndarray
  comm_span: int
  info: dict = dataclasses.field(default_factory=dict)

  @property
  def num_ranks(self) -> int:
    return int(self.pairs_S.size)

  def compute_flops_S(self, dims: ModelDims) -> np.ndarray:
    """[S] one layer's forward + backward FLOPs in the shared work model
    (``metrics.work_flops``): token-linear 6 N_layer tokens + attention at 3.5x forward."""
    return metrics_lib.work_flops(dims.layer_matmul_params, 1, dims.q_heads, dims.head_dim,
                                  self.tokens_S, self.pairs_S)

  def summary(self, dims: ModelDims | None = None, hw: Hardware | None = None) -> dict[str, Any]:
    """Headline numbers (JSON-friendly)."""
    out = {
        "strategy": self.strategy, "dp": self.dp, "cp": self.cp, "ranks": self.num_ranks,
        "attention_imbalance": imbalance(self.pairs_S),
        "token_imbalance": imbalance(self.tokens_S),
        "bytes_mean": float(self.bytes_S.mean()), "bytes_max": float(self.bytes_S.max()),
        "pairs_mean": float(self.pairs_S.mean()), "tokens_mean": float(self.tokens_S.mean()),
        "tokens_max": int(self.tokens_S.max()),
        "kv_rows_max": int(self.kv_rows_S.max()),
        **self.info,
    }
    if dims is not None:
      out["kv_bytes_max"] = float(self.kv_rows_S.max()) * dims.kv_row_bytes
      out["compute_imbalance"] = imbalance(self.compute_flops_S(dims))
      out["layer_seconds"] = float(estimate_layer_seconds(self, dims, hw).max())
    return out


def imbalance(values) -> float:
  """max / mean (1.0 when everything is zero)."""
  return plan_lib.imbalance(values)


def estimate_layer_seconds(m: RankMetrics, dims: ModelDims,
                           hw: Hardware | None = None) -> np.ndarray:
  """[S] estimated seconds of one layer's forward + backward per rank, communication not hidden.

  compute = ``compute_flops_S`` (the shared work model) / (peak x efficiency); communication = 2 x bytes / bandwidth(span) (forward, and as much
  again in the backward).
  """
  hw = hw or Hardware()
  flops = m.compute_flops_S(dims)
  comm = 2.0 * m.bytes_S / hw.bandwidth(m.comm_span) if m.comm_span > 1 else 0.0 * m.bytes_S
  return flops / (hw.peak_flops * hw.efficiency) + comm


# ----------------------------------------------------------------------------------------------
# Per strategy.
# ----------------------------------------------------------------------------------------------
def _rank_sum(values_B: np.ndarray, rows_per_rank: int) -> np.ndarray:
  return np.asarray(values_B).reshape(-1, rows_per_rank).sum(1)


def placement_metrics(placement: packing.Placement, dims: ModelDims, strategy: str,
                      info: dict | None = None) -> RankMetrics:
  """Metrics of any placement (``packed_dp``: the natural one; ``cp``; ``wlb``).

  Every piece ``[a, b)`` costs ``P(a, b)`` pairs on its rank; a rank receives the K/V rows of the
  other ranks of its group (all-gather), ``c > 1`` only.
  """
  p = placement
  r, c = p.rows_per_rank, p.cp_size
  pairs_B = np.bincount(p.row_P, weights=plan_lib.pairs(p.start_P, p.end_P).astype(np.float64),
                        minlength=p.num_rows)
  tokens_B = p.row_tokens()
  lane_tok = np.bincount(p.lane_of_row(np.arange(p.num_rows)), weights=tokens_B)
  others_B = lane_tok[p.lane_of_row(np.arange(p.num_rows))] - tokens_B
  bytes_B = others_B * dims.kv_row_bytes if c > 1 else np.zeros(p.num_rows)
  kv_B = np.bincount(p.row_P, weights=p.end_P, minlength=p.num_rows)
  s = p.num_rows // r
  return RankMetrics(strategy, s // c, c, _rank_sum(pairs_B, r), _rank_sum(tokens_B, r),
                     _rank_sum(bytes_B, r).astype(np.float64),
                     _rank_sum(kv_B, r).astype(np.int64), c, dict(info or {}))


def packed_dp_metrics(row_doclens: Sequence[Sequence[int]], tokens_per_row: int,
                      dims: ModelDims, *, rows_per_rank: int = 1) -> RankMetrics:
  """``packed_dp``: every rank computes the documents of its own rows."""
  return placement_metrics(
      packing.natural_placement(row_doclens, tokens_per_row, rows_per_rank=rows_per_rank),
      dims, "packed_dp")


def cp_metrics(lane_doclens: Sequence[Sequence[int]], cp_size: int, tokens_per_row: int,
               dims: ModelDims, *, rows_per_rank: int = 1) -> RankMetrics:
  """``cp``: lane sequences of ``c T`` tokens in head-tail chunks (``packing.cp_placement``)."""
  return placement_metrics(
      packing.cp_placement(lane_doclens, cp_size, tokens_per_row, rows_per_rank=rows_per_rank),
      dims, "cp")


def wlb_metrics(pk: packing.WlbPacking, dims: ModelDims, *, rows_per_rank: int = 1,
                alpha: float | None = None) -> RankMetrics:
  """``wlb`` from its packing, without building the placement (fast for large ``c``).

  Equals ``placement_metrics(wlb_placement(pk))`` (tested).
  """
  c, r = pk.cp_size, rows_per_rank
  start, end = pk.chunks()
  pr = plan_lib.pairs(start, end).astype(np.float64)  # [J, 2c]
  pr = pr[:, :c] + pr[:, ::-1][:, :c]  # rank i: chunk i + chunk 2c - 1 - i
  lanes = pk.num_lanes
  idx = (pk.lane_J[:, None] * c + np.arange(c)[None, :]).reshape(-1)
  pairs_LxC = np.bincount(idx, weights=pr.reshape(-1), minlength=lanes * c).reshape(lanes, c)
  # Key rows: each non-empty chunk is a task reading keys [0, its end); rank c - 1's chunks
  # c - 1 and c are adjacent and form one task (as in `wlb_placement`). Head >= tail in size.
  head_end, tail_end = end[:, :c], end[:, ::-1][:, :c]
  head_n = head_end > start[:, :c]
  tail_n = tail_end > start[:, ::-1][:, :c]
  kv = np.where(head_n, head_end, 0) + np.where(tail_n, tail_end, 0)
  kv[:, c - 1] = np.where(tail_n[:, c - 1], tail_end[:, c - 1],
                          np.where(head_n[:, c - 1], head_end[:, c - 1], 0))
  kv_LxC = np.bincount(idx, weights=kv.reshape(-1), minlength=lanes * c).reshape(lanes, c)
  tokens_LxC = pk.tokens_LxC.astype(np.float64)
  bytes_LxC = (tokens_LxC.sum(1, keepdims=True) - tokens_LxC) * dims.kv_row_bytes
  if c == 1:
    bytes_LxC[:] = 0.0

  def by_rank(x_LxC):  # lane = g R + j, rank = g c + i
    g = lanes // r
    return x_LxC.reshape(g, r, c).sum(1).reshape(-1)

  info = {"num_split": pk.num_split, "num_oversize": pk.num_oversize,
          "row_tokens": pk.row_tokens, "wlb_load_imbalance": imbalance(pk.load_W_L)}
  if alpha is not None:
    info["alpha"] = alpha
  return RankMetrics("wlb", lanes // r, c, by_rank(pairs_LxC), by_rank(tokens_LxC).astype(np.int64),
                     by_rank(bytes_LxC), by_rank(kv_LxC).astype(np.int64), c, info)


def distca_metrics(plan: plan_lib.Plan) -> RankMetrics:
  """``distca`` from a scheduler ``Plan``: loads after balancing, tokens in place, traffic.

  A rank receives, per layer forward, the query and K/V rows other ranks send it as a server
  (``pair_q_rows``, ``pair_kv_rows`` columns) plus its own output rows returned from other servers
  (``pair_q_rows`` row: outputs have the queries' shape).
  """
  s, t = plan.num_servers, plan.tokens_per_rank
  _, rank, g0, g1 = packing.split_at(plan.doc_starts, plan.doc_starts + plan.doc_lens, t)
  tokens = np.bincount(rank, weights=(g1 - g0), minlength=s).astype(np.int64)
  bq = plan.q_heads * plan.head_dim * plan.dtype_bytes
  bkv = 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes
  recv = (plan.pair_q_rows.sum(0) * bq + plan.pair_kv_rows.sum(0) * bkv
          + plan.pair_q_rows.sum(1) * bq).astype(np.float64)
  kv_rows = np.bincount(plan.tasks[:, 3], weights=plan.tasks[:, 2], minlength=s).astype(np.int64)
  info = {"tolerance": plan.tolerance, "imbalance_before": plan.imbalance_before,
          "degraded": bool(plan.degraded)}
  return RankMetrics("distca", s, 1, np.asarray(plan.loads_after, np.float64), tokens, recv,
                     kv_rows, s, info)


# ----------------------------------------------------------------------------------------------
# From the trainer's per-row document lengths (training logs) or a flat global window.
# ----------------------------------------------------------------------------------------------
def wlb_row_tokens(alpha: float, tokens_per_row: int) -> int:
  """Lmax: the per-rank token cap ``floor(alpha T)`` (alpha >= 1)."""
  if not alpha >= 1.0:
    raise ValueError(f"wlb alpha={alpha!r} must be >= 1 (Lmax = alpha x the average budget)")
  return int(math.floor(alpha * tokens_per_row))


def lanes_from_rows(row_doclens: Sequence[Sequence[int]], cp_size: int,
                    rows_per_rank: int = 1) -> list[list[int]]:
  """The ``cp`` lane sequences of the trainer's rows: a lane concatenates its group's rows."""
  b = len(row_doclens)
  c = packing.check_pos_int("cp_size", cp_size)
  r = packing.check_pos_int("rows_per_rank", rows_per_rank)
  if b % (c * r):
    raise ValueError(f"{b} rows do not split into groups of cp_size={c} x rows_per_rank={r}")
  lanes = []
  for lane in range(b // c):
    g, j = divmod(lane, r)
    seq = []
    for i in range(c):
      seq.extend(int(x) for x in row_doclens[(g * c + i) * r + j])
    lanes.append(seq)
  return lanes


def rank_metrics(strategy: str, row_doclens: Sequence[Sequence[int]], tokens_per_row: int, *,
                 dims: ModelDims | None = None, rows_per_rank: int = 1, cp_size: int = 1,
                 alpha: float = 1.0, tolerance: float = plan_lib.DEFAULT_TOLERANCE) -> RankMetrics:
  """Metrics of one strategy on a trainer batch's per-row document lengths (for training logs).

  ``cp`` groups rows into lane sequences, ``wlb`` re-packs the rows' pieces (whole rows' pieces
  are its documents), ``distca`` plans the rows in place (documents never span rows).
  """
  dims = dims or ModelDims()
  if strategy == "packed_dp":
    return packed_dp_metrics(row_doclens, tokens_per_row, dims, rows_per_rank=rows_per_rank)
  if strategy == "cp":
    return cp_metrics(lanes_from_rows(row_doclens, cp_size, rows_per_rank), cp_size,
                      tokens_per_row, dims, rows_per_rank=rows_per_rank)
  if strategy == "wlb":
    flat = [int(x) for row in row_doclens for x in row]
    pk = packing.wlb_pack(flat, len(row_doclens) // cp_size, cp_size,
                          wlb_row_tokens(alpha, tokens_per_row), dims.balance_len)
    return wlb_metrics(pk, dims, rows_per_rank=rows_per_rank, alpha=alpha)
  if strategy == "distca":
    if rows_per_rank != 1:
      raise ValueError(f"distca metrics plan one row per rank; got {rows_per_rank=}")
    plan = plan_lib.schedule([list(r) for r in row_doclens], len(row_doclens),
                             tokens_per_rank=tokens_per_row,
                             options=plan_lib.PlanOptions(tolerance=tolerance,
                                                          q_heads=dims.q_heads,
                                                          kv_heads=dims.kv_heads,
                                                          head_dim=dims.head_dim,
                                                          dtype_bytes=dims.dtype_bytes))
    return distca_metrics(plan)
  raise ValueError(f"unknown {strategy=}; choose 'packed_dp', 'wlb', 'cp' or 'distca'")
