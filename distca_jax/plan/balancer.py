"""The balancer: spread CA-tasks over in-place attention servers (host, NumPy only).

``scheduling.schedule`` turns a global batch's document layout (``metadata.parse_layout``) into a
``Plan``: which server computes which query shard. Cost units: ``cost.pairs``; caps:
``capacity.Capacity`` (totals per device: rows each sender sends and each server receives).


Balancing (greedy, communication-aware; paper Sec. 4.2)
-------------------------------------------------------
Let ``mean`` be the mean load and ``limit = (1 + tolerance) mean``. While some server is above the
limit, the most needy server (lowest load, not yet found blocked) is the destination; among all
items on servers above the limit (an item is one or two query intervals of one document on one
server), each is scored by ``useful work moved / bytes communicated`` under three options, and the
best (item, option) that passes the exact capacity check is applied:

* whole: move the item;
* mirrored: take ``m`` tokens from the inner end of its head interval ``[a, x)`` and ``m`` from the
  inner start of its tail interval ``[y, b)`` (a single interval is split at its middle). These
  ``m`` mirrored pairs cost exactly ``m (x + y + 1)`` pairs, so the moved work is exact; taking
  the innermost pairs keeps the key range of the moved piece short (``[0, y + m)``);
* suffix: move the last ``k`` tokens ``[b - k, b)`` (keys ``[0, b)``), which needs fewer query
  rows for the same work but the whole key range.

Bytes of a move are the query bytes of moved rows not owned by the destination plus the key/value
bytes of context rows not already present there: the rows of ``[0, b)`` of that document the
destination neither owns nor already receives (a KV row is sent at most once per (sender, server)
pair because every task's key range is a prefix ``[0, b)``). "Useful work" is the move's work
capped at ``min(source excess over limit, destination room to mean)``, so overshooting buys
nothing. A move never pushes its destination above ``limit`` and never creates a query piece
shorter than ``min_shard`` tokens (whole items, however short, may move). The loop is
deterministic: ties go to the lowest item index and the options' fixed order.

It stops when every server is at most ``limit`` (servers below the mean do not slow a step). If
no destination admits a move first (pieces of at least ``min_shard`` tokens do not fit the room a
tight limit leaves, or caps refuse), a second phase keeps lowering the maximum load with the same
greedy under intermediate limits between the current maximum and ``limit`` (more room per
destination). A tight limit can get stuck above where a looser one ends (it spends the
under-loaded servers' room on servers just above the mean, which the looser limit leaves alone),
so a stuck run also balances from the start towards the next larger tolerance of ``LEVELS``
(settled the same way), lowers the maximum from there towards its own limit with both phases,
and keeps whichever ends lower. So a stuck run never ends worse than the run at the next larger
tolerance of ``LEVELS`` (0.01 ... 1 in 1-2-5 steps), and a run that reaches its limit ends
within it (``tests/test_scheduler.py`` checks that a smaller tolerance never ends worse on
Pretrain layouts). ``Plan.degraded`` is set
when the result is above ``limit``, with a reason naming the caps that blocked moves or the
``min_shard`` granularity.
Sufficient condition for reaching the limit without caps: a destination below the mean always has
room ``>= tolerance * mean``, and the smallest move any item allows costs at most
``4 min_shard (L_max + 1)`` pairs (a piece of ``min_shard`` tokens, or a whole item too short to
split: at most two parts shorter than ``2 min_shard`` each); when that is ``<= tolerance * mean``
the greedy always finds a move until every server is within the limit. With ``tolerance = 0`` an
exact balance of integer token counts is generally impossible and the plan reports ``degraded``
within one such piece of the mean.

Sliding-window layers (``window`` w > 0; ``cost.k_starts``, ``cost.pairs``): loads, a move's
exact amount (bisected on windowed work) and traffic (a (document, server)'s key/value rows: the
union of its tasks' key ranges) are windowed; the scores use windowed estimates (``_derive``).

With hosts (``PlanOptions.servers_per_host``) ``hosts.HostBalancer`` runs the same greedy in
three phases and prices bytes by link (``hosts`` module docstring).

The gate (``min_gain``): balancing first asks whether it is worth it. With the linear layers'
work per token in pair units (``linear_pairs_per_token``, from the model), the speedup a perfect
balance could bring is ``1 + (max - mean) / (mean + linear work)`` (``predicted_step_gain`` is
the part past 1); below ``min_gain`` nothing moves and the plan is ``gated``. The data plane
plans each nano-batch apart, so each is gated on its own. Moving rows costs time of its own
(gathers into the attention buffers, the exchange, shorter kernel tasks): on 2 H200s, batches
whose step-work ceiling was 1.00-1.03 ran at 0.965-1.010x packed_dp's speed with CAD, while
those above 1.05 took their whole ceiling (results/per_batch_bound.md).
"""

from __future__ import annotations

import math

import numpy as np

from distca_jax.plan.capacity import CAP_FIELDS, Capacity
from distca_jax.plan.cost import k_starts, pairs
from distca_jax.plan.intervals import first_reaching, last_within, merge, subtract

