"""``PlanOptions``: every choice of the planner besides the batch and the caps, in one frozen
value that ``schedule``, ``host_plan``, ``fit_host_plan`` and ``suggest_capacity`` take."""

from __future__ import annotations

import dataclasses
import os

from distca_jax.plan import cost


@dataclasses.dataclass(frozen=True)
class PlanOptions:
  """How a batch is balanced (``plan.schedule``) and the byte model its traffic is counted in.

  Attributes:
    tolerance: epsilon; the goal is every server at most ``(1 + tolerance) * mean`` pairs.
    min_shard: shortest query piece a split may create (whole items of any length may move).
      ``None`` = ``auto_min_shard`` of the rows' tokens: ``for_rows`` resolves it, where the
      tokens per row are known (``host_plan``, ``fit_host_plan``; a run config's
      ``attention.distca.min_shard = 0`` reads as ``None``). ``schedule`` takes only a number.
    split: 'auto' (mirrored or suffix, whichever scores better), 'mirrored' or 'suffix'.
    q_heads, kv_heads, head_dim, dtype_bytes: the byte model (query row = q_heads * head_dim *
      dtype_bytes; key/value row = 2 * kv_heads * head_dim * dtype_bytes).
    cost_model: a ``CostTable`` or the path of its JSON; fills ``Plan.times_*``.
    max_moves: safety bound on moves (default ``20 * (S + items)``).
    min_gain: the gate: when the speedup a perfect balance could bring, minus 1
      (``cost.predicted_step_gain`` with ``linear_pairs_per_token``), is below this, nothing
      moves (``Plan.gated``): moving rows has a cost of its own (gathers, exchange, shorter
      kernel tasks), which on near-balanced batches exceeds the gain. 0 = always balance.
    linear_pairs_per_token: the linear layers' work per token in pair units (see
      ``cost.predicted_step_gain``); 0 counts attention alone.
    servers_per_host: servers on one host; servers are numbered host-major (server ``s`` on
      host ``s // servers_per_host``, the order of a mesh's data axis over one process per
      host). The balancer then moves only each host's excess across hosts, balances inside
      each host, and prices every move's bytes at its link's rate (``hosts`` module
      docstring). Must divide the server count; None (or the server count) = one host, every
      link alike.
    intra_host_gbps, inter_host_gbps: per-GPU link rates (GB/s) inside a host and between hosts;
      only their ratio prices moves. Defaults: ``cost.INTRA_HOST_GBPS`` and
      ``cost.INTER_HOST_GBPS`` (which state their sources).
    window: the layer's sliding window in keys (0 = full causal): a task ``[a, b)`` reads keys
      ``[max(0, a - window + 1), b)`` only (``cost.k_starts``), loads count windowed pairs
      (``cost.pairs(a, b, window)``) and the metadata gathers and sends only those key/value
      rows; the data plane's kernel then takes the same ``window``
      (``dataplane.DispatchOptions.window``). A chunked layer is full causal attention over
      documents cut at chunk boundaries (``plan.chunk_layout``), with window 0.
  """
  tolerance: float = cost.DEFAULT_TOLERANCE
  min_shard: int | None = cost.DEFAULT_MIN_SHARD
  split: str = "auto"
  q_heads: int = cost.DEFAULT_Q_HEADS
  kv_heads: int = cost.DEFAULT_KV_HEADS
  head_dim: int = cost.DEFAULT_HEAD_DIM
  dtype_bytes: int = cost.DEFAULT_DTYPE_BYTES
  cost_model: str | os.PathLike | cost.CostTable | None = None
  max_moves: int | None = None
  min_gain: float = 0.0
  linear_pairs_per_token: float = 0.0
  servers_per_host: int | None = None
  intra_host_gbps: float = cost.INTRA_HOST_GBPS
  inter_host_gbps: float = cost.INTER_HOST_GBPS
  window: int = 0

  def for_rows(self, tokens_per_row: int) -> "PlanOptions":
    """These options with ``min_shard=None`` resolved to ``auto_min_shard(tokens_per_row)``."""
    if self.min_shard is not None:
      return self
    return dataclasses.replace(self, min_shard=auto_min_shard(tokens_per_row))


def auto_min_shard(tokens_per_row: int) -> int:
  """``min_shard`` left to the planner: ``cost.DEFAULT_MIN_SHARD``, or ``T / 16`` (at least 8)
  for short rows."""
  return int(min(cost.DEFAULT_MIN_SHARD, max(8, tokens_per_row // 16)))
