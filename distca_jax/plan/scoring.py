"""The balancer's scores: every pool item's priority per option for one destination (host, NumPy).

``Scoring`` is a mixin of ``balancer.Balancer``: it reads the balancer's state (pool, intervals,
loads, caps) and writes nothing but the arrays it returns. ``_score_pool`` scores all items at once
with closed forms (whole item, mirrored pairs, suffix; the options of the ``balancer`` module
docstring); ``_correct`` rescores, with exact bytes and caps, the items of documents already at or
owned by the destination, where those forms are not exact. With a sliding window the closed forms
are windowed estimates and ``_correct`` takes the general path (``Balancer._exact``).
"""

from __future__ import annotations

import math

import numpy as np

from distca_jax.plan.capacity import CAP_FIELDS, Capacity


class Scoring:
  """Scores of moves for ``balancer.Balancer`` (a mixin; see the module docstring)."""

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
    if not self.window and (not use_caps or not any(
        getattr(self.capacity, f) is not None for f in CAP_FIELDS)):
      self._correct_uncapped(i, p, j, d, have, prio, upper, tu, room)
      return
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

  def _correct_uncapped(self, i: int, p: int, j: int, d: int, have: int, prio: np.ndarray,
                        upper: np.ndarray, tu: float, room: float) -> None:
    """``_correct`` without caps or window: the amounts ``_exact`` picks and the bytes
    ``_move_bytes`` counts, in scalar arithmetic."""
    a, x = int(self.head_lo[i]), int(self.head_hi[i])
    y, b = int(self.tail_lo[i]), int(self.tail_hi[i])
    rows = self._priced_rows
    qb, kvb = self.q_row_bytes, self.kv_row_bytes

    def put(opt, work, q_rows, end):
      nbytes = qb * q_rows + (kvb * rows(j, d, have, end) if end > have else 0.0)
      prio[opt, p] = min(work, tu) / nbytes if nbytes > 0 else np.inf

    upper[:, p] = np.inf
    if self.item_work[i] > room:
      prio[0, p] = -1.0
    else:
      put(0, float(self.item_work[i]), rows(j, d, a, b) - rows(j, d, x, y), b)
    m0 = self.min_shard
    if self.split != "suffix":
      c1 = x + y + 1
      m_lo = max(m0 if x < y else (m0 + 1) // 2, 1)
      m_hi = min(min(x - a, b - y) - m0, int(room // c1), b)
      m = min(max(math.ceil(tu / c1), m_lo), m_hi)
      if m < m_lo:
        prio[1, p] = -1.0
      else:
        put(1, m * c1, rows(j, d, x - m, x) + rows(j, d, y, y + m), y + m)
    if self.split != "mirrored":
      last_lo = y if x < y else a
      bb = 2 * b + 1

      def k_for(target: float) -> int:
        k = max(0, math.ceil((bb - math.sqrt(max(bb * bb - 8.0 * target, 0.0))) / 2))
        while k > 0 and (k - 1) * (bb - k + 1) // 2 >= target:
          k -= 1
        while k * (bb - k) // 2 < target and k < b - last_lo:
          k += 1
        return k

      k_room = k_for(room)
      if k_room * (bb - k_room) // 2 > room:
        k_room -= 1
      k_lo = max(m0, 1)
      k = min(max(k_for(tu), k_lo), min(b - last_lo - m0, k_room, b))
      if k < k_lo:
        prio[2, p] = -1.0
      else:
        put(2, k * (bb - k) // 2, rows(j, d, b - k, b), b)

  def _priced_rows(self, j: int, d: int, lo: int, hi: int) -> float:
    """Rows of document ``j``'s [lo, hi) that ``d`` does not own, as ``_move_bytes`` counts
    them."""
    return hi - lo - self._own_overlap(j, d, lo, hi)

  def _move_bytes(self, j: int, d: int, moved, have: int) -> float:
    """Bytes of sending ``moved`` query intervals of document ``j`` to ``d``, which already
    holds its key/value rows ``[0, have)``: the rows ``d`` does not own."""
    end = max(hi for _, hi in moved)
    q_rows = sum(hi - lo - self._own_overlap(j, d, lo, hi) for lo, hi in moved)
    kv_rows = (end - have - self._own_overlap(j, d, have, end)) if end > have else 0
    return self.q_row_bytes * q_rows + self.kv_row_bytes * kv_rows