SPLITS = ("auto", "mirrored", "suffix")
# Tolerances a stuck run falls back on, increasing (see ``Balancer._settle``).
LEVELS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


# ---------------------------------------------------------------------------------------------
# The balancer.
# ---------------------------------------------------------------------------------------------
class Balancer:
  """Mutable state of one greedy run; see the module docstring for the rules.

  An item is one or two query intervals of one document on one server: the head
  ``[head_lo, head_hi)`` and the tail ``[tail_lo, tail_hi)`` (one interval when
  ``head_hi == tail_lo``). Item arrays (``item_doc``, ``head_lo`` ... ``item_server``) hold
  ``num_items`` live rows. ``intervals[(doc, server)]`` is the truth for tasks and traffic;
  ``loads``, ``q_rows``, ``kv_attn_rows`` and ``num_tasks`` are per server, ``pair_q_rows`` and
  ``pair_kv_rows`` per (sender, server), and their totals ``send_q`` / ``send_kv`` (row sums: per
  sender) and ``recv_q`` / ``recv_kv`` (column sums: per server) are what the caps bound.
  """

  def __init__(self, lens: np.ndarray, starts: np.ndarray, num_servers: int,
               tokens_per_rank: int, tolerance: float, min_shard: int, capacity: Capacity,
               q_row_bytes: float, kv_row_bytes: float, split: str, window: int = 0):
    s, t = num_servers, tokens_per_rank
    self.window = int(window)
    self.num_servers, self.tokens_per_rank = s, t
    self.tolerance, self.min_shard, self.capacity = tolerance, min_shard, capacity
    self.q_row_bytes, self.kv_row_bytes, self.split = q_row_bytes, kv_row_bytes, split
    self.host: np.ndarray | None = None  # [S] host of each server (``hosts.HostBalancer``)
    self.doc_starts = starts.tolist()
    self.doc_starts_np = np.asarray(starts, np.float64)
    jn = lens.size
    first = starts // t
    last = (starts + lens - 1) // t
    self.doc_first_rank = first
    nseg = (last - first + 1) if jn else np.zeros(0, np.int64)
    doc = np.repeat(np.arange(jn), nseg)
    off = np.arange(doc.size) - np.repeat(np.cumsum(nseg) - nseg, nseg)
    rank = first[doc] + off
    lo = np.maximum(0, rank * t - starts[doc])
    hi = np.minimum(lens[doc], (rank + 1) * t - starts[doc])
    n0 = doc.size
    self.num_items = n0
    size = n0 + 4 * s + 64
    self.item_doc = np.zeros(size, np.int64)
    self.head_lo = np.zeros(size)
    self.head_hi = np.zeros(size)
    self.tail_lo = np.zeros(size)
    self.tail_hi = np.zeros(size)
    self.item_work = np.zeros(size)
    self.item_server = np.zeros(size, np.int64)
    mid = (lo + hi) // 2
    self.item_doc[:n0] = doc
    self.head_lo[:n0] = lo
    self.head_hi[:n0] = mid
    self.tail_lo[:n0] = mid
    self.tail_hi[:n0] = hi
    self.item_work[:n0] = pairs(lo, hi, self.window)
    self.item_server[:n0] = rank
    self.seg_rank, self.seg_lo, self.seg_hi = rank, lo, hi
    # (doc, server) -> sorted merged query intervals: the truth for tasks and traffic.
    self.intervals: dict[tuple[int, int], list[tuple[int, int]]] = {
        (j, r): [(a, b)] for j, r, a, b in zip(doc.tolist(), rank.tolist(), lo.tolist(),
                                               hi.tolist())}
    self.loads = np.bincount(rank, weights=pairs(lo, hi, self.window).astype(np.float64),
                             minlength=s)
    self.q_rows = np.bincount(rank, weights=(hi - lo).astype(np.float64), minlength=s)
    self.kv_attn_rows = np.bincount(
        rank, weights=(hi - k_starts(lo, self.window)).astype(np.float64), minlength=s)
    self.num_tasks = np.bincount(rank, minlength=s).astype(np.float64)
    self.pair_q_rows = np.zeros((s, s))
    self.pair_kv_rows = np.zeros((s, s))
    self.spanning_docs = set(np.flatnonzero(nseg > 1).tolist())
    # Docs whose bytes to a destination need exact correction: spanning docs owned by it, and
    # docs it has received pieces of.
    self.exact_docs: list[set[int]] = [set() for _ in range(s)]
    self.doc_items: dict[int, list[int]] = {}
    for i, (j, r, a) in enumerate(zip(doc.tolist(), rank.tolist(), lo.tolist())):
      if j in self.spanning_docs:
        self.exact_docs[r].add(j)
        self.doc_items.setdefault(j, []).append(i)
        if a > 0:
          for o, cnt in self._owner_rows(j, int(k_starts(a, self.window)), a):
            if o != r:
              self.pair_kv_rows[o, r] += cnt
    self.send_q, self.recv_q = np.zeros(s), np.zeros(s)
    self.send_kv, self.recv_kv = self.pair_kv_rows.sum(1), self.pair_kv_rows.sum(0)
    self.num_moves = 0

  # -- ownership ------------------------------------------------------------------------------
  def _owner_rows(self, j: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """[(rank, rows)] of document ``j``'s rows [lo, hi) by owning rank."""
    t = self.tokens_per_rank
    g0, g1 = self.doc_starts[j] + lo, self.doc_starts[j] + hi
    out = []
    r = g0 // t
    while g0 < g1:
      e = min(g1, (r + 1) * t)
      out.append((r, e - g0))
      g0, r = e, r + 1
    return out

  def _own_overlap(self, j: int, d: int, lo: int, hi: int) -> int:
    """Rows of document ``j``'s [lo, hi) owned by rank ``d``."""
    g = self.doc_starts[j]
    olo, ohi = max(lo, d * self.tokens_per_rank - g), min(hi, (d + 1) * self.tokens_per_rank - g)
    return max(0, ohi - olo)

  def _key_union(self, ivs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Key/value rows the tasks ``ivs`` of a (document, server) read: ``[k_start, hi)`` merged."""
    if not self.window:
      return [(0, ivs[-1][1])] if ivs else []
    return merge([(int(k_starts(lo, self.window)), hi) for lo, hi in ivs])

  def _stats(self, j: int, d: int, ivs: list[tuple[int, int]]):
    """(load, q rows, tasks, kv attention rows, {owner: q rows}, {owner: kv rows})."""
    load = q = kva = 0
    pq: dict[int, int] = {}
    pkv: dict[int, int] = {}
    span, w = j in self.spanning_docs, self.window
    for lo, hi in ivs:
      load += int(pairs(lo, hi, w)) if w else (hi - lo) * (lo + hi + 1) // 2
      q += hi - lo
      kva += hi - int(k_starts(lo, w))
      if span:
        for o, c in self._owner_rows(j, lo, hi):
          if o != d:
            pq[o] = pq.get(o, 0) + c
    if ivs:
      keys = self._key_union(ivs)
      if span:
        for klo, khi in keys:
          for o, c in self._owner_rows(j, klo, khi):
            if o != d:
              pkv[o] = pkv.get(o, 0) + c
      else:
        o = self.doc_starts[j] // self.tokens_per_rank
        if o != d:
          pq[o] = q
          pkv[o] = sum(khi - klo for klo, khi in keys)
    return load, q, len(ivs), kva, pq, pkv

  # -- one move -------------------------------------------------------------------------------
  def _exact(self, i: int, opt: int, d: int, t_useful: float, room: float,
             upper: float = math.inf, effects: bool = True):
    """Exact integer version of option ``opt`` (0 whole, 1 mirrored, 2 suffix) for item ``i``.

    ``m`` (mirrored pairs) or ``k`` (suffix tokens) is the smallest amount whose work reaches
    ``t_useful``, within [min_shard bound, ``upper``] and the destination ``room``; if that
    overflows a cap, halved amounts are tried down to the minimum.

    Returns (moved intervals, kept item (a, x, y, b) or None, moved item, work, where, effects)
    or a string naming why it is infeasible (a cap name, or 'shape'). Without ``effects`` (no
    caps to check): (moved intervals, kept item, moved item, work) only.
    """
    if not effects:
      def settle(moved, kept, new):
        return moved, kept, new, sum(int(pairs(lo, hi, self.window)) for lo, hi in moved)
    else:
      def settle(moved, kept, new):
        return self._effects(i, d, moved, kept, new)
    a, x = int(self.head_lo[i]), int(self.head_hi[i])
    y, b = int(self.tail_lo[i]), int(self.tail_hi[i])
    two = x < y
    m0 = self.min_shard
    upper = int(min(upper, b))
    if opt == 0:
      if self.item_work[i] > room:
        return "shape"
      return settle([(a, x), (y, b)] if two else [(a, b)], None, (a, x, y, b))
    w = self.window
    if opt == 1:
      c1 = x + y + 1
      m_lo = max(m0 if two else (m0 + 1) // 2, 1)
      m_top = min(min(x - a, b - y) - m0, upper)
      if w:  # windowed work of m mirrored pairs: monotone in m, bisected
        work = ((lambda m: int(pairs(x - m, x, w) + pairs(y, y + m, w))) if two
                else (lambda m: int(pairs(x - m, x + m, w))))
        m_hi = min(m_top, last_within(work, room, m_top))
        m = min(max(first_reaching(work, t_useful, m_hi), m_lo), m_hi)
      else:
        m_hi = min(m_top, int(room // c1))
        m = min(max(math.ceil(t_useful / c1), m_lo), m_hi)
      if m < m_lo:
        return "shape"
      while True:
        if two:
          moved, new = [(x - m, x), (y, y + m)], (x - m, x, y, y + m)
        else:
          moved, new = [(x - m, x + m)], (x - m, x, x, x + m)
        res = settle(moved, (a, x - m, y + m, b), new)
        if not isinstance(res, str) or m == m_lo:
          return res
        m = max(m_lo, m // 2)
    last_lo = y if two else a
    bb = 2 * b + 1

    def w_of(k):
      return int(pairs(b - k, b, w)) if w else k * (bb - k) // 2

    def k_for(target: float) -> int:
      """Smallest k with w_of(k) >= target."""
      k = max(0, math.ceil((bb - math.sqrt(max(bb * bb - 8.0 * target, 0.0))) / 2))
      while k > 0 and w_of(k - 1) >= target:
        k -= 1
      while w_of(k) < target and k < b - last_lo:
        k += 1
      return k

    if w:
      k_room = last_within(w_of, room, b - last_lo)
      k_for = lambda target: first_reaching(w_of, target, b - last_lo)  # noqa: E731
    else:
      k_room = k_for(room)
      if w_of(k_room) > room:
        k_room -= 1
    k_lo = max(m0, 1)
    k_hi = min(b - last_lo - m0, k_room, upper)
    k = min(max(k_for(t_useful), k_lo), k_hi)
    if k < k_lo:
      return "shape"
    while True:
      new = (b - k, b - k + k // 2, b - k + k // 2, b)
      if two:
        kept = (a, x, y, b - k)
      else:
        km = (a + b - k) // 2
        kept = (a, km, km, b - k)
      res = settle([(b - k, b)], kept, new)
      if not isinstance(res, str) or k == k_lo:
        return res
      k = max(k_lo, k // 2)

  def _effects(self, i: int, d: int, moved, kept, new):
    """Per-server and per-pair deltas of moving ``moved`` of item ``i`` to ``d``; checks caps."""
    j = int(self.item_doc[i])
    s = int(self.item_server[i])
    old_s = self.intervals[(j, s)]
    new_s = subtract(old_s, moved)
    old_d = self.intervals.get((j, d), [])
    new_d = merge(old_d + moved)
    eff = []
    for srv_, old, new_ivs in ((s, old_s, new_s), (d, old_d, new_d)):
      st0 = self._stats(j, srv_, old)
      st1 = self._stats(j, srv_, new_ivs)
      dpq = {o: st1[4].get(o, 0) - st0[4].get(o, 0) for o in set(st0[4]) | set(st1[4])}
      dpkv = {o: st1[5].get(o, 0) - st0[5].get(o, 0) for o in set(st0[5]) | set(st1[5])}
      eff.append((srv_, st1[0] - st0[0], st1[1] - st0[1], st1[2] - st0[2], st1[3] - st0[3],
                  dpq, dpkv))
    cap = self.capacity
    for srv_, _, dq, dt, dkva, dpq, dpkv in eff:
      if cap.q_tokens is not None and dq > 0 and self.q_rows[srv_] + dq > cap.q_tokens:
        return "q_tokens"
      if cap.tasks is not None and dt > 0 and self.num_tasks[srv_] + dt > cap.tasks:
        return "tasks"
      if cap.kv_tokens is not None and dkva > 0 and self.kv_attn_rows[srv_] + dkva > cap.kv_tokens:
        return "kv_tokens"
    totals = (("q_send", self.send_q), ("q_recv", self.recv_q), ("kv_send", self.send_kv),
              ("kv_recv", self.recv_kv))
    if any(getattr(cap, name) is not None for name, _ in totals):
      for (name, have), delta in zip(totals, _traffic_deltas(eff)):
        c = getattr(cap, name)
        if c is not None and any(dr > 0 and have[r] + dr > c for r, dr in delta.items()):
          return name
    work = eff[1][1]
    return moved, kept, new, work, (s, new_s, new_d), eff

  def _apply(self, i: int, d: int, res) -> None:
    moved, kept, new, work, (s, new_s, new_d), eff = res
    j = int(self.item_doc[i])
    for srv_, dload, dq, dt, dkva, dpq, dpkv in eff:
      self.loads[srv_] += dload
      self.q_rows[srv_] += dq
      self.num_tasks[srv_] += dt
      self.kv_attn_rows[srv_] += dkva
      for o, c in dpq.items():
        self.pair_q_rows[o, srv_] += c
        self.send_q[o] += c
        self.recv_q[srv_] += c
      for o, c in dpkv.items():
        self.pair_kv_rows[o, srv_] += c
        self.send_kv[o] += c
        self.recv_kv[srv_] += c
    if new_s:
      self.intervals[(j, s)] = new_s
    else:
      del self.intervals[(j, s)]
    self.intervals[(j, d)] = new_d
    if kept is None:
      self.item_server[i] = d
      ni = i
    else:
      self._set_item(i, kept)
      ni = self.num_items
      if ni >= self.item_doc.size:
        self._grow()
      self.item_doc[ni] = j
      self.item_server[ni] = d
      self._set_item(ni, new)
      self.num_items += 1
    self.exact_docs[d].add(j)
    items = self.doc_items.setdefault(j, [])
    if not items:
      items.append(i)
    if ni != i:
      items.append(ni)
    self.num_moves += 1

  def _set_item(self, i: int, shape) -> None:
    a, x, y, b = shape
    if x == a or y == b:  # one side empty: re-centre a single interval
      lo, hi = (y, b) if x == a else (a, x)
      a, b = lo, hi
      x = y = (lo + hi) // 2
    self.head_lo[i], self.head_hi[i], self.tail_lo[i], self.tail_hi[i] = a, x, y, b
    self.item_work[i] = pairs(a, x, self.window) + pairs(y, b, self.window)

  def _grow(self) -> None:
    for name in ("item_doc", "head_lo", "head_hi", "tail_lo", "tail_hi", "item_work",
                 "item_server"):
      arr = getattr(self, name)
      setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))

  # -- scoring --------------------------------------------------------------------------------
  # Derived per-item quantities the scorer needs, cached for the pool (rows aligned with it).
  def _derive(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    a, x, y, b = self.head_lo[idx], self.head_hi[idx], self.tail_lo[idx], self.tail_hi[idx]
    two = x < y
    m0 = float(self.min_shard)
    c1 = x + y + 1
    rows_w = (x - a) + (b - y)
    bb = 2 * b + 1
    w, kv_b = self.window, b
    if w:  # windowed: an innermost mirrored pair's work, the keys [k_start(a), b)
      c1, kv_b = np.minimum(x, w) + np.minimum(y + 1, w), b - np.maximum(a - w + 1, 0)
    return {
        "srv": self.item_server[idx], "own": self.doc_first_rank[self.item_doc[idx]],
        "w": self.item_work[idx],
        "b": b, "kv_b": kv_b, "x": x, "y": y, "two": two, "c1": c1, "inv_c1": 1.0 / c1,
        "m_lo": np.maximum(np.where(two, m0, math.ceil(m0 / 2)), 1.0),
        "m_hi": np.minimum(x - a, b - y) - m0,
        "rows_w": rows_w, "a": a, "g": self.doc_starts_np[self.item_doc[idx]],
        "kva_w": np.where(two, x + b, b), "kva_m0": np.where(two, x + y, y),
        "parts_w": np.where(two, 2.0, 1.0), "bb": bb, "bb2": bb * bb,
        "k_hi": b - np.where(two, y, a) - m0}

  def _set_pool(self, pool: np.ndarray) -> None:
    self.pool = pool
    self.pool_items = self._derive(pool)

  def _filter_pool(self, keep: np.ndarray) -> None:
    self.pool = self.pool[keep]
    self.pool_items = {k: v[keep] for k, v in self.pool_items.items()}

  def _refresh_pool_item(self, i: int) -> None:
    p = int(np.searchsorted(self.pool, i))
    if p < self.pool.size and self.pool[p] == i:
      one = self._derive(np.asarray([i]))
      for k, v in one.items():
        self.pool_items[k][p] = v[0]

  def _score(self, d: int, exc: np.ndarray, soft: float, room: float, use_caps: bool = True):
    """Scores every pool item for destination ``d``.

    Returns (candidate items [n], priorities [3, n] (rows: whole, mirrored, suffix; -1 marks an
    infeasible option), useful targets [n], amount bounds [3, n] from the caps).
    """
    c = self.pool
    if c.size == 0:
      return c, None, None, None
    with np.errstate(divide="ignore", invalid="ignore"):
      return self._score_pool(d, exc, soft, room, use_caps)

  def _score_pool(self, d: int, exc: np.ndarray, soft: float, room: float, use_caps: bool):
    c = self.pool
    pc = self.pool_items
    cap = self.capacity
    tu = np.minimum(exc[pc["srv"]], soft)
    m0 = float(self.min_shard)
    qb, kvb = self._row_bytes(d, pc)
    prio = np.empty((3, c.size))
    upper = np.full((3, c.size), np.inf)
    w = pc["w"]
    # Destination room left under each cap (a move into the document's own rank uses no pair).
    inf = np.inf
    capped = use_caps and any(getattr(cap, f) is not None for f in CAP_FIELDS)
    if capped:
      free_q = inf if cap.q_tokens is None else cap.q_tokens - self.q_rows[d]
      free_t = inf if cap.tasks is None else cap.tasks - self.num_tasks[d]
      free_kva = inf if cap.kv_tokens is None else cap.kv_tokens - self.kv_attn_rows[d]
      home = pc["own"] == d
      # Rows the owner may still send and the destination may still receive (the exact
      # check, ``_effects``, also counts the owners of spanning documents' other segments).
      def room_of(send_cap, recv_cap, sent, got):
        room = np.full(c.size, inf)
        if send_cap is not None:
          room = np.minimum(room, send_cap - sent[pc["own"]])
        if recv_cap is not None:
          room = np.minimum(room, recv_cap - got[d])
        return np.where(home, inf, room)
      free_qs = room_of(cap.q_send, cap.q_recv, self.send_q, self.recv_q)
      free_kvs = room_of(cap.kv_send, cap.kv_recv, self.send_kv, self.recv_kv)
      free_rows = np.minimum(free_qs, free_q)
    # Option 0: the whole item.
    np.divide(np.minimum(w, tu), qb * pc["rows_w"] + kvb * pc["kv_b"], out=prio[0])
    bad = w > room
    if capped:
      bad |= ((pc["rows_w"] > free_rows) | (pc["parts_w"] > free_t) | (pc["kva_w"] > free_kva)
              | (pc["b"] > free_kvs))
    prio[0][bad] = -1.0
    # Option 1: m innermost mirrored pairs, m in [m_lo, m_up].
    if self.split != "suffix":
      c1 = pc["c1"]
      m_up = np.minimum(pc["m_hi"], np.floor(room * pc["inv_c1"]))
      m_lo = pc["m_lo"]
      bad = np.zeros(c.size, dtype=bool)
      if capped:
        np.minimum(m_up, np.floor(free_rows / 2), out=m_up)
        np.minimum(m_up, free_kva - pc["kva_m0"], out=m_up)
        np.minimum(m_up, free_kvs - pc["y"], out=m_up)
        bad |= np.where(pc["two"], 2.0, 1.0) > free_t
        # A single interval split in the middle leaves two tasks on the source.
        single = ~pc["two"]
        if cap.tasks is not None:
          bad |= single & (self.num_tasks[pc["srv"]] + 1 > cap.tasks)
        if cap.kv_tokens is not None:
          src_free = cap.kv_tokens - self.kv_attn_rows[pc["srv"]]
          m_lo = np.where(single, np.maximum(m_lo, pc["x"] - src_free), m_lo)
      upper[1] = m_up
      m = np.ceil(tu * pc["inv_c1"])
      np.maximum(m, m_lo, out=m)
      np.minimum(m, m_up, out=m)
      kv_y = pc["y"] if not self.window else np.minimum(pc["y"], self.window - 1.0)
      np.divide(np.minimum(m * c1, tu), m * (2 * qb + kvb) + kvb * kv_y, out=prio[1])
      prio[1][bad | (m < m_lo)] = -1.0
    else:
      prio[1] = -1.0
    # Option 2: the last k tokens, k in [min_shard, k_up].
    if self.split != "mirrored":
      bb, bb2 = pc["bb"], pc["bb2"]
      k_up = pc["k_hi"].copy()
      bad = np.zeros(c.size, dtype=bool)
      if capped:
        np.minimum(k_up, free_rows, out=k_up)
        bad |= (1.0 > free_t) | (pc["b"] > free_kva) | (pc["b"] > free_kvs)
      if self.window:  # a suffix token holds about min(b, w) pairs and reads w - 1 more keys
        per = np.minimum(pc["b"], float(self.window))
        k = np.minimum(np.minimum(np.maximum(np.ceil(tu / per), m0), k_up), np.floor(room / per))
        work, kv_rows = k * per, np.minimum(pc["b"], k + self.window - 1.0)
      else:
        k = np.ceil(0.5 * (bb - np.sqrt(np.maximum(bb2 - 8 * tu, 0.0))))
        np.maximum(k, m0, out=k)
        np.minimum(k, k_up, out=k)
        over = k * (bb - k) > 2 * room
        if over.any():
          k_room = np.floor(0.5 * (bb - np.sqrt(np.maximum(bb2 - 8 * room, 0.0))))
          k = np.where(over, k_room, k)
        work, kv_rows = 0.5 * k * (bb - k), pc["b"]
      upper[2] = k_up
      np.divide(np.minimum(work, tu), qb * k + kvb * kv_rows, out=prio[2])
      prio[2][bad | (k < max(m0, 1.0))] = -1.0
    else:
      prio[2] = -1.0
    # Exact scores for documents already (partly) at the destination or owned by it: their bytes
    # (rows already there) and caps (merged intervals) differ from the formulas above.
    docs = self.exact_docs[d]
    if docs:
      items = [i for j in docs for i in self.doc_items.get(j, ())]
      if items:
        pos = np.minimum(np.searchsorted(c, np.asarray(items, dtype=np.int64)), c.size - 1)
        for i, p in zip(items, pos.tolist()):
          if c[p] == i:
            self._correct(i, p, d, prio, upper, float(tu[p]), room, use_caps)
    return c, prio, tu, upper

  def _row_bytes(self, d: int, pc: dict[str, np.ndarray]):
    """(query, key/value) bytes per row the pool's items cost sent to ``d``."""
    return self.q_row_bytes, self.kv_row_bytes

  def _correct(self, i: int, p: int, d: int, prio: np.ndarray, upper: np.ndarray, tu: float,
               room: float, use_caps: bool) -> None:
    """Recomputes the priorities of candidate ``p`` (item ``i``) with exact bytes and caps."""
    j = int(self.item_doc[i])
    ivs = self.intervals.get((j, d))
    have = ivs[-1][1] if ivs else 0
    saved = self.capacity
    if not use_caps:
      self.capacity = Capacity()
    capped = any(getattr(self.capacity, f) is not None for f in CAP_FIELDS)
    try:
      for opt in range(3):
        upper[opt, p] = np.inf
        if (opt == 1 and self.split == "suffix") or (opt == 2 and self.split == "mirrored"):
          continue
        res = self._exact(i, opt, d, tu, room, effects=capped)
        if isinstance(res, str):
          prio[opt, p] = -1.0
          continue
        moved, work = res[0], res[3]
        nbytes = self._move_bytes(j, d, moved, have)
        prio[opt, p] = min(work, tu) / nbytes if nbytes > 0 else np.inf
    finally:
      self.capacity = saved

  def _move_bytes(self, j: int, d: int, moved, have: int) -> float:
    """Bytes of sending ``moved`` query intervals of document ``j`` to ``d``, which already
    holds its key/value rows ``[0, have)``: the rows ``d`` does not own."""
    end = max(hi for _, hi in moved)
    q_rows = sum(hi - lo - self._own_overlap(j, d, lo, hi) for lo, hi in moved)
    kv_rows = (end - have - self._own_overlap(j, d, have, end)) if end > have else 0
    return self.q_row_bytes * q_rows + self.kv_row_bytes * kv_rows

  def run(self, mean: float, max_moves: int) -> str:
    """Greedy balancing from the initial state; returns '' on success or the reason it stopped
    above the limit."""
    return self._settle(self.tolerance, mean, self.loads.max(), max_moves)

  def _settle(self, tol: float, mean: float, top0: float, max_moves: int) -> str:
    """Balances the initial state (maximum ``top0``) towards ``(1 + tol) * mean``; returns ''
    on success or the reason it stopped above.

    Phase 1 balances towards the limit. If it gets stuck above it (pieces no smaller than
    ``min_shard`` do not fit the room destinations have under a tight limit, or caps refuse),
    phase 2 keeps lowering the maximum with intermediate limits (``_lower``). A tight limit can
    get stuck worse than a looser one ends: it spends the under-loaded servers' room on servers
    a looser limit leaves alone. So a stuck run also settles the next larger tolerance of
    ``LEVELS`` (the same way) from the initial state, lowers the maximum from there towards
    this limit, and keeps whichever of the two ends lower: never worse than the larger one.
    """
    target = (1.0 + tol) * mean
    status = self._run_at(mean, target, max_moves)
    if status != "stuck":
      return status
    status = self._lower(mean, target, max_moves)
    if status != "stuck":
      return status
    up = next((v for v in LEVELS if v > tol), None)
    if up is None or (1.0 + up) * mean >= top0:
      return self._why_stopped(mean, target)
    stuck, stuck_top = self.__dict__, self.loads.max()
    self.__dict__ = self._initial().__dict__
    status = self._settle(up, mean, top0, max_moves)
    if not status.startswith("move limit") and self.loads.max() > target * (1 + 1e-12):
      status = self._run_at(mean, target, max_moves)
      if status == "stuck":
        status = self._lower(mean, target, max_moves)
    if self.loads.max() >= stuck_top:
      self.__dict__ = stuck
      return self._why_stopped(mean, target)
    if status.startswith("move limit"):
      return status
    return "" if self.loads.max() <= target * (1 + 1e-12) else self._why_stopped(mean, target)

  def _lower(self, mean: float, target: float, max_moves: int,
             members: np.ndarray | None = None) -> str:
    """Phase 2: reruns the greedy with limits between the current maximum and ``target`` (more
    room per destination) while that lowers the maximum; '', 'stuck' or the move-limit reason.
    ``members``: among these servers only (``_run_at``)."""
    loads = lambda: self.loads if members is None else self.loads[members]
    for _ in range(64):
      top = loads().max()
      for frac in (0.5, 0.8, 0.95):
        moves = self.num_moves
        status = self._run_at(mean, target + (top - target) * frac, max_moves, members)
        if status.startswith("move limit"):
          return status
        if self.num_moves > moves and loads().max() < top:
          break
      else:
        break
      if loads().max() <= target * (1 + 1e-12):
        return ""
    return "stuck"

  def _initial(self) -> Balancer:
    """A new (host-blind) balancer in this one's initial state (nothing moved)."""
    lens = np.zeros(len(self.doc_starts), np.int64)
    # The first items are the initial segments, in document order; they keep their document.
    np.maximum.at(lens, self.item_doc[:self.seg_hi.size], self.seg_hi.astype(np.int64))
    return Balancer(lens, np.asarray(self.doc_starts, np.int64), self.num_servers,
                    self.tokens_per_rank, self.tolerance, self.min_shard, self.capacity,
                    self.q_row_bytes, self.kv_row_bytes, self.split, window=self.window)

  def _run_at(self, mean: float, limit: float, max_moves: int,
              members: np.ndarray | None = None, across: float | None = None) -> str:
    """Greedy loop towards ``limit``: '' when reached, 'stuck', or the move-limit reason.

    ``members`` ([S] bool): sources and destinations only among these servers. ``across``
    (hosts known): the loop is over hosts instead, towards at most ``across`` pairs per server
    of each host (the host limit, ``servers_per_host * across``): sources are the servers above
    the mean on hosts above it (their excess is the host's), destinations the servers below
    ``limit`` of hosts below it (their room at most the host's), and it stops when every host
    is within it.
    """
    lim_eps = limit * (1 + 1e-12)
    if across is not None:
      per_host = self.servers_per_host
      host_loads = lambda: self.loads.reshape(-1, per_host).sum(1)
      host_lim = per_host * across
      host_lim_eps = host_lim * (1 + 1e-12)
      # Sources: the servers above the mean on hosts above their limit.
      over = (host_loads() > host_lim_eps)[self.host] & (self.loads > mean)
    else:
      over = self.loads > lim_eps
    never = np.zeros(self.num_servers, dtype=bool) if members is None else ~members
    over &= ~never
    blocked = never.copy()
    moves_at_clear = self.num_moves
    # Servers only leave the overloaded set (destinations never pass the limit), so the pool of
    # candidate items only shrinks: filter it when a source drops out or an item moves whole.
    self._set_pool(np.flatnonzero(over[self.item_server[:self.num_items]]))
    while True:
      if across is not None:
        if host_loads().max() <= host_lim_eps:
          return ""
      elif (self.loads if members is None else self.loads[members]).max() <= lim_eps:
        return ""
      if self.num_moves >= max_moves:
        return f"move limit {max_moves} reached"
      if across is not None:
        # A host's room is what it can take and still balance inside: its servers' total room.
        hl = host_loads()
        host_room = (host_lim - hl)[self.host]
        cand = np.where(blocked | (self.loads >= limit) | (host_room <= 0)
                        | (hl > host_lim_eps)[self.host], np.inf, self.loads)
      else:
        cand = np.where(blocked | (self.loads >= limit), np.inf, self.loads)
      d = int(np.argmin(cand))
      if not np.isfinite(cand[d]):
        # Every destination is blocked. Moves since the last sweep may have changed the pool
        # (smaller kept pieces), so sweep again once; stop when a sweep moved nothing.
        if self.num_moves > moves_at_clear and (blocked & ~never).any():
          blocked[:] = never
          moves_at_clear = self.num_moves
          continue
        return "stuck"
      room = limit - self.loads[d]
      soft = mean - self.loads[d]
      if across is not None:
        exc = (hl - host_lim)[self.host]
        room = min(room, host_room[d])
        soft = min(soft, per_host * mean - hl[self.host[d]])
      else:
        exc = self.loads - limit
      if soft <= 0:
        soft = room
      c, prio, tu, upper = self._score(d, exc, soft, room)
      done = False
      if prio is not None:
        flat = prio.reshape(-1)
        for _ in range(64):
          f = int(np.argmax(flat))
          if flat[f] <= 0:
            break
          opt, p = divmod(f, c.size)
          i = int(c[p])
          res = self._exact(i, opt, d, float(tu[p]), room, float(upper[opt, p]))
          if isinstance(res, str):
            flat[f] = -1.0
            continue
          src = int(self.item_server[i])
          self._apply(i, d, res)
          if across is not None and host_loads()[self.host[src]] <= host_lim_eps:
            self._filter_pool(self.host[self.pool_items["srv"]] != self.host[src])
          elif across is None and self.loads[src] <= lim_eps:
            self._filter_pool(self.pool_items["srv"] != src)
          elif res[1] is None:
            self._filter_pool(self.pool != i)
          else:
            self._refresh_pool_item(i)
          done = True
          break
      if not done:
        blocked[d] = True
        if self.host is not None and not any(getattr(self.capacity, f) is not None
                                             for f in CAP_FIELDS):
          # Uncapped, whether a piece fits depends only on the room: no destination with less
          # room than d takes one either.
          rooms = limit - self.loads
          if across is not None:
            rooms = np.minimum(rooms, host_room)
          blocked[rooms <= room] = True

  def _why_stopped(self, mean: float, limit: float) -> str:
    """Explains why no destination admits a move: the caps (which) or min_shard granularity."""
    exc = self.loads - limit
    refused: dict[str, int] = {}
    for d in np.flatnonzero(self.loads < limit).tolist():
      room = limit - self.loads[d]
      soft = mean - self.loads[d]
      c, prio, tu, _ = self._score(d, exc, soft if soft > 0 else room, room, use_caps=False)
      if prio is None or prio.max() <= 0:
        continue
      # Without caps a move exists: name the caps refusing the best uncapped moves.
      flat = prio.reshape(-1)
      for f in np.argsort(-flat, kind="stable")[:4].tolist():
        if flat[f] <= 0:
          break
        opt, p = divmod(f, c.size)
        res = self._exact(int(c[p]), opt, d, float(tu[p]), room)
        if isinstance(res, str) and res != "shape":
          refused[res] = refused.get(res, 0) + 1
    if refused:
      caps = ", ".join(f"{k}={getattr(self.capacity, k)}" for k in sorted(refused))
      return f"capacity blocked moves ({caps}); raise those caps for better balance"
    return (f"no movable piece fits: items on overloaded servers are unsplittable under "
            f"min_shard={self.min_shard} or larger than the room left on under-loaded servers")


def _traffic_deltas(eff) -> tuple[dict[int, int], ...]:
  """Per-rank changes of (query rows sent, query rows received, key/value rows sent, key/value
  rows received) of a move's per-server effects (``Balancer._effects``)."""
  out: tuple[dict[int, int], ...] = ({}, {}, {}, {})
  for srv_, _, _, _, _, dpq, dpkv in eff:
    for (send, recv), pair in (((out[0], out[1]), dpq), ((out[2], out[3]), dpkv)):
      for o, c in pair.items():
        send[o] = send.get(o, 0) + c
        recv[srv_] = recv.get(srv_, 0) + c
  return out
