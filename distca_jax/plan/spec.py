"""A batch's plan as the device step reads it: static shapes (``PlanSpec``), the host planner
(``host_plan``: schedule, routing tables, packing).

The contract with the data plane: a batch's plan enters the step as one int32 array
``[S * R, W]`` (every ``PlanMetadata`` device field of each device,
flattened and split over that device's rows); every shape comes from the ``PlanSpec`` (servers,
tokens per row, rows per device, capacity), so one compiled step serves every batch.

Rows per device. The trainer gives each data rank ``R`` rows of ``T`` tokens and never lets a
document cross a row. Planning is per device: a device's rows are concatenated into ``R * T``
local tokens (its documents packed first, padding last, so the balancer's "per-rank list" form
applies), and the host rewrites every local row index of the metadata through that packing
permutation, so the device works on its rows in their natural ``[R, T]`` order. With
``attention.nano_batches = n`` the model calls core attention once per nano-batch (``R / n``
rows of every rank; ``nano_batch_rows``), each planned and balanced on its own.

Exchange. Every buffer of the exchange holds a capped total of rows per device (send and
receive, ``Capacity``), packed from its first row; the per-peer offsets and counts travel in the
metadata's routes (``PlanMetadata.q_routes`` / ``kv_routes``), checked by ``PlanSpec.pack``.
``distca_jax.dataplane.exchange`` moves the rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from distca_jax.checks import check_int
from distca_jax.plan.scheduling import schedule
from distca_jax.plan.capacity import Capacity, required_capacity, row_multiple
from distca_jax.plan.metadata import Plan, PlanMetadata, plan_to_metadata, recv_order
from distca_jax.plan.options import PlanOptions
from distca_jax.plan.two_level import TwoLevel, relay_overflow, required_relay, with_relay


@dataclasses.dataclass(frozen=True)
class PlanSpec:
  """Everything static about a packed plan (hashable: a jit static argument).

  Attributes:
    num_servers: ``S``, the size of the data axis.
    tokens_per_row: ``T``.
    rows_per_device: ``R``; a device holds ``R * T`` tokens.
    capacity: the bounded capacity that sizes every buffer.
    two_level: None (one-level exchange), or the two-level exchange's servers per host and
      relay buffers (``plan.two_level``): the metadata then carries both legs' tables and
      every receive buffer is ordered by (sender local index, sender host).
  """
  num_servers: int
  tokens_per_row: int
  rows_per_device: int
  capacity: Capacity
  two_level: TwoLevel | None = None

  def __post_init__(self):
    for name in ("num_servers", "tokens_per_row", "rows_per_device"):
      check_int(name, getattr(self, name), 1)
    if not self.capacity.bounded:
      raise ValueError(f"PlanSpec needs a bounded capacity (every field set); got {self.capacity}")
    if self.two_level is not None:
      if not isinstance(self.two_level, TwoLevel):
        raise TypeError(f"two_level={self.two_level!r} must be a plan.two_level.TwoLevel or None")
      self.two_level.hosts(self.num_servers)

  @property
  def servers_per_host(self) -> int:
    """``L`` of the two-level exchange, 0 with one level."""
    return 0 if self.two_level is None else self.two_level.servers_per_host

  @property
  def tokens_per_device(self) -> int:
    return self.tokens_per_row * self.rows_per_device

  @property
  def fields(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, per-device shape) of every packed field (``PlanMetadata.DEVICE_FIELDS``), in
    packing order."""
    s, c, tl = self.num_servers, self.capacity, self.two_level
    one = (("q_send_idx", (c.q_send,)), ("kv_send_idx", (c.kv_send,)),
           ("q_attn_idx", (c.q_tokens,)), ("kv_attn_idx", (c.kv_tokens,)),
           ("cu_seqlens_q", (c.tasks + 1,)), ("cu_seqlens_k", (c.tasks + 1,)),
           ("o_send_idx", (c.q_recv,)), ("o_local_idx", (self.tokens_per_device,)),
           ("q_routes", (6, s)), ("kv_routes", (6, s)))
    if tl is None:
      return one
    return one + (("q_a_routes", (6, s)), ("q_b_routes", (6, s)),
                  ("q_b_idx", (c.q_send + tl.q_relay,)), ("kv_a_routes", (6, s)),
                  ("kv_b_routes", (6, s)), ("kv_b_idx", (c.kv_send + tl.kv_relay,)))

  @property
  def device_width(self) -> int:
    """int32 entries of one device's metadata."""
    return sum(math.prod(shape) for _, shape in self.fields)

  @property
  def width(self) -> int:
    """``W``: entries per row of the packed plan array ``[S * R, W]``."""
    return -(-self.device_width // self.rows_per_device)

  def pack(self, meta: PlanMetadata) -> np.ndarray:
    """``PlanMetadata`` (all ranks) -> int32 ``[S * R, W]``: each device's fields, flattened.

    Also checks that every exchange buffer holds exactly its routed rows, packed from row 0
    (``_check_groups_packed``), and that query and output rows are routed once.
    """
    s, r = self.num_servers, self.rows_per_device
    if meta.num_servers != s or meta.tokens_per_rank != self.tokens_per_device:
      raise ValueError(f"metadata for {meta.num_servers} servers x {meta.tokens_per_rank} tokens "
                       f"does not match {self}")
    if meta.servers_per_host != self.servers_per_host or (
        self.two_level is not None and meta.q_b_idx is None):
      raise ValueError(f"metadata for servers_per_host={meta.servers_per_host} does not match "
                       f"{self.two_level} (build it with plan.host_plan, or plan_to_metadata(..., "
                       "servers_per_host=L) then plan.two_level.with_relay)")
    _check_groups_packed(meta)
    _check_unique_rows(meta)
    arrays = meta.device_arrays()
    flat = np.concatenate([arrays[name].reshape(s, -1) for name, _ in self.fields], axis=1)
    if flat.shape[1] != self.device_width:
      raise ValueError(f"metadata shapes do not match the capacity: {flat.shape[1]=} entries per "
                       f"device, expected {self.device_width} from {self.capacity}")
    out = np.zeros((s, r * self.width), np.int32)
    out[:, :flat.shape[1]] = flat
    return out.reshape(s * r, self.width)

  def unpack_local(self, plan_RxW):
    """One device's block ``[R, W]`` of the packed plan (a jax or NumPy array) -> its metadata
    fields, reshaped views of it (the data plane calls this inside the step)."""
    flat = plan_RxW.reshape(-1)
    out, off = {}, 0
    for name, shape in self.fields:
      n = math.prod(shape)
      out[name] = flat[off:off + n].reshape(shape)
      off += n
    return out


def _check_unique_rows(meta: PlanMetadata) -> None:
  """Raises unless the query/output routing reads every source row at most once per device.

  The backward of those gathers is a gather through the inverse map (``_take(unique=True)``),
  which is the sum of the contributions only if no source row is read twice.
  """
  t, c = meta.tokens_per_rank, meta.capacity
  for name, bound in (("q_send_idx", t), ("q_attn_idx", t + c.q_recv), ("o_send_idx", c.q_tokens),
                      ("o_local_idx", c.q_tokens + c.q_send)):
    for p, rows in enumerate(getattr(meta, name)):
      rows = rows.reshape(-1)
      rows = rows[rows < bound]
      if rows.size and np.bincount(rows).max() > 1:
        dup = int(np.flatnonzero(np.bincount(rows) > 1)[0])
        raise ValueError(f"metadata {name}[{p}] reads source row {dup} more than once; query and "
                         "output rows must be routed once (build metadata with "
                         "plan.plan_to_metadata)")


def _check_groups_packed(meta: PlanMetadata) -> None:
  """Raises unless every exchange buffer holds exactly its routed rows, packed from row 0.

  A send buffer's used entries (``q_send_idx`` / ``kv_send_idx`` not the sentinel ``T``) must be
  its first ``sum(send_len)`` rows, and the groups of the routes must tile them in server order
  (``send_off`` the exclusive prefix sum of ``send_len``); likewise the return send buffer
  (``o_send_idx``, sentinel ``Nq``) against the query receive groups, in the senders'
  ``recv_order``. The exchange moves only routed rows: a used entry outside them would be lost.
  """
  if meta.ranks.size != meta.num_servers:
    raise ValueError(f"packing needs every device's metadata; got ranks {meta.ranks.tolist()} of "
                     f"{meta.num_servers} (call plan_to_metadata without ranks=)")
  t, nq = meta.tokens_per_rank, meta.capacity.q_tokens
  order = recv_order(meta.num_servers, meta.servers_per_host)
  for name, sentinel, rts, off_row, len_row in (
      ("q_send_idx", t, meta.q_routes, 0, 1), ("kv_send_idx", t, meta.kv_routes, 0, 1),
      ("o_send_idx", nq, meta.q_routes, 2, 3)):
    used = getattr(meta, name) != sentinel  # [S, C]
    off, ln = rts[:, off_row].astype(np.int64), rts[:, len_row].astype(np.int64)  # [S, S]
    want = np.arange(used.shape[1])[None, :] < ln.sum(1)[:, None]
    by = order if off_row == 2 else np.arange(ln.shape[1])
    want_off = np.empty_like(ln)
    want_off[:, by] = np.cumsum(ln[:, by], axis=1) - ln[:, by]
    bad = (used != want).any(1) | (off != want_off).any(1)
    if bad.any():
      p = int(np.argmax(bad))
      raise ValueError(f"metadata {name}[{p}] does not hold exactly its {int(ln[p].sum())} "
                       f"routed rows packed from row 0 (used entries at "
                       f"{np.flatnonzero(used[p]).tolist()[:8]}..., offsets "
                       f"{off[p].tolist()[:8]}...); build metadata with plan.plan_to_metadata")


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostPlan:
  """A batch's plan, its routing tables and the packed array the device step reads.

  Attributes:
    plan: ``Plan`` over devices (each device's rows concatenated, documents first).
    meta: ``PlanMetadata`` with local rows in the devices' natural ``[R, T]`` order.
    packed: int32 ``[S * R, W]`` (``PlanSpec.pack``), rows sharded like the batch.
    spec: the static shapes.
  """
  plan: Plan
  meta: PlanMetadata
  packed: np.ndarray
  spec: PlanSpec


def device_layout(doc_lens, spec: PlanSpec):
  """Scheduler layout over devices and the per-device packing permutation ``[S, R * T]``.

  Returns (layout for ``schedule``, perm) where ``perm[p, i]`` is the natural local row
  (``row * T + token``) of packed local row ``i`` (documents of row 0, row 1, ..., then padding).
  """
  s, r, t = spec.num_servers, spec.rows_per_device, spec.tokens_per_row
  perm = np.tile(np.arange(r * t, dtype=np.int64), (s, 1))
  is_seq = [isinstance(v, (list, tuple, np.ndarray)) for v in doc_lens]
  nested = bool(doc_lens) and all(is_seq)
  if not nested or r == 1:
    # Flat (documents may span ranks) or one list per rank: the balancer's own forms.
    if not nested and r != 1:
      raise ValueError(f"a flat doc_lens list needs rows_per_device=1 (got {r}); pass one list "
                       "per row")
    return doc_lens, perm
  if len(doc_lens) != s * r:
    raise ValueError(f"doc_lens has {len(doc_lens)} rows but {s} devices x {r} rows per device "
                     f"= {s * r}; check rows_per_rank")
  per_device = []
  for p in range(s):
    rows = [list(map(int, doc_lens[p * r + j])) for j in range(r)]
    used = [sum(x) for x in rows]
    for j, u in enumerate(used):
      if u > t:
        raise ValueError(f"row {p * r + j} holds {u} tokens > tokens_per_row={t}")
    real = np.concatenate([j * t + np.arange(u) for j, u in enumerate(used)])
    pad = np.concatenate([j * t + np.arange(u, t) for j, u in enumerate(used)])
    perm[p] = np.concatenate([real, pad])
    per_device.append([x for row in rows for x in row])
  return per_device, perm


def _remap_local_rows(meta: PlanMetadata, perm: np.ndarray) -> PlanMetadata:
  """Rewrites every local-row reference of ``meta`` from packed to natural row order."""
  td = meta.tokens_per_rank
  if np.array_equal(perm, np.broadcast_to(np.arange(td), perm.shape)):
    return meta

  def local(idx: np.ndarray) -> np.ndarray:
    # Values < td are own rows (sentinels and received-buffer rows are >= td).
    out = idx.copy()
    for p in range(idx.shape[0]):
      m = out[p] < td
      out[p][m] = perm[p][out[p][m]]
    return out

  o_local = np.empty_like(meta.o_local_idx)
  for p in range(perm.shape[0]):
    o_local[p, perm[p]] = meta.o_local_idx[p]
  return dataclasses.replace(
      meta, q_send_idx=local(meta.q_send_idx), kv_send_idx=local(meta.kv_send_idx),
      q_attn_idx=local(meta.q_attn_idx), kv_attn_idx=local(meta.kv_attn_idx),
      o_local_idx=o_local)


def host_plan(doc_lens, spec: PlanSpec, options: PlanOptions = PlanOptions(min_shard=None)
              ) -> HostPlan:
  """Plans a batch on the host: schedule, routing tables, packing (NumPy only).

  Args:
    doc_lens: a flat list packed across ranks (``rows_per_device`` must be 1; documents may span
      ranks), or one list per row (``S * R`` lists; with ``R = 1`` one list per rank).
    spec: the static shapes (servers, tokens per row, rows per device, capacity).
    options: the planner's options; ``min_shard=None`` (the default here) takes
      ``auto_min_shard`` of ``spec.tokens_per_row``.

  Returns:
    ``HostPlan``. Raises ``ValueError`` naming the cap to raise when the layout overflows it.
  """
  layout, perm = device_layout(doc_lens, spec)
  options = options.for_rows(spec.tokens_per_row)
  try:
    plan = schedule(layout, spec.num_servers, tokens_per_rank=spec.tokens_per_device,
                    capacity=spec.capacity, options=options)
  except ValueError as e:
    raise ValueError(f"distca: cannot plan this batch within {spec.capacity}: {e} (set the cap in "
                     "config.attention.distca or the capacity= option)") from e
  over = "" if spec.two_level is None else relay_overflow(plan, spec.two_level)
  if over:  # the balancer knows no relay caps: this batch moves nothing, reported as capped
    plan = schedule(layout, spec.num_servers, tokens_per_rank=spec.tokens_per_device,
                    capacity=spec.capacity, options=dataclasses.replace(options, max_moves=0))
    plan = dataclasses.replace(plan, degraded=True, degraded_reason=(
        f"{over}: the batch moves nothing (relay capacity; raise attention.distca.q_relay / "
        "kv_relay)"))
  return pack_plan(plan, perm, spec)


def pack_plan(plan: Plan, perm: np.ndarray, spec: PlanSpec) -> HostPlan:
  """``plan`` (a ``schedule`` of a layout whose packing permutation is ``perm``,
  ``device_layout``) in the buffers of ``spec``: its routing tables (both legs' with the
  two-level exchange), local rows in natural order, packed. Raises if it does not fit."""
  meta = plan_to_metadata(plan, spec.capacity, servers_per_host=spec.servers_per_host)
  if spec.two_level is not None:
    meta = with_relay(meta, spec.two_level)
  meta = _remap_local_rows(meta, perm)
  return HostPlan(plan=plan, meta=meta, packed=spec.pack(meta), spec=spec)




def nano_batch_rows(num_devices: int, rows_per_device: int, nano_batches: int,
                     i: int) -> list[int]:
  """Batch rows of nano-batch ``i``: rows ``[i R/n, (i+1) R/n)`` of every device's block."""
  rn = rows_per_device // nano_batches
  return [p * rows_per_device + i * rn + j for p in range(num_devices) for j in range(rn)]


def fit_host_plan(doc_lens, num_servers: int, tokens_per_rank: int,
                  capacity: Capacity | Mapping[str, int | None] | None = None,
                  options: PlanOptions = PlanOptions(min_shard=None)) -> HostPlan:
  """``host_plan`` for one row per rank, with caps left unset sized by the plan itself.

  A bounded ``capacity`` plans as ``host_plan`` does. Otherwise the batch is planned once
  without the missing caps, which then take the plan's own needs rounded up to a row multiple
  (``capacity.row_multiple``): a new layout may then change shapes (and recompile).
  ``options.min_shard=None`` (the default here) takes ``auto_min_shard(tokens_per_rank)``.
  """
  cap = capacity if isinstance(capacity, Capacity) else Capacity(**dict(capacity or {}))
  options = options.for_rows(tokens_per_rank)
  if cap.bounded:
    spec = PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_rank, rows_per_device=1,
                    capacity=cap)
    return host_plan(doc_lens, spec, options)
  # One row per rank: local rows keep their order, so no remapping is needed.
  free = schedule(doc_lens, num_servers, tokens_per_rank=tokens_per_rank, capacity=cap,
                  options=options)
  cap = cap.replace_none(Capacity.envelope([required_capacity(free)],
                                           multiple=row_multiple(tokens_per_rank)))
  spec = PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_rank, rows_per_device=1,
                  capacity=cap)
  meta = plan_to_metadata(free, cap)
  return HostPlan(plan=free, meta=meta, packed=spec.pack(meta), spec=spec)


