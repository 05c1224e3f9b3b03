"""A plan and its routing tables: ``Plan`` (which server computes which query shard) and
``PlanMetadata`` (fixed-shape int32 arrays the data plane executes), with the layout parser.

Ranks, documents, servers
-------------------------
``doc_lens`` is either one flat list packed in order across ranks (rank ``r`` holds global tokens
``[r T, (r + 1) T)``, ``T = tokens_per_rank``; documents may span ranks; an unfilled tail is
padding) or one list per rank (documents never span ranks; each rank's unfilled tail is padding).
Documents are numbered in that order (rank-major for the nested form). Every rank is an attention
server ("in place"). The starting point is "every query row computed where it lives": one task per
(document, rank) segment ``[lo, hi)`` with keys ``[0, hi)``; a document spanning ranks already
needs key/value rows of its earlier segments from their ranks.

Key/value layout on a server (the choice and its cost)
------------------------------------------------------
The kernel takes one varlen call per server with monotone ``cu_seqlens_q`` / ``cu_seqlens_k``, so
every task owns a contiguous, disjoint key range ``[cu_seqlens_k[i], cu_seqlens_k[i + 1])`` whose
last ``q_len`` rows are aligned with the task's queries (causal, bottom-right). Several tasks of one
document on one server (the head and tail of a mirrored split, or non-adjacent shards) therefore
each get their own copy of their key prefix ``[0, b_i)`` in the attention KV buffer: the rows are
sent over the network once per (sender, server) pair and duplicated by the server's local gather.
Adjacent shards of one document on one server are merged into a single task first. Cost of the
duplication: no network bytes; HBM of ``sum_i b_i - max_i b_i`` extra KV rows per document on that
server (a head-tail pair ``[s, s+m) + [L-s-m, L-s)`` duplicates ``s + m`` rows, i.e.
``2 (s + m) bkv`` bytes for K and V), counted in ``kv_tokens``; the kernel reads them anyway
because each task attends its whole key prefix. The gather's transpose (scatter-add) sums dK/dV of
duplicated rows in the backward for free. (A kernel taking per-row key ranges could share one
prefix; the ``core_attention`` signature does not.)

PlanMetadata: the contract with the data plane
----------------------------------------------
Every device array has a leading axis of devices (``PlanMetadata.DEVICE_FIELDS``), so the data
plane shards every array over its data axis and each device reads its own row. ``T =
tokens_per_rank``; ``Cqs, Ckvs, Cqr, Ckvr, Nq, Nkv, Nt`` are the capacity's ``q_send, kv_send,
q_recv, kv_recv, q_tokens, kv_tokens, tasks``. No shape depends on the number of servers ``S``
but the routes (``[6, S]`` per part). Padding entries hold a sentinel one past the end of the
indexed array: gather with ``jnp.take(..., mode='fill', fill_value=0)`` and scatter with
``mode='drop'`` (this also makes the autodiff transposes correct).

Ragged buffers. A device's send buffer holds the rows it sends, grouped by destination server
(ascending), each group at ``send_off[d]`` with ``send_len[d]`` rows; a server's receive buffer
holds the rows it receives, grouped by sender (ascending; by (sender local index, sender host)
for the two-level exchange, ``recv_order``), at ``recv_off[p]`` with ``recv_len[p]`` rows.
Groups are packed from row 0 without gaps; rows past the last group are unused. The routes of
one part (``q_routes`` or ``kv_routes``, int32 ``[6, S]`` per device) are the rows
``ROUTE_ROWS``: ``send_off``, ``send_len``, ``recv_off``, ``recv_len``, ``peer_recv_off``
(where this device's group lands in server d's receive buffer: d's ``recv_off[me]``) and
``peer_send_off`` (where sender p's group for this device starts in p's send buffer: p's
``send_off[me]``). The self entries are empty: a server reads its own rows
directly.

1. Sender gather (device ``p``): ``q_send = q[p][q_send_idx[p]]`` with ``q_send_idx[p, Cqs]`` in
   ``[0, T]`` (sentinel ``T``); ``kv_send_idx[p, Ckvs]`` likewise for K and V.
2. Exchange (``q_routes``, ``kv_routes``): every group ``send_off[d] .. + send_len[d]`` of the
   send buffer lands at ``peer_recv_off[d]`` of server d's receive buffer ``q_recv[Cqr]``
   (``k_recv``, ``v_recv`` ``[Ckvr]``); each row crosses the wire once.
3. Server gather into attention inputs (device ``s``): sources are the server's own rows followed
   by its receive buffer: ``q_src = concat([q_local[T], q_recv[Cqr]])``;
   ``q_attn = q_src[q_attn_idx[s]]`` with ``q_attn_idx[s, Nq]`` in ``[0, T + Cqr]`` (sentinel
   ``T + Cqr``); ``kv_src`` / ``kv_attn_idx[s, Nkv]`` likewise with ``Ckvr``. KV indices may
   repeat (duplicated prefixes, see above); query indices never do.
4. Kernel: one call ``core_attention(q_attn, k_attn, v_attn, cu_seqlens_q[s], cu_seqlens_k[s])``
   with ``cu_seqlens_q[s, Nt + 1]``, ``cu_seqlens_k[s, Nt + 1]`` over the attention inputs, causal
   bottom-right; unused trailing tasks are empty (the arrays repeat their last value) and rows past
   ``cu_seqlens_*[s, Nt]`` belong to no task (their output is never read).
5. Return: the server's return send buffer has the layout of its query receive buffer:
   ``o_send = O_attn[o_send_idx[s]]`` with ``o_send_idx[s, Cqr]`` in ``[0, Nq]`` (sentinel
   ``Nq``); the exchange runs ``q_routes`` backwards (``reverse_routes``), so the rows land in
   the owner's return receive buffer ``[Cqs]`` where its query rows left its send buffer; the
   owner ``p`` assembles ``o_src = concat([O_attn_own[Nq], o_recv[Cqs]])`` and
   ``o_local = o_src[o_local_idx[p]]`` with ``o_local_idx[p, T]`` in ``[0, Nq + Cqs]`` (sentinel
   for padding rows, which come back zero). The softmax LSE follows the same routing.

Counts (``q_send_len``, ``kv_send_len`` [S, S] rows per (sender, server); ``q_len``, ``kv_len``,
``num_tasks`` [S] per server) give useful bytes for bandwidth reports and masks;
``task_index[s, Nt]`` maps a server's task slot to its row in ``Plan.tasks`` (-1 for padding).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from distca_jax.checks import check_int
from distca_jax.plan import cost
from distca_jax.plan.capacity import Capacity, required_capacity

# Rows of a part's routes (``PlanMetadata.q_routes`` / ``kv_routes``), module docstring.
ROUTE_ROWS = ("send_off", "send_len", "recv_off", "recv_len", "peer_recv_off", "peer_send_off")


def server_hosts(num_servers: int, servers_per_host: int) -> np.ndarray:
  """[S] host of each server: servers are numbered host-major (server ``s`` on host
  ``s // servers_per_host``); raises unless ``servers_per_host`` divides ``num_servers``."""
  if (isinstance(servers_per_host, bool) or not isinstance(servers_per_host, (int, np.integer))
      or servers_per_host < 1 or num_servers % servers_per_host):
    raise ValueError(f"servers_per_host={servers_per_host!r} must be a positive divisor of "
                     f"num_servers={num_servers} (servers are numbered host-major), or None for "
                     "one host")
  return np.arange(num_servers) // int(servers_per_host)


# ---------------------------------------------------------------------------------------------
# Layout parsing.
# ---------------------------------------------------------------------------------------------
def parse_layout(doc_lens, num_servers: int, tokens_per_rank: int
                 ) -> tuple[np.ndarray, np.ndarray]:
  """Validates ``doc_lens`` (flat or per rank) and returns (lengths [J], global starts [J]).

  Global token ``g`` lives on rank ``g // tokens_per_rank`` at local row ``g % tokens_per_rank``.
  """
  s = check_int("num_servers", num_servers, 1)
  t = check_int("tokens_per_rank", tokens_per_rank, 1)
  if isinstance(doc_lens, np.ndarray) and doc_lens.ndim == 1:
    doc_lens = doc_lens.tolist()
  if not isinstance(doc_lens, (list, tuple)):
    raise TypeError(f"doc_lens must be a list of ints or a list of per-rank lists; got "
                    f"{type(doc_lens).__name__}")
  is_seq = [isinstance(v, (list, tuple, np.ndarray)) for v in doc_lens]
  if any(is_seq) and not all(is_seq):
    raise ValueError("doc_lens mixes ints and lists; pass either a flat list of lengths or one "
                     "list per rank")
  nested = bool(doc_lens) and all(is_seq)

  def _lens(vals, where: str) -> np.ndarray:
    out = np.zeros(len(vals), dtype=np.int64)
    for i, v in enumerate(vals):
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"document length {v!r} at {where}[{i}] must be a positive int")
      out[i] = int(v)
    return out

  if not nested:
    lens = _lens(doc_lens, "doc_lens")
    total = int(lens.sum())
    if total > s * t:
      raise ValueError(f"doc_lens hold {total} tokens > {num_servers=} x {tokens_per_rank=} = "
                       f"{s * t}; raise tokens_per_rank or num_servers")
    starts = np.cumsum(lens) - lens
    return lens, starts
  if len(doc_lens) != s:
    raise ValueError(f"per-rank doc_lens has {len(doc_lens)} ranks but {num_servers=}; servers "
                     "are the ranks (in place), pass one list per rank")
  all_lens, all_starts = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
  for r, rank_lens in enumerate(doc_lens):
    lens = _lens(list(rank_lens), f"doc_lens[{r}]")
    if lens.sum() > t:
      raise ValueError(f"rank {r} holds {int(lens.sum())} tokens > {tokens_per_rank=}")
    all_lens.append(lens)
    all_starts.append(r * t + np.cumsum(lens) - lens)
  return np.concatenate(all_lens), np.concatenate(all_starts)


