"""The two-level exchange's routing (host, NumPy): every row crosses the inter-host link once.

Servers are numbered host-major: server ``s`` is device ``(s // L, s % L)`` of host ``s // L``
with ``L`` servers per host (``TwoLevel.servers_per_host``; ``H = S / L`` hosts). One part's
exchange (query or key/value; ``send_len`` [S, S] rows per (sender, server), the send buffers
grouped by server as ``metadata`` states) runs as two ragged exchanges:

* Leg A (between hosts): device ``(h, l)`` sends the rows it has for all servers of host
  ``h' != h`` to device ``(h', l)`` (same local index). Send groups are ordered by server, so the
  rows for host ``h'`` are one contiguous block of the device's send buffer (``a_routes``: its
  send offsets point into the send buffer; nonzero only between devices of equal local index on
  different hosts). They land in the relay buffer ``[relay]`` of ``(h', l)``, grouped by sender
  host. Only the cross-host rows of ``send_len`` cross, each once.
* Relay gather (``b_idx``): the forwarder ``f = (h, l)`` builds leg B's send buffer
  ``[send + relay]`` from ``concat(send buffer [send], relay buffer [relay])``: per server ``d``
  of host ``h`` (ascending) the rows of senders ``(0, l), (1, l), ..., (H-1, l)`` for ``d``
  (its own for ``h``, the relayed rows for the others).
* Leg B (inside a host, ``b_routes``): forwarder ``f`` sends its group for ``d`` straight to its
  final place in ``d``'s receive buffer. For that group to be contiguous, a server's receive
  buffer is ordered by (sender local index, sender host) instead of by sender
  (``metadata.recv_order``); the server gathers read the metadata's ``recv_off``, so they follow.

The way back (the output return, every backward) runs the reverse legs in reverse order: leg B
reversed, the relay gather's inverse (the gather reads every source row at most once), leg A
reversed on the relay part; the in-host rows are already home.

Buffers: leg A's receive buffer holds ``relay`` rows per device (``TwoLevel.q_relay`` /
``kv_relay``), leg B's send buffer ``send + relay``. A device relays at most ``min(L * recv,
(H - 1) * send)`` rows (``safe_relay``: the rows its host's ``L`` servers receive, or what the
other hosts' same-index devices send), a bound that does not grow with ``S`` at a fixed ``L``;
the ``distca`` backend sizes the relay buffers from the run's first batches instead
(``backends.distca.startup_capacity``), and ``spec.host_plan`` plans a batch that would overflow
them to move nothing (``relay_overflow``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.checks import check_int
from distca_jax.plan.metadata import packed_offsets, ranges, routes


@dataclasses.dataclass(frozen=True)
class TwoLevel:
  """The two-level exchange's static shape (hashable: part of ``PlanSpec``).

  Attributes:
    servers_per_host: ``L``; must divide the servers.
    q_relay: rows of a device's query relay buffer (leg A's receive buffer).
    kv_relay: rows of a device's key/value relay buffer.
  """
  servers_per_host: int
  q_relay: int
  kv_relay: int

  def __post_init__(self):
    for name in ("servers_per_host", "q_relay", "kv_relay"):
      object.__setattr__(self, name, check_int(f"TwoLevel.{name}", getattr(self, name), 1))

  def hosts(self, num_servers: int) -> int:
    """``H = S / L``; raises unless ``L`` divides ``S``."""
    s, l = int(num_servers), self.servers_per_host
    if s % l:
      raise ValueError(f"servers_per_host={l} must divide the {s} servers (set "
                       "attention.distca.servers_per_host to the GPUs one process drives, or 0 = "
                       "auto)")
    return s // l


def leg_lengths(send_len: np.ndarray, servers_per_host: int):
  """(A [S, S]: leg A rows per (sender, forwarder), B [S, S]: leg B rows per (forwarder,
  server)) of one part's ``send_len``."""
  s, l = send_len.shape[0], int(servers_per_host)
  hn = s // l
  dev = np.arange(s)
  host, loc = dev // l, dev % l
  to_host = send_len.reshape(s, hn, l).sum(2)  # [S, H]: rows a sender has for each host
  a = np.where((loc[:, None] == loc[None, :]) & (host[:, None] != host[None, :]),
               to_host[:, host], 0)
  by_loc = send_len.reshape(hn, l, s).sum(0)  # [L, S]: rows of senders (*, l) per server
  b = np.where(host[:, None] == host[None, :], by_loc[loc], 0)
  return a, b


def relay_rows(send_len: np.ndarray, servers_per_host: int) -> np.ndarray:
  """[S] rows each device relays (leg A's receive rows) for one part."""
  return leg_lengths(np.asarray(send_len), servers_per_host)[0].sum(0)


def safe_relay(send_cap: int, recv_cap: int, num_servers: int, servers_per_host: int) -> int:
  """Relay rows no plan within the send/recv caps exceeds: ``min(L * recv, (H - 1) * send)``
  (at least 1)."""
  hn = int(num_servers) // int(servers_per_host)
  return max(1, min(int(servers_per_host) * int(recv_cap), (hn - 1) * int(send_cap)))


