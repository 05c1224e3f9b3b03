"""distca's caps and exchange as the simulator prices them as built (``dataplane.exchange``):
the caps training sizes from sampled plans, the collective 'auto' resolves to, and each
exchange's wire bytes and seconds ('remote', 'dense', 'ragged', 'two_level'), the relay
buffers of the two-level exchange, and the data plane's passes over the capped buffers.
``sim.step`` prices a step with them."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from distca_jax import plan as plan_lib
from distca_jax.dataplane import exchange as exchange_lib
from distca_jax.dataplane.exchange import dense_wire_rows, round_wire_rows
from distca_jax.plan import two_level as two_level_lib
from distca_jax.sim import costs

# distca's exchange implementations the simulator prices (``dataplane.exchange``); 'auto' is
# resolved per layout (``resolve_collective``).
SIM_COLLECTIVES = ("auto", "remote", "dense", "ragged", "two_level")
# Exchanges of one layer, forward + backward ('keep'): Q, O, dO, dQ move query rows; K/V and
# dK/dV key/value rows (the backward of an exchange is the exchange of its cotangents reversed).
Q_EXCHANGES, KV_EXCHANGES = 4, 2


def distca_caps(plans: Sequence[plan_lib.Plan], tokens: int, headroom: float
                ) -> plan_lib.Capacity:
  """The caps training would size from these plans: their envelope x ``headroom`` rounded to
  row multiples (``plan.caps_with_headroom``); tasks as the envelope (at least 64, the
  default)."""
  env = plan_lib.Capacity.envelope([plan_lib.required_capacity(p) for p in plans])
  rows = plan_lib.caps_with_headroom(dataclasses.asdict(env), tokens, headroom)
  return plan_lib.Capacity(**rows, tasks=max(64, env.tasks))


def resolve_collective(collective: str, layout: Layout, cal: costs.Calibration) -> str:
  """The exchange a job of ``layout`` runs. 'auto' as ``dataplane.resolve_collective`` resolves
  it on GPUs, with the launcher's one process per node: a job within one node
  (``cal.gpus_per_node``) is one process, so 'remote'; a job across nodes is several processes,
  so 'dense' ('remote' needs the peer addresses XLA shares only between the devices of one
  process; no multi-process device-initiated exchange is built)."""
  if collective not in SIM_COLLECTIVES:
    raise ValueError(f"collective={collective!r} is not priced by the simulator; use one of "
                     f"{SIM_COLLECTIVES}")
  if collective != "auto":
    return collective
  return exchange_lib.resolve_collective("auto", platform="gpu",
                                         one_process=layout.gpus <= cal.gpus_per_node)


def relay_rows(plans: Sequence[plan_lib.Plan], per_host: int, headroom: float
               ) -> tuple[int, int]:
  """(query, key/value) relay rows of the two-level exchange (its leg A receive buffers) sized
  as training sizes them: the envelope of ``plans`` x ``headroom``, at least 1."""
  need = np.array([two_level_lib.required_relay(p, per_host) for p in plans]).max(0)
  return tuple(max(1, int(math.ceil(int(n) * headroom))) for n in need)


def two_level_rows(plan: plan_lib.Plan, caps: plan_lib.Capacity, relay: tuple[int, int],
                   per_host: int, buckets: int) -> dict[str, float]:
  """Rows per device each leg of one exchange puts on the wire ('q_leg_a', 'q_leg_b',
  'kv_leg_a', 'kv_leg_b'): leg A's ``H - 1`` rounds over ``min(send cap, relay)``, leg B's
  ``L - 1`` rounds over ``min(send + relay, recv cap)`` (``dataplane.round_wire_rows``)."""
  rows = {}
  for part, pair, send, recv, rel in (
      ("q", plan.pair_q_rows, caps.q_send, caps.q_recv, relay[0]),
      ("kv", plan.pair_kv_rows, caps.kv_send, caps.kv_recv, relay[1])):
    a, b = two_level_lib.leg_lengths(np.asarray(pair, np.int64), per_host)
    rows[f"{part}_leg_a"] = float(round_wire_rows(a, min(send, rel), buckets, per_host, "hosts"))
    rows[f"{part}_leg_b"] = float(round_wire_rows(b, min(send + rel, recv), buckets, per_host,
                                                  "local"))
  return rows


def two_level_wire_bytes(plan: plan_lib.Plan, caps: plan_lib.Capacity, relay: tuple[int, int],
                         dims, per_host: int, buckets: int, memory_mode: str = "keep"
                         ) -> tuple[float, float]:
  """(leg A, leg B) bytes per device one layer's exchanges put on the wire as the two-level
  exchange runs them (``two_level_rows``; heads of every tensor-parallel GPU)."""
  nq, nkv = exchange_counts(memory_mode)
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  rows = two_level_rows(plan, caps, relay, per_host, buckets)
  return tuple(nq * rows[f"q_leg_{x}"] * bq + nkv * rows[f"kv_leg_{x}"] * dims.kv_row_bytes
               for x in ("a", "b"))


def two_level_seconds(plan: plan_lib.Plan, caps: plan_lib.Capacity, relay: tuple[int, int],
                      dims, cal: costs.Calibration, tp: int, per_host: int, buckets: int,
                      memory_mode: str = "keep") -> tuple[np.ndarray, dict[str, float]]:
  """[S] seconds of one layer's exchanges (``exchange_counts``) as the two-level exchange runs
  them, and the rows per device each leg puts on the wire (one exchange of each part).

  Leg A (between hosts): ``H - 1`` rounds of one ``ppermute`` each, a round's payload the bucket
  (``dense_block_rows`` of ``min(send cap, relay)``) that holds its largest group
  (``round_wire_rows``), at ``Calibration.inter_node_bw``; leg B (inside a host): ``L - 1``
  rounds the same way over ``min(send + relay, recv cap)``, at ``Calibration.intra_node_bw``.
  Every round costs ``Calibration.a2a_latency_s`` (the fitted in-node collective latency; a
  ppermute between nodes is not measured). The legs run one after the other; every device waits
  for the busiest (each round is a collective). Heads are split over ``tp``."""
  s = plan.num_servers
  hosts = s // per_host
  nq, nkv = exchange_counts(memory_mode)
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  sec = 0.0
  rows = two_level_rows(plan, caps, relay, per_host, buckets)
  for part, n, width in (("q", nq, bq), ("kv", nkv, dims.kv_row_bytes)):
    ra, rb = rows[f"{part}_leg_a"], rows[f"{part}_leg_b"]
    legs = ((hosts - 1) * cal.a2a_latency_s + ra * width / tp / cal.inter_node_bw
            + (per_host - 1) * cal.a2a_latency_s + rb * width / tp / cal.intra_node_bw)
    sec += n * legs
  return np.full(s, sec), rows


def exchange_counts(memory_mode: str) -> tuple[int, int]:
  """(query, key/value) exchanges of one layer, forward + backward: 'resend' rebuilds the
  servers' inputs in the backward by running the forward's Q and K/V exchanges once more."""
  if memory_mode not in ("keep", "resend"):
    raise ValueError(f"memory_mode={memory_mode!r} must be resolved to 'keep' or 'resend' "
                     "(resolve_distca)")
  extra = int(memory_mode == "resend")
  return Q_EXCHANGES + extra, KV_EXCHANGES + extra


def exchange_wire_bytes(plan: plan_lib.Plan, caps: plan_lib.Capacity, dims, collective: str,
                        buckets: int, memory_mode: str = "keep") -> np.ndarray:
  """[S] bytes per device one layer's exchanges (forward + backward, ``exchange_counts``) put on
  the wire.

  'dense': per exchange ``S`` blocks of the bucket the data plane picks for the plan's largest
  (sender, server) group (``dataplane.dense_wire_rows``, full block ``min(send cap, recv
  cap)``), the same on every device; 'remote' and 'ragged': the device's useful rows, the most
  it sends or receives (each row crosses the wire once)."""
  nq, nkv = exchange_counts(memory_mode)
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  bkv = dims.kv_row_bytes
  if collective == "dense":
    q = dense_wire_rows(plan.pair_q_rows, min(caps.q_send, caps.q_recv), buckets)
    kv = dense_wire_rows(plan.pair_kv_rows, min(caps.kv_send, caps.kv_recv), buckets)
    return np.full(plan.num_servers, float(nq * q * bq + nkv * kv * bkv))
  if collective not in ("remote", "ragged"):
    raise ValueError(f"collective={collective!r} must be resolved to 'remote', 'dense' or "
                     "'ragged' (resolve_collective)")
  q = np.maximum(plan.pair_q_rows.sum(0), plan.pair_q_rows.sum(1))
  kv = np.maximum(plan.pair_kv_rows.sum(0), plan.pair_kv_rows.sum(1))
  return (nq * q * bq + nkv * kv * bkv).astype(np.float64)


def ragged_group_bytes(plan: plan_lib.Plan, dims, memory_mode: str = "keep") -> float:
  """Bytes of the largest (sender, server) group of each of one layer's exchanges, summed:
  what XLA's ragged all-to-all's time follows (``Calibration.ragged_bw``). The return and the
  backward run the groups transposed: the same largest group."""
  nq, nkv = exchange_counts(memory_mode)
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  return float(nq * plan.pair_q_rows.max(initial=0) * bq
               + nkv * plan.pair_kv_rows.max(initial=0) * dims.kv_row_bytes)


def dispatch_buffer_bytes(caps: plan_lib.Capacity, dims, memory_mode: str = "keep",
                          relay: tuple[int, int] | None = None) -> float:
  """Bytes of the send and receive buffers one layer's exchanges (``exchange_counts``) fill and
  drain on a device: the capped totals, whatever the plan uses (static shapes), which the data
  plane's gathers, scatters and selects run over (``Calibration.dispatch_bw``). ``relay``: the
  two-level exchange's relay rows, whose buffer and leg B's send buffer (send + relay rows) the
  relay gather passes over too."""
  nq, nkv = exchange_counts(memory_mode)
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  rq, rkv = relay or (0, 0)
  return float(nq * (caps.q_send + caps.q_recv + (caps.q_send + 2 * rq if relay else 0)) * bq
               + nkv * (caps.kv_send + caps.kv_recv + (caps.kv_send + 2 * rkv if relay else 0))
               * dims.kv_row_bytes)


def exchange_seconds(wire_S: np.ndarray, servers: int, cal: costs.Calibration, collective: str,
                     tp: int, memory_mode: str = "keep") -> np.ndarray:
  """[S] seconds of one layer's exchanges: every device waits for the busiest (an all-to-all,
  and the remote exchange's exit barrier, complete together); heads are split over ``tp``;
  across nodes the measured in-node bandwidth is scaled by ``inter_node_bw / intra_node_bw``.
  'ragged': ``wire_S`` holds the largest groups' bytes (``ragged_group_bytes``), not the wire."""
  if servers <= 1:
    return np.zeros_like(wire_S)
  latency, bw = {"remote": (cal.remote_latency_s, cal.remote_bw),
                 "dense": (cal.dense_latency_s, cal.dense_bw),
                 "ragged": (cal.ragged_latency_s, cal.ragged_bw)}[collective]
  bw *= min(1.0, cal.bandwidth(servers * tp) / cal.intra_node_bw)
  calls = sum(exchange_counts(memory_mode))
  sec = calls * latency + float(np.max(wire_S)) / tp / bw
  return np.full_like(wire_S, sec)
