"""Capacities: the fixed buffer sizes (rows) a plan must fit, and their defaults.

The compiled step has fixed buffers, so a plan respects per-device caps; ``None`` means
unbounded (for analysis; metadata then takes the plan's own tight sizes, which changes shapes from
batch to batch and recompiles). Caps bound totals per device, never per (sender, server) pair, so
no buffer grows with the number of servers ``S``. Per device, with ``bq = q_heads * head_dim *
bytes`` and ``bkv = kv_heads * head_dim * bytes`` (one of K or V):

=============  =========================================  ======================================
field          what it bounds                             buffers it sizes (bytes per device)
=============  =========================================  ======================================
``q_send``     query rows a device sends to all other     Q send: ``q_send bq``; O return recv:
               servers together (``Cqs``)                 ``q_send bq``
``kv_send``    key/value rows a device sends to all       K,V send: ``2 kv_send bkv``
               other servers together (``Ckvs``)
``q_recv``     query rows a server receives from all      Q recv: ``q_recv bq``; O return send:
               other devices together (``Cqr``)           ``q_recv bq``
``kv_recv``    key/value rows a server receives from      K,V recv: ``2 kv_recv bkv``
               all other devices together (``Ckvr``)
``q_tokens``   query rows in a server's attention input   Q and O: ``2 q_tokens bq`` (+ LSE)
               (its own rows plus received; ``Nq``)
``kv_tokens``  key/value rows in a server's attention     K and V: ``2 kv_tokens bkv``
               input, counting duplicates (``Nkv``)
``tasks``      tasks (varlen segments) per server         ``cu_seqlens``: ``2 (tasks + 1)`` int32
=============  =========================================  ======================================

``Capacity.memory_bytes`` evaluates this. The self pair never goes through the exchange (a
server reads its own rows directly), so the send/recv caps bound cross-rank traffic only; a
flat layout whose documents span whole ranks needs ``kv_send`` and ``kv_recv`` of up to
``tokens_per_rank`` already before balancing (the server computing the last rows of a document
needs every earlier row); a layout that does not fit the caps even before balancing raises
``ValueError`` naming the needed value. To choose caps: plan a few hundred sampled batches
without caps, take ``required_capacity`` of each, and set every cap to a high quantile of those
(``Capacity.envelope``), rounded up to a multiple of 128 (``spec.suggest_capacity``); tighter
caps cost imbalance (the plan reports it), looser ones cost memory.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np

from distca_jax.plan import cost

CAP_FIELDS = ("q_send", "kv_send", "q_recv", "kv_recv", "q_tokens", "kv_tokens", "tasks")
# The row caps of the exchange (totals per device, cross-rank rows only).
EXCHANGE_FIELDS = ("q_send", "kv_send", "q_recv", "kv_recv")

# Default tasks per row when the config leaves ``tasks`` at 0: sampled plans of both workloads
# needed at most 43 (experiments/scheduler_table.py); a task costs only table entries.
_TASKS_PER_ROW = 64


def row_multiple(tokens_per_device: int) -> int:
  """Row caps are rounded up to a multiple of this: 128, or 16 below 1024 tokens."""
  return 128 if tokens_per_device >= 1024 else 16


@dataclasses.dataclass(frozen=True)
class Capacity:
  """Fixed buffer sizes a plan must fit (rows, not bytes); ``None`` = unbounded.

  Attributes:
    q_send: query rows one device sends to all other servers together (``Cqs``).
    kv_send: key/value rows one device sends to all other servers together (``Ckvs``; a row
      sent to two servers counts twice).
    q_recv: query rows one server receives from all other devices together (``Cqr``).
    kv_recv: key/value rows one server receives from all other devices together (``Ckvr``).
    q_tokens: query rows in one server's attention input, own rows included (``Nq``).
    kv_tokens: key/value rows in one server's attention input, per-task duplicates included
      (``Nkv``).
    tasks: tasks per server (``Nt``).
  """
  q_send: int | None = None
  kv_send: int | None = None
  q_recv: int | None = None
  kv_recv: int | None = None
  q_tokens: int | None = None
  kv_tokens: int | None = None
  tasks: int | None = None

  def __post_init__(self):
    for name in CAP_FIELDS:
      v = getattr(self, name)
      if v is None:
        continue
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"Capacity.{name}={v!r} must be a positive int or None (unbounded)")
      object.__setattr__(self, name, int(v))

  @property
  def bounded(self) -> bool:
    """True when every field is set (metadata shapes are then fixed by the config)."""
    return all(getattr(self, f) is not None for f in CAP_FIELDS)

  def replace_none(self, other: "Capacity") -> "Capacity":
    """This capacity with its ``None`` fields taken from ``other``."""
    return Capacity(**{f: getattr(self, f) if getattr(self, f) is not None else getattr(other, f)
                       for f in CAP_FIELDS})

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
    for f in CAP_FIELDS:
      vals = [getattr(c, f) for c in caps]
      if any(v is None for v in vals):
        raise ValueError(f"Capacity.envelope: field {f} is None in some input; pass bounded caps")
      q = float(np.quantile(np.asarray(vals, dtype=np.float64), quantile, method="higher"))
      step = 8 if f == "tasks" else multiple
      out[f] = max(step, int(math.ceil(q / step) * step))
    return Capacity(**out)

  def memory_bytes(self, num_servers: int, *, q_heads: int = cost.DEFAULT_Q_HEADS,
                   kv_heads: int = cost.DEFAULT_KV_HEADS, head_dim: int = cost.DEFAULT_HEAD_DIM,
                   dtype_bytes: int = cost.DEFAULT_DTYPE_BYTES) -> dict[str, int]:
    """Per-device bytes of the buffers these caps size (one layer, forward activations).

    Keys: ``q_exchange`` (Q send + recv), ``o_exchange`` (O send + recv), ``kv_exchange`` (K and V
    send + recv), ``attention_q_o`` (Q input and O output), ``attention_kv`` (K and V inputs),
    ``lse`` (float32 softmax statistics), ``metadata`` (int32 index arrays and the exchange's
    per-peer routes) and ``total``. Only ``metadata``'s routes depend on ``num_servers``.
    """
    if not self.bounded:
      raise ValueError(f"memory_bytes needs every cap set; got {self}")
    s = int(num_servers)
    bq = q_heads * head_dim * dtype_bytes
    bkv = kv_heads * head_dim * dtype_bytes
    out = {
        "q_exchange": (self.q_send + self.q_recv) * bq,
        "o_exchange": (self.q_send + self.q_recv) * bq,
        "kv_exchange": 2 * (self.kv_send + self.kv_recv) * bkv,
        "attention_q_o": 2 * self.q_tokens * bq,
        "attention_kv": 2 * self.kv_tokens * bkv,
        "lse": self.q_tokens * q_heads * 4,
        "metadata": 4 * (self.q_send + self.kv_send + self.q_recv + self.q_tokens
                         + self.kv_tokens + 2 * (self.tasks + 1) + self.tasks + 12 * s),
    }
    out["total"] = sum(out.values())
    return out


def required_capacity(plan) -> Capacity:
  """The tightest capacity ``plan`` (a ``metadata.Plan``) fits (every field at least 1)."""
  q_rows, kv_rows = plan.pair_q_rows, plan.pair_kv_rows
  t = plan.tasks
  srv = t[:, 3]
  s = plan.num_servers
  qlen = np.bincount(srv, weights=(t[:, 2] - t[:, 1]).astype(np.float64), minlength=s)
  kvlen = np.bincount(srv, weights=(t[:, 2] - cost.k_starts(t[:, 1], plan.window)).astype(
      np.float64), minlength=s)
  ntask = np.bincount(srv, minlength=s)
  most = lambda x: max(1, int(x.max(initial=0)))
  return Capacity(q_send=most(q_rows.sum(1)), kv_send=most(kv_rows.sum(1)),
                  q_recv=most(q_rows.sum(0)), kv_recv=most(kv_rows.sum(0)),
                  q_tokens=most(qlen), kv_tokens=most(kvlen), tasks=most(ntask))


def default_capacity(tokens_per_device: int, rows_per_device: int = 1) -> Capacity:
  """The capacity used for config fields left at 0 (rows; ``Td`` = tokens per device).

  ``q_send = q_recv = Td``, ``kv_send = 3 Td``, ``kv_recv = 2 Td``, ``q_tokens = 3 Td/2``,
  ``kv_tokens = 3 Td``, ``tasks = 64 * rows``; row fields are rounded up to a multiple of 128
  (16 below 1024 tokens). A device never sends more query rows than it owns, so ``q_send = Td``
  never binds; the others cover the sampled plans of both workloads at 2-64 servers
  (experiments/scheduler_table.py). The planner never exceeds a cap: a tighter cap only costs
  balance (``Plan.degraded``), a looser one memory (``Capacity.memory_bytes``). Derive caps for a
  run with ``backends.distca.suggest_config_capacity``.
  """
  td = int(tokens_per_device)
  mult = row_multiple(td)

  def up(x: float) -> int:
    return max(mult, int(math.ceil(x / mult) * mult))

  return Capacity(q_send=up(td), kv_send=up(3 * td), q_recv=up(td), kv_recv=up(2 * td),
                  q_tokens=up(1.5 * td), kv_tokens=up(3 * td),
                  tasks=_TASKS_PER_ROW * int(rows_per_device))


def resolve_capacity(capacity: Capacity | Mapping[str, int | None] | None, tokens_per_device: int,
                     rows_per_device: int = 1) -> Capacity:
  """A bounded capacity: fields that are None or 0 take ``default_capacity``'s values."""
  if capacity is None:
    capacity = {}
  if isinstance(capacity, Capacity):
    capacity = dataclasses.asdict(capacity)
  unknown = set(capacity) - set(CAP_FIELDS)
  if unknown:
    raise ValueError(f"unknown capacity fields {sorted(unknown)}; valid: {CAP_FIELDS}")
  given = {f: capacity.get(f) for f in CAP_FIELDS if capacity.get(f)}
  return Capacity(**given).replace_none(default_capacity(tokens_per_device, rows_per_device))


def caps_with_headroom(envelope: Mapping[str, int], rows: int, headroom: float,
                       fields: Sequence[str] = EXCHANGE_FIELDS + ("q_tokens", "kv_tokens")
                       ) -> dict[str, int]:
  """Row caps ``fields`` from sampled batches' ``envelope``: x ``headroom``, rounded up to
  whole row multiples of ``rows`` (a device's rows in one call), and never below what the
  no-move layout needs (exchange buffers of one multiple; attention buffers of ``rows``)."""
  mult = row_multiple(rows)
  floor = dict({f: mult for f in EXCHANGE_FIELDS}, q_tokens=rows, kv_tokens=rows)
  return {f: -(-max(floor[f], math.ceil(envelope[f] * headroom)) // mult) * mult
          for f in fields}
