"""Core-attention scheduler: balance CA-tasks over in-place attention servers (host, NumPy only).

This module plans; it never touches a device. ``schedule`` turns a global batch's document layout
into a ``Plan`` (which server computes which query shard), and ``plan_to_metadata`` turns a plan
into fixed-shape int32 arrays (``PlanMetadata``) that the data plane (``distca_jax.dispatch``)
executes inside one compiled step. ``reference_execute`` runs that metadata with NumPy so the
contract is tested before any device code exists.

Units and cost (DistCA paper, arXiv 2510.18121, Sec. 4; ``docs/DESIGN_NOTES.md`` Sec. 1)
------------------------------------------------------------------------------------------
A CA-task is a query shard ``[a, b)`` of one document with keys ``[0, b)`` of the same document,
causal with the diagonal. Its work is ``P(a, b) = (b - a) (a + b + 1) / 2`` query-key pairs;
forward FLOPs are ``FWD_FLOPS_PER_PAIR * q_heads * head_dim * P`` and the kernel's backward costs
``BWD_FWD_RATIO`` times the forward. Loads are balanced in pairs (exact integer arithmetic); an
optional measured ``CostTable`` predicts per-server kernel time for the same plan.

Ranks, documents, servers
-------------------------
``doc_lens`` is either one flat list packed in order across ranks (rank ``r`` holds global tokens
``[r T, (r + 1) T)``, ``T = tokens_per_rank``; documents may span ranks; an unfilled tail is
padding) or one list per rank (documents never span ranks; each rank's unfilled tail is padding).
Documents are numbered in that order (rank-major for the nested form). Every rank is an attention
server ("in place"). The starting point is "every query row computed where it lives": one task per
(document, rank) segment ``[lo, hi)`` with keys ``[0, hi)``; a document spanning ranks already
needs key/value rows of its earlier segments from their ranks.

Balancing (greedy, communication-aware; paper Sec. 4.2)
-------------------------------------------------------
Let ``mean`` be the mean load and ``limit = (1 + tolerance) mean``. While some server is above the
limit, the most needy server (lowest load, not yet found blocked) is the destination; among all
items on servers above the limit (an item is one or two query intervals of one document on one
server), each is scored by ``useful work moved / bytes communicated`` under three options, and the
best (item, option) that passes the exact capacity check is applied:

* whole: move the item;
* mirrored: take ``m`` tokens from the inner end of its head interval ``[a, x)`` and ``m`` from the
  inner start of its tail interval ``[y, b)`` (a single interval is split at its middle). These
  ``m`` mirrored pairs cost exactly ``m (x + y + 1)`` pairs, so the moved work is exact; taking
  the innermost pairs keeps the key range of the moved piece short (``[0, y + m)``);
* suffix: move the last ``k`` tokens ``[b - k, b)`` (keys ``[0, b)``), which needs fewer query
  rows for the same work but the whole key range.

Bytes of a move are the query bytes of moved rows not owned by the destination plus the key/value
bytes of context rows not already present there: the rows of ``[0, b)`` of that document the
destination neither owns nor already receives (a KV row is sent at most once per (sender, server)
pair because every task's key range is a prefix ``[0, b)``). "Useful work" is the move's work
capped at ``min(source excess over limit, destination room to mean)``, so overshooting buys
nothing. A move never pushes its destination above ``limit`` and never creates a query piece
shorter than ``min_shard`` tokens (whole items, however short, may move). The loop is
deterministic: ties go to the lowest item index and the options' fixed order.

It stops when every server is at most ``limit`` (servers below the mean do not slow a step). If
no destination admits a move first (pieces of at least ``min_shard`` tokens do not fit the room a
tight limit leaves, or caps refuse), a second phase keeps lowering the maximum load with the same
greedy under intermediate limits between the current maximum and ``limit`` (more room per
destination), so a smaller tolerance never ends worse than it must. ``Plan.degraded`` is set
when the result is above ``limit``, with a reason naming the caps that blocked moves or the
``min_shard`` granularity.
Sufficient condition for reaching the limit without caps: a destination below the mean always has
room ``>= tolerance * mean``, and the smallest move any item allows costs at most
``4 min_shard (L_max + 1)`` pairs (a piece of ``min_shard`` tokens, or a whole item too short to
split: at most two parts shorter than ``2 min_shard`` each); when that is ``<= tolerance * mean``
the greedy always finds a move until every server is within the limit. With ``tolerance = 0`` an
exact balance of integer token counts is generally impossible and the plan reports ``degraded``
within one such piece of the mean.

The gate (``min_gain``): balancing first asks whether it is worth it. With the linear layers'
work per token in pair units (``linear_pairs_per_token``, from the model), the speedup a perfect
balance could bring is ``1 + (max - mean) / (mean + linear work)`` (``predicted_step_gain`` is
the part past 1); below ``min_gain`` nothing moves and the plan is ``gated``. The data plane
plans each nano-batch apart, so each is gated on its own. Moving rows costs time of its own
(gathers into the attention buffers, the exchange, shorter kernel tasks): on 2 H200s, batches
whose step-work ceiling was 1.00-1.03 ran at 0.965-1.010x packed_dp's speed with CAD, while
those above 1.05 took their whole ceiling (results/per_batch_bound.md).

Capacities (``Capacity``) and what they cost
--------------------------------------------
The compiled step has fixed buffers, so a plan respects per-server and per-pair caps; ``None``
means unbounded (for analysis; metadata then takes the plan's own tight sizes, which changes
shapes from batch to batch and recompiles). Per device, with ``bq = q_heads * head_dim * bytes``
and ``bkv = kv_heads * head_dim * bytes`` (one of K or V) and ``S`` servers:

=============  =========================================  ======================================
field          what it bounds                             buffers it sizes (bytes per device)
=============  =========================================  ======================================
``q_slot``     query rows one sender sends one server     Q send + recv: ``2 S q_slot bq``;
               (``Cq``)                                   O return send + recv: ``2 S q_slot bq``
``kv_slot``    key/value rows one sender sends one        K,V send + recv: ``4 S kv_slot bkv``
               server (``Ckv``)
``q_tokens``   query rows in a server's attention input   Q and O: ``2 q_tokens bq`` (+ LSE)
               (its own rows plus received; ``Nq``)
``kv_tokens``  key/value rows in a server's attention     K and V: ``2 kv_tokens bkv``
               input, counting duplicates (``Nkv``)
``tasks``      tasks (varlen segments) per server         ``cu_seqlens``: ``2 (tasks + 1)`` int32
=============  =========================================  ======================================

``Capacity.memory_bytes`` evaluates this. The self pair never goes through the exchange (a
server reads its own rows directly), so slot caps bound cross-rank traffic only; a flat layout
whose documents span whole ranks needs ``kv_slot >= tokens_per_rank`` (the server computing the
last rows of a document needs every earlier row, a rank's worth from each earlier rank); a layout
that does not fit the caps even before balancing raises ``ValueError`` naming the needed value.
To choose caps: plan a few hundred sampled batches without caps, take ``required_capacity`` of
each, and set every cap to a high quantile of those (``Capacity.envelope``), rounded up to a
multiple of 128; tighter caps cost imbalance (the plan reports it), looser ones cost memory.

Key/value layout on a server (the choice and its cost)
------------------------------------------------------
The kernel takes one varlen call per server with monotone ``cu_seqlens_q`` / ``cu_seqlens_k``, so
every task owns a contiguous, disjoint key range ``[cu_seqlens_k[i], cu_seqlens_k[i + 1])`` whose
last ``q_len`` rows are aligned with the task's queries (causal, bottom-right). Several tasks of one
document on one server (the head and tail of a mirrored split, or non-adjacent shards) therefore
each get their own copy of their key prefix ``[0, b_i)`` in the attention KV buffer: the rows are
sent over the network once per (sender, server) pair and duplicated by the server's local gather.
Adjacent shards of one document on one server are merged into a single task first. Cost of the
duplication: no network bytes; HBM of ``sum_i b_i - max_i b_i`` extra KV rows per document on that
server (a head-tail pair ``[s, s+m) + [L-s-m, L-s)`` duplicates ``s + m`` rows, i.e.
``2 (s + m) bkv`` bytes for K and V), counted in ``kv_tokens``; the kernel reads them anyway
because each task attends its whole key prefix. The gather's transpose (scatter-add) sums dK/dV of
duplicated rows in the backward for free. (A kernel taking per-row key ranges could share one
prefix; the ``core_attention`` signature does not.)

PlanMetadata: the contract with the data plane
----------------------------------------------
All arrays are int32 with a leading axis indexed by the device that uses them (``S`` of them),
so the data plane shards every array over its data axis and each device reads its own row.
``T = tokens_per_rank``, ``Cq, Ckv, Nq, Nkv, Nt`` are the capacity's ``q_slot, kv_slot, q_tokens,
kv_tokens, tasks``. Padding entries hold a sentinel one past the end of the indexed array:
gather with ``jnp.take(..., mode='fill', fill_value=0)`` and scatter with ``mode='drop'`` (this
also makes the autodiff transposes correct).

1. Sender gather (device ``p``): ``q_send_idx[p, s, j]`` in ``[0, T]`` is the local row of
   ``q[p]`` placed in slot ``j`` of the buffer bound for server ``s`` (sentinel ``T``);
   ``kv_send_idx[p, s, j]`` likewise for K and V (both use the same rows). The self pair
   ``[p, p, :]`` is all sentinel. Build ``q_send[S, Cq, H, D]``, ``k_send/v_send[S, Ckv, K, D]``.
2. Exchange: dense ``lax.all_to_all`` (split axis 0, concat axis 0): server ``s`` receives
   ``q_recv[p] = q_send_of_p[s]``, i.e. ``q_recv[S, Cq, H, D]``, ``k_recv/v_recv[S, Ckv, K, D]``.
3. Server gather into attention inputs (device ``s``): sources are the server's own rows followed
   by everything received: ``q_src = concat([q_local[T], q_recv.reshape(S * Cq)])``;
   ``q_attn = q_src[q_attn_idx[s]]`` with ``q_attn_idx[s, Nq]`` in ``[0, T + S Cq]`` (sentinel
   ``T + S Cq``); ``kv_src`` / ``kv_attn_idx[s, Nkv]`` likewise with ``Ckv`` (sentinel
   ``T + S Ckv``). KV indices may repeat (duplicated prefixes, see above); query indices never do.
4. Kernel: one call ``core_attention(q_attn, k_attn, v_attn, cu_seqlens_q[s], cu_seqlens_k[s])``
   with ``cu_seqlens_q[s, Nt + 1]``, ``cu_seqlens_k[s, Nt + 1]`` over the attention inputs, causal
   bottom-right; unused trailing tasks are empty (the arrays repeat their last value) and rows past
   ``cu_seqlens_*[s, Nt]`` belong to no task (their output is never read).
5. Return: ``o_send = O_attn[o_send_idx[s]]`` with ``o_send_idx[s, p, j]`` in ``[0, Nq]`` (the
   attention row whose output goes back to sender ``p`` in the slot ``j`` where its query came
   from; sentinel ``Nq``), ``all_to_all`` back, then the owner ``p`` assembles its output rows:
   ``o_src = concat([O_attn_own[Nq], o_recv.reshape(S * Cq)])`` and
   ``o_local = o_src[o_local_idx[p]]`` with ``o_local_idx[p, T]`` in ``[0, Nq + S Cq]``
   (sentinel for padding rows, which come back zero). The softmax LSE follows the same routing.

Counts (``q_send_len``, ``kv_send_len`` [S, S] rows per (sender, server); ``q_len``, ``kv_len``,
``num_tasks`` [S] per server) give useful bytes for bandwidth reports and masks;
``task_index[s, Nt]`` maps a server's task slot to its row in ``Plan.tasks`` (-1 for padding).
"""