def suggest_capacity(doc_lens_samples: Sequence[Any], num_servers: int, tokens_per_rank: int, *,
                     quantile: float = 1.0, multiple: int = 128,
                     options: PlanOptions = PlanOptions()) -> Capacity:
  """Caps covering ``quantile`` of sampled layouts, planned without caps (``Capacity.envelope``).

  Args:
    doc_lens_samples: layouts, each as ``schedule`` takes them.
    num_servers: ``S``.
    tokens_per_rank: tokens per device (rows per device x tokens per row).
    quantile: per-field quantile over the samples (1.0 = the maximum).
    multiple: row fields are rounded up to a multiple of this.
    options: passed to ``schedule`` (``min_shard`` a number).
  """
  return suggest_caps(doc_lens_samples, num_servers, tokens_per_rank, quantile=quantile,
                      multiple=multiple, options=options)[0]


def suggest_caps(doc_lens_samples: Sequence[Any], num_servers: int, tokens_per_rank: int, *,
                 quantile: float = 1.0, multiple: int = 128, options: PlanOptions = PlanOptions(),
                 servers_per_host: int = 0) -> tuple[Capacity, tuple[int, int] | None]:
  """``suggest_capacity``'s caps and, with ``servers_per_host`` L, the two-level exchange's
  (query, key/value) relay rows over the same plans (``plan.two_level.required_relay``; the
  same quantile, rounded up to ``multiple``), else None."""
  plans = [schedule(d, num_servers, tokens_per_rank=tokens_per_rank, options=options)
           for d in doc_lens_samples]
  cap = Capacity.envelope([required_capacity(p) for p in plans], quantile=quantile,
                          multiple=multiple)
  if not servers_per_host:
    return cap, None
  need = np.asarray([required_relay(p, servers_per_host) for p in plans], np.float64)
  relay = np.quantile(need, quantile, axis=0, method="higher")
  return cap, tuple(max(multiple, int(math.ceil(r / multiple) * multiple)) for r in relay)
