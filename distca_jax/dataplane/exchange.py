"""The exchange: a device's rows out to their attention servers, and outputs back to owners.

Inside one ``jax.shard_map`` over the data axis (every data rank is an in-place attention
server), ``send_to_servers`` runs steps 1-3 of the data plane and ``return_to_owners`` step 5:

  1. sender gather: local Q/K/V rows into padded per-server slots ``[S, slot, heads, dim]``;
  2. one dense collective carrying Q, K and V together (dense collectives over padded slots beat
     ``ragged_all_to_all`` on GPUs, and the ragged one does not run on CPU; docs/design.md);
  3. server gather into the attention buffers: query rows by ``copies.place_unique`` (the own
     rows' gather runs while the rows are on the wire), key/value rows by ``copies.gather_two``;
  5. O (and the LSE on request) into return slots, back by the same collective, placed into the
     owners' rows like step 3's query rows; padding rows come back as zeros.

Collectives (``collective=``): 'all_to_all' is one tiled ``lax.all_to_all`` over every server's
slot, the sender's own slot included (a local copy nobody reads); 'ppermute' is ``S - 1``
``lax.ppermute`` rounds (round k: device i sends to i + k) over the peers' slots only.

Bucketed exchange. The slots must hold the worst batch, so a typical batch fills a fraction of
them. The plan carries the fullest slot's rows (``plan.exchange_rows``), and a ``lax.switch``
runs the branch of the smallest bucket holding them (``plan.exchange_bucket_rows``): steps 1-2
gather and send only the first rows of every slot, and step 3 reads the received rows where
they landed (``copies.recv_rows``). With ``n >= 2`` buckets there is also an empty bucket: a plan
that moves nothing skips the send gathers and the collective. Step 5 does the same with the Q
bucket. Every branch has static shapes (one compiled step for all batches), and every device
takes the same branch, so the collectives match. ``exchange_buckets = 1`` is the plain
full-slot exchange (no switch). One joint bucket sizes the Q and the K/V parts of a slot by the
same fraction. (Buckets chosen per part would move fewer bytes,
results/archive/5a62d97/split_exchange_bytes.md, but need two collectives, and no timing shows
them faster: the exchange has one layout.)

Signal-only (``signal_only=True``; benchmarks only, results are WRONG by design): every
collective carries one row per slot, and each device uses its own send buffer in place of the
rows it would have received. Gathers, kernel and return keep their shapes and data dependences,
so timing the step against the real one measures what the wire costs (the paper's
"signal-only" ablation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from distca_jax import ops
from distca_jax.checks import check_int
from distca_jax.dataplane.copies import gather_two, place_unique, take_rows
from distca_jax.plan.spec import (DEFAULT_EXCHANGE_BUCKETS, PlanSpec, exchange_bucket_rows,
                                  return_bucket_rows)

# How rows cross the wire (module docstring, "Collectives"). Training takes 'auto' (each wins at
# some size: results/collective_bench.md); the others force one path (tests, benchmarks).
COLLECTIVES = ("auto", "all_to_all", "ppermute")


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
  """How rows cross the wire (hashable: part of the step's static arguments).

  Attributes:
    buckets: slot fractions the exchange chooses from per batch (module docstring); 1 = always
      the full slots.
    collective: 'auto' (``resolve_collective``), 'all_to_all' or 'ppermute'.
    signal_only: benchmarks only: every collective carries one row per slot, shapes unchanged,
      results WRONG by design (module docstring).
  """
  buckets: int = DEFAULT_EXCHANGE_BUCKETS
  collective: str = "auto"
  signal_only: bool = False

  def __post_init__(self):
    try:
      check_int("exchange_buckets", self.buckets, 1)
    except ValueError as e:
      raise ValueError(f"distca {e} (1 = full slots always; default "
                       f"{DEFAULT_EXCHANGE_BUCKETS})") from e
    if self.collective not in COLLECTIVES:
      raise ValueError(f"distca collective={self.collective!r}; choose one of {COLLECTIVES}")
    if not isinstance(self.signal_only, (bool, np.bool_)):
      raise ValueError(f"distca signal_only={self.signal_only!r} must be True or False (True only "
                       "for timing benchmarks: it gives wrong results)")
    object.__setattr__(self, "buckets", int(self.buckets))
    object.__setattr__(self, "signal_only", bool(self.signal_only))


def resolve_collective(collective: str, num_servers: int) -> str:
  """'auto' -> 'ppermute' for 2 servers (one round carrying only the peer's slot was faster on 2
  H200s: results/archive/039a22a/dispatch_v3_summary.md), else 'all_to_all' (one collective
  instead of S - 1 rounds)."""
  if collective == "auto":
    return "ppermute" if num_servers == 2 else "all_to_all"
  if num_servers == 1:  # no peer: nothing crosses the wire either way; one all_to_all over the
    return "all_to_all"  # one (own) slot keeps the shapes non-empty
  return collective


def _bucket_index(rows_K: jax.Array, bucket_rows: Sequence[Sequence[int]]) -> jax.Array:
  """Device twin of ``choose_bucket``: the first bucket whose sizes cover ``rows_K`` (int32)."""
  sizes_NxK = jnp.asarray(bucket_rows, jnp.int32)
  # Bucket sizes ascend in every part, so the buckets too small in some part come first.
  short = jnp.sum(jnp.any(sizes_NxK < rows_K[None, :], axis=1), dtype=jnp.int32)
  return jnp.minimum(short, len(bucket_rows) - 1)


def _bucketed(rows_K: jax.Array, bucket_rows: Sequence[Sequence[int]], branch, *operands):
  """``branch(*sizes)(*operands)`` for the bucket ``rows_K`` picks; no switch for one bucket."""
  return ops.switch_or_call(_bucket_index(rows_K, bucket_rows), [branch(*b) for b in bucket_rows],
                            *operands)


def _send_slots(idx_SxC: jax.Array, axis: str, collective: str) -> jax.Array:
  """The slots a device sends, in the collective's block order.

  'all_to_all': every server's slot (block p goes to server p). 'ppermute': the S - 1 peers'
  slots, block k - 1 going to server (me + k) % S (round k of ``_move_blocks``).
  """
  if collective == "all_to_all":
    return idx_SxC
  s = idx_SxC.shape[0]
  me = lax.axis_index(axis)
  return jnp.take(idx_SxC, (me + jnp.arange(1, s)) % s, axis=0)


def _recv_block_of_sender(s: int, axis: str, collective: str) -> jax.Array:
  """int32 [S]: the received block that holds sender p's rows (the number of blocks: none)."""
  p = jnp.arange(s, dtype=jnp.int32)
  if collective == "all_to_all":
    return p
  me = lax.axis_index(axis).astype(jnp.int32)
  return jnp.where(p == me, s - 1, (me - p) % s - 1)


def _move_blocks(send_NxF: jax.Array, axis: str, collective: str, signal_only: bool,
                 row_elems: int) -> jax.Array:
  """Blocks of ``send`` to their servers (``_send_slots`` order); returns the received blocks.

  'all_to_all': ``recv[p]`` = what device p put in its block for this device, one tiled
  all-to-all. 'ppermute': round k (1 <= k < S) sends block k - 1 to device (me + k) % S, so
  ``recv[k - 1]`` came from device (me - k) % S (``_recv_block_of_sender``).

  ``signal_only`` (timing ablation, wrong results): only the first ``row_elems`` entries of each
  block cross the wire; the rest of a received block is this device's own send block, which
  keeps the sender gather live (XLA would otherwise drop the rows nobody reads).
  """
  def move(x):
    if collective == "all_to_all":
      return lax.all_to_all(x, axis, 0, 0, tiled=True)
    s = x.shape[0] + 1
    return jnp.stack([lax.ppermute(x[k - 1], axis, [(i, (i + k) % s) for i in range(s)])
                      for k in range(1, s)])

  if not signal_only:
    return move(send_NxF)
  n = min(row_elems, send_NxF.shape[1])
  return send_NxF.at[:, :n].set(move(send_NxF[:, :n]))


def _exchange_parts(parts, sizes: Sequence[int], *, num_servers: int, axis: str,
                    collective: str, signal_only: bool):
  """One bucket branch's steps 1-3 for ``parts`` moved by ONE collective.

  ``parts``: ``(arrays, send_idx [S, slot], attn_idx, slot, unique)`` per part (the query part:
  ``(q,)``; the key/value part: ``(k, v)``, which share their routing), ``sizes[i]`` the rows of
  every slot part ``i`` sends in this branch. A part of 0 rows moves nothing (its tasks read only
  own rows); when no part moves, no collective runs. Returns each part's attention buffers.
  """
  if any(sizes):
    # 1-2. Sender gather of the first b rows of every slot of each moving part, side by side in
    # one block per peer, and one collective.
    sends, row_elems = [], None
    for (xs, send_idx, _, _, unique), b in zip(parts, sizes):
      if b == 0:
        continue
      idx = _send_slots(send_idx[:, :b], axis, collective)
      nb = idx.shape[0]  # blocks on the wire: S (all_to_all) or S - 1 (ppermute)
      for x in xs:
        row_el = math.prod(x.shape[1:])
        row_elems = row_elems or row_el
        sends.append(take_rows(x, idx.reshape(-1), unique=unique).reshape(nb, b * row_el))
    recv = _move_blocks(jnp.concatenate(sends, axis=1), axis, collective, signal_only, row_elems)
    blk = _recv_block_of_sender(num_servers, axis, collective)
  out, off = [], 0
  for (xs, _, attn_idx, slot, unique), b in zip(parts, sizes):
    if b == 0:  # every task's rows of this part are the server's own
      out.append(tuple(take_rows(x, attn_idx, unique=unique) for x in xs))
      continue
    placed = []
    for x in xs:
      w = b * math.prod(x.shape[1:])
      r = recv[:, off:off + w].reshape((recv.shape[0], b) + x.shape[1:])
      off += w
      # 3. A query row belongs to one task: sent once, placed once (own rows first, received
      # rows written in place). A key/value row may feed several tasks: one fused gather.
      placed.append((place_unique if unique else gather_two)(x, r, attn_idx, slot, blk))
    out.append(tuple(placed))
  return out


def send_to_servers(q_TxHxD, k_TxKxD, v_TxKxD, m: Mapping[str, jax.Array], spec: PlanSpec,
                    axis: str, exchange: ExchangeOptions = ExchangeOptions()):
  """Steps 1-3 on one device (inside ``shard_map``): its rows out, its attention inputs in.

  Args:
    q_TxHxD, k_TxKxD, v_TxKxD: this device's rows (``T = R * tokens_per_row``, local heads).
    m: this device's metadata (``PlanSpec.unpack_local``).
    spec: the static shapes.
    axis: the servers' mesh axis.
    exchange: buckets, collective, signal-only (``ExchangeOptions``). One bucket switch and one
      collective carry Q, K and V together, the bucket sized by the fuller of the two parts.

  Returns:
    (q_attn [Nq, H, D], k_attn [Nkv, K, D], v_attn [Nkv, K, D]); rows no task uses are zero.
  """
  s, cap = spec.num_servers, spec.capacity
  wire = dict(num_servers=s, axis=axis, collective=resolve_collective(exchange.collective, s),
              signal_only=exchange.signal_only)

  def joint(bq: int, bkv: int):
    def run(q, k, v, q_send_idx, kv_send_idx, q_attn_idx, kv_attn_idx):
      (q_attn,), (k_attn, v_attn) = _exchange_parts(
          [((q,), q_send_idx, q_attn_idx, cap.q_slot, True),
           ((k, v), kv_send_idx, kv_attn_idx, cap.kv_slot, False)], (bq, bkv), **wire)
      return q_attn, k_attn, v_attn
    return run

  return _bucketed(
      m["exchange_rows"], exchange_bucket_rows(cap, exchange.buckets), joint,
      q_TxHxD, k_TxKxD, v_TxKxD, m["q_send_idx"], m["kv_send_idx"], m["q_attn_idx"],
      m["kv_attn_idx"])


def return_to_owners(x_NqxF, m: Mapping[str, jax.Array], spec: PlanSpec, axis: str, fill=0,
                     exchange: ExchangeOptions = ExchangeOptions()):
  """Step 5 on one device: attention-output rows back to the devices their queries came from.

  Args:
    x_NqxF: per attention query row values ``[Nq, ...]`` (O ``[Nq, H, D]`` or LSE ``[Nq, H]``).
    m, spec, axis, exchange: as in ``send_to_servers`` (the return uses the query-slot sizes
      of the buckets).
    fill: value of local rows no task produced (padding).

  Returns:
    ``[T, ...]``: this device's rows in its natural order.
  """
  s, cq = spec.num_servers, spec.capacity.q_slot
  collective = resolve_collective(exchange.collective, s)
  signal_only = exchange.signal_only
  feat = x_NqxF.shape[1:]
  row_el = math.prod(feat)

  def back(bq: int):
    def run(x_NqxF, o_send_idx_SxCq, o_local_idx):
      if bq == 0:  # nothing moved: every query row was attended on its owner
        return take_rows(x_NqxF, o_local_idx, fill, unique=True)
      # Every attention row goes back once, to one owner row (unique).
      o_idx = _send_slots(o_send_idx_SxCq[:, :bq], axis, collective)
      nb = o_idx.shape[0]
      send = take_rows(x_NqxF, o_idx.reshape(-1), unique=True).reshape(nb, bq * row_el)
      recv = _move_blocks(send, axis, collective, signal_only, row_el)
      return place_unique(x_NqxF, recv.reshape((nb, bq) + feat), o_local_idx, cq,
                           _recv_block_of_sender(s, axis, collective), fill)

    return run

  return _bucketed(m["exchange_rows"][:1], return_bucket_rows(spec.capacity, exchange.buckets),
                   back, x_NqxF, m["o_send_idx"], m["o_local_idx"])