from __future__ import annotations

import dataclasses
import json
import math
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

# Minimum query-shard length the balancer may create. FlashAttention-3 varlen on one H200 with
# tail shards [b - s, b) of long documents (DESIGN_NOTES Sec. 5): forward 567-601 TF/s for every
# s, but forward+backward 584 TF/s at s=4096, 502 at 1024, 431 at 512, 332 at 256, 226 at 128
# (the backward pays dK/dV over the whole key range per task). 512 keeps fwd+bwd at 74% of the
# 4096-token rate (128 would be 39%), while 1024 (86%) would double the smallest movable piece,
# i.e. the balancing granularity 2 * min_shard * (2 L + 1) pairs.
DEFAULT_MIN_SHARD = 512
# Every server within (1 + 0.02) x mean: on 2 H200s at Pretrain 128K, attention max/mean 1.014
# per GPU vs 1.04 at 0.05, for 1.6% more bytes; eps 0 / 0.05 / 0.1 stepped alike
# (results/e2e_v5_summary.md, e2e_2gpu_64k_v3.md). The config's attention.distca.tolerance
# defaults to it.
DEFAULT_TOLERANCE = 0.02
# Llama-3-8B attention shapes and bf16: the byte model's defaults.
DEFAULT_Q_HEADS = 32
DEFAULT_KV_HEADS = 8
DEFAULT_HEAD_DIM = 128
DEFAULT_DTYPE_BYTES = 2

_SPLITS = ("auto", "mirrored", "suffix")
_CAP_FIELDS = ("q_slot", "kv_slot", "q_tokens", "kv_tokens", "tasks")


def pairs(a, b):
  """Causal query-key pairs of the task with queries [a, b) and keys [0, b) (ints or arrays)."""
  return (b - a) * (a + b + 1) // 2


def task_flops(pairs_count, q_heads: int, head_dim: int, *, backward: bool = True) -> float:
  """Kernel FLOPs of ``pairs_count`` pairs: forward, plus ``BWD_FWD_RATIO`` x forward if asked."""
  fwd = FWD_FLOPS_PER_PAIR * q_heads * head_dim * np.asarray(pairs_count, dtype=np.float64)
  return fwd * (1.0 + BWD_FWD_RATIO) if backward else fwd


# ---------------------------------------------------------------------------------------------
# Capacities.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Capacity:
  """Fixed buffer sizes a plan must fit (rows, not bytes); ``None`` = unbounded.

  Attributes:
    q_slot: query rows per (sender, server) pair, self pair excluded (``Cq``).
    kv_slot: key/value rows per (sender, server) pair, self pair excluded (``Ckv``).
    q_tokens: query rows in one server's attention input, own rows included (``Nq``).
    kv_tokens: key/value rows in one server's attention input, per-task duplicates included
      (``Nkv``).
    tasks: tasks per server (``Nt``).
  """
  q_slot: int | None = None
  kv_slot: int | None = None
  q_tokens: int | None = None
  kv_tokens: int | None = None
  tasks: int | None = None

  def __post_init__(self):
    for name in _CAP_FIELDS:
      v = getattr(self, name)
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"Capacity.{name}={v!r} must be a positive int or None (unbounded)")
      object.__setattr__(self, name, int(v))

  @property
  def bounded(self) -> bool:
    """True when every field is set (metadata shapes are then fixed by the config)."""
    return all(getattr(self, f) is not None for f in _CAP_FIELDS)

  def replace_none(self, other: "Capacity") -> "Capacity":
    """This capacity with its ``None`` fields taken from ``other``."""
    return Capacity(**{f: getattr(self, f) if getattr(self, f) is not None else getattr(other, f)
                       for f in _CAP_FIELDS})

  @staticmethod
  def envelope(caps: Sequence["Capacity"], *, quantile: float = 1.0,
               multiple: int = 128) -> "Capacity":
    """Per-field ``quantile`` over ``caps`` (e.g. ``required_capacity`` of sampled plans).

    Row fields are rounded up to a multiple of ``multiple``; ``tasks`` is rounded up to a
    multiple of 8.
    """
    if not caps:
      raise ValueError("Capacity.envelope needs at least one capacity")
    if not 0.0 <= quantile <= 1.0:
      raise ValueError(f"{quantile=} must lie in [0, 1]")
    out = {}
    for f in _CAP_FIELDS:
      vals = [getattr(c, f) for c in caps]
      if any(v is None for v in vals):
        raise ValueError(f"Capacity.envelope: field {f} is None in some input; pass bounded caps")
      q = float(np.quantile(np.asarray(vals, dtype=np.float64), quantile, method="higher"))
      step = 8 if f == "tasks" else multiple
      out[f] = max(step, int(math.ceil(q / step) * step))
    return Capacity(**out)

  def memory_bytes(self, num_servers: int, *, q_heads: int = DEFAULT_Q_HEADS,
                   kv_heads: int = DEFAULT_KV_HEADS, head_dim: int = DEFAULT_HEAD_DIM,
                   dtype_bytes: int = DEFAULT_DTYPE_BYTES) -> dict[str, int]:
    """Per-device bytes of the buffers these caps size (one layer, forward activations).

    Keys: ``q_exchange`` (Q send + recv), ``o_exchange`` (O send + recv), ``kv_exchange`` (K and V
    send + recv), ``attention_q_o`` (Q input and O output), ``attention_kv`` (K and V inputs),
    ``lse`` (float32 softmax statistics), ``metadata`` (int32 index arrays) and ``total``.
    """
    if not self.bounded:
      raise ValueError(f"memory_bytes needs every cap set; got {self}")
    s = int(num_servers)
    bq = q_heads * head_dim * dtype_bytes
    bkv = kv_heads * head_dim * dtype_bytes
    out = {
        "q_exchange": 2 * s * self.q_slot * bq,
        "o_exchange": 2 * s * self.q_slot * bq,
        "kv_exchange": 4 * s * self.kv_slot * bkv,
        "attention_q_o": 2 * self.q_tokens * bq,
        "attention_kv": 2 * self.kv_tokens * bkv,
        "lse": self.q_tokens * q_heads * 4,
        "metadata": 4 * (2 * s * self.q_slot + s * self.kv_slot + self.q_tokens + self.kv_tokens
                         + 2 * (self.tasks + 1) + self.tasks),
    }
    out["total"] = sum(out.values())
    return out


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


def _as_cost_table(cost_model) -> CostTable | None:
  if cost_model is None or isinstance(cost_model, CostTable):
    return cost_model
  if isinstance(cost_model, (str, os.PathLike)):
    return CostTable.from_json(os.fspath(cost_model))
  raise TypeError(f"cost_model={cost_model!r} must be None, a JSON path or a CostTable")


# ---------------------------------------------------------------------------------------------
# Layout parsing.
# ---------------------------------------------------------------------------------------------
def check_int(name: str, v, lo: int) -> int:
  """``int(v)``, or a ValueError naming ``name`` unless ``v`` is an int (not a bool) >= ``lo``."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
    raise ValueError(f"{name}={v!r} must be an int >= {lo}")
  return int(v)


def check_float(name: str, v, lo: float = 0.0, hint: str = "") -> float:
  """``float(v)``, or a ValueError naming ``name`` (and ``hint``, the fix) unless ``v`` is a
  finite real number (not a bool) >= ``lo``."""
  if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
      or not lo <= float(v) < float("inf")):
    raise ValueError(f"{name}={v!r} must be a finite number >= {lo:g}"
                     + (f" ({hint})" if hint else ""))
  return float(v)


def parse_layout(doc_lens, num_servers: int, tokens_per_rank: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Validates ``doc_lens`` (flat or per rank) and returns (lengths [J], global starts [J]).

  Global token ``g`` lives on rank ``g // tokens_per_rank`` at local row ``g % tokens_per_rank``.
  """
  s = check_int("num_servers", num_servers, 1)
  t = check_int("tokens_per_rank", tokens_per_rank, 1)
  if isinstance(doc_lens, np.ndarray) and doc_lens.ndim == 1:
    doc_lens = doc_lens.tolist()
  if not isinstance(doc_lens, (list, tuple)):
    raise TypeError(f"doc_lens must be a list of ints or a list of per-rank lists; got "
                    f"{type(doc_lens).__name__}")
  is_seq = [isinstance(v, (list, tuple, np.ndarray)) for v in doc_lens]
  if any(is_seq) and not all(is_seq):
    raise ValueError("doc_lens mixes ints and lists; pass either a flat list of lengths or one "
                     "list per rank")
  nested = bool(doc_lens) and all(is_seq)

  def _lens(vals, where: str) -> np.ndarray:
    out = np.zeros(len(vals), dtype=np.int64)
    for i, v in enumerate(vals):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"document length {v!r} at {where}[{i}] must be a positive int")
      out[i] = int(v)
    return out

  if not nested:
    lens = _lens(doc_lens, "doc_lens")
    total = int(lens.sum())
    if total > s * t:
      raise ValueError(f"doc_lens hold {total} tokens > {num_servers=} x {tokens_per_rank=} = "
                       f"{s * t}; raise tokens_per_rank or num_servers")
    starts = np.cumsum(lens) - lens
    return lens, starts
  if len(doc_lens) != s:
    raise ValueError(f"per-rank doc_lens has {len(doc_lens)} ranks but {num_servers=}; servers "
                     "are the ranks (in place), pass one list per rank")
  all_lens, all_starts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
  for r, rank_lens in enumerate(doc_lens):
    lens = _lens(list(rank_lens), f"doc_lens[{r}]")
    if lens.sum() > t:
      raise ValueError(f"rank {r} holds {int(lens.sum())} tokens > {tokens_per_rank=}")
    all_lens.append(lens)
    all_starts.append(r * t + np.cumsum(lens) - lens)
  return np.concatenate(all_lens), np.concatenate(all_starts)


