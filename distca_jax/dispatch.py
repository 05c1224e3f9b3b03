"""CAD data plane: move each CA-task's rows to its attention server, attend, and bring O back.

The scheduler (``distca_jax.scheduler``, host, NumPy) decides which server computes which query
shard and writes the decision as fixed-shape int32 routing tables (``PlanMetadata``). This module
executes those tables on devices, inside one ``jax.shard_map`` over the mesh's ``data`` axis
(every data rank is an in-place attention server):

  1. sender gather: local Q/K/V rows into padded per-server slots ``[S, slot, heads, dim]``;
  2. one dense collective carrying Q, K and V together ("Collectives" below; DESIGN_NOTES Sec. 3:
     dense collectives over padded slots beat ``ragged_all_to_all`` 50-190x on H200s, and the
     ragged one does not run on CPU);
  3. server gather into the attention buffers. Query rows: the own rows are gathered without
     waiting for the collective (XLA runs that gather while the rows are on the wire), then the
     received rows are scattered into their places (``_place_unique``). Key/value rows: one
     fused gather from [own rows | received rows] (``_gather_two``; a KV row sent once per
     (sender, server) may be gathered several times, once per task that needs it);
  4. ONE fused ``ops.core_attention`` call over all of the server's tasks;
  5. O (and the LSE on request) gathered into return slots, sent back by the same collective,
     placed into the owners' rows like step 3's query rows; padding rows come back as zeros.

Collectives (``collective=``): 'all_to_all' is one tiled ``lax.all_to_all`` over every server's
slot, the sender's own slot included (a local copy nobody reads); 'ppermute' is ``S - 1``
``lax.ppermute`` rounds (round k: device i sends to i + k) over the peers' slots only. 'auto'
(default) takes ppermute with 2 servers, where it is one round that gathers and moves half the
buffer (on 2 H200s the Pretrain exchange took 1.9 ms instead of 2.1-2.6 ms,
results/dispatch_v3_summary.md), and all_to_all otherwise (ppermute rounds at S > 2 are not
measured).

Bucketed exchange. The slots must hold the worst batch, so a typical batch fills a fraction of
them. A slot's used rows are packed at its front (``scheduler.plan_to_metadata``; checked by
``PlanSpec.pack``), and the host stores in every device's plan the most rows any (sender, server
!= sender) slot uses, for Q and for K/V (``exchange_rows``, identical on every device). With
``exchange_buckets = n`` the device picks the smallest fraction ``f`` of ``1/n, 2/n, ..., 1``
whose slot prefix (``ceil(f * slot)`` rows, rounded up to a multiple of 8) holds them, and a
``lax.switch`` runs that bucket's branch: steps 1-2 gather and send only the first rows of every
slot, and step 3 reads the received rows where they landed (``_recv_rows`` maps the metadata's
full-slot indices onto the bucket's rows). With ``n >= 2`` there is also an empty bucket: a plan
that moves nothing skips the send gathers and the collective. Step 5 does the same with the Q
bucket (a server returns as many O rows to an owner as it received from it). Every branch has
static shapes (one compiled step for all batches), and every device takes the same branch, so
the collectives match. ``exchange_buckets = 1`` is the plain full-slot exchange (no switch).
``exchange_bytes`` reports the bytes a batch moves.

One joint bucket sizes the Q and the K/V parts of a slot by the same fraction, so a batch whose
query rows fill 50% of ``q_slot`` and key/value rows 90% of ``kv_slot`` sends 90% of both. With
``split_exchange=True`` the two parts each pick their own bucket (``part_bucket_rows``) and cross
in their own collective (two switches, ``n + 1`` branches each instead of ``(n + 1)^2`` for one
switch over every pair: each branch costs compile time). Planned under the trainer's startup
caps (Pretrain and ProLong, 64K-128K tokens per device, 2-8 servers) it moves 1.05-1.12x the
fullest slots' bytes instead of 1.15-1.28x: 8-12% fewer bytes
(results/split_exchange_bytes.md). The cost: two collectives instead of one, and the query
rows' own-row gather overlaps only the query collective. Its time is not measured on GPUs yet,
so the default stays joint.

Signal-only (``signal_only=True``; benchmarks only, results are WRONG by design): every
all-to-all of the data plane carries one row per slot, and each device uses its own send buffer
in place of the rows it would have received. Gathers, kernel and return scatter keep their
shapes and their data dependences, so timing the step against the real one measures what the
wire costs (the paper's "signal-only" ablation, DESIGN_NOTES Sec. 6).

Backward: steps 1-3 and 5 are gathers and all-to-alls, which JAX transposes (gather ->
scatter-add, so dK/dV of a KV row used by several tasks or servers are summed; all-to-all ->
all-to-all; the bucket switch -> a switch on the same bucket); the kernel has its own
``custom_vjp``. Memory modes:
  'keep'    default autodiff: the kernel's residuals (the server's received Q/K/V attention
            buffers, O and LSE) stay alive until the backward.
  'resend'  ``jax.checkpoint`` around the per-device body whose policy saves only the kernel's
            outputs (O, LSE): the attention buffers are rebuilt in the backward by re-running the
            gathers and the all-to-all (the owners re-send Q/K/V), and the kernel's forward is not
            rerun. With the plain-jnp 'reference' kernel there is no kernel primitive to save, so
            its forward is recomputed too (it is a test kernel).
The layer's remat policy (``ModelConfig.remat``) wraps all of this: 'full' reruns the whole
forward in the backward (exchange, kernel, return); 'save_attention' keeps the kernel's outputs
and inputs ('keep'; with 'resend' the inputs are still re-sent) and the returned O: the kernel's forward
and the return never rerun (nor the send, with 'keep').

No recompiles: every shape comes from the capacity (``scheduler.Capacity``), the server count,
the tokens per device and the bucket count; a batch's plan enters the step as one int32 array
``[rows, W]`` (the ``PlanMetadata`` fields and ``exchange_rows`` of each device, flattened and
split over that device's rows).

Rows per rank. The trainer gives each data rank ``R = rows_per_rank`` rows of ``T`` tokens and
never lets a document cross a row. Planning is per device: a device's rows are concatenated into
``R * T`` local tokens (its documents packed first, padding last, so the scheduler's "per-rank
list" form applies), and the host rewrites every local row index of the metadata through that
packing permutation, so the device works on its rows in their natural ``[R, T]`` order.
With ``attention.nano_batches = n`` (ping-pong) the model calls core attention once per
nano-batch (``R / n`` rows of every rank); each is planned and balanced on its own (see
``make_backend``).

Entry points:
  ``core_attention(q, k, v, doc_lens, mesh, **options)``: notebooks and tests (plans on the host,
    then runs the jitted device part).
  ``make_backend(**options)``: the ``distca`` core-attention backend of the trainer
    (``config.attention.backend = 'distca'``, options in ``config.attention.distca``).
  ``dispatch_attention(...)``: the device function, given a packed plan.
  ``host_plan(...)``: the host planner (schedule + metadata + packing).

Letters: S servers (= data ranks), R rows per device, T tokens per row (per rank in the notebook
entry), H query heads, K kv heads, D head dim, W packed plan width per row.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Mapping, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import ops
from distca_jax import scheduler as sc
from distca_jax.scheduler import Capacity

MEMORY_MODES = ("keep", "resend")
KERNELS = ops.BACKENDS
PLAN_KEY = "distca_plan"  # the one key of ``layout.extra`` this backend reads
CAP_FIELDS = ("q_slot", "kv_slot", "q_tokens", "kv_tokens", "tasks")

# Default tasks per row when config leaves ``tasks`` at 0. Measured with
# ``scheduler.required_capacity`` on both workloads (WorkloadSampler, context_length =
# tokens_per_row, tolerance 0.1, 8 ranks of 256 to 16K tokens and 2 of 64K): at most 43 tasks per
# rank; at tolerance 0.02 and 0 (2-16 ranks of 16K-128K, 10 batches each) at most 34, with q_slot
# <= 0.36 x tokens per rank. Tasks cost only int32 table entries and empty kernel blocks.
_TASKS_PER_ROW = 64

# Exchange buckets (module docstring): the default count, and bucket slot rows are rounded up to a
# multiple of this (whole sublanes/tiles; fewer distinct branches for small slots).
DEFAULT_EXCHANGE_BUCKETS = 8
_BUCKET_ROW_MULTIPLE = 8

# How rows cross the wire (module docstring, "Collectives"): one tiled all_to_all over every
# server's slot (the own slot is a local copy nobody reads), or S - 1 ppermute rounds over the
# peers' slots only; 'auto' = ppermute with 2 servers, all_to_all otherwise.
COLLECTIVES = ("auto", "all_to_all", "ppermute")
DEFAULT_COLLECTIVE = "auto"


def resolve_collective(collective: str, num_servers: int) -> str:
  """'auto' -> 'ppermute' for 2 servers (one round carrying only the peer's slot: the exchange
  took 1.9 ms instead of 2.1-2.6 ms on 2 H200s, results/dispatch_v3_summary.md), else
  'all_to_all' (one collective instead of S - 1 rounds; ppermute rounds are unmeasured there)."""
  if collective == "auto":
    return "ppermute" if num_servers == 2 else "all_to_all"
  if num_servers == 1:  # no peer: nothing crosses the wire either way; one all_to_all over the
    return "all_to_all"  # one (own) slot keeps the shapes non-empty
  return collective


_check_int = sc.check_int


def _row_multiple(tokens_per_device: int) -> int:
  """Row caps are rounded up to a multiple of this: 128, or 16 below 1024 tokens."""
  return 128 if tokens_per_device >= 1024 else 16


# ---------------------------------------------------------------------------------------------
# Static shapes of a packed plan.
# ---------------------------------------------------------------------------------------------
def default_capacity(tokens_per_device: int, rows_per_device: int = 1) -> Capacity:
  """The capacity used for config fields left at 0 (rows; ``Td`` = tokens per device).

  ``q_slot = Td/2``, ``kv_slot = Td``, ``q_tokens = 3 Td/2``, ``kv_tokens = 3 Td``,
  ``tasks = 64 * rows``; row fields are rounded up to a multiple of 128 (16 below 1024 tokens).
  Measured ``required_capacity`` over 20 batches of each workload, one list per rank (tolerance
  0.1; 8 ranks of 256 and 16K tokens, 2 of 64K; context_length = tokens per rank unless noted):
  q_slot <= 0.36 Td, kv_slot <= Td, q_tokens <= 1.46 Td, kv_tokens <= 3.1 Td (90th percentile
  <= 3.05 Td; 4.2 Td at 256 tokens with context_length 4096; 2.0 Td at 64K). Flat layouts whose
  documents span ranks reached 0.59 / 1.0 / 1.97 / 7.8 Td. The planner never exceeds a cap: a
  tighter cap only costs balance (``Plan.degraded``), a looser one memory
  (``Capacity.memory_bytes``) and, for the dense 'reference' kernel, time. Derive caps for a run
  with ``suggest_config_capacity``.
  """
  td = int(tokens_per_device)
  mult = _row_multiple(td)

  def up(x: float) -> int:
    return max(mult, int(math.ceil(x / mult) * mult))

  return Capacity(q_slot=up(td / 2), kv_slot=up(td), q_tokens=up(1.5 * td), kv_tokens=up(3 * td),
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


def suggest_capacity(doc_lens_samples: Sequence[Any], num_servers: int, tokens_per_rank: int, *,
                     quantile: float = 1.0, multiple: int = 128, **schedule_options) -> Capacity:
  """Caps covering ``quantile`` of sampled layouts, planned without caps (``Capacity.envelope``).

  Args:
    doc_lens_samples: layouts, each as ``scheduler.schedule`` takes them.
    num_servers: ``S``.
    tokens_per_rank: tokens per device (rows per device x tokens per row).
    quantile: per-field quantile over the samples (1.0 = the maximum).
    multiple: row fields are rounded up to a multiple of this.
    **schedule_options: passed to ``scheduler.schedule`` (tolerance, min_shard, ...).
  """
  reqs = [sc.required_capacity(sc.schedule(d, num_servers, tokens_per_rank=tokens_per_rank,
                                           **schedule_options)) for d in doc_lens_samples]
  return Capacity.envelope(reqs, quantile=quantile, multiple=multiple)


def startup_capacity(c, *, data: int | None = None) -> dict[str, int]:
  """Row caps for a run: those its config leaves at 0, from its own first batches.

  ``config.attention.distca.caps_from_batches = N > 0``: ``suggest_config_capacity`` over the
  run's first N batches, times ``caps_headroom``, rounded up to whole row multiples. Each cap is
  at least what the no-move layout needs: ``q_tokens`` and ``kv_tokens`` hold a device's rows
  of one call, so every batch can be planned. A later batch that would need more only moves
  less (``Plan.degraded``). ``tasks`` is never derived: a batch with more documents than task
  slots cannot be planned at all, so it keeps ``default_capacity``'s value. Returns the
  overrides (name -> value) for the caps left at 0, or ``{}`` when N is 0 or every row cap is
  set.
  """
  d = c.attention.distca
  n = _check_int("config.attention.distca.caps_from_batches", d.caps_from_batches, 0)
  headroom = float(d.caps_headroom)
  if not headroom >= 1.0:
    raise ValueError(f"config.attention.distca.caps_headroom={d.caps_headroom} must be >= 1 (a "
                     "margin over the sampled batches)")
  auto = [f for f in ("q_slot", "kv_slot", "q_tokens", "kv_tokens") if not d[f]]
  if n == 0 or not auto:
    return {}
  sugg = suggest_config_capacity(c, num_batches=n, data=data)
  rows = int(c.tokens_per_rank) * int(c.rows_per_rank) // int(c.attention.nano_batches)
  return caps_with_headroom(sugg, rows, headroom, auto)


def caps_with_headroom(envelope: Mapping[str, int], rows: int, headroom: float,
                       fields: Sequence[str] = ("q_slot", "kv_slot", "q_tokens",
                                                "kv_tokens")) -> dict[str, int]:
  """Row caps ``fields`` from sampled batches' ``envelope``: x ``headroom``, rounded up to
  whole row multiples of ``rows`` (a device's rows in one call), and never below what the
  no-move layout needs (a slot of one multiple; attention buffers of ``rows``)."""
  mult = _row_multiple(rows)
  floor = {"q_slot": mult, "kv_slot": mult, "q_tokens": rows, "kv_tokens": rows}
  return {f: -(-max(floor[f], math.ceil(envelope[f] * headroom)) // mult) * mult
          for f in fields}


def _nano_batch_rows(num_devices: int, rows_per_device: int, nano_batches: int,
                     i: int) -> list[int]:
  """Batch rows of nano-batch ``i``: rows ``[i R/n, (i+1) R/n)`` of every device's block."""
  rn = rows_per_device // nano_batches
  return [p * rows_per_device + i * rn + j for p in range(num_devices) for j in range(rn)]


def suggest_config_capacity(c, *, num_batches: int = 32, quantile: float = 1.0,
                            data: int | None = None) -> dict[str, int]:
  """Caps for a run config from its own data source: ``config.attention.distca`` overrides.

  Plans ``num_batches`` batches of ``c.data`` (the steps a run starts with) the way
  ``host_prepare`` will (per nano-batch), without caps, and returns ``suggest_capacity``'s
  envelope as a dict of ``q_slot, kv_slot, q_tokens, kv_tokens, tasks`` (e.g. print them as
  ``--config.attention.distca.<name>=<value>`` flags).

  Args:
    c: the run config (``config.base_config`` tree).
    num_batches: batches to sample.
    quantile: per-field quantile over the batches (1.0 = the maximum seen).
    data: the data-axis size; default ``c.mesh.data``, or (when -1) every visible device over
      ``c.mesh.tensor * c.mesh.pipe``.
  """
  from distca_jax.data import make_source  # pylint: disable=import-outside-toplevel
  if data is None:
    data = c.mesh.data if c.mesh.data > 0 else jax.device_count() // (c.mesh.tensor * c.mesh.pipe)
  r, t, n = int(c.rows_per_rank), int(c.tokens_per_rank), int(c.attention.nano_batches)
  rn = r // n
  src = make_source(c.data, rows=data * r, tokens_per_row=t, vocab_size=c.model.vocab_size,
                    seed=c.seed)
  spec = PlanSpec(num_servers=data, tokens_per_row=t, rows_per_device=rn,
                  capacity=default_capacity(rn * t, rn))
  layouts = []
  for step in range(num_batches):
    doclens = src.doclens(step)
    for i in range(n):
      rows = [doclens[x] for x in _nano_batch_rows(data, r, n, i)]
      layouts.append(_device_layout(rows, spec)[0])
  d = c.attention.distca
  cap = suggest_capacity(layouts, data, rn * t, quantile=quantile,
                         multiple=_row_multiple(rn * t), tolerance=d.tolerance,
                         min_shard=d.min_shard or auto_min_shard(t), q_heads=c.model.n_heads,
                         kv_heads=c.model.n_kv_heads, head_dim=c.model.head_dim)
  return dataclasses.asdict(cap)


@dataclasses.dataclass(frozen=True)
class PlanSpec:
  """Everything static about a packed plan (hashable: a jit static argument).

  Attributes:
    num_servers: ``S``, the size of the data axis.
    tokens_per_row: ``T``.
    rows_per_device: ``R``; a device holds ``R * T`` tokens.
    capacity: the bounded capacity that sizes every buffer.
  """
  num_servers: int
  tokens_per_row: int
  rows_per_device: int
  capacity: Capacity

  def __post_init__(self):
    for name in ("num_servers", "tokens_per_row", "rows_per_device"):
      _check_int(name, getattr(self, name), 1)
    if not self.capacity.bounded:
      raise ValueError(f"PlanSpec needs a bounded capacity (every field set); got {self.capacity}")

  @property
  def tokens_per_device(self) -> int:
    return self.tokens_per_row * self.rows_per_device

  @property
  def fields(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, per-device shape) of every packed field, in packing order.

    Every ``PlanMetadata.DEVICE_FIELDS`` entry, then ``exchange_rows`` (int32 [2], the same on
    every device, from ``exchange_rows(meta)``): the most query and key/value rows any (sender,
    server != sender) slot uses, which picks the exchange bucket on the device.
    """
    s, c = self.num_servers, self.capacity
    return (("q_send_idx", (s, c.q_slot)), ("kv_send_idx", (s, c.kv_slot)),
            ("q_attn_idx", (c.q_tokens,)), ("kv_attn_idx", (c.kv_tokens,)),
            ("cu_seqlens_q", (c.tasks + 1,)), ("cu_seqlens_k", (c.tasks + 1,)),
            ("o_send_idx", (s, c.q_slot)), ("o_local_idx", (self.tokens_per_device,)),
            ("exchange_rows", (2,)))

  @property
  def device_width(self) -> int:
    """int32 entries of one device's metadata."""
    return sum(math.prod(shape) for _, shape in self.fields)

  @property
  def width(self) -> int:
    """``W``: entries per row of the packed plan array ``[S * R, W]``."""
    return -(-self.device_width // self.rows_per_device)

  def pack(self, meta: sc.PlanMetadata) -> np.ndarray:
    """``PlanMetadata`` (all ranks) -> int32 ``[S * R, W]``: each device's fields, flattened.

    Also checks that every send slot's used rows are at its front (the bucketed exchange sends
    only a prefix of each slot) and appends ``exchange_rows``.
    """
    s, r = self.num_servers, self.rows_per_device
    if meta.num_servers != s or meta.tokens_per_rank != self.tokens_per_device:
      raise ValueError(f"metadata for {meta.num_servers} servers x {meta.tokens_per_rank} tokens "
                       f"does not match {self}")
    _check_slots_front_packed(meta)
    _check_unique_rows(meta)
    arrays = dict(meta.device_arrays(),
                  exchange_rows=np.broadcast_to(exchange_rows(meta), (s, 2)))
    flat = np.concatenate([arrays[name].reshape(s, -1) for name, _ in self.fields], axis=1)
    if flat.shape[1] != self.device_width:
      raise ValueError(f"metadata shapes do not match the capacity: {flat.shape[1]=} entries per "
                       f"device, expected {self.device_width} from {self.capacity}")
    out = np.zeros((s, r * self.width), np.int32)
    out[:, :flat.shape[1]] = flat
    return out.reshape(s * r, self.width)

  def unpack_local(self, plan_RxW: jax.Array) -> dict[str, jax.Array]:
    """One device's block ``[R, W]`` of the packed plan -> its metadata fields (jnp)."""
    flat = plan_RxW.reshape(-1)
    out, off = {}, 0
    for name, shape in self.fields:
      n = math.prod(shape)
      out[name] = flat[off:off + n].reshape(shape)
      off += n
    return out


def exchange_rows(meta: sc.PlanMetadata) -> np.ndarray:
  """int32 [2]: the most (query, key/value) rows any (sender, server != sender) slot holds."""
  off = ~np.eye(meta.num_servers, dtype=bool)
  return np.array([np.where(off, meta.q_send_len, 0).max(initial=0),
                   np.where(off, meta.kv_send_len, 0).max(initial=0)], np.int32)


def _check_unique_rows(meta: sc.PlanMetadata) -> None:
  """Raises unless the query/output routing reads every source row at most once per device.

  The backward of those gathers is a gather through the inverse map (``_take(unique=True)``),
  which is the sum of the contributions only if no source row is read twice.
  """
  t, s, cq, nq = meta.tokens_per_rank, meta.num_servers, meta.capacity.q_slot, meta.capacity.q_tokens
  for name, bound in (("q_send_idx", t), ("q_attn_idx", t + s * cq), ("o_send_idx", nq),
                      ("o_local_idx", nq + s * cq)):
    for p, rows in enumerate(getattr(meta, name)):
      rows = rows.reshape(-1)
      rows = rows[rows < bound]
      if rows.size and np.bincount(rows).max() > 1:
        dup = int(np.flatnonzero(np.bincount(rows) > 1)[0])
        raise ValueError(f"metadata {name}[{p}] reads source row {dup} more than once; query and "
                         "output rows must be routed once (build metadata with "
                         "scheduler.plan_to_metadata)")


def _check_slots_front_packed(meta: sc.PlanMetadata) -> None:
  """Raises unless every send slot holds exactly its plan rows, at its front.

  The bucketed exchange moves only a prefix of each slot; a used entry behind it would be lost.
  Slots: ``q_send_idx[p, d]`` and ``kv_send_idx[p, d]`` (sender p to server d, sentinel ``T``)
  hold ``q_send_len[p, d]`` / ``kv_send_len[p, d]`` rows; ``o_send_idx[d, p]`` (server d back to
  owner p, sentinel ``Nq``) holds ``q_send_len[p, d]``.
  """
  if meta.ranks.size != meta.num_servers:
    raise ValueError(f"packing needs every device's metadata; got ranks {meta.ranks.tolist()} of "
                     f"{meta.num_servers} (call plan_to_metadata without ranks=)")
  t, nq = meta.tokens_per_rank, meta.capacity.q_tokens
  for name, sentinel, want in (("q_send_idx", t, meta.q_send_len),
                               ("kv_send_idx", t, meta.kv_send_len),
                               ("o_send_idx", nq, meta.q_send_len.T)):
    used = getattr(meta, name) != sentinel
    front = np.arange(used.shape[-1]) < np.asarray(want)[..., None]
    if not np.array_equal(used, front):
      p, d = np.argwhere((used != front).any(-1))[0].tolist()
      raise ValueError(f"metadata slot {name}[{p}, {d}] does not hold exactly its "
                       f"{int(want[p, d])} plan rows at its front (used entries at "
                       f"{np.flatnonzero(used[p, d]).tolist()[:8]}...); build metadata with "
                       "scheduler.plan_to_metadata")


def _bucket_slot_rows(i: int, n: int, slot: int) -> int:
  """Rows of a slot bucket ``i`` of ``n`` keeps: ``ceil(i / n * slot)``, rounded up to a
  multiple of 8, at most the slot."""
  r = -(-i * slot // n)
  return min(slot, -(-r // _BUCKET_ROW_MULTIPLE) * _BUCKET_ROW_MULTIPLE)


def exchange_bucket_rows(capacity: Capacity, exchange_buckets: int) -> tuple[tuple[int, int], ...]:
  """(query rows, key/value rows) per slot of each joint exchange bucket, ascending.

  With ``exchange_buckets = n >= 2`` the first bucket is ``(0, 0)``: a plan that moves nothing
  (every task on its owner) skips the gathers and the all-to-all. Bucket ``i`` of ``n`` keeps
  ``ceil(i / n * slot)`` rows of a slot, rounded up to a multiple of 8 and at most the slot;
  buckets equal to the previous one are dropped, so the last is always the full slot.
  ``n = 1`` is the full slot alone (no switch). ``split_exchange`` uses ``part_bucket_rows``
  instead: one such list per part.
  """
  n = _check_int("exchange_buckets", exchange_buckets, 1)
  out = [(0, 0)] if n > 1 else []
  for i in range(1, n + 1):
    b = (_bucket_slot_rows(i, n, capacity.q_slot), _bucket_slot_rows(i, n, capacity.kv_slot))
    if not out or b != out[-1]:
      out.append(b)
  return tuple(out)


def part_bucket_rows(slot: int, exchange_buckets: int) -> tuple[tuple[int], ...]:
  """Rows per slot of each bucket of one part (queries or keys/values) alone, ascending.

  The same fractions as ``exchange_bucket_rows`` (0 first when ``n >= 2``; distinct sizes
  only). The return of O / LSE rows uses the query part's list; with ``split_exchange`` the
  query and key/value exchanges each use their own.
  """
  n = _check_int("exchange_buckets", exchange_buckets, 1)
  return tuple((r,) for r in sorted({_bucket_slot_rows(i, n, slot) for i in range(1, n + 1)}
                                    | ({0} if n > 1 else set())))


def _return_bucket_rows(capacity: Capacity, exchange_buckets: int) -> tuple[tuple[int], ...]:
  """Query rows per slot of each return (O / LSE) bucket: the exchange buckets' Q sizes."""
  return part_bucket_rows(capacity.q_slot, exchange_buckets)


def choose_bucket(rows: Sequence[int], bucket_rows: Sequence[Sequence[int]]) -> int:
  """Host twin of the device's choice: the first bucket holding ``rows`` in every part."""
  for i, b in enumerate(bucket_rows):
    if all(x <= y for x, y in zip(rows, b)):
      return i
  raise ValueError(f"{tuple(rows)=} exceed the largest bucket {tuple(bucket_rows[-1])}: the plan "
                   "does not fit its capacity")


# ---------------------------------------------------------------------------------------------
# Host: plan a batch.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostPlan:
  """A batch's plan, its routing tables and the packed array the device step reads.

  Attributes:
    plan: ``scheduler.Plan`` over devices (each device's rows concatenated, documents first).
    meta: ``scheduler.PlanMetadata`` with local rows in the devices' natural ``[R, T]`` order.
    packed: int32 ``[S * R, W]`` (``PlanSpec.pack``), rows sharded like the batch.
    spec: the static shapes.
  """
  plan: sc.Plan
  meta: sc.PlanMetadata
  packed: np.ndarray
  spec: PlanSpec


def auto_min_shard(tokens_per_row: int) -> int:
  """Default ``min_shard``: the scheduler's 512, or ``T / 16`` (at least 8) for short rows."""
  return int(min(sc.DEFAULT_MIN_SHARD, max(8, tokens_per_row // 16)))


def _device_layout(doc_lens, spec: PlanSpec):
  """Scheduler layout over devices and the per-device packing permutation ``[S, R * T]``.

  Returns (layout for ``schedule``, perm) where ``perm[p, i]`` is the natural local row
  (``row * T + token``) of packed local row ``i`` (documents of row 0, row 1, ..., then padding).
  """
  s, r, t = spec.num_servers, spec.rows_per_device, spec.tokens_per_row
  perm = np.tile(np.arange(r * t, dtype=np.int64), (s, 1))
  is_seq = [isinstance(v, (list, tuple, np.ndarray)) for v in doc_lens]
  nested = bool(doc_lens) and all(is_seq)
  if not nested or r == 1:
    # Flat (documents may span ranks) or one list per rank: the scheduler's own forms.
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


def _remap_local_rows(meta: sc.PlanMetadata, perm: np.ndarray) -> sc.PlanMetadata:
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


def host_plan(doc_lens, spec: PlanSpec, *, tolerance: float = sc.DEFAULT_TOLERANCE,
              min_shard: int | None = None, **schedule_options) -> HostPlan:
  """Plans a batch on the host: schedule, routing tables, packing (NumPy only).

  Args:
    doc_lens: a flat list packed across ranks (``rows_per_device`` must be 1; documents may span
      ranks), or one list per row (``S * R`` lists; with ``R = 1`` one list per rank).
    spec: the static shapes (servers, tokens per row, rows per device, capacity).
    tolerance: the balancing epsilon.
    min_shard: shortest query piece a split may create; None = ``auto_min_shard``.
    **schedule_options: further ``scheduler.schedule`` keywords (split, q_heads, kv_heads,
      head_dim, dtype_bytes, cost_model, max_moves).

  Returns:
    ``HostPlan``. Raises ``ValueError`` naming the cap to raise when the layout overflows it.
  """
  layout, perm = _device_layout(doc_lens, spec)
  if min_shard is None or min_shard == 0:
    min_shard = auto_min_shard(spec.tokens_per_row)
  try:
    plan = sc.schedule(layout, spec.num_servers, tokens_per_rank=spec.tokens_per_device,
                       tolerance=tolerance, capacity=spec.capacity, min_shard=min_shard,
                       **schedule_options)
  except ValueError as e:
    raise ValueError(f"distca: cannot plan this batch within {spec.capacity}: {e} (set the cap in "
                     "config.attention.distca or the capacity= option)") from e
  meta = _remap_local_rows(sc.plan_to_metadata(plan, spec.capacity), perm)
  return HostPlan(plan=plan, meta=meta, packed=spec.pack(meta), spec=spec)


# ---------------------------------------------------------------------------------------------
# Device: the per-device body and its shard_map.
# ---------------------------------------------------------------------------------------------
def _take(x: jax.Array, idx: jax.Array, fill=0, *, unique: bool = False) -> jax.Array:
  """Rows ``x[idx]``; an out-of-range index (the metadata's sentinel) gives ``fill``.

  The rows are copied as 32-bit words (``_row_words``): on an H200 XLA gathered 64K-token
  servers' query rows (32 x 128 bf16) at 2049 GB/s of memory traffic as ``[rows, heads, dim]``
  bf16 and 2585 GB/s as uint32 words, key/value rows (8 x 128) at 1384 and 1457 GB/s
  (results/row_copy_bench.md); building the attention buffers from real plans' routing was
  faster in 11 of 12 comparisons, by up to 2.2x (results/data_plane_v7_summary.md).

  The backward (``_take_rows``) avoids XLA's bf16 scatter-add, which ran at ~200-240 GB/s
  (results/gather_bench.md): with ``unique=True`` (no row of ``x`` is read twice: the query and
  output paths) it is a gather through the inverse map (3.3x faster); otherwise (key/value rows
  feed several tasks and servers) a scatter-add in float32 (1.5x faster, and the sum of a row's
  contributions is rounded once).
  """
  return _take_rows(x, idx, fill, unique)


def _row_words(x: jax.Array) -> jax.Array:
  """``[N, ...]`` -> ``[N, W]`` uint32 view of each row's bytes (rows of whole 4-byte words), or
  ``[N, F]`` flat rows when a row's bytes are not whole words (no copy: a bitcast)."""
  n, item = x.shape[0], jnp.dtype(x.dtype).itemsize
  flat = x.reshape(n, -1)
  if item > 4 or 4 % item or (flat.shape[1] * item) % 4:
    return flat
  return lax.bitcast_convert_type(flat.reshape(n, -1, 4 // item) if item < 4 else flat,
                                  jnp.uint32)


def _from_words(w: jax.Array, like: jax.Array, rows: int) -> jax.Array:
  """Inverse of ``_row_words``: ``rows`` rows shaped and typed like ``like``'s."""
  if w.dtype != like.dtype:
    w = lax.bitcast_convert_type(w, like.dtype)
  return w.reshape((rows,) + like.shape[1:])


def _word_fill(fill, dtype) -> Any:
  """The 32-bit word whose bytes are ``fill`` in ``dtype`` (every element of it)."""
  item = jnp.dtype(dtype).itemsize
  if item > 4 or 4 % item:
    return fill
  return int(np.full(4 // item, fill, dtype=jnp.dtype(dtype)).view(np.uint32)[0])


def _gather_words(x, idx, fill):
  """``jnp.take(x, idx, axis=0, mode='fill')`` on the ``_row_words`` view: rows as words."""
  w = _row_words(x)
  return jnp.take(w, idx, axis=0, mode="fill",
                  fill_value=_word_fill(fill, x.dtype) if w.dtype != x.dtype else fill)


def _take_words(x, idx, fill):
  """``jnp.take(x, idx, axis=0, mode='fill')`` computed on ``_row_words`` views."""
  return _from_words(_gather_words(x, idx, fill), x, idx.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _take_rows(x, idx, fill, unique):
  return _take_words(x, idx, fill)


def _take_rows_fwd(x, idx, fill, unique):
  # A zero-width stand-in carries x's row count and dtype to the backward.
  return _take_rows(x, idx, fill, unique), (idx, jnp.zeros((x.shape[0], 0), x.dtype))


def _take_rows_bwd(fill, unique, res, dy):
  idx, like = res
  n = like.shape[0]
  if unique:
    inv = jnp.full((n,), idx.shape[0], jnp.int32).at[idx].set(
        jnp.arange(idx.shape[0], dtype=jnp.int32), mode="drop")
    dx = _take_words(dy, inv, 0)
  else:
    flat = dy.reshape(dy.shape[0], -1).astype(jnp.float32)
    dx = jnp.zeros((n, flat.shape[1]), jnp.float32).at[idx].add(flat, mode="drop").reshape(
        (n,) + dy.shape[1:])
  return dx.astype(like.dtype), None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


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


def _gather_two(own_TxF: jax.Array, recv_NxBxF: jax.Array, idx: jax.Array, slot: int,
                block_of_sender: jax.Array, fill=0) -> jax.Array:
  """``concat(own, received padded to full slots)[idx]`` without building either buffer.

  ``idx`` addresses the metadata's source order: own rows ``[0, T)``, then sender ``p``'s slot
  ``[T + p * slot, T + (p + 1) * slot)``; anything at or past ``T + S * slot`` (the sentinel)
  gives ``fill``. ``recv_NxBxF`` holds, in block ``block_of_sender[p]`` (``_move_blocks``), the
  first ``B <= slot`` rows of sender p's slot (the bucket), and every used row of a slot is among
  them (slots are packed at the front). Each
  output row reads one source: one gather from each buffer, joined by a select, which XLA fuses
  into one pass (no zero-padded copy of the received rows, no concatenated copy of own rows).
  """
  t = own_TxF.shape[0]
  nb, b = recv_NxBxF.shape[:2]
  ridx, in_recv = _recv_rows(idx - t, slot, b, nb, block_of_sender)
  return _take_two(own_TxF, recv_NxBxF.reshape((nb * b,) + recv_NxBxF.shape[2:]), idx, ridx,
                   in_recv, fill)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _take_two(own, recv, own_idx, recv_idx, in_recv, fill):
  """``where(in_recv, recv[recv_idx], own[own_idx])`` (out-of-range -> ``fill``), copied as
  32-bit words like ``_take``.

  The select runs on the words, so XLA fuses both gathers and the select into one pass
  (selecting bf16 rows after two word gathers ran up to 1.7x slower than the plain bf16
  gathers on an H200: results/placement_bench_v7_bf16select.md). An index of one source is out
  of range wherever the row reads the other (``_gather_two``), so each source's cotangent is
  the output's, scattered through its own index.
  """
  got = jnp.where(in_recv[:, None], _gather_words(recv, recv_idx, fill),
                  _gather_words(own, own_idx, fill))
  return _from_words(got, own, own_idx.shape[0])


def _take_two_fwd(own, recv, own_idx, recv_idx, in_recv, fill):
  like = lambda x: jnp.zeros((x.shape[0], 0), x.dtype)
  return (_take_two(own, recv, own_idx, recv_idx, in_recv, fill),
          (own_idx, recv_idx, like(own), like(recv)))


def _take_two_bwd(fill, res, dy):
  own_idx, recv_idx, like_own, like_recv = res
  d_own, _ = _take_rows_bwd(fill, False, (own_idx, like_own), dy)
  d_recv, _ = _take_rows_bwd(fill, False, (recv_idx, like_recv), dy)
  return d_own, d_recv, None, None, None


_take_two.defvjp(_take_two_fwd, _take_two_bwd)


def _recv_rows(r: jax.Array, slot: int, b: int, nb: int, block_of_sender: jax.Array):
  """(row of the flat received buffer or ``nb * b`` = none, whether ``r`` addresses a slot).

  ``r``: the metadata's index past the own rows (sender p's slot is ``[p * slot, (p+1) * slot)``).
  Rows of a slot past the bucket were not sent (the plan never uses them): none, never the next
  sender's rows.
  """
  s = block_of_sender.shape[0]
  in_recv = (r >= 0) & (r < s * slot)
  blk = jnp.take(block_of_sender, jnp.clip(r // slot, 0, s - 1))
  ok = in_recv & (r % slot < b) & (blk < nb)
  return jnp.where(ok, blk * b + r % slot, nb * b), in_recv


def _place_unique(own_TxF: jax.Array, recv_NxBxF: jax.Array, idx: jax.Array, slot: int,
                  block_of_sender: jax.Array, fill=0) -> jax.Array:
  """``_gather_two(..., unique=True)`` built as own rows first, received rows written in place.

  For routes that read every source row at most once (query rows to the server, output rows
  back to the owner). The gather of the own rows does not depend on the all-to-all, so XLA may
  run it while the rows are on the wire; after the all-to-all only the received rows are
  touched: one scatter (unique destinations, no atomics) of ``N * B`` rows into that buffer.
  ``_gather_two`` instead reads both sources for every output row after the all-to-all.
  Output rows that no source fills are ``fill``.
  """
  t = own_TxF.shape[0]
  nb, b = recv_NxBxF.shape[:2]
  n = idx.shape[0]
  out = _take(own_TxF, idx, fill, unique=True)  # rows routed to received rows: fill, for now
  src, _ = _recv_rows(idx - t, slot, b, nb, block_of_sender)
  # The inverse map: received row -> its output row (n = not placed, dropped by the scatter).
  dst = jnp.full((nb * b,), n, jnp.int32).at[src].set(jnp.arange(n, dtype=jnp.int32),
                                                      mode="drop", unique_indices=True)
  # Flat rows: XLA's scatter, like its gather, is faster over [rows, features] than over
  # [rows, heads, dim] (results/row_copy_bench.md).
  return out.reshape(n, -1).at[dst].set(recv_NxBxF.reshape(nb * b, -1), mode="drop",
                                        unique_indices=True).reshape(out.shape)


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
        sends.append(_take(x, idx.reshape(-1), unique=unique).reshape(nb, b * row_el))
    recv = _move_blocks(jnp.concatenate(sends, axis=1), axis, collective, signal_only, row_elems)
    blk = _recv_block_of_sender(num_servers, axis, collective)
  out, off = [], 0
  for (xs, _, attn_idx, slot, unique), b in zip(parts, sizes):
    if b == 0:  # every task's rows of this part are the server's own
      out.append(tuple(_take(x, attn_idx, unique=unique) for x in xs))
      continue
    placed = []
    for x in xs:
      w = b * math.prod(x.shape[1:])
      r = recv[:, off:off + w].reshape((recv.shape[0], b) + x.shape[1:])
      off += w
      # 3. A query row belongs to one task: sent once, placed once (own rows first, received
      # rows written in place). A key/value row may feed several tasks: one fused gather.
      placed.append((_place_unique if unique else _gather_two)(x, r, attn_idx, slot, blk))
    out.append(tuple(placed))
  return out


def send_to_servers(q_TxHxD, k_TxKxD, v_TxKxD, m: Mapping[str, jax.Array], spec: PlanSpec,
                    axis: str, *, exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                    collective: str = DEFAULT_COLLECTIVE, signal_only: bool = False,
                    split_exchange: bool = False):
  """Steps 1-3 on one device (inside ``shard_map``): its rows out, its attention inputs in.

  Args:
    q_TxHxD, k_TxKxD, v_TxKxD: this device's rows (``T = R * tokens_per_row``, local heads).
    m: this device's metadata (``PlanSpec.unpack_local``).
    spec: the static shapes.
    axis: the servers' mesh axis.
    exchange_buckets: slot fractions to choose from (module docstring); 1 = full slots.
    collective: 'auto', 'all_to_all' or 'ppermute' (``resolve_collective``).
    signal_only: timing ablation: one row per slot crosses the wire (wrong results).
    split_exchange: False: one bucket switch and one collective for Q, K and V together (the
      bucket sized by the fuller of the two); True: the query rows and the key/value rows each
      choose their own bucket and cross in their own collective (module docstring).

  Returns:
    (q_attn [Nq, H, D], k_attn [Nkv, K, D], v_attn [Nkv, K, D]); rows no task uses are zero.
  """
  s, cap = spec.num_servers, spec.capacity
  wire = dict(num_servers=s, axis=axis, collective=resolve_collective(collective, s),
              signal_only=signal_only)

  def q_part(q, q_send_idx, q_attn_idx):
    return ((q,), q_send_idx, q_attn_idx, cap.q_slot, True)

  def kv_part(k, v, kv_send_idx, kv_attn_idx):
    return ((k, v), kv_send_idx, kv_attn_idx, cap.kv_slot, False)

  if not split_exchange:
    def joint(bq: int, bkv: int):
      def run(q, k, v, q_send_idx, kv_send_idx, q_attn_idx, kv_attn_idx):
        (q_attn,), (k_attn, v_attn) = _exchange_parts(
            [q_part(q, q_send_idx, q_attn_idx), kv_part(k, v, kv_send_idx, kv_attn_idx)],
            (bq, bkv), **wire)
        return q_attn, k_attn, v_attn
      return run

    return _bucketed(
        m["exchange_rows"], exchange_bucket_rows(cap, exchange_buckets), joint,
        q_TxHxD, k_TxKxD, v_TxKxD, m["q_send_idx"], m["kv_send_idx"], m["q_attn_idx"],
        m["kv_attn_idx"])

  def q_only(bq: int):
    return lambda *a: _exchange_parts([q_part(*a)], (bq,), **wire)[0][0]

  def kv_only(bkv: int):
    return lambda *a: _exchange_parts([kv_part(*a)], (bkv,), **wire)[0]

  q_attn = _bucketed(m["exchange_rows"][:1], part_bucket_rows(cap.q_slot, exchange_buckets),
                     q_only, q_TxHxD, m["q_send_idx"], m["q_attn_idx"])
  k_attn, v_attn = _bucketed(m["exchange_rows"][1:],
                             part_bucket_rows(cap.kv_slot, exchange_buckets), kv_only,
                             k_TxKxD, v_TxKxD, m["kv_send_idx"], m["kv_attn_idx"])
  return q_attn, k_attn, v_attn


def return_to_owners(x_NqxF, m: Mapping[str, jax.Array], spec: PlanSpec, axis: str, fill=0, *,
                     exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                     collective: str = DEFAULT_COLLECTIVE, signal_only: bool = False):
  """Step 5 on one device: attention-output rows back to the devices their queries came from.

  Args:
    x_NqxF: per attention query row values ``[Nq, ...]`` (O ``[Nq, H, D]`` or LSE ``[Nq, H]``).
    m, spec, axis, exchange_buckets, collective, signal_only: as in ``send_to_servers`` (the
      return uses the query-slot sizes of the buckets).
    fill: value of local rows no task produced (padding).

  Returns:
    ``[T, ...]``: this device's rows in its natural order.
  """
  s, cq = spec.num_servers, spec.capacity.q_slot
  collective = resolve_collective(collective, s)
  feat = x_NqxF.shape[1:]
  row_el = math.prod(feat)

  def back(bq: int):
    def run(x_NqxF, o_send_idx_SxCq, o_local_idx):
      if bq == 0:  # nothing moved: every query row was attended on its owner
        return _take(x_NqxF, o_local_idx, fill, unique=True)
      # Every attention row goes back once, to one owner row (unique).
      o_idx = _send_slots(o_send_idx_SxCq[:, :bq], axis, collective)
      nb = o_idx.shape[0]
      send = _take(x_NqxF, o_idx.reshape(-1), unique=True).reshape(nb, bq * row_el)
      recv = _move_blocks(send, axis, collective, signal_only, row_el)
      return _place_unique(x_NqxF, recv.reshape((nb, bq) + feat), o_local_idx, cq,
                           _recv_block_of_sender(s, axis, collective), fill)

    return run

  return _bucketed(m["exchange_rows"][:1], _return_bucket_rows(spec.capacity, exchange_buckets),
                   back, x_NqxF, m["o_send_idx"], m["o_local_idx"])


def _device_body(q_RxTxHxD, k_RxTxKxD, v_RxTxKxD, plan_RxW, *, spec: PlanSpec, axis: str,
                 kernel: str, softmax_scale: float, return_lse: bool,
                 kernel_options: tuple[tuple[str, Any], ...], exchange_buckets: int,
                 collective: str, signal_only: bool, resend: bool = False,
                 split_exchange: bool = False):
  """One device: send, fused kernel over all of its tasks, return.

  ``resend``: the 'resend' memory mode; the kernel's inputs are then not named for the layer's
  remat policy, so a policy that keeps them ('save_attention') cannot undo the re-send.
  """
  r, t, h, d = q_RxTxHxD.shape
  kh = k_RxTxKxD.shape[2]
  m = spec.unpack_local(plan_RxW)
  wire = dict(exchange_buckets=exchange_buckets, collective=collective, signal_only=signal_only)
  q_attn, k_attn, v_attn = send_to_servers(
      q_RxTxHxD.reshape(r * t, h, d), k_RxTxKxD.reshape(r * t, kh, d),
      v_RxTxKxD.reshape(r * t, kh, d), m, spec, axis, split_exchange=split_exchange, **wire)
  # 4. One fused varlen call over all of this server's tasks.
  out = ops.core_attention(q_attn, k_attn, v_attn, m["cu_seqlens_q"], m["cu_seqlens_k"],
                           backend=kernel, softmax_scale=softmax_scale, return_lse=return_lse,
                           name_inputs=not resend, **dict(kernel_options))
  o_attn, lse_attn = out if return_lse else (out, None)
  # 5. O back to the owners (zeros at padding).
  o_RxTxHxD = return_to_owners(o_attn, m, spec, axis, **wire).reshape(r, t, h, d)
  if not return_lse:
    return o_RxTxHxD
  lse_RxTxH = return_to_owners(lse_attn, m, spec, axis, fill=-jnp.inf, **wire).reshape(r, t, h)
  return o_RxTxHxD, lse_RxTxH


def _check_options(kernel: str, memory_mode: str,
                   exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                   signal_only: bool = False, collective: str = DEFAULT_COLLECTIVE,
                   split_exchange: bool = False) -> None:
  if kernel not in KERNELS:
    raise ValueError(f"distca {kernel=} is not a core_attention backend; choose one of {KERNELS}")
  if memory_mode not in MEMORY_MODES:
    raise ValueError(f"distca {memory_mode=}; choose one of {MEMORY_MODES}")
  try:
    _check_int("exchange_buckets", exchange_buckets, 1)
  except ValueError as e:
    raise ValueError(f"distca {e} (1 = full slots always; default {DEFAULT_EXCHANGE_BUCKETS})") from e
  if not isinstance(signal_only, (bool, np.bool_)):
    raise ValueError(f"distca {signal_only=} must be True or False (True only for timing "
                     "benchmarks: it gives wrong results)")
  if collective not in COLLECTIVES:
    raise ValueError(f"distca {collective=}; choose one of {COLLECTIVES}")
  if not isinstance(split_exchange, (bool, np.bool_)):
    raise ValueError(f"distca {split_exchange=} must be True or False (True: queries and "
                     "keys/values each choose their own bucket and collective)")


def _mesh_and_servers(mesh, data_axis: str | tuple[str, ...]):
  """(mesh, servers): the given mesh or the one set by `jax.set_mesh`, and the size of its
  data axis (or the product of several: a pipeline's servers are every pipe x data rank)."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError("CAD core attention needs a mesh: pass mesh= or trace under "
                       "jax.set_mesh(mesh) (the trainer's mesh_context)")
  axes = data_axis if isinstance(data_axis, tuple) else (data_axis,)
  if not set(axes) <= set(mesh.axis_names):
    raise ValueError(f"{data_axis=} is not an axis of the mesh {dict(mesh.shape)}")
  return mesh, math.prod(mesh.shape[a] for a in axes)


def dispatch_attention(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
                       plan_BxW: jax.Array, spec: PlanSpec, *, kernel: str = "reference",
                       memory_mode: str = "keep", softmax_scale: float | None = None,
                       data_axis: str = "data", head_axis: str | None = None, mesh=None,
                       return_lse: bool = False, kernel_options: Mapping[str, Any] | None = None,
                       exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                       collective: str = DEFAULT_COLLECTIVE, signal_only: bool = False,
                       split_exchange: bool = False):
  """Core attention of every document by CAD, given a packed plan (device side, jit-able).

  Args:
    q_BxTxHxD: queries, rows ``B = S * R`` sharded over ``data_axis`` (heads over ``head_axis``).
    k_BxTxKxD, v_BxTxKxD: keys and values, sharded the same way.
    plan_BxW: int32 packed plan (``HostPlan.packed``), rows sharded over ``data_axis``.
    spec: the plan's static shapes.
    kernel: ``ops.core_attention`` backend ('reference', 'pallas', 'flash3').
    memory_mode: 'keep' or 'resend' (module docstring).
    softmax_scale: default ``1 / sqrt(D)``.
    data_axis: the mesh axis of the servers.
    head_axis: mesh axis the heads are split over (tensor parallelism), or None.
    mesh: the mesh; default the one set by ``jax.set_mesh`` (``trainer.mesh_context``).
    return_lse: also return the softmax log-sum-exp ``[B, T, H]`` (f32; -inf at padding).
    kernel_options: extra keywords for ``ops.core_attention`` (e.g. ``interpret``).
    exchange_buckets: slot fractions the exchange chooses from per batch (module docstring);
      1 = always the full slots.
    collective: how rows cross the wire: 'auto', 'all_to_all' or 'ppermute' (module
      docstring, "Collectives").
    signal_only: benchmarks only: every all-to-all carries one row per slot, shapes unchanged,
      results WRONG by design (module docstring).
    split_exchange: queries and keys/values choose their buckets apart and cross in two
      collectives (module docstring, "Bucketed exchange"); default one joint bucket.

  Returns:
    O ``[B, T, H, D]`` like q (zeros at padding), or ``(O, lse)``.
  """
  _check_options(kernel, memory_mode, exchange_buckets, signal_only, collective, split_exchange)
  mesh, s = _mesh_and_servers(mesh, data_axis)
  b, t, h, d = q_BxTxHxD.shape
  kh = k_BxTxKxD.shape[2]
  if k_BxTxKxD.shape != (b, t, kh, d) or v_BxTxKxD.shape != k_BxTxKxD.shape:
    raise ValueError(f"expected q [B,T,H,D], k and v [B,T,K,D]; got {q_BxTxHxD.shape=} "
                     f"{k_BxTxKxD.shape=} {v_BxTxKxD.shape=}")
  if not q_BxTxHxD.dtype == k_BxTxKxD.dtype == v_BxTxKxD.dtype:
    raise ValueError(f"q, k, v must share a dtype (one all-to-all carries them); got "
                     f"{q_BxTxHxD.dtype=} {k_BxTxKxD.dtype=} {v_BxTxKxD.dtype=}")
  if s != spec.num_servers or b != s * spec.rows_per_device or t != spec.tokens_per_row:
    raise ValueError(f"q {q_BxTxHxD.shape} on a {data_axis}={s} mesh does not match the plan's "
                     f"{spec}: expected rows = {spec.num_servers} x {spec.rows_per_device}, "
                     f"tokens per row = {spec.tokens_per_row}")
  if plan_BxW.shape != (b, spec.width) or plan_BxW.dtype != jnp.int32:
    raise ValueError(f"{plan_BxW.shape=} {plan_BxW.dtype=} must be int32 {(b, spec.width)} "
                     "(built by host_plan for the same capacity, rows_per_rank and mesh)")
  if head_axis is not None:
    tp = mesh.shape[head_axis]
    if h % tp or kh % tp:
      raise ValueError(f"query heads {h} and kv heads {kh} must divide by {head_axis}={tp}")
  scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
  body = functools.partial(_device_body, spec=spec, axis=data_axis, kernel=kernel,
                           softmax_scale=scale, return_lse=return_lse,
                           kernel_options=tuple(sorted((kernel_options or {}).items())),
                           exchange_buckets=int(exchange_buckets), collective=collective,
                           signal_only=bool(signal_only), resend=memory_mode == "resend",
                           split_exchange=bool(split_exchange))
  if memory_mode == "resend":
    body = jax.checkpoint(body, policy=ops.saves_kernel_outputs)
  qkv = P(data_axis, None, head_axis, None)
  out_specs = (qkv, P(data_axis, None, head_axis)) if return_lse else qkv
  # check_vma=False: the Pallas kernel's pallas_call carries no varying-axes annotations.
  f = jax.shard_map(body, mesh=mesh, in_specs=(qkv, qkv, qkv, P(data_axis, None)),
                    out_specs=out_specs, check_vma=False)
  return f(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, plan_BxW)


# ---------------------------------------------------------------------------------------------
# Notebook entry point.
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("spec", "kernel", "memory_mode", "softmax_scale",
                                             "data_axis", "head_axis", "mesh", "return_lse",
                                             "kernel_options", "exchange_buckets",
                                             "collective", "signal_only", "split_exchange"))
def _dispatch_jit(q, k, v, plan, *, spec, kernel, memory_mode, softmax_scale, data_axis,
                  head_axis, mesh, return_lse, kernel_options, exchange_buckets, collective,
                  signal_only, split_exchange):
  return dispatch_attention(q, k, v, plan, spec, kernel=kernel, memory_mode=memory_mode,
                            softmax_scale=softmax_scale, data_axis=data_axis, head_axis=head_axis,
                            mesh=mesh, return_lse=return_lse,
                            kernel_options=dict(kernel_options),
                            exchange_buckets=exchange_buckets, collective=collective,
                            signal_only=signal_only, split_exchange=split_exchange)


def core_attention(q: jax.Array, k: jax.Array, v: jax.Array, doc_lens, mesh, *,
                   tolerance: float = sc.DEFAULT_TOLERANCE,
                   capacity: Capacity | Mapping[str, int | None] | None = None,
                   kernel: str = "reference", softmax_scale: float | None = None,
                   memory_mode: str = "keep", min_shard: int | None = None,
                   data_axis: str = "data", head_axis: str | None = None,
                   return_lse: bool = False, return_plan: bool = False,
                   kernel_options: Mapping[str, Any] | None = None,
                   exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                   collective: str = DEFAULT_COLLECTIVE, signal_only: bool = False,
                   split_exchange: bool = False, **schedule_options):
  """Each document's causal attention, computed by CAD: plan, dispatch, fused kernel, return.

  Args:
    q: ``[ranks, tokens_per_rank, q_heads, head_dim]``, sharded over ``mesh``'s ``data_axis``.
    k, v: ``[ranks, tokens_per_rank, kv_heads, head_dim]``, sharded the same way.
    doc_lens: as ``scheduler.schedule`` takes it: a flat list packed in order across ranks
      (documents may span ranks; the unfilled tail is padding) or one list per rank. Must be
      concrete (Python ints): the plan is made on the host, also under ``jit``/``grad``.
    mesh: a ``jax.sharding.Mesh`` with a ``data_axis`` of size ``ranks``.
    tolerance: balancing epsilon (every server within ``(1 + tolerance)`` x mean pairs).
    capacity: buffer caps (``Capacity`` or dict); None or missing fields: the plan's own
      required sizes rounded up to a multiple of 128 (a new layout may then recompile).
    kernel: ``ops.core_attention`` backend: 'reference', 'pallas' (interpret mode on CPU) or
      'flash3'.
    softmax_scale: default ``1 / sqrt(head_dim)``.
    memory_mode: 'keep' or 'resend' (what the backward keeps; see the module docstring).
    min_shard: shortest query piece a split may create; None = ``auto_min_shard``.
    data_axis: the mesh axis of the ranks (= attention servers).
    head_axis: mesh axis the heads are sharded over, if any.
    return_lse: also return the log-sum-exp ``[ranks, tokens_per_rank, q_heads]``.
    return_plan: also return the ``HostPlan`` (last element).
    kernel_options: extra ``ops.core_attention`` keywords (``interpret``, ``block_sizes``, ...).
    exchange_buckets: slot fractions the exchange chooses from (module docstring); 1 = full.
    collective: 'auto', 'all_to_all' or 'ppermute' (module docstring, "Collectives").
    signal_only: benchmarks only: one row per slot on the wire, results WRONG by design.
    split_exchange: queries and keys/values each choose their own bucket and collective.
    **schedule_options: further ``scheduler.schedule`` keywords (split, cost_model, ...).

  Returns:
    O shaped like q (zeros at padding); ``(O, lse)`` with ``return_lse``; the ``HostPlan``
    appended with ``return_plan``. Differentiable in q, k, v.
  """
  _check_options(kernel, memory_mode, exchange_buckets, signal_only, collective, split_exchange)
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [ranks, tokens_per_rank, q_heads, head_dim] and k, v "
                     f"[ranks, tokens_per_rank, kv_heads, head_dim]; got {q.shape=} {k.shape=}")
  s, t, h, d = q.shape
  if data_axis not in mesh.axis_names or mesh.shape[data_axis] != s:
    raise ValueError(f"q has {s} ranks but mesh {dict(mesh.shape)} has "
                     f"{data_axis}={mesh.shape.get(data_axis)}; the ranks are the data axis")
  if min_shard is None:
    min_shard = auto_min_shard(t)
  byte_model = dict(q_heads=h, kv_heads=k.shape[2], head_dim=d,
                    dtype_bytes=jnp.dtype(q.dtype).itemsize)
  byte_model.update(schedule_options)
  cap = capacity if isinstance(capacity, Capacity) else Capacity(**dict(capacity or {}))
  if cap.bounded:
    spec = PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
    hp = host_plan(doc_lens, spec, tolerance=tolerance, min_shard=min_shard, **byte_model)
  else:  # the plan sizes the missing caps, and it fits them: plan once (one row per rank, so
    # local rows keep their order and host_plan's remapping is the identity)
    free = sc.schedule(doc_lens, s, tokens_per_rank=t, tolerance=tolerance, capacity=cap,
                       min_shard=min_shard, **byte_model)
    cap = cap.replace_none(Capacity.envelope([sc.required_capacity(free)],
                                             multiple=_row_multiple(t)))
    spec = PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
    meta = sc.plan_to_metadata(free, cap)
    hp = HostPlan(plan=free, meta=meta, packed=spec.pack(meta), spec=spec)
  plan = hp.packed
  if not isinstance(q, jax.core.Tracer):
    plan = jax.device_put(plan, NamedSharding(mesh, P(data_axis, None)))
  out = _dispatch_jit(q, k, v, plan, spec=spec, kernel=kernel, memory_mode=memory_mode,
                      softmax_scale=softmax_scale, data_axis=data_axis, head_axis=head_axis,
                      mesh=mesh, return_lse=return_lse,
                      kernel_options=tuple(sorted((kernel_options or {}).items())),
                      exchange_buckets=int(exchange_buckets), collective=collective,
                      signal_only=bool(signal_only), split_exchange=bool(split_exchange))
  if return_plan:
    return (*out, hp) if return_lse else (out, hp)
  return out


# ---------------------------------------------------------------------------------------------
# The trainer's backend.
# ---------------------------------------------------------------------------------------------
def make_backend(*, tolerance: float = sc.DEFAULT_TOLERANCE, min_shard: int = 0,
                 q_slot: int = 0, kv_slot: int = 0, q_tokens: int = 0, kv_tokens: int = 0,
                 tasks: int = 0, kernel: str = "reference", memory_mode: str = "keep",
                 rows_per_rank: int = 1, nano_batches: int = 1,
                 q_heads: int = sc.DEFAULT_Q_HEADS, kv_heads: int = sc.DEFAULT_KV_HEADS,
                 head_dim: int = sc.DEFAULT_HEAD_DIM, dtype_bytes: int = sc.DEFAULT_DTYPE_BYTES,
                 data_axis: str = "data", head_axis: str | None = "tensor",
                 cost_table: str = "", exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                 collective: str = DEFAULT_COLLECTIVE,
                 signal_only: bool = False, split_exchange: bool = False,
                 min_gain: float = 0.0,
                 linear_pairs_per_token: float = 0.0) -> "DistcaBackend":
  """The ``distca`` core-attention backend (options: ``config.attention.distca`` + model shapes).

  Returns a ``DistcaBackend``.

  ``host_prepare(doclens, tokens_per_row)`` plans each batch on the input thread (one list of
  document lengths per row; ``len(doclens) = data ranks x rows_per_rank``) and returns
  ``{'distca_plan': int32 [rows, W]}``; ``fn`` reads it from ``layout.extra`` and runs
  ``dispatch_attention`` over the mesh set by ``trainer.mesh_context``.

  With ``nano_batches = n`` (ping-pong, ``model.split_rows``) the model calls core attention once
  per nano-batch, on rows ``[i R/n, (i+1) R/n)`` of every rank's block; each nano-batch is planned
  and balanced on its own, and its plan is stored in exactly those rows of ``distca_plan``, so
  ``split_rows`` hands every call its own plan.

  Caps are per device for one call (``R/n`` rows of ``tokens_per_row``); 0 takes
  ``default_capacity``, ``min_shard`` 0 takes ``auto_min_shard``. ``min_gain`` and
  ``linear_pairs_per_token`` gate each plan (``scheduler.schedule``: a plan whose predicted
  speedup is below ``1 + min_gain`` moves nothing; the trainer derives
  ``linear_pairs_per_token`` from the model). ``exchange_buckets``, ``split_exchange``,
  ``collective`` and ``signal_only`` (benchmarks only: wrong results) go to
  ``dispatch_attention``.
  """
  try:
    _check_options(kernel, memory_mode, exchange_buckets, signal_only, collective,
                   split_exchange)
  except ValueError as e:
    raise ValueError(f"{e} (config.attention.distca)") from e
  r = _check_int("rows_per_rank", rows_per_rank, 1)
  n = _check_int("nano_batches", nano_batches, 1)
  # Checked here, not only by each plan's scheduler.schedule: a bad value fails at startup.
  sc.check_float("config.attention.distca.min_gain", min_gain,
                 hint="0 = always balance; default 0.02")
  sc.check_float("linear_pairs_per_token", linear_pairs_per_token,
                 hint="the trainer derives it: metrics.linear_pairs_per_token")
  if r % n:
    raise ValueError(f"{rows_per_rank=} must be a multiple of {nano_batches=}")
  caps = dict(q_slot=q_slot, kv_slot=kv_slot, q_tokens=q_tokens, kv_tokens=kv_tokens,
              tasks=tasks)
  for name, v in caps.items():
    _check_int(f"config.attention.distca.{name} (0 = auto)", v, 0)
  rn = r // n  # rows per device in one core-attention call
  byte_model = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes)

  def spec_for(num_servers: int, tokens_per_row: int) -> PlanSpec:
    return PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_row, rows_per_device=rn,
                    capacity=resolve_capacity(caps, rn * tokens_per_row, rn))

  def host_plans(doclens, tokens_per_row: int) -> list[HostPlan]:
    rows = len(doclens)
    if rows % r:
      raise ValueError(f"the batch has {rows} rows, not a multiple of {rows_per_rank=}")
    s = rows // r
    spec = spec_for(s, int(tokens_per_row))
    # Nano-batch i: rows [i rn, (i + 1) rn) of every device's block (model.split_rows).
    return [host_plan([list(doclens[x]) for x in _nano_batch_rows(s, r, n, i)], spec,
                      tolerance=tolerance, min_shard=min_shard or None,
                      cost_model=cost_table or None, min_gain=min_gain,
                      linear_pairs_per_token=linear_pairs_per_token, **byte_model)
            for i in range(n)]

  warned = []

  def host_prepare(doclens, tokens_per_row: int) -> dict[str, np.ndarray]:
    plans = host_plans(doclens, tokens_per_row)
    capped = [hp.plan.degraded_reason for hp in plans
              if hp.plan.degraded and "capacity" in hp.plan.degraded_reason]
    if capped and not warned:  # once per backend: the caps are the same for every batch
      warned.append(True)
      warnings.warn(f"distca: a batch's plan stopped short of its tolerance: {capped[0]} (caps "
                    f"{caps}; raise them in config.attention.distca, or caps_headroom / "
                    "caps_from_batches). Training goes on with that balance; this warning is "
                    "shown once.", stacklevel=2)
    spec = plans[0].spec
    s = spec.num_servers
    out = np.zeros((s, r, spec.width), np.int32)
    for i, hp in enumerate(plans):
      out[:, i * rn:(i + 1) * rn] = hp.packed.reshape(s, rn, spec.width)
    return {PLAN_KEY: out.reshape(s * r, spec.width)}

  def fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *, softmax_scale: float):
    if PLAN_KEY not in layout.extra:
      raise ValueError(f"the 'distca' backend needs layout.extra['{PLAN_KEY}'] (got keys "
                       f"{sorted(layout.extra)}); run backend.host_prepare on the batch "
                       "(trainer.add_host_plan)")
    mesh, s = _mesh_and_servers(None, data_axis)
    if q_BxTxHxD.shape[0] != s * rn:
      raise ValueError(f"core attention got {q_BxTxHxD.shape[0]} rows on {data_axis}={s}; the "
                       f"backend was built for {rows_per_rank=} / {nano_batches=} = {rn} rows per "
                       "device and call (pass the config's values to make_backend)")
    spec = spec_for(s, q_BxTxHxD.shape[1])
    hax = head_axis if head_axis in mesh.axis_names and mesh.shape[head_axis] > 1 else None
    # Documents never cross a row, so no task has more than a row's query or key rows: the bound
    # for flash3 (its grid is tasks x ceil(max_seqlen / 128) blocks; the buffers are up to 3x
    # longer); other kernels ignore it.
    kopts = {"max_seqlen_q": spec.tokens_per_row, "max_seqlen_k": spec.tokens_per_row}
    return dispatch_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.extra[PLAN_KEY], spec,
                              kernel=kernel, memory_mode=memory_mode,
                              softmax_scale=softmax_scale, data_axis=data_axis, head_axis=hax,
                              exchange_buckets=exchange_buckets, collective=collective,
                              signal_only=signal_only, split_exchange=split_exchange,
                              kernel_options=kopts)

  return DistcaBackend(fn=fn, host_prepare=host_prepare, host_plans=host_plans, caps=caps)


@dataclasses.dataclass(frozen=True)
class DistcaBackend(attn_lib.Backend):
  """The ``distca`` backend; ``host_plans(doclens, tokens_per_row) -> [HostPlan]`` (one per
  nano-batch) is the planning ``host_prepare`` packs, for benchmarks and diagnostics; ``caps``
  the capacity options it was built with (0 = ``default_capacity``'s value)."""
  host_plans: Callable[..., list[HostPlan]] | None = None
  caps: Mapping[str, int] | None = None


attn_lib.register_backend("distca", make_backend)


def count_primitives(jaxpr, names) -> collections.Counter:
  """Primitives of ``names`` one execution of ``jaxpr`` runs (nested jaxprs included; a bucket
  switch counts its largest branch), plus every ``pallas_call`` under its kernel's name (e.g.
  ``varlen_attention_fwd``). Benchmarks and tests read a CAD program's structure with it."""
  acc = collections.Counter()
  for e in jaxpr.eqns:
    if e.primitive.name in names:
      acc[e.primitive.name] += 1
    if e.primitive.name == "pallas_call":
      acc[str(e.params["name"])] += 1
    if e.primitive.name == "cond":
      per_branch = [count_primitives(b.jaxpr, names) for b in e.params["branches"]]
      for key in set().union(*per_branch):
        acc[key] += max(c[key] for c in per_branch)
      continue
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          acc.update(count_primitives(inner, names))
  return acc


# ---------------------------------------------------------------------------------------------
# Byte accounting (benchmarks).
# ---------------------------------------------------------------------------------------------
def exchange_bytes(meta: sc.PlanMetadata, *, q_heads: int, kv_heads: int, head_dim: int,
                   dtype_bytes: int, exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                   split_exchange: bool = False) -> dict[str, float]:
  """Per-device bytes of one forward exchange: useful (plan rows), moved (bucket), padded (slots).

  ``dispatch_*`` counts Q + K + V rows sent to other devices; ``return_*`` the O rows coming back
  (same count as the query rows). ``*_padded`` is what the full-slot dense all-to-all moves
  off-device: every slot of every peer, the self slot excluded (``exchange_buckets = 1``).
  ``*_moved``: what the bucketed exchange moves off-device for this batch (the chosen bucket's
  slot prefix to every peer). ``dispatch_useful_busiest_device`` / ``return_useful_busiest_device``:
  the most any one device sends; ``max_pair_dispatch_useful``: the largest (sender, server) pair.
  ``exchange_q_rows`` / ``exchange_kv_rows``: the plan's fullest slots (``exchange_rows``);
  ``bucket`` / ``return_bucket``: the chosen bucket's index among ``num_buckets`` /
  ``num_return_buckets`` distinct ones (``split_exchange``: ``bucket = iq * nkv + ikv`` of the
  ``nq x nkv`` pairs of the two parts' buckets); ``bucket_q_rows``, ``bucket_kv_rows``,
  ``return_bucket_q_rows``: their rows per slot.
  """
  s = meta.num_servers
  c = meta.capacity
  bq = q_heads * head_dim * dtype_bytes
  bkv = 2 * kv_heads * head_dim * dtype_bytes
  useful_q = float(meta.q_send_len.sum()) / s * bq
  useful_kv = float(meta.kv_send_len.sum()) / s * bkv
  sent = meta.q_send_len.sum(axis=1) * bq + meta.kv_send_len.sum(axis=1) * bkv
  returned = meta.q_send_len.sum(axis=0) * bq  # a server returns the O rows it received
  rows = exchange_rows(meta).tolist()
  ret_buckets = _return_bucket_rows(c, exchange_buckets)
  j = choose_bucket(rows[:1], ret_buckets)
  (rr,) = ret_buckets[j]
  if split_exchange:
    kv_buckets = part_bucket_rows(c.kv_slot, exchange_buckets)
    jkv = choose_bucket(rows[1:], kv_buckets)
    (rq,), (rkv,) = ret_buckets[j], kv_buckets[jkv]
    i, num = j * len(kv_buckets) + jkv, len(ret_buckets) * len(kv_buckets)
  else:
    buckets = exchange_bucket_rows(c, exchange_buckets)
    i, num = choose_bucket(rows, buckets), len(buckets)
    rq, rkv = buckets[i]
  return {
      "dispatch_useful": useful_q + useful_kv,
      "dispatch_useful_busiest_device": float(sent.max()),
      "dispatch_padded": float((s - 1) * (c.q_slot * bq + c.kv_slot * bkv)),
      "dispatch_moved": float((s - 1) * (rq * bq + rkv * bkv)),
      "return_useful": useful_q,
      "return_useful_busiest_device": float(returned.max()),
      "return_padded": float((s - 1) * c.q_slot * bq),
      "return_moved": float((s - 1) * rr * bq),
      "max_pair_dispatch_useful": float((meta.q_send_len * bq + meta.kv_send_len * bkv).max()),
      "exchange_q_rows": rows[0],
      "exchange_kv_rows": rows[1],
      "bucket": i,
      "num_buckets": num,
      "bucket_q_rows": rq,
      "bucket_kv_rows": rkv,
      "return_bucket": j,
      "num_return_buckets": len(ret_buckets),
      "return_bucket_q_rows": rr,
  }