def chunk_layout(doc_lens, chunk: int):
  """The layout of a chunked-attention layer (Llama 4's ``attention_chunk_size``): every
  document cut at multiples of ``chunk`` of its own positions, in the form given (a flat list,
  or one list per rank or row).

  Query position p of a document sees keys ``[(p // chunk) * chunk, p]``: full causal attention
  over the pieces, so a chunked layer plans and runs as a full-causal layer of this layout (the
  tokens keep their document positions for RoPE; only attention's document boundaries change).
  """
  c = check_int("chunk", chunk, 1)

  def cut(lens):
    out = []
    for n in lens:
      n = int(n)
      out += [c] * (n // c) + ([n % c] if n % c else [])
    return out

  if isinstance(doc_lens, np.ndarray) and doc_lens.ndim == 1:
    doc_lens = doc_lens.tolist()
  if doc_lens and all(isinstance(v, (list, tuple, np.ndarray)) for v in doc_lens):
    return [cut(row) for row in doc_lens]
  return cut(doc_lens)


# ---------------------------------------------------------------------------------------------
# Plan.
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
  """A schedule: which server computes which query shard.

  Attributes:
    tasks: [N, 4] int64 rows (document index, query start, query end, server), positions inside
      the document; sorted by (server, document, start). Keys of a task are [0, query end).
    loads_before: [S] pairs per server when every row is computed where it lives.
    loads_after: [S] pairs per server under this plan.
    imbalance_before / imbalance_after: max / mean of the loads (1.0 when there is no work).
    pair_q_rows / pair_kv_rows: [S, S] rows sent from sender (row) to server (column), self
      excluded; bytes are these times the row sizes.
    bytes_q / bytes_kv: dispatch bytes (query, key+value); the output return moves ``bytes_q``
      again (O rows have the query's shape).
    degraded: True when the plan ends above ``(1 + tolerance) * mean``; ``degraded_reason`` says
      which cap or granularity stopped it.
    times_before / times_after: [S] predicted kernel seconds from the cost table, or None.
    doc_lens / doc_starts: [J] the parsed layout (global token starts).
    capacity: the caps the plan respects (None fields = unbounded).
    num_moves: balancing moves applied.
    predicted_gain: the speedup a perfect balance would bring, minus 1: ``predicted_step_gain``
      of ``loads_before`` (attention alone, ``imbalance_before - 1``, when
      ``linear_pairs_per_token`` is 0).
    gated: True when that gain was below ``min_gain``: nothing moved, by decision (not
      ``degraded``).
    servers_per_host: the hosts the plan was balanced for (``PlanOptions.servers_per_host``;
      None = one host); ``intra_host_bytes`` / ``inter_host_bytes`` split the dispatch bytes by
      link.
    window: the sliding window the plan is for (``PlanOptions.window``; 0 = full causal): task
      ``[a, b)`` reads keys ``[k_start(a), b)`` (``k_starts``).
  """
  tasks: np.ndarray
  loads_before: np.ndarray
  loads_after: np.ndarray
  imbalance_before: float
  imbalance_after: float
  pair_q_rows: np.ndarray
  pair_kv_rows: np.ndarray
  bytes_q: int
  bytes_kv: int
  degraded: bool
  degraded_reason: str
  times_before: np.ndarray | None
  times_after: np.ndarray | None
  doc_lens: np.ndarray
  doc_starts: np.ndarray
  num_servers: int
  tokens_per_rank: int
  tolerance: float
  min_shard: int
  capacity: Capacity
  q_heads: int
  kv_heads: int
  head_dim: int
  dtype_bytes: int
  num_moves: int
  predicted_gain: float = 0.0
  gated: bool = False
  servers_per_host: int | None = None
  window: int = 0

  @property
  def k_starts(self) -> np.ndarray:
    """[N] each task's first key position in its document: 0, or ``max(0, a - window + 1)``."""
    return cost.k_starts(self.tasks[:, 1], self.window)

  @property
  def crosses(self) -> bool:
    """Whether any row crosses devices (a plan that moves nothing and splits no document over
    devices does not): some (sender, server) pair sends query or key/value rows."""
    return bool(self.pair_q_rows.any() or self.pair_kv_rows.any())

  @property
  def bytes_total(self) -> int:
    """Dispatch bytes, query plus key/value (add ``bytes_q`` for the output's return)."""
    return self.bytes_q + self.bytes_kv

  @property
  def pair_bytes(self) -> np.ndarray:
    """[S, S] dispatch bytes per (sender, server)."""
    return (self.pair_q_rows * self.q_heads * self.head_dim * self.dtype_bytes
            + self.pair_kv_rows * 2 * self.kv_heads * self.head_dim * self.dtype_bytes)

  def link_bytes(self, servers_per_host: int | None = None) -> tuple[int, int]:
    """(inside hosts, between hosts) dispatch bytes with ``servers_per_host`` servers per host
    (host-major numbering; default: the plan's own ``servers_per_host``, None = one host)."""
    per_host = self.servers_per_host if servers_per_host is None else servers_per_host
    pb = self.pair_bytes
    if per_host is None:
      return int(pb.sum()), 0
    host = server_hosts(self.num_servers, per_host)
    same = host[:, None] == host[None, :]
    return int(pb[same].sum()), int(pb[~same].sum())

  @property
  def intra_host_bytes(self) -> int:
    """Dispatch bytes between servers of one host (``link_bytes``)."""
    return self.link_bytes()[0]

  @property
  def inter_host_bytes(self) -> int:
    """Dispatch bytes between hosts (``link_bytes``; 0 with one host)."""
    return self.link_bytes()[1]

  def summary(self) -> str:
    """One line of the headline numbers."""
    return (f"servers={self.num_servers} docs={self.doc_lens.size} tasks={len(self.tasks)} "
            f"imbalance {self.imbalance_before:.3f} -> {self.imbalance_after:.3f} "
            f"moves={self.num_moves} bytes={self.bytes_total / 2**20:.1f} MiB"
            + (f" DEGRADED: {self.degraded_reason}" if self.degraded else "")
            + (f" GATED: predicted step gain {self.predicted_gain:.4f}" if self.gated else ""))


# ---------------------------------------------------------------------------------------------
# Plan -> metadata (the data plane's contract; see the module docstring).
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlanMetadata:
  """Fixed-shape int32 routing tables of one plan; leading axis = the device that reads them.

  Shapes use ``S`` servers (= ranks), ``T`` tokens per rank and the capacity's ``Cqs``
  (q_send), ``Ckvs`` (kv_send), ``Cqr`` (q_recv), ``Ckvr`` (kv_recv), ``Nq`` (q_tokens), ``Nkv``
  (kv_tokens), ``Nt`` (tasks). With ``ranks`` given to ``plan_to_metadata`` the leading axis holds
  only those devices, in that order (``R`` rows).

  Attributes:
    q_send_idx: [R, Cqs] sender-local query rows of the send buffer (sentinel ``T``).
    kv_send_idx: [R, Ckvs] sender-local key/value rows of the send buffer (sentinel ``T``).
    q_attn_idx: [R, Nq] attention query rows from ``concat(own [T], received [Cqr])``
      (sentinel ``T + Cqr``).
    kv_attn_idx: [R, Nkv] attention key/value rows from ``concat(own [T], received [Ckvr])``
      (sentinel ``T + Ckvr``); may repeat.
    cu_seqlens_q: [R, Nt + 1] task boundaries over the attention query rows.
    cu_seqlens_k: [R, Nt + 1] task boundaries over the attention key/value rows.
    o_send_idx: [R, Cqr] attention output row of each return send row (the query receive
      buffer's layout; sentinel ``Nq``).
    o_local_idx: [R, T] output row of each local token from ``concat(own O [Nq], returned
      [Cqs])`` (sentinel ``Nq + Cqs`` for padding).
    q_routes: [R, 6, S] the query exchange's routes (``ROUTE_ROWS``); the output return runs
      them backwards.
    kv_routes: [R, 6, S] the key/value exchange's routes.
    q_send_len: [S, S] query rows per (sender, server), self pair 0.
    kv_send_len: [S, S] key/value rows per (sender, server), self pair 0.
    q_len: [S] attention query rows per server.
    kv_len: [S] attention key/value rows per server (duplicates counted).
    num_tasks: [S] tasks per server.
    task_index: [R, Nt] row of ``Plan.tasks`` for each task slot (-1 for padding).
    ranks: [R] the devices of the leading axis.
    num_servers: ``S``.
    tokens_per_rank: ``T``.
    capacity: the (fully bounded) capacity the shapes come from.
    servers_per_host: 0, or ``L`` when the receive buffers are in the two-level order
      (``recv_order``).
    q_a_routes, kv_a_routes: [R, 6, S] leg A's routes (between hosts), or None (one level).
    q_b_routes, kv_b_routes: [R, 6, S] leg B's routes (inside hosts), or None.
    q_b_idx, kv_b_idx: [R, send + relay] leg B's send rows from ``concat(send buffer, relay
      buffer)`` (sentinel ``send + relay``), or None (``plan.two_level``).
  """
  q_send_idx: np.ndarray
  kv_send_idx: np.ndarray
  q_attn_idx: np.ndarray
  kv_attn_idx: np.ndarray
  cu_seqlens_q: np.ndarray
  cu_seqlens_k: np.ndarray
  o_send_idx: np.ndarray
  o_local_idx: np.ndarray
  q_routes: np.ndarray
  kv_routes: np.ndarray
  q_send_len: np.ndarray
  kv_send_len: np.ndarray
  q_len: np.ndarray
  kv_len: np.ndarray
  num_tasks: np.ndarray
  task_index: np.ndarray
  ranks: np.ndarray
  num_servers: int
  tokens_per_rank: int
  capacity: Capacity
  servers_per_host: int = 0
  q_a_routes: np.ndarray | None = None
  q_b_routes: np.ndarray | None = None
  q_b_idx: np.ndarray | None = None
  kv_a_routes: np.ndarray | None = None
  kv_b_routes: np.ndarray | None = None
  kv_b_idx: np.ndarray | None = None

  DEVICE_FIELDS = ("q_send_idx", "kv_send_idx", "q_attn_idx", "kv_attn_idx", "cu_seqlens_q",
                   "cu_seqlens_k", "o_send_idx", "o_local_idx", "q_routes", "kv_routes")
  # The two-level exchange's tables (``plan.two_level``), per part.
  TWO_LEVEL_FIELDS = ("q_a_routes", "q_b_routes", "q_b_idx", "kv_a_routes", "kv_b_routes",
                      "kv_b_idx")

  def device_arrays(self) -> dict[str, np.ndarray]:
    """The arrays the compiled step consumes (all int32, leading axis = device); the
    two-level tables when set."""
    out = {f: getattr(self, f) for f in self.DEVICE_FIELDS}
    out.update({f: getattr(self, f) for f in self.TWO_LEVEL_FIELDS
                if getattr(self, f) is not None})
    return out


def plan_to_metadata(plan: Plan, capacity: Capacity | None = None, *,
                     ranks: Sequence[int] | None = None,
                     servers_per_host: int = 0) -> PlanMetadata:
  """Routing tables for ``plan`` in buffers of ``capacity``.

  Args:
    plan: from ``schedule``.
    capacity: buffer sizes; None fields (or None) fall back to ``plan.capacity``, then to the
      plan's own tight sizes (``required_capacity``; shapes then vary between plans).
    ranks: devices whose rows to build (e.g. a host's local devices); default all.
    servers_per_host: 0, or ``L`` for the two-level exchange: every receive buffer is ordered
      by (sender local index, sender host) (``recv_order``); ``plan.two_level.with_relay``
      adds the legs' tables.

  Returns:
    ``PlanMetadata``. Raises ``ValueError`` if the plan does not fit ``capacity``.
  """
  s, t = plan.num_servers, plan.tokens_per_rank
  cap = (capacity or Capacity()).replace_none(plan.capacity).replace_none(
      required_capacity(plan))
  cqs, ckvs, cqr, ckvr = cap.q_send, cap.kv_send, cap.q_recv, cap.kv_recv
  nq, nkv, nt = cap.q_tokens, cap.kv_tokens, cap.tasks
  if ranks is None:
    ranks_arr = np.arange(s)
  else:
    ranks_arr = np.asarray(list(ranks), dtype=np.int64)
    if ranks_arr.ndim != 1 or ((ranks_arr < 0) | (ranks_arr >= s)).any() or len(
        set(ranks_arr.tolist())) != ranks_arr.size:
      raise ValueError(f"{ranks=} must be distinct ranks in [0, {s})")
  row_of = np.full(s, -1, dtype=np.int64)
  row_of[ranks_arr] = np.arange(ranks_arr.size)
  nr = ranks_arr.size
  i32 = np.int32
  q_send_idx = np.full((nr, cqs), t, i32)
  kv_send_idx = np.full((nr, ckvs), t, i32)
  q_attn_idx = np.full((nr, nq), t + cqr, i32)
  kv_attn_idx = np.full((nr, nkv), t + ckvr, i32)
  cu_q = np.zeros((nr, nt + 1), i32)
  cu_k = np.zeros((nr, nt + 1), i32)
  o_send_idx = np.full((nr, cqr), nq, i32)
  o_local_idx = np.full((nr, t), nq + cqs, i32)
  task_index = np.full((nr, nt), -1, i32)
  q_send_len = np.zeros((s, s), np.int64)
  kv_send_len = np.zeros((s, s), np.int64)
  q_len = np.zeros(s, np.int64)
  kv_len = np.zeros(s, np.int64)
  num_tasks = np.zeros(s, np.int64)

  tasks = plan.tasks
  g_doc = plan.doc_starts
  doc, qa, qb_, srv = tasks[:, 0], tasks[:, 1], tasks[:, 2], tasks[:, 3]
  qlen_t = qb_ - qa
  ks_t = plan.k_starts  # each task's keys are [ks_t, qb_) of its document
  klen_t = qb_ - ks_t
  num_tasks = np.bincount(srv, minlength=s)
  q_len = np.bincount(srv, weights=qlen_t, minlength=s).astype(np.int64)
  kv_len = np.bincount(srv, weights=klen_t, minlength=s).astype(np.int64)
  for name, have, lim in (("tasks", num_tasks, nt), ("q_tokens", q_len, nq),
                          ("kv_tokens", kv_len, nkv)):
    if have.max(initial=0) > lim:
      d = int(np.argmax(have))
      raise ValueError(f"server {d} needs {name}={int(have[d])} > capacity.{name}={lim}")
  first_task = np.searchsorted(srv, np.arange(s))
  # Offsets of each task inside its server's attention Q and KV buffers (tasks in plan order).
  q_off = np.cumsum(qlen_t) - qlen_t
  k_off = np.cumsum(klen_t) - klen_t
  if tasks.shape[0]:
    q_off -= q_off[first_task[srv]]
    k_off -= k_off[first_task[srv]]
  gs = g_doc[doc] + qa

  # Query pieces: task query intervals cut at rank boundaries; groups per (owner, server) pair.
  pt, p_own, p_s, p_e = split_at(gs, g_doc[doc] + qb_, t)
  p_srv = srv[pt]
  p_len = p_e - p_s
  p_attn = q_off[pt] + (p_s - gs[pt])
  p_cross, p_pos, q_send_len = _route_pieces(p_own, p_srv, p_len, s)
  q_soff, q_roff = _group_offsets(q_send_len, cqs, cqr, "query", "q", servers_per_host)
  # KV: per (server, document) the union of its tasks' key ranges is sent once ([0, max end)
  # without a window); cut at rank boundaries. Tasks are sorted by (server, document, start), so
  # a union interval starts at a group's first task or where a task's keys start past the
  # previous task's end.
  if tasks.shape[0]:
    grp = np.flatnonzero(np.r_[True, (srv[1:] != srv[:-1]) | (doc[1:] != doc[:-1])
                               | (ks_t[1:] > qb_[:-1])])
    u_end = np.maximum.reduceat(qb_, grp)
  else:
    grp = np.zeros(0, np.int64)
    u_end = np.zeros(0, np.int64)
  u_srv, u_doc = srv[grp], doc[grp]
  ut, u_own, u_s, u_e = split_at(g_doc[u_doc] + ks_t[grp], g_doc[u_doc] + u_end, t)
  u_psrv = u_srv[ut]
  u_len = u_e - u_s
  u_cross, u_pos, kv_send_len = _route_pieces(u_own, u_psrv, u_len, s)
  kv_soff, kv_roff = _group_offsets(kv_send_len, ckvs, ckvr, "key/value", "kv",
                                    servers_per_host)

  # Server side (devices in ``ranks``): attention gathers, task tables, output return rows.
  sel = row_of[p_srv] >= 0
  r_ = row_of[p_srv[sel]]
  val0 = np.where(p_cross[sel], t + q_roff[p_srv[sel], p_own[sel]] + p_pos[sel], p_s[sel] % t)
  q_attn_idx.reshape(-1)[ranges(r_ * nq + p_attn[sel], p_len[sel])] = ranges(val0, p_len[sel])
  selc = sel & p_cross
  r_ = row_of[p_srv[selc]]
  o_send_idx.reshape(-1)[ranges(r_ * cqr + q_roff[p_srv[selc], p_own[selc]] + p_pos[selc],
                                p_len[selc])] = (
      ranges(p_attn[selc], p_len[selc]))
  # Each task's keys [ks, b) of its document, cut at rank boundaries; a cross-rank piece lies
  # inside one (server, document) KV piece (the last one starting at or before it), at the
  # piece's position plus its offset in the piece.
  tsel = np.flatnonzero(row_of[srv] >= 0)
  kt, k_own, k_s, k_e = split_at(g_doc[doc[tsel]] + ks_t[tsel], g_doc[doc[tsel]] + qb_[tsel], t)
  kt = tsel[kt]
  k_srv = srv[kt]
  k_cross = k_own != k_srv
  nd = max(int(plan.doc_lens.size), 1)
  span = s * t + 1
  u_key = (u_psrv * nd + u_doc[ut]) * span + u_s
  k_key = (k_srv * nd + doc[kt]) * span + k_s
  u_order = np.argsort(u_key, kind="stable")
  if kt.size:
    piece = u_order[np.searchsorted(u_key[u_order], k_key, side="right") - 1]
    k_upos = u_pos[piece] + (k_s - u_s[piece])
  else:
    k_upos = k_key
  val0 = np.where(k_cross, t + kv_roff[k_srv, k_own] + k_upos, k_s % t)
  dst0 = row_of[k_srv] * nkv + k_off[kt] + (k_s - g_doc[doc[kt]] - ks_t[kt])
  kv_attn_idx.reshape(-1)[ranges(dst0, k_e - k_s)] = ranges(val0, k_e - k_s)
  for d in ranks_arr.tolist():
    r = row_of[d]
    lo_t, n_task = int(first_task[d]), int(num_tasks[d])
    ql, kl = qlen_t[lo_t:lo_t + n_task], klen_t[lo_t:lo_t + n_task]
    cu_q[r, 1:] = np.concatenate([np.cumsum(ql), np.full(nt - n_task, ql.sum())])
    cu_k[r, 1:] = np.concatenate([np.cumsum(kl), np.full(nt - n_task, kl.sum())])
    task_index[r, :n_task] = np.arange(lo_t, lo_t + n_task)

  # Sender side (devices in ``ranks`` as owners): send buffers and where outputs come back.
  osel = row_of[p_own] >= 0
  ro = row_of[p_own[osel]]
  val0 = np.where(p_cross[osel], nq + q_soff[p_own[osel], p_srv[osel]] + p_pos[osel],
                  p_attn[osel])
  o_local_idx.reshape(-1)[ranges(ro * t + p_s[osel] % t, p_len[osel])] = (
      ranges(val0, p_len[osel]))
  osel &= p_cross
  ro = row_of[p_own[osel]]
  q_send_idx.reshape(-1)[ranges(ro * cqs + q_soff[p_own[osel], p_srv[osel]] + p_pos[osel],
                                p_len[osel])] = (
      ranges(p_s[osel] % t, p_len[osel]))
  usel = (row_of[u_own] >= 0) & u_cross
  ro = row_of[u_own[usel]]
  kv_send_idx.reshape(-1)[ranges(ro * ckvs + kv_soff[u_own[usel], u_psrv[usel]] + u_pos[usel],
                                 u_len[usel])] = (
      ranges(u_s[usel] % t, u_len[usel]))
  return PlanMetadata(q_send_idx=q_send_idx, kv_send_idx=kv_send_idx, q_attn_idx=q_attn_idx,
                      kv_attn_idx=kv_attn_idx, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      o_send_idx=o_send_idx, o_local_idx=o_local_idx,
                      q_routes=routes(q_send_len, q_soff, q_roff, ranks_arr),
                      kv_routes=routes(kv_send_len, kv_soff, kv_roff, ranks_arr),
                      q_send_len=q_send_len,
                      kv_send_len=kv_send_len, q_len=q_len, kv_len=kv_len, num_tasks=num_tasks,
                      task_index=task_index, ranks=ranks_arr, num_servers=s, tokens_per_rank=t,
                      capacity=cap, servers_per_host=int(servers_per_host))


def split_at(g0: np.ndarray, g1: np.ndarray, width: int):
  """Cuts intervals [g0, g1) at multiples of ``width`` (rank boundaries when width = T).

  Empty intervals yield no piece. Returns (interval index, block index, piece start, piece end),
  pieces in interval order.
  """
  g0 = np.asarray(g0, np.int64)
  g1 = np.asarray(g1, np.int64)
  keep = g1 > g0
  g0, g1, src = g0[keep], g1[keep], np.flatnonzero(keep)
  if g0.size == 0:
    z = np.zeros(0, np.int64)
    return z, z, z, z
  r0 = g0 // width
  cnt = (g1 - 1) // width - r0 + 1
  idx = np.repeat(np.arange(g0.size), cnt)
  block = r0[idx] + (np.arange(idx.size) - np.repeat(np.cumsum(cnt) - cnt, cnt))
  return (src[idx], block, np.maximum(g0[idx], block * width),
          np.minimum(g1[idx], (block + 1) * width))


def _route_pieces(owner: np.ndarray, server: np.ndarray, lengths: np.ndarray, s: int):
  """Pieces (owner rank, server, rows) -> (crosses, position inside the (owner, server) group,
  [S, S] rows sent); rows that stay on their owner take no place in the exchange."""
  cross = owner != server
  pos = np.zeros_like(lengths)
  pos[cross] = _slot_positions(server[cross], owner[cross], lengths[cross], s)
  send_len = np.zeros((s, s), np.int64)
  np.add.at(send_len, (owner[cross], server[cross]), lengths[cross])
  return cross, pos, send_len


def _group_offsets(send_len: np.ndarray, send_cap: int, recv_cap: int, what: str, part: str,
                   servers_per_host: int = 0):
  """(send_off [S, S]: where sender p's group for server d starts in p's send buffer, recv_off
  [S, S]: where server d's group from sender p starts in d's receive buffer, indexed [d, p];
  senders in ``recv_order``). Raises when a device sends more than ``send_cap`` or receives
  more than ``recv_cap`` rows."""
  sent, got = send_len.sum(1), send_len.sum(0)
  for name, have, cap, verb in ((f"{part}_send", sent, send_cap, "sends"),
                                (f"{part}_recv", got, recv_cap, "receives")):
    if have.max(initial=0) > cap:
      d = int(np.argmax(have))
      raise ValueError(f"device {d} {verb} {int(have[d])} {what} rows > capacity.{name}={cap}")
  return packed_offsets(send_len, recv_order(send_len.shape[0], servers_per_host))


def recv_order(num_servers: int, servers_per_host: int = 0) -> np.ndarray:
  """Senders in the order of a server's receive buffer: ascending (``servers_per_host`` 0), or
  by (sender local index, sender host) for the two-level exchange (``plan.two_level``) with
  ``servers_per_host`` servers per host."""
  s = np.arange(int(num_servers))
  if not servers_per_host:
    return s
  return np.lexsort((s // servers_per_host, s % servers_per_host))


def packed_offsets(send_len: np.ndarray, order: np.ndarray | None = None):
  """Groups packed from row 0: (send_off [S, S], servers ascending; recv_off [S, S] indexed
  [server, sender], senders in ``order``, default ascending)."""
  send_off = np.cumsum(send_len, axis=1) - send_len
  order = np.arange(send_len.shape[0]) if order is None else np.asarray(order)
  by = send_len[order]
  recv_off = np.empty_like(send_len)
  recv_off[order] = np.cumsum(by, axis=0) - by
  return send_off, recv_off.T


def routes(send_len: np.ndarray, send_off: np.ndarray, recv_off: np.ndarray,
           ranks: np.ndarray) -> np.ndarray:
  """int32 [R, 6, S]: each device's routes of one part (``ROUTE_ROWS``, module docstring)."""
  out = np.stack([send_off, send_len, recv_off, send_len.T, recv_off.T, send_off.T], axis=1)
  return out[ranks].astype(np.int32)


def reverse_routes(routes_6xS):
  """The routes of the opposite direction (the output return of the query exchange, or a
  cotangent going back): sends become receives. Works on NumPy and jax arrays, ``[..., 6, S]``."""
  return routes_6xS[..., (2, 3, 0, 1, 5, 4), :]


def _slot_positions(server: np.ndarray, owner: np.ndarray, lengths: np.ndarray,
                    s: int) -> np.ndarray:
  """Start of each piece inside its (owner, server) group: pieces keep their given order."""
  if server.size == 0:
    return np.zeros(0, np.int64)
  key = server * s + owner
  order = np.argsort(key, kind="stable")
  ln = lengths[order]
  excl = np.cumsum(ln) - ln
  ks = key[order]
  start = np.r_[True, ks[1:] != ks[:-1]]
  base = np.maximum.accumulate(np.where(start, excl, 0))
  pos = np.empty_like(excl)
  pos[order] = excl - base
  return pos


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Concatenation of ``arange(starts[i], starts[i] + lengths[i])`` (int64)."""
  lengths = np.asarray(lengths, dtype=np.int64)
  total = int(lengths.sum())
  if total == 0:
    return np.zeros(0, np.int64)
  offs = np.cumsum(lengths) - lengths
  return np.repeat(np.asarray(starts, np.int64) - offs, lengths) + np.arange(total)