# ---------------------------------------------------------------------------------------------
# Plan.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
  """A schedule: which server computes which query shard.

  Attributes:
    tasks: [N, 4] int64 rows (document index, query start, query end, server), positions inside
      the document; sorted by (server, document, start). Keys of a task are [0, query end).
    loads_before: [S] pairs per server when every row is computed where it lives.
    loads_after: [S] pairs per server under this plan.
    imbalance_before / imbalance_after: max / mean of the loads (1.0 when there is no work).
    pair_q_rows / pair_kv_rows: [S, S] rows sent from sender (row) to server (column), self
      excluded; bytes are these times the row sizes.
    bytes_q / bytes_kv: dispatch bytes (query, key+value); the output return moves ``bytes_q``
      again (O rows have the query's shape).
    degraded: True when the plan ends above ``(1 + tolerance) * mean``; ``degraded_reason`` says
      which cap or granularity stopped it.
    times_before / times_after: [S] predicted kernel seconds from the cost table, or None.
    doc_lens / doc_starts: [J] the parsed layout (global token starts).
    capacity: the caps the plan respects (None fields = unbounded).
    num_moves: balancing moves applied.
    predicted_gain: the speedup a perfect balance would bring, minus 1: ``predicted_step_gain``
      of ``loads_before`` (attention alone, ``imbalance_before - 1``, when
      ``linear_pairs_per_token`` is 0).
    gated: True when that gain was below ``min_gain``: nothing moved, by decision (not
      ``degraded``).
  """
  tasks: np.ndarray
  loads_before: np.ndarray
  loads_after: np.ndarray
  imbalance_before: float
  imbalance_after: float
  pair_q_rows: np.ndarray
  pair_kv_rows: np.ndarray
  bytes_q: int
  bytes_kv: int
  degraded: bool
  degraded_reason: str
  times_before: np.ndarray | None
  times_after: np.ndarray | None
  doc_lens: np.ndarray
  doc_starts: np.ndarray
  num_servers: int
  tokens_per_rank: int
  tolerance: float
  min_shard: int
  capacity: Capacity
  q_heads: int
  kv_heads: int
  head_dim: int
  dtype_bytes: int
  num_moves: int
  predicted_gain: float = 0.0
  gated: bool = False

  @property
  def bytes_total(self) -> int:
    """Dispatch bytes, query plus key/value (add ``bytes_q`` for the output's return)."""
    return self.bytes_q + self.bytes_kv

  @property
  def pair_bytes(self) -> np.ndarray:
    """[S, S] dispatch bytes per (sender, server)."""
    return (self.pair_q_rows * self.q_heads * self.head_dim * self.dtype_bytes
            + self.pair_kv_rows * 2 * self.kv_heads * self.head_dim * self.dtype_bytes)

  def summary(self) -> str:
    """One line of the headline numbers."""
    return (f"servers={self.num_servers} docs={self.doc_lens.size} tasks={len(self.tasks)} "
            f"imbalance {self.imbalance_before:.3f} -> {self.imbalance_after:.3f} "
            f"moves={self.num_moves} bytes={self.bytes_total / 2**20:.1f} MiB"
            + (f" DEGRADED: {self.degraded_reason}" if self.degraded else "")
            + (f" GATED: predicted step gain {self.predicted_gain:.4f}" if self.gated else ""))


def imbalance(loads) -> float:
  """max / mean of per-server loads (1.0 when every load is zero)."""
  loads = np.asarray(loads, dtype=np.float64)
  mean = loads.mean() if loads.size else 0.0
  return float(loads.max() / mean) if mean > 0 else 1.0


def server_loads(plan: Plan, *, use_time: bool = False) -> np.ndarray:
  """[S] per-server load recomputed from ``plan.tasks``: pairs, or predicted seconds."""
  if use_time:
    if plan.times_after is None:
      raise ValueError("plan has no cost table; pass cost_model= to schedule()")
    return plan.times_after
  t = plan.tasks
  return np.bincount(t[:, 3], weights=pairs(t[:, 1], t[:, 2]).astype(np.float64),
                     minlength=plan.num_servers)


def pair_bytes(plan: Plan) -> np.ndarray:
  """[S, S] dispatch bytes per (sender, server), recomputed from ``plan.tasks``."""
  q_rows, kv_rows = traffic_rows(plan)
  return (q_rows * plan.q_heads * plan.head_dim * plan.dtype_bytes
          + kv_rows * 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes)


