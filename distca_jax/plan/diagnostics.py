"""Numbers about a plan: loads, traffic, headline diagnostics, a load plot, and the bytes of one
forward exchange (benchmarks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from distca_jax.plan.capacity import required_capacity
from distca_jax.plan.cost import imbalance, pairs
from distca_jax.plan.metadata import Plan, PlanMetadata


def server_loads(plan: Plan, *, use_time: bool = False) -> np.ndarray:
  """[S] per-server load recomputed from ``plan.tasks``: pairs, or predicted seconds."""
  if use_time:
    if plan.times_after is None:
      raise ValueError("plan has no cost table; pass cost_model= to schedule()")
    return plan.times_after
  t = plan.tasks
  return np.bincount(t[:, 3], weights=pairs(t[:, 1], t[:, 2], plan.window).astype(np.float64),
                     minlength=plan.num_servers)


def pair_bytes(plan: Plan) -> np.ndarray:
  """[S, S] dispatch bytes per (sender, server), recomputed from ``plan.tasks``."""
  q_rows, kv_rows = traffic_rows(plan)
  return (q_rows * plan.q_heads * plan.head_dim * plan.dtype_bytes
          + kv_rows * 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes)


def traffic_rows(plan: Plan) -> tuple[np.ndarray, np.ndarray]:
  """([S, S] query rows, [S, S] key/value rows) per (sender, server), from ``plan.tasks``.

  Independent of the balancer's bookkeeping: every task's query rows not owned by its server
  come from their owners; per (document, server), the rows of its tasks' key ranges (``[0, max
  query end)``; with a window the union of ``[k_start, end)``) not owned by the server come from
  their owners once.
  """
  s, t = plan.num_servers, plan.tokens_per_rank
  q_rows = np.zeros((s, s), dtype=np.int64)
  kv_rows = np.zeros((s, s), dtype=np.int64)
  kv_keys: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for (doc, lo, hi, srv), ks in zip(plan.tasks.tolist(), plan.k_starts.tolist()):
    g = int(plan.doc_starts[doc])
    _add_owner_rows(q_rows, g + lo, g + hi, t, srv)
    kv_keys.setdefault((doc, srv), []).append((ks, hi))
  for (doc, srv), ivs in kv_keys.items():
    g = int(plan.doc_starts[doc])
    end = -1
    for ks, hi in sorted(ivs):  # the union of the key ranges
      lo = max(ks, end)
      if hi > lo:
        _add_owner_rows(kv_rows, g + lo, g + hi, t, srv)
      end = max(end, hi)
  return q_rows, kv_rows


def _add_owner_rows(mat: np.ndarray, g0: int, g1: int, t: int, server: int) -> None:
  """Adds the rows of global tokens [g0, g1) not owned by ``server`` to ``mat[owner, server]``."""
  r = g0 // t
  while g0 < g1:
    e = min(g1, (r + 1) * t)
    if r != server:
      mat[r, server] += e - g0
    g0, r = e, r + 1



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
      "servers_per_host": plan.servers_per_host,
      "intra_host_bytes": plan.intra_host_bytes, "inter_host_bytes": plan.inter_host_bytes,
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


def exchange_bytes(meta: PlanMetadata, *, q_heads: int, kv_heads: int,
                   head_dim: int, dtype_bytes: int) -> dict[str, float]:
  """Per-device bytes of one forward exchange: useful (plan rows) and buffers (capacity).

  ``dispatch_*`` counts Q + K + V rows sent to other devices; ``return_*`` the O rows coming back
  (same count as the query rows). ``*_useful``: the routed rows, the mean over devices; the ragged
  exchange moves exactly these (each row once), so they are also its wire bytes.
  ``*_buffer``: the bytes of a device's send and receive buffers (the caps), what the step
  allocates whatever the batch. ``dispatch_useful_busiest_device`` /
  ``return_useful_busiest_device``: the most any one device sends;
  ``dispatch_recv_busiest_device``: the most any one server receives;
  ``max_pair_dispatch_useful``: the largest (sender, server) pair.
  """
  s = meta.num_servers
  c = meta.capacity
  bq = q_heads * head_dim * dtype_bytes
  bkv = 2 * kv_heads * head_dim * dtype_bytes
  useful_q = float(meta.q_send_len.sum()) / s * bq
  useful_kv = float(meta.kv_send_len.sum()) / s * bkv
  sent = meta.q_send_len.sum(axis=1) * bq + meta.kv_send_len.sum(axis=1) * bkv
  got = meta.q_send_len.sum(axis=0) * bq + meta.kv_send_len.sum(axis=0) * bkv
  returned = meta.q_send_len.sum(axis=0) * bq  # a server returns the O rows it received
  return {
      "dispatch_useful": useful_q + useful_kv,
      "dispatch_useful_busiest_device": float(sent.max()),
      "dispatch_recv_busiest_device": float(got.max()),
      "dispatch_buffer": float(c.q_send * bq + c.kv_send * bkv + c.q_recv * bq
                               + c.kv_recv * bkv),
      "return_useful": useful_q,
      "return_useful_busiest_device": float(returned.max()),
      "return_buffer": float((c.q_send + c.q_recv) * bq),
      "max_pair_dispatch_useful": float((meta.q_send_len * bq + meta.kv_send_len * bkv).max()),
  }
