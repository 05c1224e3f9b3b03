"""The cost model of core attention: pairs, FLOPs, measured kernel times, and the balance gate.

A CA-task is a query shard ``[a, b)`` of one document with keys ``[0, b)`` of the same document,
causal with the diagonal (DistCA paper, arXiv 2510.18121, Sec. 4; docs/design.md). Its work is
``P(a, b) = (b - a) (a + b + 1) / 2`` query-key pairs; forward FLOPs are
``FWD_FLOPS_PER_PAIR * q_heads * head_dim * P`` and the kernel's backward costs ``BWD_FWD_RATIO``
times the forward. In a sliding-window layer of ``w`` keys (``window``), query position ``p``
sees keys ``[max(0, p - w + 1), p]``: the task reads keys ``[k_start(a), b)`` with ``k_start(a) =
max(0, a - w + 1)`` (``k_starts``) and holds ``sum_p min(p + 1, w)`` pairs (``pairs(a, b, w)``).
The balancer works in pairs (exact integer arithmetic); an optional measured ``CostTable``
predicts per-server kernel time for the same plan.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------
# Cost constants: the one place that holds them.
# ---------------------------------------------------------------------------------------------
# Forward FLOPs per query-key pair per (query head x head-dim element): QK^T (2) + PV (2).
FWD_FLOPS_PER_PAIR = 4
# The fused kernel's backward costs ~2.5x its forward (it recomputes QK^T); fwd+bwd = 3.5x.
BWD_FWD_RATIO = 2.5
# MFU accounting uses Megatron's document-masked convention: fwd+bwd = 3x forward FLOPs.
MFU_FWD_BWD_FACTOR = 3.0

# Shortest query piece the balancer may create: short tail shards cost the fused kernel's
# backward dearly (dK/dV over the whole key range per task); see results/kernel_bench.md.
DEFAULT_MIN_SHARD = 512
# Every server within (1 + 0.02) x mean: balances as well as 0 for a few % more bytes than a
# looser goal (docs/design.md Sec. 10); config.attention.distca.tolerance defaults to it.
DEFAULT_TOLERANCE = 0.02
# Llama-3-8B attention shapes and bf16: the byte model's defaults.
DEFAULT_Q_HEADS = 32
DEFAULT_KV_HEADS = 8
DEFAULT_HEAD_DIM = 128
DEFAULT_DTYPE_BYTES = 2
# Per-GPU link rates (GB/s) the balancer prices moves with when it knows the hosts
# (``PlanOptions.servers_per_host``): inside a host, the device-initiated exchange's rate fitted
# on 4 x H100 (0.64 ms + bytes / 344 GB/s, results/four/raw/exchange_bench_grid.json); between
# hosts, one 400 Gb/s NIC per GPU (stated, as ``sim.costs``' inter-node bandwidth). Their ratio
# (about 7) is what a row sent across hosts costs against one sent inside a host.
INTRA_HOST_GBPS = 344.0
INTER_HOST_GBPS = 50.0


def pairs(a, b, window: int = 0):
  """Causal query-key pairs of the task with queries [a, b) and keys [0, b) (ints or arrays);
  with ``window`` w > 0, of its sliding-window task (keys [k_start(a), b)): query position p
  sees min(p + 1, w) keys."""
  if not window:
    return (b - a) * (a + b + 1) // 2
  m = np.minimum(np.maximum(window, a), b)  # positions [a, m) see p + 1 keys, [m, b) see w
  return (m - a) * (a + m + 1) // 2 + (b - m) * window


def k_starts(a, window: int = 0):
  """First key position of the task with queries starting at ``a`` (ints or arrays): 0, or
  ``max(0, a - window + 1)`` in a sliding-window layer."""
  if not window:
    return np.zeros_like(a) if isinstance(a, np.ndarray) else 0
  return np.maximum(a - window + 1, 0)


def task_flops(pairs_count, q_heads: int, head_dim: int, *, backward: bool = True) -> float:
  """Kernel FLOPs of ``pairs_count`` pairs: forward, plus ``BWD_FWD_RATIO`` x forward if asked."""
  fwd = FWD_FLOPS_PER_PAIR * q_heads * head_dim * np.asarray(pairs_count, dtype=np.float64)
  return fwd * (1.0 + BWD_FWD_RATIO) if backward else fwd


def attention_pairs(cu_seqlens_q_N1: Sequence[int] | np.ndarray,
                    cu_seqlens_k_N1: Sequence[int] | np.ndarray, window: int = 0) -> int:
  """Exact count of (query, key) pairs the bottom-right causal mask keeps, summed over the tasks
  of a kernel call's task table (``cu_seqlens``, as ``ops.core_attention`` takes them).

  A task with lq queries and lk keys: local row r sees clip(r + 1 + lk - lq, 0, lk) keys; for
  lq <= lk this is lq * (lk - lq) + lq * (lq + 1) / 2 (``pairs``; docs/design.md Sec. 10).
  With a sliding ``window`` w, row r sees min(max(r + 1 + lk - lq, 0), w) keys.
  """
  cu_q = np.asarray(cu_seqlens_q_N1, dtype=np.int64)
  cu_k = np.asarray(cu_seqlens_k_N1, dtype=np.int64)
  if cu_q.shape != cu_k.shape or cu_q.ndim != 1:
    raise ValueError(f"cu_seqlens must be 1-D of equal shape; got {cu_q.shape=}, {cu_k.shape=}")
  if window:
    # Rows see u = r + 1 + lk - lq keys for u in (lk - lq, lk], min(max(u, 0), w) each:
    # sum_{u=1}^{n} min(u, w) = pairs(0, n, w).
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    keep = (lq > 0) & (lk > 0)
    lq, lk = lq[keep], lk[keep]
    return int((pairs(0, lk, window) - pairs(0, np.maximum(lk - lq, 0), window)).sum())
  total = 0
  for lq, lk in zip(np.diff(cu_q).tolist(), np.diff(cu_k).tolist()):
    if lq <= 0 or lk <= 0:
      continue
    off = lk - lq
    # Rows r with r + 1 + off in [1, lk]: they see r + 1 + off keys; rows before see none.
    r_lo = max(0, -off)
    n = lq - r_lo
    first = r_lo + 1 + off
    total += n * first + n * (n - 1) // 2
  return int(total)


def core_attention_flops(cu_seqlens_q_N1: Sequence[int] | np.ndarray,
                         cu_seqlens_k_N1: Sequence[int] | np.ndarray, *, num_q_heads: int,
                         head_dim: int, include_backward: bool = False, window: int = 0) -> int:
  """Exact attention FLOPs of a task table: forward ``FWD_FLOPS_PER_PAIR * H * D * pairs``
  (QK^T and PV).

  With ``include_backward`` the kernel-throughput convention adds ``BWD_FWD_RATIO`` x
  forward (fwd + bwd = 3.5x forward). Query heads count, not KV heads (GQA saves bytes only).
  """
  fwd = (FWD_FLOPS_PER_PAIR * int(num_q_heads) * int(head_dim)
         * attention_pairs(cu_seqlens_q_N1, cu_seqlens_k_N1, window))
  if not include_backward:
    return fwd
  return int(round(fwd * (1.0 + BWD_FWD_RATIO)))




# ---------------------------------------------------------------------------------------------
# Measured cost model.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CostTable:
  """Measured kernel time per task over a (q_len, kv_len) grid, bilinear in log-log space.

  Attributes:
    q_lens: [Q] increasing query lengths.
    kv_lens: [K] increasing key lengths.
    time_s: [Q, K] seconds per task (a task with ``q_len`` query rows aligned at the end of
      ``kv_len`` keys). Entries with ``q_len > kv_len`` are not tasks; the loader fills them with
      the diagonal value (query length clamped to the key length) so cells straddling the
      diagonal interpolate.
    meta: free-form description of the measurement (device, backend, heads, dtype, command).
  """
  q_lens: np.ndarray
  kv_lens: np.ndarray
  time_s: np.ndarray
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @staticmethod
  def from_json(path: str, *, key: str = "fwd_bwd_s") -> "CostTable":
    """Loads a table written by ``experiments/cost_table.py``; ``key`` picks the timing column."""
    if not os.path.exists(path):
      raise FileNotFoundError(f"cost table {path=} does not exist; measure one with "
                              "experiments/cost_table.py")
    with open(path) as f:
      blob = json.load(f)
    for k in ("q_lens", "kv_lens", key):
      if k not in blob:
        raise ValueError(f"cost table {path}: missing field {k!r} (has {sorted(blob)})")
    return CostTable.from_arrays(blob["q_lens"], blob["kv_lens"], blob[key],
                                 meta=blob.get("meta", {}))

  @staticmethod
  def from_arrays(q_lens, kv_lens, time_s, *, meta: Mapping[str, Any] | None = None
                  ) -> "CostTable":
    """Validates a grid; ``time_s`` may hold None/NaN where ``q_len > kv_len``."""
    q = np.asarray(q_lens, dtype=np.float64)
    kv = np.asarray(kv_lens, dtype=np.float64)
    t = np.array([[np.nan if v is None else v for v in row] for row in time_s], dtype=np.float64)
    if q.ndim != 1 or kv.ndim != 1 or q.size < 1 or kv.size < 1:
      raise ValueError(f"cost table grids must be non-empty 1-D; got {q.shape=} {kv.shape=}")
    if (q <= 0).any() or (np.diff(q) <= 0).any() or (kv <= 0).any() or (np.diff(kv) <= 0).any():
      raise ValueError(f"cost table grids must be positive and increasing: {q_lens=} {kv_lens=}")
    if t.shape != (q.size, kv.size):
      raise ValueError(f"time table shape {t.shape} != (len(q_lens), len(kv_lens)) = "
                       f"{(q.size, kv.size)}")
    valid = q[:, None] <= kv[None, :]
    bad = valid & ~(np.isfinite(t) & (t > 0))
    if bad.any():
      i, j = np.argwhere(bad)[0]
      raise ValueError(f"cost table entry (q_len={q[i]:g}, kv_len={kv[j]:g}) = {t[i, j]} must be "
                       "a positive finite time")
    # Fill q > kv with the diagonal value: time(kv, kv), found by interpolating the valid column.
    for j in range(kv.size):
      col_valid = valid[:, j]
      if not col_valid.all():
        if not col_valid.any():
          raise ValueError(f"cost table column kv_len={kv[j]:g} has no q_len <= kv_len")
        diag = _interp_log(q[col_valid], t[col_valid, j], kv[j])
        t[~col_valid, j] = diag
    return CostTable(q, kv, t, dict(meta or {}))

  def time(self, q_len, kv_len) -> np.ndarray:
    """Predicted seconds of tasks with ``q_len`` queries ending ``kv_len`` keys (arrays ok).

    Inside the grid: bilinear interpolation of log time over (log q_len, log kv_len). Outside:
    the clamped grid value scaled by the ratio of causal pairs.
    """
    q = np.asarray(q_len, dtype=np.float64)
    kv = np.asarray(kv_len, dtype=np.float64)
    if np.any(q < 1) or np.any(kv < q):
      raise ValueError(f"tasks need 1 <= q_len <= kv_len; got {q_len=} {kv_len=}")
    kc = np.clip(kv, self.kv_lens[0], self.kv_lens[-1])
    qc = np.clip(np.minimum(q, kc), self.q_lens[0], self.q_lens[-1])
    lq, lk = np.log(self.q_lens), np.log(self.kv_lens)
    lt = np.log(self.time_s)
    xq, xk = np.log(qc), np.log(kc)
    iq = np.clip(np.searchsorted(lq, xq, side="right") - 1, 0, max(lq.size - 2, 0))
    ik = np.clip(np.searchsorted(lk, xk, side="right") - 1, 0, max(lk.size - 2, 0))
    iq1 = np.minimum(iq + 1, lq.size - 1)
    ik1 = np.minimum(ik + 1, lk.size - 1)
    fq = np.where(iq1 > iq, (xq - lq[iq]) / np.where(iq1 > iq, lq[iq1] - lq[iq], 1.0), 0.0)
    fk = np.where(ik1 > ik, (xk - lk[ik]) / np.where(ik1 > ik, lk[ik1] - lk[ik], 1.0), 0.0)
    v = ((1 - fq) * (1 - fk) * lt[iq, ik] + fq * (1 - fk) * lt[iq1, ik]
         + (1 - fq) * fk * lt[iq, ik1] + fq * fk * lt[iq1, ik1])
    # Outside the grid, scale by causal pairs: pairs of (q, kv) over pairs of the clamped point.
    p_true = q * (2 * kv - q + 1) / 2
    p_clamp = qc * (2 * kc - qc + 1) / 2
    return np.exp(v) * p_true / p_clamp


def _interp_log(x: np.ndarray, y: np.ndarray, at: float) -> float:
  """Linear interpolation of log y over log x at ``at`` (edge-clamped)."""
  return float(np.exp(np.interp(np.log(at), np.log(x), np.log(y))))


def as_cost_table(cost_model) -> CostTable | None:
  """``cost_model`` (None, a JSON path or a ``CostTable``) as a ``CostTable`` or None."""
  if cost_model is None or isinstance(cost_model, CostTable):
    return cost_model
  if isinstance(cost_model, (str, os.PathLike)):
    return CostTable.from_json(os.fspath(cost_model))
  raise TypeError(f"cost_model={cost_model!r} must be None, a JSON path or a CostTable")


def imbalance(loads) -> float:
  """max / mean of per-server loads (1.0 when every load is zero)."""
  loads = np.asarray(loads, dtype=np.float64)
  mean = loads.mean() if loads.size else 0.0
  return float(loads.max() / mean) if mean > 0 else 1.0



def layout_step_gain(server_doc_lens, tokens_per_rank: int,
                     linear_pairs_per_token: float) -> float:
  """``predicted_step_gain`` of documents as they lie: one list of document lengths per server
  (every document computed where it lives), as the planner's gate computes it
  (``Plan.predicted_gain``) without planning."""
  loads = [int(pairs(0, np.asarray(lens, np.int64)).sum()) for lens in server_doc_lens]
  return predicted_step_gain(loads, tokens_per_rank, linear_pairs_per_token)


def predicted_step_gain(loads, tokens_per_rank: int, linear_pairs_per_token: float) -> float:
  """The speedup a perfect attention balance would bring, minus 1, from per-server pairs.

  A server's step work is its attention pairs plus the linear layers' work on its token budget,
  ``linear_pairs_per_token * tokens_per_rank`` in pair units (the same on every server: every
  rank runs its linear layers on all ``T`` token slots). The step waits for the busiest server,
  so a perfect balance speeds it up by ``(max + linear) / (mean + linear)``: the gain is
  ``(max - mean) / (mean + linear)`` (the step-work ceiling minus 1), before the costs of
  moving rows. ``linear_pairs_per_token = 6 N / (14 L Hq D)`` for a model of ``N`` matmul
  weights (layers and LM head), ``L`` layers, ``Hq`` query heads of dim ``D`` (the work model
  ``metrics.work_flops``: ``6 N`` per token, ``task_flops`` = 14 Hq D per causal pair and
  layer).
  """
  loads = np.asarray(loads, dtype=np.float64)
  if loads.size == 0:
    return 0.0
  mean = float(loads.mean())
  denom = mean + float(linear_pairs_per_token) * float(tokens_per_rank)
  return float((loads.max() - mean) / denom) if denom > 0 else 0.0