def traffic_rows(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
  """([S, S] query rows, [S, S] key/value rows) per (sender, server), from ``plan.tasks``.

  Independent of the balancer's bookkeeping: every task's query rows not owned by its server
  come from their owners; per (document, server), rows [0, max query end) not owned by the server
  come from their owners once.
  """
  s, t = plan.num_servers, plan.tokens_per_rank
  q_rows = np.zeros((s, s), dtype=np.int64)
  kv_rows = np.zeros((s, s), dtype=np.int64)
  kv_end: dict[tuple[int, int], int] = {}
  for doc, lo, hi, srv in plan.tasks.tolist():
    g = int(plan.doc_starts[doc])
    _add_owner_rows(q_rows, g + lo, g + hi, t, srv)
    key = (doc, srv)
    kv_end[key] = max(kv_end.get(key, 0), hi)
  for (doc, srv), end in kv_end.items():
    g = int(plan.doc_starts[doc])
    _add_owner_rows(kv_rows, g, g + end, t, srv)
  return q_rows, kv_rows


def _add_owner_rows(mat: np.ndarray, g0: int, g1: int, t: int, server: int) -> None:
  """Adds the rows of global tokens [g0, g1) not owned by ``server`` to ``mat[owner, server]``."""
  r = g0 // t
  while g0 < g1:
    e = min(g1, (r + 1) * t)
    if r != server:
      mat[r, server] += e - g0
    g0, r = e, r + 1


def required_capacity(plan: Plan) -> Capacity:
  """The tightest capacity this plan fits (every field at least 1)."""
  q_rows, kv_rows = plan.pair_q_rows, plan.pair_kv_rows
  t = plan.tasks
  srv = t[:, 3]
  s = plan.num_servers
  qlen = np.bincount(srv, weights=(t[:, 2] - t[:, 1]).astype(np.float64), minlength=s)
  kvlen = np.bincount(srv, weights=t[:, 2].astype(np.float64), minlength=s)
  ntask = np.bincount(srv, minlength=s)
  return Capacity(q_slot=max(1, int(q_rows.max(initial=0))),
                  kv_slot=max(1, int(kv_rows.max(initial=0))),
                  q_tokens=max(1, int(qlen.max(initial=0))),
                  kv_tokens=max(1, int(kvlen.max(initial=0))),
                  tasks=max(1, int(ntask.max(initial=0))))


# ---------------------------------------------------------------------------------------------
# The balancer.
# ---------------------------------------------------------------------------------------------
def _merge(ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """Sorted union of half-open intervals, touching ones merged."""
  if len(ivs) <= 1:
    return list(ivs)
  ivs = sorted(ivs)
  out = [ivs[0]]
  for lo, hi in ivs[1:]:
    plo, phi = out[-1]
    if lo <= phi:
      out[-1] = (plo, max(phi, hi))
    else:
      out.append((lo, hi))
  return out


def _subtract(ivs: list[tuple[int, int]], cut: list[tuple[int, int]]) -> list[tuple[int, int]]:
  """``ivs`` minus ``cut`` (``cut`` lies inside ``ivs``)."""
  out = []
  for lo, hi in ivs:
    pieces = [(lo, hi)]
    for clo, chi in cut:
      nxt = []
      for plo, phi in pieces:
        if chi <= plo or clo >= phi:
          nxt.append((plo, phi))
          continue
        if plo < clo:
          nxt.append((plo, clo))
        if chi < phi:
          nxt.append((chi, phi))
      pieces = nxt
    out.extend(pieces)
  return out


class _Balancer:
  """Mutable state of one greedy run; see the module docstring for the rules."""

  def __init__(self, lens: np.ndarray, starts: np.ndarray, s: int, t: int, tol: float,
               min_shard: int, cap: Capacity, qb: float, kvb: float, split: str):
    self.s, self.t, self.tol, self.m0 = s, t, tol, min_shard
    self.cap, self.qb, self.kvb, self.split = cap, qb, kvb, split
    self.starts_l = starts.tolist()
    jn = lens.size
    first = starts // t
    last = (starts + lens - 1) // t
    self.first_rank = first
    nseg = (last - first + 1) if jn else np.zeros(0, np.int64)
    doc = np.repeat(np.arange(jn), nseg)
    off = np.arange(doc.size) - np.repeat(np.cumsum(nseg) - nseg, nseg)
    rank = first[doc] + off
    lo = np.maximum(0, rank * t - starts[doc])
    hi = np.minimum(lens[doc], (rank + 1) * t - starts[doc])
    n0 = doc.size
    self.n = n0
    size = n0 + 4 * s + 64
    self.doc = np.zeros(size, np.int64)
    self.fa = np.zeros(size)
    self.fx = np.zeros(size)
    self.fy = np.zeros(size)
    self.fb = np.zeros(size)
    self.fw = np.zeros(size)
    self.srv = np.zeros(size, np.int64)
    mid = (lo + hi) // 2
    self.doc[:n0] = doc
    self.fa[:n0] = lo
    self.fx[:n0] = mid
    self.fy[:n0] = mid
    self.fb[:n0] = hi
    self.fw[:n0] = pairs(lo, hi)
    self.srv[:n0] = rank
    self.seg_rank, self.seg_lo, self.seg_hi = rank, lo, hi
    # (doc, server) -> sorted merged query intervals: the truth for tasks and traffic.
    self.iv: dict[tuple[int, int], list[tuple[int, int]]] = {
        (j, r): [(a, b)] for j, r, a, b in zip(doc.tolist(), rank.tolist(), lo.tolist(),
                                               hi.tolist())}
    self.load = np.bincount(rank, weights=pairs(lo, hi).astype(np.float64), minlength=s)
    self.qrows = np.bincount(rank, weights=(hi - lo).astype(np.float64), minlength=s)
    self.kvattn = np.bincount(rank, weights=hi.astype(np.float64), minlength=s)
    self.ntasks = np.bincount(rank, minlength=s).astype(np.float64)
    self.pair_q = np.zeros((s, s))
    self.pair_kv = np.zeros((s, s))
    self.spanning = set(np.flatnonzero(nseg > 1).tolist())
    # Docs whose bytes to a destination need exact correction: spanning docs owned by it, and
    # docs it has received pieces of.
    self.corr_docs: list[set[int]] = [set() for _ in range(s)]
    self.doc_items: dict[int, list[int]] = {}
    for i, (j, r, a) in enumerate(zip(doc.tolist(), rank.tolist(), lo.tolist())):
      if j in self.spanning:
        self.corr_docs[r].add(j)
        self.doc_items.setdefault(j, []).append(i)
        if a > 0:
          for o, cnt in self._owner_rows(j, 0, a):
            if o != r:
              self.pair_kv[o, r] += cnt
    self.num_moves = 0

  # -- ownership ------------------------------------------------------------------------------
  def _owner_rows(self, j: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """[(rank, rows)] of document ``j``'s rows [lo, hi) by owning rank."""
    t = self.t
    g0, g1 = self.starts_l[j] + lo, self.starts_l[j] + hi
    out = []
    r = g0 // t
    while g0 < g1:
      e = min(g1, (r + 1) * t)
      out.append((r, e - g0))
      g0, r = e, r + 1
    return out

  def _own_overlap(self, j: int, d: int, lo: int, hi: int) -> int:
    """Rows of document ``j``'s [lo, hi) owned by rank ``d``."""
    g = self.starts_l[j]
    olo, ohi = max(lo, d * self.t - g), min(hi, (d + 1) * self.t - g)
    return max(0, ohi - olo)

  def _stats(self, j: int, d: int, ivs: list[tuple[int, int]]):
    """(load, q rows, tasks, kv attention rows, {owner: q rows}, {owner: kv rows})."""
    load = q = kva = 0
    pq: dict[int, int] = {}
    pkv: dict[int, int] = {}
    span = j in self.spanning
    for lo, hi in ivs:
      load += (hi - lo) * (lo + hi + 1) // 2
      q += hi - lo
      kva += hi
      if span:
        for o, c in self._owner_rows(j, lo, hi):
          if o != d:
            pq[o] = pq.get(o, 0) + c
    if ivs:
      end = ivs[-1][1]
      if span:
        for o, c in self._owner_rows(j, 0, end):
          if o != d:
            pkv[o] = pkv.get(o, 0) + c
      else:
        o = self.starts_l[j] // self.t
        if o != d:
          pq[o] = q
          pkv[o] = end
    return load, q, len(ivs), kva, pq, pkv

  # -- one move -------------------------------------------------------------------------------
  def _exact(self, i: int, opt: int, d: int, t_useful: float, room: float,
             upper: float = math.inf):
    """Exact integer version of option ``opt`` (0 whole, 1 mirrored, 2 suffix) for item ``i``.

    ``m`` (mirrored pairs) or ``k`` (suffix tokens) is the smallest amount whose work reaches
    ``t_useful``, within [min_shard bound, ``upper``] and the destination ``room``; if that
    overflows a cap, halved amounts are tried down to the minimum.

    Returns (moved intervals, kept item (a, x, y, b) or None, moved item, work, where, effects)
    or a string naming why it is infeasible (a cap name, or 'shape').
    """
    a, x, y, b = int(self.fa[i]), int(self.fx[i]), int(self.fy[i]), int(self.fb[i])
    two = x < y
    m0 = self.m0
    upper = int(min(upper, b))
    if opt == 0:
      if self.fw[i] > room:
        return "shape"
      return self._effects(i, d, [(a, x), (y, b)] if two else [(a, b)], None, (a, x, y, b))
    if opt == 1:
      c1 = x + y + 1
      m_lo = max(m0 if two else (m0 + 1) // 2, 1)
      m_hi = min(min(x - a, b - y) - m0, int(room // c1), upper)
      m = min(max(math.ceil(t_useful / c1), m_lo), m_hi)
      if m < m_lo:
        return "shape"
      while True:
        if two:
          moved, new = [(x - m, x), (y, y + m)], (x - m, x, y, y + m)
        else:
          moved, new = [(x - m, x + m)], (x - m, x, x, x + m)
        res = self._effects(i, d, moved, (a, x - m, y + m, b), new)
        if not isinstance(res, str) or m == m_lo:
          return res
        m = max(m_lo, m // 2)
    last_lo = y if two else a
    bb = 2 * b + 1

    def w_of(k):
      return k * (bb - k) // 2

    def k_for(target: float) -> int:
      """Smallest k with w_of(k) >= target."""
      k = max(0, math.ceil((bb - math.sqrt(max(bb * bb - 8.0 * target, 0.0))) / 2))
      while k > 0 and w_of(k - 1) >= target:
        k -= 1
      while w_of(k) < target and k < b - last_lo:
        k += 1
      return k

    k_room = k_for(room)
    if w_of(k_room) > room:
      k_room -= 1
    k_lo = max(m0, 1)
    k_hi = min(b - last_lo - m0, k_room, upper)
    k = min(max(k_for(t_useful), k_lo), k_hi)
    if k < k_lo:
      return "shape"
    while True:
      new = (b - k, b - k + k // 2, b - k + k // 2, b)
      if two:
        kept = (a, x, y, b - k)
      else:
        km = (a + b - k) // 2
        kept = (a, km, km, b - k)
      res = self._effects(i, d, [(b - k, b)], kept, new)
      if not isinstance(res, str) or k == k_lo:
        return res
      k = max(k_lo, k // 2)

  def _effects(self, i: int, d: int, moved, kept, new):
    """Per-server and per-pair deltas of moving ``moved`` of item ``i`` to ``d``; checks caps."""
    j = int(self.doc[i])
    s = int(self.srv[i])
    old_s = self.iv[(j, s)]
    new_s = _subtract(old_s, moved)
    old_d = self.iv.get((j, d), [])
    new_d = _merge(old_d + moved)
    eff = []
    for srv_, old, new_ivs in ((s, old_s, new_s), (d, old_d, new_d)):
      st0 = self._stats(j, srv_, old)
      st1 = self._stats(j, srv_, new_ivs)
      dpq = {o: st1[4].get(o, 0) - st0[4].get(o, 0) for o in set(st0[4]) | set(st1[4])}
      dpkv = {o: st1[5].get(o, 0) - st0[5].get(o, 0) for o in set(st0[5]) | set(st1[5])}
      eff.append((srv_, st1[0] - st0[0], st1[1] - st0[1], st1[2] - st0[2], st1[3] - st0[3],
                  dpq, dpkv))
    cap = self.cap
    for srv_, _, dq, dt, dkva, dpq, dpkv in eff:
      if cap.q_tokens is not None and dq > 0 and self.qrows[srv_] + dq > cap.q_tokens:
        return "q_tokens"
      if cap.tasks is not None and dt > 0 and self.ntasks[srv_] + dt > cap.tasks:
        return "tasks"
      if cap.kv_tokens is not None and dkva > 0 and self.kvattn[srv_] + dkva > cap.kv_tokens:
        return "kv_tokens"
      if cap.q_slot is not None:
        for o, c in dpq.items():
          if c > 0 and self.pair_q[o, srv_] + c > cap.q_slot:
            return "q_slot"
      if cap.kv_slot is not None:
        for o, c in dpkv.items():
          if c > 0 and self.pair_kv[o, srv_] + c > cap.kv_slot:
            return "kv_slot"
    work = eff[1][1]
    return moved, kept, new, work, (s, new_s, new_d), eff

  def _apply(self, i: int, d: int, res) -> None:
    moved, kept, new, work, (s, new_s, new_d), eff = res
    j = int(self.doc[i])
    for srv_, dload, dq, dt, dkva, dpq, dpkv in eff:
      self.load[srv_] += dload
      self.qrows[srv_] += dq
      self.ntasks[srv_] += dt
      self.kvattn[srv_] += dkva
      for o, c in dpq.items():
        self.pair_q[o, srv_] += c
      for o, c in dpkv.items():
        self.pair_kv[o, srv_] += c
    if new_s:
      self.iv[(j, s)] = new_s
    else:
      del self.iv[(j, s)]
    self.iv[(j, d)] = new_d
    if kept is None:
      self.srv[i] = d
      ni = i
    else:
      self._set_item(i, kept)
      ni = self.n
      if ni >= self.doc.size:
        self._grow()
      self.doc[ni] = j
      self.srv[ni] = d
      self._set_item(ni, new)
      self.n += 1
    self.corr_docs[d].add(j)
    items = self.doc_items.setdefault(j, [])
    if not items:
      items.append(i)
    if ni != i:
      items.append(ni)
    self.num_moves += 1

  def _set_item(self, i: int, shape) -> None:
    a, x, y, b = shape
    if x == a or y == b:  # one side empty: re-centre a single interval
      lo, hi = (y, b) if x == a else (a, x)
      a, b = lo, hi
      x = y = (lo + hi) // 2
    self.fa[i], self.fx[i], self.fy[i], self.fb[i] = a, x, y, b
    self.fw[i] = pairs(a, x) + pairs(y, b)

  def _grow(self) -> None:
    for name in ("doc", "fa", "fx", "fy", "fb", "fw", "srv"):
      arr = getattr(self, name)
      setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))

  # -- scoring --------------------------------------------------------------------------------
  # Derived per-item quantities the scorer needs, cached for the pool (rows aligned with it).
  def _derive(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    a, x, y, b = self.fa[idx], self.fx[idx], self.fy[idx], self.fb[idx]
    two = x < y
    m0 = float(self.m0)
    c1 = x + y + 1
    rows_w = (x - a) + (b - y)
    bb = 2 * b + 1
    return {
        "srv": self.srv[idx], "own": self.first_rank[self.doc[idx]], "w": self.fw[idx],
        "b": b, "x": x, "y": y, "two": two, "c1": c1, "inv_c1": 1.0 / c1,
        "m_lo": np.maximum(np.where(two, m0, math.ceil(m0 / 2)), 1.0),
        "m_hi": np.minimum(x - a, b - y) - m0,
        "bytes_w": self.qb * rows_w + self.kvb * b, "rows_w": rows_w, "kvb_y": self.kvb * y,
        "kva_w": np.where(two, x + b, b), "kva_m0": np.where(two, x + y, y),
        "parts_w": np.where(two, 2.0, 1.0), "bb": bb, "bb2": bb * bb,
        "k_hi": b - np.where(two, y, a) - m0, "kvb_b": self.kvb * b}

  def _set_pool(self, pool: np.ndarray) -> None:
    self.pool = pool
    self.pc = self._derive(pool)

  def _filter_pool(self, keep: np.ndarray) -> None:
    self.pool = self.pool[keep]
    self.pc = {k: v[keep] for k, v in self.pc.items()}

  def _refresh_pool_item(self, i: int) -> None:
    p = int(np.searchsorted(self.pool, i))
    if p < self.pool.size and self.pool[p] == i:
      one = self._derive(np.asarray([i]))
      for k, v in one.items():
        self.pc[k][p] = v[0]

  def _score(self, d: int, exc: np.ndarray, soft: float, room: float, use_caps: bool = True):
    """Scores every pool item for destination ``d``.

    Returns (candidate items [n], priorities [3, n] (rows: whole, mirrored, suffix; -1 marks an
    infeasible option), useful targets [n], amount bounds [3, n] from the caps).
    """
    c = self.pool
    if c.size == 0:
      return c, None, None, None
    with np.errstate(divide="ignore", invalid="ignore"):
      return self._score_pool(d, exc, soft, room, use_caps)

  def _score_pool(self, d: int, exc: np.ndarray, soft: float, room: float, use_caps: bool):
    c = self.pool
    pc = self.pc
    cap = self.cap
    tu = np.minimum(exc[pc["srv"]], soft)
    qb, kvb, m0 = self.qb, self.kvb, float(self.m0)
    prio = np.empty((3, c.size))
    upper = np.full((3, c.size), np.inf)
    w = pc["w"]
    # Destination room left under each cap (a move into the document's own rank uses no pair).
    inf = np.inf
    capped = use_caps and any(getattr(cap, f) is not None for f in _CAP_FIELDS)
    if capped:
      free_q = inf if cap.q_tokens is None else cap.q_tokens - self.qrows[d]
      free_t = inf if cap.tasks is None else cap.tasks - self.ntasks[d]
      free_kva = inf if cap.kv_tokens is None else cap.kv_tokens - self.kvattn[d]
      home = pc["own"] == d
      free_qs = (np.full(c.size, inf) if cap.q_slot is None
                 else np.where(home, inf, cap.q_slot - self.pair_q[pc["own"], d]))
      free_kvs = (np.full(c.size, inf) if cap.kv_slot is None
                  else np.where(home, inf, cap.kv_slot - self.pair_kv[pc["own"], d]))
      free_rows = np.minimum(free_qs, free_q)
    # Option 0: the whole item.
    np.divide(np.minimum(w, tu), pc["bytes_w"], out=prio[0])
    bad = w > room
    if capped:
      bad |= ((pc["rows_w"] > free_rows) | (pc["parts_w"] > free_t) | (pc["kva_w"] > free_kva)
              | (pc["b"] > free_kvs))
    prio[0][bad] = -1.0
    # Option 1: m innermost mirrored pairs, m in [m_lo, m_up].
    if self.split != "suffix":
      c1 = pc["c1"]
      m_up = np.minimum(pc["m_hi"], np.floor(room * pc["inv_c1"]))
      m_lo = pc["m_lo"]
      bad = np.zeros(c.size, dtype=bool)
      if capped:
        np.minimum(m_up, np.floor(free_rows / 2), out=m_up)
        np.minimum(m_up, free_kva - pc["kva_m0"], out=m_up)
        np.minimum(m_up, free_kvs - pc["y"], out=m_up)
        bad |= np.where(pc["two"], 2.0, 1.0) > free_t
        # A single interval split in the middle leaves two tasks on the source.
        single = ~pc["two"]
        if cap.tasks is not None:
          bad |= single & (self.ntasks[pc["srv"]] + 1 > cap.tasks)
        if cap.kv_tokens is not None:
          src_free = cap.kv_tokens - self.kvattn[pc["srv"]]
          m_lo = np.where(single, np.maximum(m_lo, pc["x"] - src_free), m_lo)
      upper[1] = m_up
      m = np.ceil(tu * pc["inv_c1"])
      np.maximum(m, m_lo, out=m)
      np.minimum(m, m_up, out=m)
      np.divide(np.minimum(m * c1, tu), m * (2 * qb + kvb) + pc["kvb_y"], out=prio[1])
      prio[1][bad | (m < m_lo)] = -1.0
    else:
      prio[1] = -1.0
    # Option 2: the last k tokens, k in [min_shard, k_up].
    if self.split != "mirrored":
      bb, bb2 = pc["bb"], pc["bb2"]
      k_up = pc["k_hi"].copy()
      bad = np.zeros(c.size, dtype=bool)
      if capped:
        np.minimum(k_up, free_rows, out=k_up)
        bad |= (1.0 > free_t) | (pc["b"] > free_kva) | (pc["b"] > free_kvs)
      k = np.ceil(0.5 * (bb - np.sqrt(np.maximum(bb2 - 8 * tu, 0.0))))
      np.maximum(k, m0, out=k)
      np.minimum(k, k_up, out=k)
      over = k * (bb - k) > 2 * room
      if over.any():
        k_room = np.floor(0.5 * (bb - np.sqrt(np.maximum(bb2 - 8 * room, 0.0))))
        k = np.where(over, k_room, k)
      upper[2] = k_up
      np.divide(np.minimum(0.5 * k * (bb - k), tu), qb * k + pc["kvb_b"], out=prio[2])
      prio[2][bad | (k < max(m0, 1.0))] = -1.0
    else:
      prio[2] = -1.0
    # Exact scores for documents already (partly) at the destination or owned by it: their bytes
    # (rows already there) and caps (merged intervals) differ from the formulas above.
    docs = self.corr_docs[d]
    if docs:
      items = [i for j in docs for i in self.doc_items.get(j, ())]
      if items:
        pos = np.minimum(np.searchsorted(c, np.asarray(items, dtype=np.int64)), c.size - 1)
        for i, p in zip(items, pos.tolist()):
          if c[p] == i:
            self._correct(i, p, d, prio, upper, float(tu[p]), room, use_caps)
    return c, prio, tu, upper

  def _correct(self, i: int, p: int, d: int, prio: np.ndarray, upper: np.ndarray, tu: float,
               room: float, use_caps: bool) -> None:
    """Recomputes the priorities of candidate ``p`` (item ``i``) with exact bytes and caps."""
    j = int(self.doc[i])
    ivs = self.iv.get((j, d))
    have = ivs[-1][1] if ivs else 0
    saved = self.cap
    if not use_caps:
      self.cap = Capacity()
    try:
      for opt in range(3):
        upper[opt, p] = np.inf
        if (opt == 1 and self.split == "suffix") or (opt == 2 and self.split == "mirrored"):
          continue
        res = self._exact(i, opt, d, tu, room)
        if isinstance(res, str):
          prio[opt, p] = -1.0
          continue
        moved, work = res[0], res[3]
        q_rows = sum(hi - lo - self._own_overlap(j, d, lo, hi) for lo, hi in moved)
        end = max(hi for _, hi in moved)
        kv_rows = (end - have - self._own_overlap(j, d, have, end)) if end > have else 0
        nbytes = self.qb * q_rows + self.kvb * kv_rows
        prio[opt, p] = min(work, tu) / nbytes if nbytes > 0 else np.inf
    finally:
      self.cap = saved

  def run(self, mean: float, max_moves: int) -> str:
    """Greedy balancing; returns '' on success or the reason it stopped above the limit.

    Phase 1 balances towards ``(1 + tol) * mean``. If it gets stuck above that (pieces no
    smaller than ``min_shard`` do not fit the room destinations have under a tight limit, or caps
    refuse), phase 2 keeps lowering the maximum load: it reruns the greedy with intermediate
    limits between the current maximum and the target, which give destinations more room.
    """
    target = (1.0 + self.tol) * mean
    status = self._run_at(mean, target, max_moves)
    if status != "stuck":
      return status
    for _ in range(64):
      top = self.load.max()
      for frac in (0.5, 0.8, 0.95):
        moves = self.num_moves
        status = self._run_at(mean, target + (top - target) * frac, max_moves)
        if status.startswith("move limit"):
          return status
        if self.num_moves > moves and self.load.max() < top:
          break
      else:
        break
      if self.load.max() <= target * (1 + 1e-12):
        return ""
    return self._why_stopped(mean, target)

  def _run_at(self, mean: float, limit: float, max_moves: int) -> str:
    """Greedy loop towards ``limit``: '' when reached, 'stuck', or the move-limit reason."""
    lim_eps = limit * (1 + 1e-12)
    blocked = np.zeros(self.s, dtype=bool)
    moves_at_clear = self.num_moves
    # Servers only leave the overloaded set (destinations never pass the limit), so the pool of
    # candidate items only shrinks: filter it when a source drops out or an item moves whole.
    self._set_pool(np.flatnonzero((self.load > lim_eps)[self.srv[:self.n]]))
    while True:
      if self.load.max() <= lim_eps:
        return ""
      if self.num_moves >= max_moves:
        return f"move limit {max_moves} reached"
      cand = np.where(blocked | (self.load >= limit), np.inf, self.load)
      d = int(np.argmin(cand))
      if not np.isfinite(cand[d]):
        # Every destination is blocked. Moves since the last sweep may have changed the pool
        # (smaller kept pieces), so sweep again once; stop when a sweep moved nothing.
        if self.num_moves > moves_at_clear and blocked.any():
          blocked[:] = False
          moves_at_clear = self.num_moves
          continue
        return "stuck"
      exc = self.load - limit
      room = limit - self.load[d]
      soft = mean - self.load[d]
      if soft <= 0:
        soft = room
      c, prio, tu, upper = self._score(d, exc, soft, room)
      done = False
      if prio is not None:
        flat = prio.reshape(-1)
        for _ in range(64):
          f = int(np.argmax(flat))
          if flat[f] <= 0:
            break
          opt, p = divmod(f, c.size)
          i = int(c[p])
          res = self._exact(i, opt, d, float(tu[p]), room, float(upper[opt, p]))
          if isinstance(res, str):
            flat[f] = -1.0
            continue
          src = int(self.srv[i])
          self._apply(i, d, res)
          if self.load[src] <= lim_eps:
            self._filter_pool(self.pc["srv"] != src)
          elif res[1] is None:
            self._filter_pool(self.pool != i)
          else:
            self._refresh_pool_item(i)
          done = True
          break
      if not done:
        blocked[d] = True

  def _why_stopped(self, mean: float, limit: float) -> str:
    """Explains why no destination admits a move: the caps (which) or min_shard granularity."""
    exc = self.load - limit
    refused: dict[str, int] = {}
    for d in np.flatnonzero(self.load < limit).tolist():
      room = limit - self.load[d]
      soft = mean - self.load[d]
      c, prio, tu, _ = self._score(d, exc, soft if soft > 0 else room, room, use_caps=False)
      if prio is None or prio.max() <= 0:
        continue
      # Without caps a move exists: name the caps refusing the best uncapped moves.
      flat = prio.reshape(-1)
      for f in np.argsort(-flat, kind="stable")[:4].tolist():
        if flat[f] <= 0:
          break
        opt, p = divmod(f, c.size)
        res = self._exact(int(c[p]), opt, d, float(tu[p]), room)
        if isinstance(res, str) and res != "shape":
          refused[res] = refused.get(res, 0) + 1
    if refused:
      caps = ", ".join(f"{k}={getattr(self.cap, k)}" for k in sorted(refused))
      return f"capacity blocked moves ({caps}); raise those caps for better balance"
    return (f"no movable piece fits: items on overloaded servers are unsplittable under "
            f"min_shard={self.m0} or larger than the room left on under-loaded servers")


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


def schedule(doc_lens, num_servers: int, *, tokens_per_rank: int,
             tolerance: float = DEFAULT_TOLERANCE,
             capacity: Capacity | Mapping[str, int | None] | None = None,
             min_shard: int = DEFAULT_MIN_SHARD,
             split: str = "auto",
             q_heads: int = DEFAULT_Q_HEADS, kv_heads: int = DEFAULT_KV_HEADS,
             head_dim: int = DEFAULT_HEAD_DIM, dtype_bytes: int = DEFAULT_DTYPE_BYTES,
             cost_model: str | os.PathLike | CostTable | None = None,
             max_moves: int | None = None, min_gain: float = 0.0,
             linear_pairs_per_token: float = 0.0) -> Plan:
  """Balances core-attention work over ``num_servers`` in-place servers.

  Args:
    doc_lens: flat list of document lengths packed across ranks (documents may span ranks), or
      one list per rank (documents never span ranks). See the module docstring.
    num_servers: number of ranks = attention servers (``S``).
    tokens_per_rank: token budget of one rank (``T``).
    tolerance: epsilon; the goal is every server at most ``(1 + tolerance) * mean`` pairs.
    capacity: buffer caps (``Capacity`` or a dict of its fields); None = unbounded.
    min_shard: shortest query piece a split may create (whole items of any length may move).
    split: 'auto' (mirrored or suffix, whichever scores better), 'mirrored' or 'suffix'.
    q_heads, kv_heads, head_dim, dtype_bytes: the byte model (query row = q_heads * head_dim *
      dtype_bytes; key/value row = 2 * kv_heads * head_dim * dtype_bytes).
    cost_model: a ``CostTable`` or the path of its JSON; fills ``Plan.times_*``.
    max_moves: safety bound on moves (default ``20 * (S + items)``).
    min_gain: the gate: when the speedup a perfect balance could bring, minus 1
      (``predicted_step_gain`` with ``linear_pairs_per_token``), is below this, nothing
      moves (``Plan.gated``): moving rows has a cost of its own (gathers, exchange, shorter
      kernel tasks), which on near-balanced batches exceeds the gain. 0 = always balance.
    linear_pairs_per_token: the linear layers' work per token in pair units (see
      ``predicted_step_gain``); 0 counts attention alone.

  Returns:
    The ``Plan``.
  """
  lens, starts = parse_layout(doc_lens, num_servers, tokens_per_rank)
  s, t = int(num_servers), int(tokens_per_rank)
  if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
      0.0 <= float(tolerance) < float("inf")):
    raise ValueError(f"{tolerance=} must be a finite float >= 0 (e.g. 0.1)")
  tol = float(tolerance)
  m0 = check_int("min_shard", min_shard, 1)
  if split not in _SPLITS:
    raise ValueError(f"{split=} must be one of {_SPLITS}")
  for name, v in (("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim),
                  ("dtype_bytes", dtype_bytes)):
    check_int(name, v, 1)
  if q_heads % kv_heads:
    raise ValueError(f"{q_heads=} must be a multiple of {kv_heads=} (grouped-query attention)")
  if capacity is None:
    cap = Capacity()
  elif isinstance(capacity, Capacity):
    cap = capacity
  elif isinstance(capacity, Mapping):
    unknown = set(capacity) - set(_CAP_FIELDS)
    if unknown:
      raise ValueError(f"unknown capacity fields {sorted(unknown)}; valid: {_CAP_FIELDS}")
    cap = Capacity(**capacity)
  else:
    raise TypeError(f"capacity={capacity!r} must be None, a Capacity or a dict")
  table = _as_cost_table(cost_model)
  qb = float(q_heads * head_dim * dtype_bytes)
  kvb = float(2 * kv_heads * head_dim * dtype_bytes)

  bal = _Balancer(lens, starts, s, t, tol, m0, cap, qb, kvb, split)
  _check_initial_caps(bal, cap)
  loads_before = bal.load.copy()
  total = float(loads_before.sum())
  mean = total / s
  if max_moves is None:
    max_moves = 20 * (s + bal.n)
  check_int("max_moves", max_moves, 0)
  min_gain = check_float("min_gain", min_gain)
  gain = predicted_step_gain(loads_before, t,
                             check_float("linear_pairs_per_token", linear_pairs_per_token))
  gated = min_gain > 0.0 and gain < min_gain
  reason = bal.run(mean, max_moves) if total > 0 and not gated else ""

  # Tasks: every merged interval of every (document, server).
  keys = list(bal.iv.keys())
  nper = [len(bal.iv[k]) for k in keys]
  flat = [iv for k in keys for iv in bal.iv[k]]
  tasks = np.zeros((len(flat), 4), dtype=np.int64)
  if flat:
    tasks[:, 0] = np.repeat([k[0] for k in keys], nper)
    tasks[:, 3] = np.repeat([k[1] for k in keys], nper)
    tasks[:, 1:3] = np.asarray(flat, dtype=np.int64)
    tasks = tasks[np.lexsort((tasks[:, 1], tasks[:, 0], tasks[:, 3]))]
  loads_after = np.bincount(tasks[:, 3], weights=pairs(tasks[:, 1], tasks[:, 2]).astype(
      np.float64), minlength=s)
  imb_after = imbalance(loads_after)
  degraded = imb_after > (1.0 + tol) * (1 + 1e-12) and not gated
  if degraded and not reason:
    reason = "stopped above the limit"
  times_before = times_after = None
  if table is not None:
    seg_q = bal.seg_hi - bal.seg_lo
    times_before = np.bincount(bal.seg_rank, weights=table.time(seg_q, bal.seg_hi) if seg_q.size
                               else np.zeros(0), minlength=s)
    times_after = np.bincount(tasks[:, 3], weights=table.time(tasks[:, 2] - tasks[:, 1],
                                                              tasks[:, 2]) if len(tasks)
                              else np.zeros(0), minlength=s)
  pq = bal.pair_q.astype(np.int64)
  pkv = bal.pair_kv.astype(np.int64)
  return Plan(tasks=tasks, loads_before=loads_before, loads_after=loads_after,
              imbalance_before=imbalance(loads_before), imbalance_after=imb_after,
              pair_q_rows=pq, pair_kv_rows=pkv, bytes_q=int(pq.sum() * qb),
              bytes_kv=int(pkv.sum() * kvb), degraded=bool(degraded),
              degraded_reason=reason if degraded else "", times_before=times_before,
              times_after=times_after, doc_lens=lens, doc_starts=starts, num_servers=s,
              tokens_per_rank=t, tolerance=tol, min_shard=m0, capacity=cap, q_heads=q_heads,
              kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
              num_moves=bal.num_moves, predicted_gain=gain, gated=gated)


def _check_initial_caps(bal: _Balancer, cap: Capacity) -> None:
  """Raises when the layout, computed where it lives, already overflows a cap."""
  need = {"q_tokens": bal.qrows.max(initial=0), "kv_tokens": bal.kvattn.max(initial=0),
          "tasks": bal.ntasks.max(initial=0), "q_slot": bal.pair_q.max(initial=0),
          "kv_slot": bal.pair_kv.max(initial=0)}
  for name, v in need.items():
    c = getattr(cap, name)
    if c is not None and v > c:
      raise ValueError(
          f"the layout itself (every row computed where it lives) needs capacity.{name} >= "
          f"{int(v)} but {name}={c}; raise it (documents spanning ranks need kv_slot up to "
          "tokens_per_rank, many short documents need more tasks)")


# ---------------------------------------------------------------------------------------------
# Plan -> metadata (the data plane's contract; see the module docstring).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanMetadata:
  """Fixed-shape int32 routing tables of one plan; leading axis = the device that reads them.

  Shapes use ``S`` servers (= ranks), ``T`` tokens per rank and the capacity's ``Cq`` (q_slot),
  ``Ckv`` (kv_slot), ``Nq`` (q_tokens), ``Nkv`` (kv_tokens), ``Nt`` (tasks). With ``ranks`` given to
  ``plan_to_metadata`` the leading axis holds only those devices, in that order (``R`` rows).

  Attributes:
    q_send_idx: [R, S, Cq] sender-local query rows per destination slot (sentinel ``T``).
    kv_send_idx: [R, S, Ckv] sender-local key/value rows per destination slot (sentinel ``T``).
    q_attn_idx: [R, Nq] attention query rows from ``concat(own [T], received [S * Cq])``
      (sentinel ``T + S * Cq``).
    kv_attn_idx: [R, Nkv] attention key/value rows from ``concat(own [T], received [S * Ckv])``
      (sentinel ``T + S * Ckv``); may repeat.
    cu_seqlens_q: [R, Nt + 1] task boundaries over the attention query rows.
    cu_seqlens_k: [R, Nt + 1] task boundaries over the attention key/value rows.
    o_send_idx: [R, S, Cq] attention output row returned to each sender slot (sentinel ``Nq``).
    o_local_idx: [R, T] output row of each local token from ``concat(own O [Nq], returned
      [S * Cq])`` (sentinel ``Nq + S * Cq`` for padding).
    q_send_len: [S, S] query rows per (sender, server), self pair 0.
    kv_send_len: [S, S] key/value rows per (sender, server), self pair 0.
    q_len: [S] attention query rows per server.
    kv_len: [S] attention key/value rows per server (duplicates counted).
    num_tasks: [S] tasks per server.
    task_index: [R, Nt] row of ``Plan.tasks`` for each task slot (-1 for padding).
    ranks: [R] the devices of the leading axis.
    num_servers: ``S``.
    tokens_per_rank: ``T``.
    capacity: the (fully bounded) capacity the shapes come from.
  """
  q_send_idx: np.ndarray
  kv_send_idx: np.ndarray
  q_attn_idx: np.ndarray
  kv_attn_idx: np.ndarray
  cu_seqlens_q: np.ndarray
  cu_seqlens_k: np.ndarray
  o_send_idx: np.ndarray
  o_local_idx: np.ndarray
  q_send_len: np.ndarray
  kv_send_len: np.ndarray
  q_len: np.ndarray
  kv_len: np.ndarray
  num_tasks: np.ndarray
  task_index: np.ndarray
  ranks: np.ndarray
  num_servers: int
  tokens_per_rank: int
  capacity: Capacity

  DEVICE_FIELDS = ("q_send_idx", "kv_send_idx", "q_attn_idx", "kv_attn_idx", "cu_seqlens_q",
                   "cu_seqlens_k", "o_send_idx", "o_local_idx")

  def device_arrays(self) -> dict[str, np.ndarray]:
    """The arrays the compiled step consumes (all int32, leading axis = device)."""
    return {f: getattr(self, f) for f in self.DEVICE_FIELDS}


def plan_to_metadata(plan: Plan, capacity: Capacity | None = None, *,
                     ranks: Sequence[int] | None = None) -> PlanMetadata:
  """Routing tables for ``plan`` in buffers of ``capacity``.

  Args:
    plan: from ``schedule``.
    capacity: buffer sizes; None fields (or None) fall back to ``plan.capacity``, then to the
      plan's own tight sizes (``required_capacity``; shapes then vary between plans).
    ranks: devices whose rows to build (e.g. a host's local devices); default all.

  Returns:
    ``PlanMetadata``. Raises ``ValueError`` if the plan does not fit ``capacity``.
  """
  s, t = plan.num_servers, plan.tokens_per_rank
  cap = (capacity or Capacity()).replace_none(plan.capacity).replace_none(
      required_capacity(plan))
  cq, ckv, nq, nkv, nt = cap.q_slot, cap.kv_slot, cap.q_tokens, cap.kv_tokens, cap.tasks
  if ranks is None:
    ranks_arr = np.arange(s)
  else:
    ranks_arr = np.asarray(list(ranks), dtype=np.int64)
    if ranks_arr.ndim != 1 or ((ranks_arr < 0) | (ranks_arr >= s)).any() or len(
        set(ranks_arr.tolist())) != ranks_arr.size:
      raise ValueError(f"{ranks=} must be distinct ranks in [0, {s})")
  row_of = np.full(s, -1, dtype=np.int64)
  row_of[ranks_arr] = np.arange(ranks_arr.size)
  nr = ranks_arr.size
  i32 = np.int32
  q_send_idx = np.full((nr, s, cq), t, i32)
  kv_send_idx = np.full((nr, s, ckv), t, i32)
  q_attn_idx = np.full((nr, nq), t + s * cq, i32)
  kv_attn_idx = np.full((nr, nkv), t + s * ckv, i32)
  cu_q = np.zeros((nr, nt + 1), i32)
  cu_k = np.zeros((nr, nt + 1), i32)
  o_send_idx = np.full((nr, s, cq), nq, i32)
  o_local_idx = np.full((nr, t), nq + s * cq, i32)
  task_index = np.full((nr, nt), -1, i32)
  q_send_len = np.zeros((s, s), np.int64)
  kv_send_len = np.zeros((s, s), np.int64)
  q_len = np.zeros(s, np.int64)
  kv_len = np.zeros(s, np.int64)
  num_tasks = np.zeros(s, np.int64)

  tasks = plan.tasks
  g_doc = plan.doc_starts
  doc, qa, qb_, srv = tasks[:, 0], tasks[:, 1], tasks[:, 2], tasks[:, 3]
  qlen_t = qb_ - qa
  num_tasks = np.bincount(srv, minlength=s)
  q_len = np.bincount(srv, weights=qlen_t, minlength=s).astype(np.int64)
  kv_len = np.bincount(srv, weights=qb_, minlength=s).astype(np.int64)
  for name, have, lim in (("tasks", num_tasks, nt), ("q_tokens", q_len, nq),
                          ("kv_tokens", kv_len, nkv)):
    if have.max(initial=0) > lim:
      d = int(np.argmax(have))
      raise ValueError(f"server {d} needs {name}={int(have[d])} > capacity.{name}={lim}")
  first_task = np.searchsorted(srv, np.arange(s))
  # Offsets of each task inside its server's attention Q and KV buffers (tasks in plan order).
  q_off = np.cumsum(qlen_t) - qlen_t
  k_off = np.cumsum(qb_) - qb_
  if tasks.shape[0]:
    q_off -= q_off[first_task[srv]]
    k_off -= k_off[first_task[srv]]
  gs = g_doc[doc] + qa

  # Query pieces: task query intervals cut at rank boundaries; slots per (owner, server) pair.
  pt, p_own, p_s, p_e = split_at(gs, g_doc[doc] + qb_, t)
  p_srv = srv[pt]
  p_len = p_e - p_s
  p_attn = q_off[pt] + (p_s - gs[pt])
  p_cross = p_own != p_srv
  p_pos = np.zeros_like(p_s)
  p_pos[p_cross] = _slot_positions(p_srv[p_cross], p_own[p_cross], p_len[p_cross], s)
  q_send_len = np.zeros((s, s), np.int64)
  np.add.at(q_send_len, (p_own[p_cross], p_srv[p_cross]), p_len[p_cross])
  if q_send_len.max(initial=0) > cq:
    o, d = np.unravel_index(np.argmax(q_send_len), q_send_len.shape)
    raise ValueError(f"server {d} receives {int(q_send_len[o, d])} query rows from sender {o} "
                     f"> capacity.q_slot={cq}")
  # KV: per (server, document) the rows [0, max end) are sent once; cut at rank boundaries.
  if tasks.shape[0]:
    grp = np.flatnonzero(np.r_[True, (srv[1:] != srv[:-1]) | (doc[1:] != doc[:-1])])
    u_end = np.maximum.reduceat(qb_, grp)
  else:
    grp = np.zeros(0, np.int64)
    u_end = np.zeros(0, np.int64)
  u_srv, u_doc = srv[grp], doc[grp]
  ut, u_own, u_s, u_e = split_at(g_doc[u_doc], g_doc[u_doc] + u_end, t)
  u_psrv = u_srv[ut]
  u_len = u_e - u_s
  u_cross = u_own != u_psrv
  u_pos = np.zeros_like(u_s)
  u_pos[u_cross] = _slot_positions(u_psrv[u_cross], u_own[u_cross], u_len[u_cross], s)
  kv_send_len = np.zeros((s, s), np.int64)
  np.add.at(kv_send_len, (u_own[u_cross], u_psrv[u_cross]), u_len[u_cross])
  if kv_send_len.max(initial=0) > ckv:
    o, d = np.unravel_index(np.argmax(kv_send_len), kv_send_len.shape)
    raise ValueError(f"server {d} receives {int(kv_send_len[o, d])} key/value rows from sender "
                     f"{o} > capacity.kv_slot={ckv}")

  # Server side (devices in ``ranks``): attention gathers, task tables, output return slots.
  sel = row_of[p_srv] >= 0
  r_ = row_of[p_srv[sel]]
  val0 = np.where(p_cross[sel], t + p_own[sel] * cq + p_pos[sel], p_s[sel] % t)
  q_attn_idx.reshape(-1)[ranges(r_ * nq + p_attn[sel], p_len[sel])] = ranges(val0, p_len[sel])
  selc = sel & p_cross
  r_ = row_of[p_srv[selc]]
  o_send_idx.reshape(-1)[ranges((r_ * s + p_own[selc]) * cq + p_pos[selc], p_len[selc])] = (
      ranges(p_attn[selc], p_len[selc]))
  # Each task's keys [0, b) of its document, cut at rank boundaries; a cross-rank piece starts
  # where the (server, document, owner) KV slot piece starts, so it inherits that slot position.
  tsel = np.flatnonzero(row_of[srv] >= 0)
  kt, k_own, k_s, k_e = split_at(g_doc[doc[tsel]], g_doc[doc[tsel]] + qb_[tsel], t)
  kt = tsel[kt]
  k_srv = srv[kt]
  k_cross = k_own != k_srv
  nd = max(int(plan.doc_lens.size), 1)
  u_key = (u_psrv * nd + u_doc[ut]) * s + u_own
  k_key = (k_srv * nd + doc[kt]) * s + k_own
  u_order = np.argsort(u_key, kind="stable")
  k_upos = u_pos[u_order[np.searchsorted(u_key[u_order], k_key)]] if kt.size else k_key
  val0 = np.where(k_cross, t + k_own * ckv + k_upos, k_s % t)
  dst0 = row_of[k_srv] * nkv + k_off[kt] + (k_s - g_doc[doc[kt]])
  kv_attn_idx.reshape(-1)[ranges(dst0, k_e - k_s)] = ranges(val0, k_e - k_s)
  for d in ranks_arr.tolist():
    r = row_of[d]
    lo_t, n_task = int(first_task[d]), int(num_tasks[d])
    ql, kl = qlen_t[lo_t:lo_t + n_task], qb_[lo_t:lo_t + n_task]
    cu_q[r, 1:] = np.concatenate([np.cumsum(ql), np.full(nt - n_task, ql.sum())])
    cu_k[r, 1:] = np.concatenate([np.cumsum(kl), np.full(nt - n_task, kl.sum())])
    task_index[r, :n_task] = np.arange(lo_t, lo_t + n_task)

  # Sender side (devices in ``ranks`` as owners): send slots and where outputs come back.
  osel = row_of[p_own] >= 0
  ro = row_of[p_own[osel]]
  val0 = np.where(p_cross[osel], nq + p_srv[osel] * cq + p_pos[osel], p_attn[osel])
  o_local_idx.reshape(-1)[ranges(ro * t + p_s[osel] % t, p_len[osel])] = (
      ranges(val0, p_len[osel]))
  osel &= p_cross
  ro = row_of[p_own[osel]]
  q_send_idx.reshape(-1)[ranges((ro * s + p_srv[osel]) * cq + p_pos[osel], p_len[osel])] = (
      ranges(p_s[osel] % t, p_len[osel]))
  usel = (row_of[u_own] >= 0) & u_cross
  ro = row_of[u_own[usel]]
  kv_send_idx.reshape(-1)[ranges((ro * s + u_psrv[usel]) * ckv + u_pos[usel], u_len[usel])] = (
      ranges(u_s[usel] % t, u_len[usel]))
  return PlanMetadata(q_send_idx=q_send_idx, kv_send_idx=kv_send_idx, q_attn_idx=q_attn_idx,
                      kv_attn_idx=kv_attn_idx, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      o_send_idx=o_send_idx, o_local_idx=o_local_idx, q_send_len=q_send_len,
                      kv_send_len=kv_send_len, q_len=q_len, kv_len=kv_len, num_tasks=num_tasks,
                      task_index=task_index, ranks=ranks_arr, num_servers=s, tokens_per_rank=t,
                      capacity=cap)


def split_at(g0: np.ndarray, g1: np.ndarray, width: int):
  """Cuts intervals [g0, g1) at multiples of ``width`` (rank boundaries when width = T).

  Empty intervals yield no piece. Returns (interval index, block index, piece start, piece end),
  pieces in interval order.
  """
  g0 = np.asarray(g0, np.int64)
  g1 = np.asarray(g1, np.int64)
  keep = g1 > g0
  g0, g1, src = g0[keep], g1[keep], np.flatnonzero(keep)
  if g0.size == 0:
    z = np.zeros(0, np.int64)
    return z, z, z, z
  r0 = g0 // width
  cnt = (g1 - 1) // width - r0 + 1
  idx = np.repeat(np.arange(g0.size), cnt)
  block = r0[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
  return (src[idx], block, np.maximum(g0[idx], block * width),
          np.minimum(g1[idx], (block + 1) * width))


def _slot_positions(server: np.ndarray, owner: np.ndarray, lengths: np.ndarray,
                    s: int) -> np.ndarray:
  """Start of each piece inside its (owner, server) slot: pieces keep their given order."""
  if server.size == 0:
    return np.zeros(0, np.int64)
  key = server * s + owner
  order = np.argsort(key, kind="stable")
  ln = lengths[order]
  excl = np.cumsum(ln) - ln
  ks = key[order]
  start = np.r_[True, ks[1:] != ks[:-1]]
  base = np.maximum.accumulate(np.where(start, excl, 0))
  pos = np.empty_like(excl)
  pos[order] = excl - base
  return pos


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Concatenation of ``arange(starts[i], starts[i] + lengths[i])`` (int64)."""
  lengths = np.asarray(lengths, dtype=np.int64)
  total = int(lengths.sum())
  if total == 0:
    return np.zeros(0, np.int64)
  offs = np.cumsum(lengths) - lengths
  return np.repeat(np.asarray(starts, np.int64) - offs, lengths) + np.arange(total)


# ---------------------------------------------------------------------------------------------
# NumPy reference executor (test oracle for the contract).
# ---------------------------------------------------------------------------------------------
def _take(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
  """``jnp.take(x, idx, axis=0, mode='fill', fill_value=0)`` in NumPy."""
  out = np.zeros(idx.shape + x.shape[1:], dtype=x.dtype)
  ok = (idx >= 0) & (idx < x.shape[0])
  out[ok] = x[idx[ok]]
  return out


def _causal_attention(q_NxHxD, k_MxKxD, v_MxKxD, scale: float):
  """Causal attention with queries aligned to the last rows of the keys; returns (O, LSE)."""
  n, h, _ = q_NxHxD.shape
  m, kh, _ = k_MxKxD.shape
  rep = h // kh
  k_HxDxM = np.repeat(k_MxKxD, rep, axis=1).transpose(1, 2, 0)
  v_HxMxD = np.repeat(v_MxKxD, rep, axis=1).transpose(1, 0, 2)
  s = np.matmul(q_NxHxD.transpose(1, 0, 2), k_HxDxM) * scale  # [H, N, M]
  qpos = (m - n) + np.arange(n)
  s = np.where(np.arange(m)[None, None, :] <= qpos[None, :, None], s, -np.inf)
  mx = s.max(axis=-1, keepdims=True)
  p = np.exp(s - mx)
  denom = p.sum(axis=-1, keepdims=True)
  o = np.matmul(p / denom, v_HxMxD).transpose(1, 0, 2)  # [N, H, D]
  lse = (mx + np.log(denom))[..., 0].T  # [n, h]
  return o, lse


def reference_execute(meta: PlanMetadata, q_STHD: np.ndarray, k_STKD: np.ndarray,
                      v_STKD: np.ndarray, *, scale: float | None = None):
  """Runs the metadata with NumPy: gather, all_to_all, per-task attention, return.

  Args:
    meta: metadata built for every rank (``ranks`` = all, in order).
    q_STHD: [S, T, H, D] queries per rank; k_STKD, v_STKD: [S, T, K, D].
    scale: softmax scale (default 1 / sqrt(D)).

  Returns:
    (o [S, T, H, D], lse [S, T, H]); padding rows are zero.
  """
  s, t = meta.num_servers, meta.tokens_per_rank
  if not np.array_equal(meta.ranks, np.arange(s)):
    raise ValueError("reference_execute needs metadata for every rank (ranks=None)")
  if q_STHD.shape[:2] != (s, t) or k_STKD.shape[:2] != (s, t) or v_STKD.shape != k_STKD.shape:
    raise ValueError(f"expected q [S={s}, T={t}, H, D], k/v [S, T, K, D]; got {q_STHD.shape=} "
                     f"{k_STKD.shape=} {v_STKD.shape=}")
  h, dim = q_STHD.shape[2:]
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  cap = meta.capacity
  # 1-2. Sender gather and dense all_to_all: recv[s][p] = send[p][s].
  q_send = np.stack([_take(q_STHD[p], meta.q_send_idx[p]) for p in range(s)])  # [S,S,Cq,H,D]
  k_send = np.stack([_take(k_STKD[p], meta.kv_send_idx[p]) for p in range(s)])
  v_send = np.stack([_take(v_STKD[p], meta.kv_send_idx[p]) for p in range(s)])
  q_recv, k_recv, v_recv = (x.swapaxes(0, 1) for x in (q_send, k_send, v_send))
  o_attn, lse_attn = [], []
  for d in range(s):
    # 3. Server gather into attention inputs.
    q_src = np.concatenate([q_STHD[d], q_recv[d].reshape((s * cap.q_slot,) + q_STHD.shape[2:])])
    k_src = np.concatenate([k_STKD[d], k_recv[d].reshape((s * cap.kv_slot,) + k_STKD.shape[2:])])
    v_src = np.concatenate([v_STKD[d], v_recv[d].reshape((s * cap.kv_slot,) + v_STKD.shape[2:])])
    qa = _take(q_src, meta.q_attn_idx[d])
    ka = _take(k_src, meta.kv_attn_idx[d])
    va = _take(v_src, meta.kv_attn_idx[d])
    # 4. One varlen call: every task [cu_q[i], cu_q[i+1]) x [cu_k[i], cu_k[i+1]).
    o = np.zeros(qa.shape, dtype=np.float64)
    lse = np.zeros(qa.shape[:2], dtype=np.float64)
    cq_, ck_ = meta.cu_seqlens_q[d], meta.cu_seqlens_k[d]
    for i in range(cap.tasks):
      q0, q1, k0, k1 = int(cq_[i]), int(cq_[i + 1]), int(ck_[i]), int(ck_[i + 1])
      if q1 == q0:
        continue
      if k1 - k0 < q1 - q0:
        raise ValueError(f"server {d} task {i}: {q1 - q0} queries but only {k1 - k0} keys")
      o[q0:q1], lse[q0:q1] = _causal_attention(qa[q0:q1], ka[k0:k1], va[k0:k1], scale)
    o_attn.append(o)
    lse_attn.append(lse)
  # 5. Return to owners.
  o_send = np.stack([_take(o_attn[d], meta.o_send_idx[d]) for d in range(s)])  # [S,S,Cq,H,D]
  l_send = np.stack([_take(lse_attn[d], meta.o_send_idx[d]) for d in range(s)])
  o_recv, l_recv = o_send.swapaxes(0, 1), l_send.swapaxes(0, 1)
  out_o = np.zeros(q_STHD.shape, dtype=np.float64)
  out_l = np.zeros(q_STHD.shape[:3], dtype=np.float64)
  for p in range(s):
    o_src = np.concatenate([o_attn[p], o_recv[p].reshape((s * cap.q_slot, h, dim))])
    l_src = np.concatenate([lse_attn[p], l_recv[p].reshape((s * cap.q_slot, h))])
    out_o[p] = _take(o_src, meta.o_local_idx[p])
    out_l[p] = _take(l_src, meta.o_local_idx[p])
  return out_o, out_l


def reference_document_attention(doc_lens, q_STHD: np.ndarray, k_STKD: np.ndarray,
                                 v_STKD: np.ndarray, *, scale: float | None = None):
  """Each document's causal attention computed alone; (o [S,T,H,D], lse [S,T,H]), pads zero."""
  s, t, h, dim = q_STHD.shape
  lens, starts = parse_layout(doc_lens, s, t)
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  qf = q_STHD.reshape(s * t, h, dim)
  kf = k_STKD.reshape((s * t,) + k_STKD.shape[2:])
  vf = v_STKD.reshape((s * t,) + v_STKD.shape[2:])
  o = np.zeros((s * t, h, dim))
  lse = np.zeros((s * t, h))
  for g, n in zip(starts.tolist(), lens.tolist()):
    o[g:g + n], lse[g:g + n] = _causal_attention(qf[g:g + n], kf[g:g + n], vf[g:g + n], scale)
  return o.reshape(s, t, h, dim), lse.reshape(s, t, h)


# ---------------------------------------------------------------------------------------------
# Diagnostics.
# ---------------------------------------------------------------------------------------------
def diagnostics(plan: Plan) -> dict[str, Any]:
  """Headline numbers of a plan (JSON-friendly)."""
  pb = plan.pair_bytes
  out = {
      "num_servers": plan.num_servers, "num_docs": int(plan.doc_lens.size),
      "num_tasks": int(len(plan.tasks)), "num_moves": plan.num_moves,
      "imbalance_before": plan.imbalance_before, "imbalance_after": plan.imbalance_after,
      "mean_load_pairs": float(plan.loads_after.mean()),
      "bytes_q": plan.bytes_q, "bytes_kv": plan.bytes_kv, "bytes_total": plan.bytes_total,
      "max_pair_bytes": int(pb.max(initial=0)),
      "active_pairs": int((pb > 0).sum()), "degraded": plan.degraded,
      "degraded_reason": plan.degraded_reason,
      "required_capacity": dataclasses.asdict(required_capacity(plan)),
  }
  if plan.times_after is not None:
    out["time_imbalance_before"] = imbalance(plan.times_before)
    out["time_imbalance_after"] = imbalance(plan.times_after)
    out["max_time_s_before"] = float(plan.times_before.max())
    out["max_time_s_after"] = float(plan.times_after.max())
  return out


def plot_loads(plan: Plan, ax=None, *, use_time: bool = False):
  """Bar chart of per-server load before and after balancing; returns the figure.

  Args:
    plan: from ``schedule``.
    ax: a matplotlib Axes to draw on (default: a new figure).
    use_time: plot predicted kernel seconds (needs a cost table) instead of pairs.
  """
  try:
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("plot_loads needs matplotlib: pip install matplotlib") from e
  if use_time:
    if plan.times_after is None:
      raise ValueError("plan has no cost table; pass cost_model= to schedule()")
    before, after, unit = plan.times_before, plan.times_after, "predicted kernel s"
  else:
    before, after, unit = plan.loads_before, plan.loads_after, "pairs"
  if ax is None:
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * plan.num_servers), 3.5))
  else:
    fig = ax.figure
  x = np.arange(plan.num_servers)
  ax.bar(x - 0.2, before, width=0.4, label=f"before (imbalance {imbalance(before):.2f})")
  ax.bar(x + 0.2, after, width=0.4, label=f"after (imbalance {imbalance(after):.2f})")
  mean = float(np.mean(after))
  ax.axhline(mean, color="k", lw=0.8, ls="--", label="mean")
  ax.axhline(mean * (1 + plan.tolerance), color="r", lw=0.8, ls=":",
             label=f"(1 + {plan.tolerance:g}) x mean")
  ax.set_xlabel("server (rank)")
  ax.set_ylabel(unit)
  ax.legend(fontsize=8)
  return fig
