"""The host-aware balancer: ``Balancer`` for servers on several hosts (host, NumPy only).

``scheduling.schedule`` uses ``HostBalancer`` when ``PlanOptions.servers_per_host`` splits the
servers into more than one host; the greedy, its moves and its caps are ``balancer.Balancer``'s
(that module's docstring).

Servers are numbered host-major (server ``s`` on host ``s // servers_per_host``), so host ``h``
owns a contiguous range of global tokens. A row sent between hosts costs ``inter_host_price =
intra_host_gbps / inter_host_gbps`` (about 7) rows sent inside one: a move's score is its useful
work over its link-priced bytes (rows on the destination's host at 1, the others at the price;
exact for documents already at or owned by the destination, the item's share of rows off the
host otherwise). The run has three phases: (1) across hosts: the greedy over hosts, sources the
servers above the mean on hosts whose load is above ``servers_per_host`` times ``target -
HOST_SLACK * mean`` (not below the mean), destinations the servers of the other hosts, each
move's useful work capped by the source host's excess and the destination host's room to its
mean, until every host is within (if stuck, once more up to ``target`` per server); (2) inside
each host on its own towards ``target`` (with ``_lower`` where stuck); (3) the global greedy,
link-priced, for what is left. Only the host-level excess crosses hosts; the slack left per
server keeps phase 2 from getting stuck on ``min_shard`` granularity. Uncapped, a destination
that takes no piece blocks every destination with less room (whether a piece fits depends only
on the room), which keeps the time near the host-blind run's. A run stuck above the limit is
replaced by the host-blind run from the start when that ends lower. With one host
(``servers_per_host`` None or the server count) none of this runs: the plan is the host-blind
one, byte for byte. ``Plan.intra_host_bytes`` / ``inter_host_bytes`` report the split
(results/host_plan_bench.md).
"""

from __future__ import annotations

import numpy as np

from distca_jax.plan.balancer import Balancer

# The room per server, in means, hosts keep to balance inside after their excess left.
HOST_SLACK = 0.02


class HostBalancer(Balancer):
  """``Balancer`` over hosts of ``servers_per_host`` servers each (host-major numbering); a row
  sent between hosts costs ``inter_host_price`` rows sent inside one."""

  def __init__(self, *args, servers_per_host: int, inter_host_price: float, **kwargs):
    super().__init__(*args, **kwargs)
    self.servers_per_host, self.inter_host_price = servers_per_host, inter_host_price
    self.host = np.arange(self.num_servers) // servers_per_host
    # Host h owns the global tokens [h host_tokens, (h + 1) host_tokens).
    self.host_tokens = servers_per_host * self.tokens_per_rank

  def run(self, mean: float, max_moves: int) -> str:
    """With hosts: each host's excess to other hosts, then inside each host (``_in_hosts``),
    then the global greedy (link-priced, ``_lower`` where stuck) for what is left. Stuck above
    the limit, the host-blind run from the initial state replaces this one when it ends
    lower."""
    target = (1.0 + self.tolerance) * mean
    status = self._in_hosts(mean, target, max_moves)
    if not status:
      status = self._run_at(mean, target, max_moves)
    if status == "stuck":
      status = self._lower(mean, target, max_moves)
    if status != "stuck":
      return status
    blind = self._initial()
    blind_status = blind.run(mean, max_moves)
    if blind.loads.max() < self.loads.max():
      self.__dict__ = blind.__dict__
      return blind_status
    return self._why_stopped(mean, target)

  def _in_hosts(self, mean: float, target: float, max_moves: int) -> str:
    """With hosts: moves each host's excess to other hosts (down to ``HOST_SLACK`` below
    ``target`` per server, not below the mean; to ``target`` where that gets stuck), then
    balances inside each host on its own towards ``target``; the move-limit reason or ''."""
    for level in (max(mean, target - HOST_SLACK * mean), target):
      status = self._run_at(mean, target, max_moves, across=level)
      if status != "stuck":
        break
    if status.startswith("move limit"):
      return status
    for h in range(self.num_servers // self.servers_per_host):
      members = self.host == h
      status = self._run_at(mean, target, max_moves, members)
      if status == "stuck":
        status = self._lower(mean, target, max_moves, members)
      if status.startswith("move limit"):
        return status
    return ""

  def _row_bytes(self, d: int, pc: dict[str, np.ndarray]):
    """([n] query, [n] key/value) row bytes of the pool's items sent to ``d``, the rows off
    ``d``'s host priced ``inter_host_price`` times: exact for whole documents, the item's rows'
    share for pieces."""
    h0 = float(self.host[d] * self.host_tokens)
    h1 = h0 + self.host_tokens
    g, a, b = pc["g"], pc["a"], pc["b"]
    extra = self.inter_host_price - 1.0
    end = np.minimum(g + b, h1)
    kv_in = np.maximum(end - np.maximum(g, h0), 0.0) / b
    q_in = np.maximum(end - np.maximum(g + a, h0), 0.0) / (b - a)
    return (self.q_row_bytes * (self.inter_host_price - extra * q_in),
            self.kv_row_bytes * (self.inter_host_price - extra * kv_in))

  def _link_rows(self, j: int, d: int, lo: int, hi: int) -> tuple[int, int]:
    """(rows on ``d``'s host, rows off it) of document ``j``'s [lo, hi) not owned by ``d``."""
    g, h0 = self.doc_starts[j], int(self.host[d]) * self.host_tokens
    inside = max(0, min(g + hi, h0 + self.host_tokens) - max(g + lo, h0))
    return inside - self._own_overlap(j, d, lo, hi), hi - lo - inside

  def _move_bytes(self, j: int, d: int, moved, have: int) -> float:
    """``Balancer._move_bytes`` with the rows off ``d``'s host priced ``inter_host_price``."""
    price = self.inter_host_price
    q_rows = 0.0
    for lo, hi in moved:
      near, far = self._link_rows(j, d, lo, hi)
      q_rows += near + price * far
    end = max(hi for _, hi in moved)
    kv_rows = 0.0
    if end > have:
      near, far = self._link_rows(j, d, have, end)
      kv_rows = near + price * far
    return self.q_row_bytes * q_rows + self.kv_row_bytes * kv_rows
