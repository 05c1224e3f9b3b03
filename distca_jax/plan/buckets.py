"""Capacity buckets: a few compiled exchange capacities, the smallest a batch's plan fits chosen
per call by the host.

The step's exchange buffers are sized for the worst of the sampled plans (``Capacity``), and
every pass of the data plane goes over all of them, so a call that moves a few rows pays for the
worst case. With ``n`` buckets the step holds ``n`` variants of the exchange (a ``lax.switch``
on the device around the sends and one around the return, ``dataplane.body._bucket_moves``),
each with its own send and receive buffers: bucket ``i`` of ``n`` caps every exchange field at
``(i + 1) / n`` of the full cap (rounded up to a row multiple), the last bucket is the full
capacity. The host plans
every call under the full capacity as before, then packs it for the smallest bucket its plan fits
(``required_capacity``; with the two-level exchange also its relay rows) and writes the bucket's
index into the plan array's last column (``BucketSpecs.pack``).

Only the exchange buffers (``EXCHANGE_FIELDS``) follow the bucket; the attention buffers
(``q_tokens``, ``kv_tokens``, ``tasks``) are the full capacity's in every bucket, so the kernel
runs once, outside the switches, on inputs of one shape. The kernel's inputs and outputs are
what a differentiated step keeps for the backward, and ``lax.switch`` would keep the residuals
of each branch side by side where their shapes differ; outside the switch they are kept once,
and the step's memory stays that of the largest bucket (docs/design.md, Sec. 5, "Capacity
buckets").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from distca_jax.checks import check_int
from distca_jax.plan.capacity import (CAP_FIELDS, EXCHANGE_FIELDS, Capacity, required_capacity,
                                      row_multiple)
from distca_jax.plan.spec import HostPlan, PlanSpec, device_layout, pack_plan
from distca_jax.plan.two_level import TwoLevel, required_relay, safe_relay

# Compiled exchange capacities per step (``attention.distca.buckets``): on sampled Pretrain and
# ProLong 128K plans at 2 and 4 devices, 4 evenly spaced buckets cut the buffer bytes per pass
# to 0.56-0.82 of one capacity's, 8 to 0.53-0.77 (results/buckets.md); each bucket compiles
# only its exchange and gathers (the kernel runs once, outside the switch).
DEFAULT_BUCKETS = 4


def bucket_capacities(full: Capacity, buckets: int,
                      tokens_per_device: int = 1024) -> tuple[Capacity, ...]:
  """The buckets' capacities, ascending and distinct, the last ``full``: bucket ``i`` of ``n``
  caps each exchange field at ``ceil((i + 1) / n * full)`` rounded up to
  ``row_multiple(tokens_per_device)`` (at most the full cap); other fields are ``full``'s."""
  n = check_int("attention.distca.buckets", buckets, 1)
  if not full.bounded:
    raise ValueError(f"bucket_capacities needs a bounded capacity; got {full}")
  mult = row_multiple(int(tokens_per_device))
  up = lambda rows: max(mult, -(-rows // mult) * mult)  # rounded up to a row multiple
  out = []
  for i in range(n):
    cap = dataclasses.replace(full, **{
        f: min(getattr(full, f), up(-(-(i + 1) * getattr(full, f) // n))) for f in EXCHANGE_FIELDS})
    if not out or cap != out[-1]:
      out.append(cap)
  return tuple(out)


def _bucket_two_level(full: TwoLevel | None, cap: Capacity, num_servers: int):
  """A bucket's two-level shape: the full relay rows, at most the safe bound of its caps."""
  if full is None:
    return None
  l = full.servers_per_host
  return TwoLevel(l, min(full.q_relay, safe_relay(cap.q_send, cap.q_recv, num_servers, l)),
                  min(full.kv_relay, safe_relay(cap.kv_send, cap.kv_recv, num_servers, l)))


@dataclasses.dataclass(frozen=True)
class BucketSpecs:
  """The static shapes of a bucketed plan array (hashable: a jit static argument).

  ``specs``: one ``PlanSpec`` per bucket, ascending, differing only in their exchange caps (and
  relay rows). The plan array is ``[S * R, W]`` with ``W = max(spec.width) + 1``: bucket ``k``'s
  packed plan in its first ``specs[k].width`` columns, ``k`` in the last column of every row
  (``pack``). ``num_servers``, ``tokens_per_row``, ``rows_per_device`` and ``width`` read as a
  ``PlanSpec``'s, so ``dataplane.dispatch_attention`` takes either.
  """
  specs: tuple[PlanSpec, ...]

  def __post_init__(self):
    specs = tuple(self.specs)
    object.__setattr__(self, "specs", specs)
    if not specs or not all(isinstance(s, PlanSpec) for s in specs):
      raise ValueError(f"BucketSpecs needs one or more PlanSpecs; got {self.specs!r}")
    last = specs[-1]
    for s in specs:
      same = (s.num_servers, s.tokens_per_row, s.rows_per_device, s.servers_per_host) == (
          last.num_servers, last.tokens_per_row, last.rows_per_device, last.servers_per_host)
      fixed = all(getattr(s.capacity, f) == getattr(last.capacity, f)
                  for f in CAP_FIELDS if f not in EXCHANGE_FIELDS)
      if not (same and fixed):
        raise ValueError(f"bucket {s} differs from the largest {last} in more than its exchange "
                         "caps (build buckets with plan.bucket_specs)")

  num_servers = property(lambda self: self.specs[-1].num_servers)
  tokens_per_row = property(lambda self: self.specs[-1].tokens_per_row)
  rows_per_device = property(lambda self: self.specs[-1].rows_per_device)
  tokens_per_device = property(lambda self: self.specs[-1].tokens_per_device)
  # The largest bucket's capacity: the planner's caps.
  capacity = property(lambda self: self.specs[-1].capacity)

  @property
  def width(self) -> int:
    return max(s.width for s in self.specs) + 1

  def choose(self, *plans) -> int:
    """Index of the smallest bucket that every plan of ``plans`` (``metadata.Plan``; those of
    one call) fits: every capacity field and, with the two-level exchange, the relay rows.
    Raises when none does (a plan made under the largest capacity always fits it)."""
    if not plans:
      raise ValueError("BucketSpecs.choose needs one or more plans")
    need = [required_capacity(p) for p in plans]
    relay = ([required_relay(p, self.specs[-1].servers_per_host) for p in plans]
             if self.specs[-1].two_level is not None else [])
    for k, s in enumerate(self.specs):
      fits = all(getattr(c, f) <= getattr(s.capacity, f) for c in need for f in CAP_FIELDS)
      tl = s.two_level
      if fits and all(q <= tl.q_relay and kv <= tl.kv_relay for q, kv in relay):
        return k
    raise ValueError(f"no bucket holds the plan's needs {need[0]}; the largest is "
                     f"{self.capacity} (plan the batch with the largest bucket's spec)")

  def in_bucket(self, doc_lens, hp: HostPlan, k: int) -> HostPlan:
    """``hp`` (planned with the largest bucket's spec, from ``doc_lens``) with its metadata
    and packed array rebuilt for bucket ``k`` (the same plan in smaller exchange buffers)."""
    spec = self.specs[k]
    if k == len(self.specs) - 1:
      return hp
    return pack_plan(hp.plan, device_layout(doc_lens, spec)[1], spec)

  def pack(self, packed: np.ndarray, k: int) -> np.ndarray:
    """Bucket ``k``'s packed plan ``[rows, specs[k].width]`` -> ``[rows, width]``: its columns
    first, zeros after, ``k`` in the last column."""
    check_int("bucket", k, 0)
    if k >= len(self.specs) or packed.shape[1] != self.specs[k].width:
      raise ValueError(f"bucket {k} of {len(self.specs)} with a packed plan of width "
                       f"{packed.shape[1]}: pack bucket k's plan (BucketSpecs.in_bucket) with "
                       "0 <= k < the number of buckets")
    out = np.zeros((packed.shape[0], self.width), np.int32)
    out[:, :packed.shape[1]] = packed
    out[:, -1] = k
    return out


def bucket_specs(spec: PlanSpec, buckets: int) -> BucketSpecs:
  """``spec`` (the full capacity) as ``buckets`` buckets (``bucket_capacities``; with the
  two-level exchange each bucket's relay rows at most the safe bound of its caps)."""
  caps = bucket_capacities(spec.capacity, buckets, spec.tokens_per_device)
  return BucketSpecs(tuple(
      dataclasses.replace(spec, capacity=c,
                          two_level=_bucket_two_level(spec.two_level, c, spec.num_servers))
      for c in caps[:-1]) + (spec,))
