"""``schedule``: a global batch's layout to a ``Plan`` (host, NumPy only): checks the inputs,
runs the balancer (``balancer.Balancer``, or ``hosts.HostBalancer`` over several hosts; their
module docstrings state the rules) and collects the tasks, loads and traffic of the result."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from distca_jax.checks import check_float, check_int
from distca_jax.plan import cost
from distca_jax.plan.balancer import SPLITS, Balancer
from distca_jax.plan.capacity import CAP_FIELDS, Capacity
from distca_jax.plan.cost import imbalance, pairs, predicted_step_gain
from distca_jax.plan.hosts import HostBalancer
from distca_jax.plan.metadata import Plan, parse_layout, server_hosts
from distca_jax.plan.options import PlanOptions


def schedule(doc_lens, num_servers: int, *, tokens_per_rank: int,
             capacity: Capacity | Mapping[str, int | None] | None = None,
             options: PlanOptions = PlanOptions()) -> Plan:
  """Balances core-attention work over ``num_servers`` in-place servers.

  Args:
    doc_lens: flat list of document lengths packed across ranks (documents may span ranks), or
      one list per rank (documents never span ranks). See the module docstring.
    num_servers: number of ranks = attention servers (``S``).
    tokens_per_rank: token budget of one rank (``T``).
    capacity: buffer caps (``Capacity`` or a dict of its fields); None = unbounded.
    options: tolerance, ``min_shard`` (a number here), split, byte model, cost model, gate
      (``PlanOptions``).

  Returns:
    The ``Plan``.
  """
  if not isinstance(options, PlanOptions):
    raise TypeError(f"options={options!r} must be a plan.PlanOptions")
  o = options
  tolerance, min_shard, split = o.tolerance, o.min_shard, o.split
  q_heads, kv_heads, head_dim, dtype_bytes = o.q_heads, o.kv_heads, o.head_dim, o.dtype_bytes
  max_moves, min_gain = o.max_moves, o.min_gain
  window = check_int("window", o.window, 0)
  if min_shard is None:
    raise ValueError("min_shard=None (auto) depends on the tokens per row; plan with host_plan, "
                     "or pass options.for_rows(tokens_per_row)")
  lens, starts = parse_layout(doc_lens, num_servers, tokens_per_rank)
  s, t = int(num_servers), int(tokens_per_rank)
  if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not (
      0.0 <= float(tolerance) < float("inf")):
    raise ValueError(f"{tolerance=} must be a finite float >= 0 (e.g. 0.1)")
  tol = float(tolerance)
  m0 = check_int("min_shard", min_shard, 1)
  if split not in SPLITS:
    raise ValueError(f"{split=} must be one of {SPLITS}")
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
    unknown = set(capacity) - set(CAP_FIELDS)
    if unknown:
      raise ValueError(f"unknown capacity fields {sorted(unknown)}; valid: {CAP_FIELDS}")
    cap = Capacity(**capacity)
  else:
    raise TypeError(f"capacity={capacity!r} must be None, a Capacity or a dict")
  per_host = _check_hosts(o, s)
  table = cost.as_cost_table(o.cost_model)
  qb = float(q_heads * head_dim * dtype_bytes)
  kvb = float(2 * kv_heads * head_dim * dtype_bytes)

  if per_host is not None and per_host < s:
    bal = HostBalancer(lens, starts, s, t, tol, m0, cap, qb, kvb, split,
                       servers_per_host=per_host,
                       inter_host_price=o.intra_host_gbps / o.inter_host_gbps, window=window)
  else:
    bal = Balancer(lens, starts, s, t, tol, m0, cap, qb, kvb, split, window=window)
  _check_initial_caps(bal, cap)
  loads_before = bal.loads.copy()
  total = float(loads_before.sum())
  mean = total / s
  if max_moves is None:
    max_moves = 20 * (s + bal.num_items)
  check_int("max_moves", max_moves, 0)
  min_gain = check_float("min_gain", min_gain)
  gain = predicted_step_gain(loads_before, t,
                             check_float("linear_pairs_per_token", o.linear_pairs_per_token))
  gated = min_gain > 0.0 and gain < min_gain
  reason = bal.run(mean, max_moves) if total > 0 and not gated else ""

  # Tasks: every merged interval of every (document, server).
  keys = list(bal.intervals.keys())
  nper = [len(bal.intervals[k]) for k in keys]
  flat = [iv for k in keys for iv in bal.intervals[k]]
  tasks = np.zeros((len(flat), 4), dtype=np.int64)
  if flat:
    tasks[:, 0] = np.repeat([k[0] for k in keys], nper)
    tasks[:, 3] = np.repeat([k[1] for k in keys], nper)
    tasks[:, 1:3] = np.asarray(flat, dtype=np.int64)
    tasks = tasks[np.lexsort((tasks[:, 1], tasks[:, 0], tasks[:, 3]))]
  loads_after = np.bincount(tasks[:, 3], weights=pairs(tasks[:, 1], tasks[:, 2], window).astype(
      np.float64), minlength=s)
  imb_after = imbalance(loads_after)
  degraded = imb_after > (1.0 + tol) * (1 + 1e-12) and not gated
  if degraded and not reason:
    reason = "stopped above the limit"
  times_before = times_after = None
  if table is not None:
    seg_q = bal.seg_hi - bal.seg_lo
    seg_k = bal.seg_hi - cost.k_starts(bal.seg_lo, window)
    times_before = np.bincount(bal.seg_rank, weights=table.time(seg_q, seg_k) if seg_q.size
                               else np.zeros(0), minlength=s)
    task_k = tasks[:, 2] - cost.k_starts(tasks[:, 1], window)
    times_after = np.bincount(tasks[:, 3], weights=table.time(tasks[:, 2] - tasks[:, 1],
                                                              task_k) if len(tasks)
                              else np.zeros(0), minlength=s)
  pq = bal.pair_q_rows.astype(np.int64)
  pkv = bal.pair_kv_rows.astype(np.int64)
  return Plan(tasks=tasks, loads_before=loads_before, loads_after=loads_after,
              imbalance_before=imbalance(loads_before), imbalance_after=imb_after,
              pair_q_rows=pq, pair_kv_rows=pkv, bytes_q=int(pq.sum() * qb),
              bytes_kv=int(pkv.sum() * kvb), degraded=bool(degraded),
              degraded_reason=reason if degraded else "", times_before=times_before,
              times_after=times_after, doc_lens=lens, doc_starts=starts, num_servers=s,
              tokens_per_rank=t, tolerance=tol, min_shard=m0, capacity=cap, q_heads=q_heads,
              kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes,
              num_moves=bal.num_moves, predicted_gain=gain, gated=gated,
              servers_per_host=per_host, window=window)


def _check_hosts(o: PlanOptions, num_servers: int) -> int | None:
  """``o.servers_per_host`` checked against the server count, and the link rates."""
  for name in ("intra_host_gbps", "inter_host_gbps"):
    v = getattr(o, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < float(v) < float(
        "inf"):
      raise ValueError(f"{name}={v!r} must be a positive finite rate in GB/s (e.g. "
                       f"{getattr(cost, name.upper())})")
  if o.servers_per_host is None:
    return None
  server_hosts(num_servers, o.servers_per_host)
  return int(o.servers_per_host)


def _check_initial_caps(bal: Balancer, cap: Capacity) -> None:
  """Raises when the layout, computed where it lives, already overflows a cap."""
  need = {"q_tokens": bal.q_rows.max(initial=0), "kv_tokens": bal.kv_attn_rows.max(initial=0),
          "tasks": bal.num_tasks.max(initial=0), "q_send": bal.send_q.max(initial=0),
          "q_recv": bal.recv_q.max(initial=0), "kv_send": bal.send_kv.max(initial=0),
          "kv_recv": bal.recv_kv.max(initial=0)}
  for name, v in need.items():
    c = getattr(cap, name)
    if c is not None and v > c:
      raise ValueError(
          f"the layout itself (every row computed where it lives) needs capacity.{name} >= "
          f"{int(v)} but {name}={c}; raise it (documents spanning ranks need kv_send and "
          "kv_recv up to tokens_per_rank, many short documents need more tasks)")