def relay_tables(send_len: np.ndarray, send_off: np.ndarray, send_cap: int, relay_cap: int,
                 servers_per_host: int, ranks: np.ndarray, part: str):
  """One part's two-level tables for the devices ``ranks``: (a_routes [R, 6, S], b_routes
  [R, 6, S], b_idx [R, send_cap + relay_cap]) (module docstring; routes as ``metadata.routes``,
  ``b_idx`` sentinel ``send_cap + relay_cap``). ``send_off`` is the part's send layout; the
  receive buffers must be ordered by ``metadata.recv_order``. Raises when a device relays more than
  ``relay_cap`` rows."""
  s, l = send_len.shape[0], int(servers_per_host)
  hn = s // l
  a, b = leg_lengths(send_len, l)
  got = a.sum(0)
  if got.max(initial=0) > relay_cap:
    f = int(np.argmax(got))
    raise ValueError(f"device {f} relays {int(got[f])} {part} rows between hosts > "
                     f"{part}_relay={relay_cap} (raise attention.distca.{part}_relay or "
                     f"TwoLevel.{part}_relay)")
  dev = np.arange(s)
  host, loc = dev // l, dev % l
  # Leg A: a sender's block for host h' starts at its send offset of server (h', 0).
  a_send_off = send_off[:, host * l]
  a_recv_off = packed_offsets(a)[1]
  b_send_off, b_recv_off = packed_offsets(b)
  # Relay gather: per forwarder f, server d of its host, sender host hs: the rows of sender
  # p = (hs, loc f) for d.
  ranks = np.asarray(ranks, np.int64)
  nr, width = ranks.size, int(send_cap) + int(relay_cap)
  f_ = np.repeat(ranks, l * hn)
  d_ = host[f_] * l + np.tile(np.repeat(np.arange(l), hn), nr)
  p_ = np.tile(np.arange(hn), nr * l) * l + loc[f_]
  n = send_len[p_, d_]
  n3 = n.reshape(nr, l, hn)
  dst = b_send_off[f_, d_] + (np.cumsum(n3, 2) - n3).reshape(-1)
  src = np.where(p_ == f_, send_off[f_, d_],
                 send_cap + a_recv_off[f_, p_] + send_off[p_, d_] - send_off[p_, host[f_] * l])
  row = np.repeat(np.arange(nr), l * hn)
  b_idx = np.full((nr, width), width, np.int32)
  b_idx.reshape(-1)[ranges(row * width + dst, n)] = ranges(src, n)
  return (routes(a, a_send_off, a_recv_off, ranks), routes(b, b_send_off, b_recv_off, ranks),
          b_idx)


def check_crossings(send_len: np.ndarray, a: np.ndarray, b: np.ndarray, servers_per_host: int):
  """Raises unless leg A moves only between hosts and exactly the cross-host rows of
  ``send_len``, each once (the rows of each (sender, destination host) pair), and leg B only
  inside hosts, delivering each server's total."""
  s, l = send_len.shape[0], int(servers_per_host)
  host = np.arange(s) // l
  same = host[:, None] == host[None, :]
  if a[same].any() or b[~same].any():
    raise ValueError("leg A must move only between hosts and leg B only inside them")
  want = np.where(~same, send_len, 0).reshape(s, s // l, l).sum(2)  # [sender, host]
  have = a.reshape(s, s // l, l).sum(2)
  if not np.array_equal(have, want):
    raise ValueError(f"leg A moves {have.tolist()} rows per (sender, host), the cross-host "
                     f"rows are {want.tolist()}")
  if not np.array_equal(b.sum(0), send_len.sum(0)):
    raise ValueError("leg B does not deliver every server's rows")


def with_relay(meta, two_level: TwoLevel):
  """``meta`` (a ``PlanMetadata`` built with ``servers_per_host = L``) with both parts'
  two-level tables (``relay_tables``) in the relay buffers of ``two_level``."""
  l = two_level.servers_per_host
  two_level.hosts(meta.num_servers)
  if meta.servers_per_host != l:
    raise ValueError(f"metadata built with servers_per_host={meta.servers_per_host}, the "
                     f"two-level exchange needs {l} (plan_to_metadata(..., servers_per_host={l}))")
  cap = meta.capacity
  out = {}
  for part, send_len, send_cap, relay in (("q", meta.q_send_len, cap.q_send, two_level.q_relay),
                                          ("kv", meta.kv_send_len, cap.kv_send,
                                           two_level.kv_relay)):
    send_len = np.asarray(send_len, np.int64)
    tables = relay_tables(send_len, packed_offsets(send_len)[0], send_cap, relay, l, meta.ranks,
                          part)
    out.update(zip((f"{part}_a_routes", f"{part}_b_routes", f"{part}_b_idx"), tables))
  return dataclasses.replace(meta, **out)


def required_relay(plan, servers_per_host: int) -> tuple[int, int]:
  """(query, key/value) relay rows ``plan`` (a ``metadata.Plan``) needs on its busiest device."""
  return tuple(int(relay_rows(ln, servers_per_host).max(initial=0))
               for ln in (plan.pair_q_rows, plan.pair_kv_rows))


def relay_overflow(plan, two_level: TwoLevel) -> str:
  """Why ``plan`` overflows the relay buffers of ``two_level`` ('' when it fits)."""
  need = required_relay(plan, two_level.servers_per_host)
  for part, have, cap in zip(("q", "kv"), need, (two_level.q_relay, two_level.kv_relay)):
    if have > cap:
      return f"a device relays {have} {part} rows between hosts > {part}_relay={cap}"
  return ""
