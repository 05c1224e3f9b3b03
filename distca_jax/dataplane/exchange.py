"""The exchange: a device's rows out to their attention servers, and outputs back to owners.

Inside one ``jax.shard_map`` over the data axis (every data rank is an in-place attention
server; every collective runs over the ``axis`` it is given, the servers' axis, which may be the
trailing part of the map's axes: per-stage CAD maps over (pipe, data) and exchanges over
``data``, so each pipe index exchanges within itself), ``send_to_servers`` runs steps 1-3 of
the data plane and ``return_to_owners`` step 5 (``distca_jax.plan.metadata`` states the
contract):

  1. sender gather: local Q/K/V rows into the device's send buffers (``[Cqs]`` and ``[Ckvs]``
     rows, grouped by destination server);
  2. the ragged exchange (``ragged_exchange``): every group lands in its server's receive buffer
     (``[Cqr]``, ``[Ckvr]``, grouped by sender); each row crosses the wire once;
  3. server gather into the attention buffers: query rows by ``copies.place_unique`` (the own
     rows' gather runs while the rows are on the wire), key/value rows by ``copies.gather_two``;
  5. O (and the LSE on request) back by the query exchange's routes reversed
     (``plan.reverse_routes``), placed into the owners' rows like step 3's query rows; padding
     rows come back as zeros.

No buffer depends on the number of servers: each holds a capped total of rows per device, and
the per-peer offsets and counts are the metadata's routes (``[6, S]`` int32 per part).

Implementations (``collective=``), one contract (``ragged_exchange``):
  'remote'  device-initiated copies (``custom_ops/remote_exchange.py``, a Pallas Mosaic GPU
            kernel): each device writes its groups straight into the servers' receive buffers.
            The wire carries exactly the routed rows; the routes are read on the device. Hopper
            GPUs, one process driving every GPU of the host.
  'ragged'  ``lax.ragged_all_to_all`` into the receive buffer (GPU; XLA:CPU does not implement
            it). The wire carries exactly the routed rows.
  'ring'    ``S - 1`` rounds of one ``lax.ppermute`` (device i to i + 1) inside a loop: each
            round passes a whole send buffer one step on, and every device copies out the group
            addressed to it. Runs everywhere (the CPU implementation of the contract) with
            buffers of O(T) rows; the wire carries ``S - 1`` send buffers, so it is no GPU path.
  'dense'   one tiled ``lax.all_to_all`` of ``[S, B]`` blocks, each group padded to ``B``:
            per batch the smallest of ``buckets`` sizes up to ``min(send cap, recv cap)`` that
            holds the largest group any device sends (a ``lax.switch``; a batch that moves
            nothing skips the all-to-all). Runs everywhere; its buffers and wire grow with
            ``S``.
  'two_level'  several hosts (``two_level_exchange``, ``plan.two_level``; servers numbered
            host-major, ``L`` per host): leg A between hosts moves each device's block for
            another host to that host's device of the same local index (each row crosses
            hosts once, only cross-host rows), a local gather builds leg B's send buffer
            from the device's in-host groups and the relayed rows, leg B inside the host
            writes every row to its final place (receive buffers ordered by (sender local
            index, sender host)). Each leg is a ``ragged_exchange`` ('rounds' by default:
            ``ppermute`` rounds over hosts / inside a host, each round padded to a bucket of
            its largest group; ``ExchangeOptions.inter_host`` / ``in_host``). Needs plans
            built for it (``PlanSpec.two_level``), and such plans run only on it. Runs
            everywhere, across processes.
'auto' is 'remote' on the GPUs of a one-process job, 'two_level' on those of a multi-process
job and 'ring' elsewhere (``resolve_collective``). With one server
(one device on the servers' axis) every implementation is the same local copy of the device's
own group: no collective and no kernel run, so one GPU needs no peer-access support; with
``ExchangeOptions.side_blocks`` > 0 that copy runs on a side CUDA stream (``dataplane.side``;
several servers refuse). The backward of
the exchange is the exchange of the cotangents with the routes reversed (a custom VJP shared by
every implementation; the two-level exchange's backward and output return are its legs reversed
in reverse order).

Signal-only (``signal_only=True``; benchmarks only, results are WRONG by design): every group
carries at most one row (``signal_only_routes``), so gathers, kernel and return keep their shapes
and data dependences, and timing the step against the real one measures what the wire costs
(the paper's "signal-only" ablation). 'remote' zeroes the rows past the unclipped groups, as in
the real exchange, and leaves a group's other rows unwritten; the others leave them zero.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from custom_ops import fills_of
from distca_jax.checks import check_int
from distca_jax.dataplane.copies import gather_two, place_unique, take_rows
from distca_jax.plan.metadata import reverse_routes
from distca_jax.plan.spec import PlanSpec

# How rows cross the wire (module docstring, "Implementations").
COLLECTIVES = ("auto", "remote", "ragged", "ring", "dense", "two_level")
# Implementations of the two-level exchange's legs (``ExchangeOptions.inter_host`` / ``in_host``).
LEG_COLLECTIVES = ("rounds", "ragged", "ring", "dense")
# The dense exchange's block sizes per batch (``dense_block_rows``).
DEFAULT_EXCHANGE_BUCKETS = 8


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
  """How rows cross the wire (hashable: part of the step's static arguments).

  Attributes:
    collective: 'auto' (``resolve_collective``), 'remote', 'ragged', 'ring' or 'dense'.
    buckets: the dense exchange's block sizes per batch (``dense_block_rows``); 1 = always the
      largest.
    signal_only: benchmarks only: every group carries at most one row, shapes unchanged,
      results WRONG by design (module docstring).
    inter_host, in_host: the two-level exchange's legs (between hosts, inside a host):
      'rounds' (``_rounds``; the default of both) or 'ragged', 'ring', 'dense' over the whole
      axis (these put padding or whole buffers on the inter-host link: CPU tests and
      measurements only).
    side_blocks: > 0: the exchange of one server (its own group) runs as the side-stream copy
      with this many CTAs (``dataplane.side``; 0 = off); exchanges over several servers refuse.
  """
  collective: str = "auto"
  signal_only: bool = False
  buckets: int = DEFAULT_EXCHANGE_BUCKETS
  inter_host: str = "rounds"
  in_host: str = "rounds"
  side_blocks: int = 0

  def __post_init__(self):
    try:
      check_int("exchange_buckets", self.buckets, 1)
    except ValueError as e:
      raise ValueError(f"distca {e} (1 = the largest dense block always; default "
                       f"{DEFAULT_EXCHANGE_BUCKETS})") from e
    object.__setattr__(self, "buckets", int(self.buckets))
    if self.collective not in COLLECTIVES:
      raise ValueError(f"distca collective={self.collective!r}; choose one of {COLLECTIVES} "
                       "('auto': remote on one process's GPUs, two_level on several, ring "
                       "elsewhere)")
    for name in ("inter_host", "in_host"):
      if getattr(self, name) not in LEG_COLLECTIVES:
        raise ValueError(f"distca two-level {name}={getattr(self, name)!r}; choose one of "
                         f"{LEG_COLLECTIVES} ('rounds': ppermute rounds, the default)")
    if self.signal_only and self.collective == "two_level":
      raise ValueError("distca signal_only=True runs with one-level collectives only; set "
                       "collective to 'ring', 'dense', 'ragged' or 'remote'")
    if not isinstance(self.signal_only, (bool, np.bool_)):
      raise ValueError(f"distca signal_only={self.signal_only!r} must be True or False (True only "
                       "for timing benchmarks: it gives wrong results)")
    object.__setattr__(self, "signal_only", bool(self.signal_only))
    if self.side_blocks:
      from distca_jax.dataplane.side import check_options  # pylint: disable=import-outside-toplevel
      check_options(self)


def resolve_collective(collective: str, platform: str | None = None,
                       one_process: bool | None = None) -> str:
  """'auto' -> 'remote' on GPUs driven by one process (``platform`` or JAX's default backend;
  ``one_process`` or ``jax.process_count() == 1``), 'two_level' on GPUs of a multi-process job
  (each row on the inter-host link once, no padding across hosts but the rounds' buckets),
  'ring' elsewhere; the others pass through, checked.

  On 4 H100s of one host, real Pretrain 128K plans (results/four/README.md): 'remote' moved the
  busiest device's rows at 70-86% of a raw all-to-all's bandwidth on the same bytes (two hosts),
  'dense' at 27-30% (its blocks are padded), XLA's ragged all-to-all at 1-2% (each (sender, server) group
  moves at about 2.6 GB/s, a call as long as its largest group: results/micro/ragged_probe.md).
  'remote' needs the peer addresses XLA shares between the devices of one process, so a
  multi-process job uses 'two_level' (its legs' speed on GPUs is not measured yet:
  docs/design.md, "The two-level exchange").
  """
  if collective not in COLLECTIVES:
    raise ValueError(f"distca collective={collective!r}; choose one of {COLLECTIVES}")
  platform = platform or jax.default_backend()
  gpu = platform in ("gpu", "cuda")
  one_process = jax.process_count() == 1 if one_process is None else one_process
  if collective == "auto":
    if platform not in ("gpu", "cuda", "rocm"):
      return "ring"
    return "remote" if one_process and gpu else "two_level"
  if collective == "remote" and not (gpu and one_process):
    where = (f"{jax.process_count()} processes" if gpu else f"the {platform!r} platform")
    raise ValueError(f"distca collective='remote' needs one process driving NVIDIA GPUs, not "
                     f"{where}: set attention.distca.collective='auto' (picks 'two_level' or "
                     "'ring')")
  return collective


def _ragged(x, out, routes, axis):
  return lax.ragged_all_to_all(x, out, routes[0], routes[1], routes[4], routes[3],
                               axis_name=axis)


def _ring(x, out, routes, axis):
  """``S - 1`` rounds: round k holds sender ``(me - k) % S``'s send buffer; its group for this
  device (``peer_send_off[p]``, ``recv_len[p]`` rows) is copied to ``recv_off[p]``."""
  s = routes.shape[-1]
  me = lax.axis_index(axis).astype(jnp.int32)
  rows = jnp.arange(out.shape[0], dtype=jnp.int32)
  perm = [(i, (i + 1) % s) for i in range(s)]

  def place(k, buf, acc):
    p = (me - k) % s
    start, n, src = routes[2, p], routes[3, p], routes[5, p]
    mine = (rows >= start) & (rows < start + n)
    got = jnp.take(buf, jnp.clip(src + rows - start, 0, buf.shape[0] - 1), axis=0)
    return jnp.where(mine.reshape((-1,) + (1,) * (out.ndim - 1)), got, acc)

  def round_(k, carry):
    buf, acc = carry
    buf = lax.ppermute(buf, axis, perm)
    return buf, place(k, buf, acc)

  acc = place(0, x, out)
  if s == 1:
    return acc
  return lax.fori_loop(1, s, round_, (x, acc))[1]


def _dense_block(x, out, routes, axis, b: int):
  """Each group padded to ``b`` rows (at least its rows), one tiled all-to-all of ``[S, b]``
  blocks; ``b = 0``: nothing moves."""
  if b == 0:  # the other branches' outputs vary over the axis: so must this one's (a zero
    return out + (routes[0, 0] * 0).astype(out.dtype)  # read from the per-device routes)
  s = routes.shape[-1]
  j = jnp.arange(b, dtype=jnp.int32)
  idx = routes[0][:, None] + j[None, :]
  send = take_rows(x, jnp.where(j[None, :] < routes[1][:, None], idx, x.shape[0]).reshape(-1))
  recv = lax.all_to_all(send.reshape((s, b) + x.shape[1:]), axis, 0, 0, tiled=True)
  # Received block p holds sender p's group at its front: row r of the receive buffer reads
  # block p's row r - recv_off[p].
  rows = jnp.arange(out.shape[0], dtype=jnp.int32)
  p = jnp.clip(jnp.searchsorted(routes[2], rows, side="right") - 1, 0, s - 1).astype(jnp.int32)
  off = rows - routes[2][p]
  ok = (off < routes[3][p]) & (off < b)
  flat = recv.reshape((s * b,) + x.shape[1:])
  got = take_rows(flat, jnp.where(ok, p * b + off, s * b))
  return jnp.where(ok.reshape((-1,) + (1,) * (out.ndim - 1)), got, out)


def dense_block_rows(full: int, buckets: int) -> tuple[int, ...]:
  """Block rows the dense exchange chooses from, ascending: ``ceil(i / n * full)`` rounded up to
  a multiple of 8 (at most ``full``) for ``i = 1 .. n``, distinct, and 0 first when ``n >= 2``
  (a batch that moves nothing skips the all-to-all)."""
  n = check_int("exchange_buckets", buckets, 1)
  sizes = set()
  for i in range(1, n + 1):
    rows = -(-i * full // n)  # ceil(i full / n)
    sizes.add(min(full, -(-rows // 8) * 8))
  return tuple(sorted(sizes | ({0} if n > 1 else set())))


def dense_block_index(sizes: tuple[int, ...], need):
  """Index into ``sizes`` (``dense_block_rows``) of the smallest block that holds ``need`` rows
  (the largest group any device sends), the last when none does; ``need`` may be traced (the
  step) or a host integer (``dense_wire_rows``)."""
  return jnp.minimum(jnp.sum(jnp.asarray(sizes, jnp.int32) < need), len(sizes) - 1)


def dense_wire_rows(send_len_SxS, full: int, buckets: int) -> int:
  """Rows per device the dense exchange puts on the wire for one part (host): ``S`` blocks of
  the size ``_dense`` picks for groups ``send_len_SxS`` [S, S] (sender, server; the plan
  metadata's ``q_send_len`` / ``kv_send_len``, or a plan's ``pair_*_rows``), ``full`` =
  ``min(send cap, recv cap)`` of the part. The same rows cross in the return / backward
  direction (groups transposed: the same largest group)."""
  send = np.asarray(send_len_SxS)
  sizes = dense_block_rows(int(full), buckets)
  i = 0 if len(sizes) == 1 else int(dense_block_index(sizes, int(send.max(initial=0))))
  return send.shape[0] * sizes[i]


def _dense(x, out, routes, axis, buckets: int):
  """Blocks of ``B = min(send rows, recv rows)`` rows at most; with ``buckets > 1`` a switch
  runs the smallest block of ``dense_block_rows`` that holds the largest group any device sends
  (one integer all-reduce finds it, so every device takes the same branch)."""
  sizes = dense_block_rows(min(x.shape[0], out.shape[0]), buckets)
  if len(sizes) == 1:
    return _dense_block(x, out, routes, axis, sizes[0])
  i = dense_block_index(sizes, lax.pmax(jnp.max(routes[1]), axis))
  return lax.switch(i, [functools.partial(_dense_block, axis=axis, b=b) for b in sizes],
                    x, out, routes)


def _round_peer(i, shift, l: int, hosts: int):
  """Device ``i = (host, local)`` moved by ``shift = (hosts, locals)`` (both modulo)."""
  return ((i // l + shift[0]) % hosts) * l + (i % l + shift[1]) % l


def _add_group(acc, buf, start, n, src, b: int):
  """``acc`` plus rows ``src .. src + n`` of ``buf`` (``n <= b``) at rows ``start ..``: a
  ``b``-row window on both sides (each padded by at least ``b`` rows past every offset, so no
  window is clamped); the window's rows past ``n`` add zeros."""
  j = jnp.arange(b, dtype=jnp.int32).reshape((-1,) + (1,) * (buf.ndim - 1))
  rows = jnp.where(j < n, lax.dynamic_slice_in_dim(buf, src, b), 0).astype(acc.dtype)
  return lax.dynamic_update_slice_in_dim(
      acc, lax.dynamic_slice_in_dim(acc, start, b) + rows, start, axis=0)


def _round_block(x, acc, routes, dst, src, axis, perm, b: int):
  """One round: this device's group for ``dst`` (a ``b``-row window from its send offset, rows
  past the group zeroed) to ``dst`` by one ``ppermute``; the window from ``src`` added at its
  receive offset. ``x`` and ``acc`` are padded by at least ``b`` rows. ``b = 0``: nothing
  moves."""
  if b == 0:  # the other branches' outputs vary over the axis: so must this one's
    return acc + (routes[0, 0] * 0).astype(acc.dtype)
  j = jnp.arange(b, dtype=jnp.int32).reshape((-1,) + (1,) * (x.ndim - 1))
  send = jnp.where(j < routes[1, dst], lax.dynamic_slice_in_dim(x, routes[0, dst], b), 0)
  recv = lax.ppermute(send, axis, perm)
  return _add_group(acc, recv, routes[2, src], b, 0, b)


def _rounds(x, out, routes, axis, buckets: int, servers_per_host: int, level: str):
  """Rounds of one ``ppermute`` each over devices ``(host, local)`` (``servers_per_host``
  ``L``): level 'hosts' (leg A), round ``r = 1 .. H - 1`` moves ``(h, l) -> (h + r, l)``;
  level 'local' (leg B), round ``r = 0 .. L - 1`` moves ``(h, l) -> (h, l + r)`` (round 0: the
  device's own group, a local copy). Each round's payload is the smallest of
  ``dense_block_rows`` that holds the round's largest group (one integer all-reduce finds every
  round's; a round that moves nothing skips its ``ppermute``). ``out`` is all zeros (the
  received groups are added into it); every copy touches its window's rows only."""
  s, l = routes.shape[-1], int(servers_per_host)
  hosts = s // l
  shifts = ([(r, 0) for r in range(1, hosts)] if level == "hosts"
            else [(0, r) for r in range(l)])
  me = lax.axis_index(axis).astype(jnp.int32)
  sizes = dense_block_rows(min(x.shape[0], out.shape[0]), buckets)
  full = max(sizes)
  if full == 0:
    return out
  # Windows of up to ``full`` rows from any offset stay inside the padded buffers.
  zeros = jnp.broadcast_to(fills_of(x, 0)[0], (full,) + x.shape[1:])
  x, acc = jnp.concatenate([x, zeros]), jnp.concatenate([out, zeros.astype(out.dtype)])
  moved = [sh for sh in shifts if sh != (0, 0)]
  if moved:
    need = lax.pmax(jnp.stack([routes[1, _round_peer(me, sh, l, hosts)] for sh in moved]), axis)
  k = 0
  for sh in shifts:
    dst = _round_peer(me, sh, l, hosts)
    src = _round_peer(me, (-sh[0], -sh[1]), l, hosts)
    if sh == (0, 0):  # its own group: a local copy
      acc = _add_group(acc, x, routes[2, me], routes[3, me], routes[5, me], full)
      continue
    perm = [(i, _round_peer(i, sh, l, hosts)) for i in range(s)]
    branches = [functools.partial(_round_block, dst=dst, src=src, axis=axis, perm=perm, b=b)
                for b in sizes]
    if len(sizes) == 1:
      acc = branches[0](x, acc, routes)
    else:
      acc = lax.switch(dense_block_index(sizes, need[k]), branches, x, acc, routes)
    k += 1
  return acc[:out.shape[0]]


def round_wire_rows(legs_SxS, full: int, buckets: int, servers_per_host: int,
                    level: str) -> int:
  """Rows per device the rounds of ``_rounds`` put on the wire for one leg (host):
  ``legs_SxS`` [S, S] rows per (sender, receiver) of the leg, ``full`` = ``min(send rows, recv
  rows)`` of the leg's buffers; the self round (level 'local') moves nothing. The same rows cross
  in the return / backward direction (groups transposed: the same largest group per round)."""
  ln = np.asarray(legs_SxS)
  s, l = ln.shape[0], int(servers_per_host)
  hosts = s // l
  sizes = dense_block_rows(int(full), buckets)
  shifts = ([(r, 0) for r in range(1, hosts)] if level == "hosts"
            else [(0, r) for r in range(1, l)])
  i = np.arange(s)
  total = 0
  for sh in shifts:
    need = int(ln[i, _round_peer(i, sh, l, hosts)].max(initial=0))
    total += sizes[0 if len(sizes) == 1 else int(dense_block_index(sizes, need))]
  return total


def ragged_exchange(x, routes, recv_rows: int, axis, collective: str,
                    buckets: int = DEFAULT_EXCHANGE_BUCKETS, signal_only: bool = False,
                    servers_per_host: int = 0, side_blocks: int = 0):
  """Moves this device's send buffer ``x [Cs, ...]`` by ``routes`` (int32 ``[6, S]``,
  ``plan.ROUTE_ROWS``) into a receive buffer ``[recv_rows, ...]`` (rows no group fills are
  zero). Inside ``shard_map`` over ``axis``; ``collective`` names the implementation ('ragged',
  'ring' or 'dense', already resolved; or a leg of the two-level exchange, 'host_rounds' /
  'local_rounds', ``_rounds`` over ``servers_per_host`` servers per host, whose routes must
  pair only devices of one local index on different hosts / of one host); ``buckets``: the
  dense exchange's and the rounds' block sizes (``dense_block_rows``); ``signal_only``: at most
  one row per group (module docstring); ``side_blocks`` > 0: one server's exchange as the
  side-stream copy of that many CTAs (``dataplane.side.side_exchange``). Differentiable in
  ``x``: the cotangents go back by the routes reversed (on the side stream too)."""
  if collective in ("host_rounds", "local_rounds"):
    check_int("servers_per_host", servers_per_host, 1)
  return _exchange(x, routes, recv_rows, axis, collective, int(buckets), bool(signal_only),
                   int(servers_per_host), int(side_blocks))


def signal_only_routes(routes):
  """Signal-only (module docstring): ``routes`` with every group cut to at most one row, and the
  receive rows the uncut groups cover (``sum(recv_len)``, where the real exchange's zeroing
  starts)."""
  cut = routes.at[1].set(jnp.minimum(routes[1], 1)).at[3].set(jnp.minimum(routes[3], 1))
  return cut, jnp.sum(routes[3])


def two_level_exchange(x, legs, recv_rows: int, axis, servers_per_host: int,
                       inter_host: str = "rounds", in_host: str = "rounds",
                       buckets: int = DEFAULT_EXCHANGE_BUCKETS, reverse: bool = False):
  """One part's exchange in two legs (``plan.two_level``): ``legs`` = (leg A's routes ``[6,
  S]``, leg B's routes ``[6, S]``, the relay gather ``b_idx [Cs + relay]``) of this device.

  Forward (``reverse=False``, ``x`` the send buffer ``[Cs, ...]``): leg A between hosts into
  the relay buffer ``[relay]``; leg B's send buffer ``concat(x, relay)[b_idx]``; leg B inside
  the host into the receive buffer ``[recv_rows]``. Reverse (the output return; ``x`` in the
  receive buffer's layout, ``recv_rows = Cs``): leg B reversed, the gather's inverse, leg A
  reversed on the relay part plus the in-host rows. Every row crosses hosts once (leg A).
  ``inter_host`` / ``in_host``: the legs' implementations ('rounds', ``_rounds`` over hosts /
  inside hosts; or 'ragged', 'ring', 'dense' over the whole axis). Differentiable in ``x``
  (each leg's VJP, the gathers' transposes)."""
  a_routes, b_routes, b_idx = legs
  width = b_idx.shape[0]
  l = int(servers_per_host)
  one_host = a_routes.shape[-1] == l
  inter = "host_rounds" if inter_host == "rounds" else inter_host
  intra = "local_rounds" if in_host == "rounds" else in_host
  leg = functools.partial(ragged_exchange, axis=axis, buckets=buckets, servers_per_host=l)
  if not reverse:
    cs = x.shape[0]
    relay = (jnp.broadcast_to(fills_of(x, 0)[0], (width - cs,) + x.shape[1:]) if one_host
             else leg(x, a_routes, width - cs, collective=inter))
    # The in-host rows are gathered while leg A runs; the relayed rows are written after it.
    send = place_unique(x, relay, b_idx)
    return leg(send, b_routes, recv_rows, collective=intra)
  back = leg(x, reverse_routes(b_routes), width, collective=intra)
  inverse = jnp.full((width,), width, jnp.int32).at[b_idx].set(
      jnp.arange(width, dtype=jnp.int32), mode="drop")
  src = take_rows(back, inverse, unique=True)
  if one_host:
    return src[:recv_rows]
  return src[:recv_rows] + leg(src[recv_rows:], reverse_routes(a_routes), recv_rows,
                               collective=inter)


def num_servers(axis) -> int:
  """Devices over the servers' ``axis`` (a name or a tuple of names), inside ``shard_map``."""
  axes = tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)
  return math.prod(int(lax.axis_size(a)) for a in axes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _exchange(x, routes, recv_rows: int, axis, collective: str, buckets: int, signal_only: bool,
              servers_per_host: int, side_blocks: int = 0):
  if side_blocks:  # one server's own group on the side stream (refuses several servers)
    from distca_jax.dataplane.side import side_exchange  # pylint: disable=import-outside-toplevel
    return side_exchange(x, routes, recv_rows, side_blocks, num_servers(axis))
  keep = None
  if signal_only:
    routes, keep = signal_only_routes(routes)
  if num_servers(axis) == 1:  # one server: its own group is all there is, no wire, no kernel
    return _ring(x, jnp.broadcast_to(fills_of(x, 0)[0], (recv_rows,) + x.shape[1:]), routes, axis)
  if collective == "remote":  # writes every row of its own output (unfilled rows: zeros)
    from custom_ops.remote_exchange import remote_exchange  # pylint: disable=import-outside-toplevel
    return remote_exchange(x, routes, recv_rows, axis, keep=keep)  # Mosaic GPU: only when used
  # Zeros that depend on x: a constant receive buffer would be computed before a differentiated
  # layer scan and held while the loop runs (``custom_ops.fills_of``).
  out = jnp.broadcast_to(fills_of(x, 0)[0], (recv_rows,) + x.shape[1:])
  if collective == "ragged":
    return _ragged(x, out, routes, axis)
  if collective == "ring":
    return _ring(x, out, routes, axis)
  if collective in ("host_rounds", "local_rounds"):
    return _rounds(x, out, routes, axis, buckets, servers_per_host,
                   "hosts" if collective == "host_rounds" else "local")
  return _dense(x, out, routes, axis, buckets)


def _exchange_fwd(x, routes, recv_rows, axis, collective, buckets, signal_only, servers_per_host,
                  side_blocks=0):
  return _exchange(x, routes, recv_rows, axis, collective, buckets, signal_only,
                   servers_per_host, side_blocks), (routes, jnp.zeros((x.shape[0], 0), x.dtype))


def _exchange_bwd(recv_rows, axis, collective, buckets, signal_only, servers_per_host,
                  side_blocks, res, dy):
  routes, like = res
  dx = _exchange(dy, reverse_routes(routes), like.shape[0], axis, collective, buckets,
                 signal_only, servers_per_host, side_blocks)
  return dx, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _move(x, m: Mapping[str, jax.Array], part: str, recv_rows: int, axis, spec: PlanSpec,
          exchange: ExchangeOptions, reverse: bool = False):
  """One part's exchange (``part`` 'q' or 'kv'; ``reverse``: the output return) under the
  options: ``ragged_exchange`` of the metadata's routes, or the two-level exchange of its legs'
  tables; signal-only (module docstring) sends at most one row per group."""
  collective = check_two_level(exchange, spec)
  if collective == "two_level":
    legs = tuple(m[f"{part}_{f}"] for f in ("a_routes", "b_routes", "b_idx"))
    return two_level_exchange(x, legs, recv_rows, axis, spec.servers_per_host,
                              exchange.inter_host, exchange.in_host, exchange.buckets, reverse)
  routes = m[f"{part}_routes"]
  routes = reverse_routes(routes) if reverse else routes
  return ragged_exchange(x, routes, recv_rows, axis, collective, exchange.buckets,
                         exchange.signal_only, side_blocks=exchange.side_blocks)


def check_two_level(exchange: ExchangeOptions, spec: PlanSpec, platform: str | None = None,
                    one_process: bool | None = None) -> str:
  """The resolved collective (``resolve_collective``), checked against the plan's shape: the
  two-level exchange needs plans with its tables (``PlanSpec.two_level``), and such plans (their
  receive buffers in the two-level order) run only on it."""
  collective = resolve_collective(exchange.collective, platform, one_process)
  if (collective == "two_level") != (spec.two_level is not None):
    raise ValueError(f"distca collective {collective!r} (from {exchange.collective!r}) with a "
                     f"plan of two_level={spec.two_level}: the two-level exchange needs plans "
                     "built for it and runs only them (PlanSpec.two_level; the distca backend "
                     "builds them when the collective resolves to 'two_level')")
  return collective


def send_to_servers(q_TxHxD, k_TxKxD, v_TxKxD, m: Mapping[str, jax.Array], spec: PlanSpec,
                    axis, exchange: ExchangeOptions = ExchangeOptions()):
  """Steps 1-3 on one device (inside ``shard_map``): its rows out, its attention inputs in.

  Args:
    q_TxHxD, k_TxKxD, v_TxKxD: this device's rows (``T = R * tokens_per_row``, local heads).
    m: this device's metadata (``PlanSpec.unpack_local``).
    spec: the static shapes.
    axis: the servers' mesh axis (or a tuple of axes).
    exchange: collective and signal-only (``ExchangeOptions``). Two exchanges: the query rows,
      and the key and value rows side by side (they share their routes).

  Returns:
    (q_attn [Nq, H, D], k_attn [Nkv, K, D], v_attn [Nkv, K, D]); rows no task uses are zero.
  """
  cap = spec.capacity
  kh = k_TxKxD.shape[1]
  # 1. Sender gathers (a key/value row may go to several servers: not unique).
  q_send = take_rows(q_TxHxD, m["q_send_idx"], unique=True)
  kv_send = jnp.concatenate([take_rows(k_TxKxD, m["kv_send_idx"]),
                             take_rows(v_TxKxD, m["kv_send_idx"])], axis=1)
  # 2. Exchanges.
  q_recv = _move(q_send, m, "q", cap.q_recv, axis, spec, exchange)
  kv_recv = _move(kv_send, m, "kv", cap.kv_recv, axis, spec, exchange)
  # 3. A query row belongs to one task: placed once (own rows first, received rows written in
  # place). A key/value row may feed several tasks: one fused gather from both sources.
  q_attn = place_unique(q_TxHxD, q_recv, m["q_attn_idx"])
  k_attn = gather_two(k_TxKxD, kv_recv[:, :kh], m["kv_attn_idx"])
  v_attn = gather_two(v_TxKxD, kv_recv[:, kh:], m["kv_attn_idx"])
  return q_attn, k_attn, v_attn


def return_to_owners(x_NqxF, m: Mapping[str, jax.Array], spec: PlanSpec, axis, fill=0,
                     exchange: ExchangeOptions = ExchangeOptions()):
  """Step 5 on one device: attention-output rows back to the devices their queries came from.

  Args:
    x_NqxF: per attention query row values ``[Nq, ...]`` (O ``[Nq, H, D]`` or LSE ``[Nq, H]``).
    m, spec, axis, exchange: as in ``send_to_servers``.
    fill: value of local rows no task produced (padding).

  Returns:
    ``[T, ...]``: this device's rows in its natural order.
  """
  # Every attention row goes back once, to one owner row (unique).
  send = take_rows(x_NqxF, m["o_send_idx"], unique=True)
  recv = _move(send, m, "q", spec.capacity.q_send, axis, spec, exchange, reverse=True)
  return place_unique(x_NqxF, recv, m["o_local_idx"], fill)
