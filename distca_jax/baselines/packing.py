"""Host planning for the baselines (NumPy only): WLB-LLM packing, CP arrangements, task tables.

Vocabulary
----------
``S`` ranks on the ``data`` mesh axis form ``S / c`` context-parallel (CP) groups of ``c = cp_size``
consecutive ranks (``c = 1``: plain data parallelism). Every rank holds ``R`` rows
(``rows_per_rank``) of ``T`` tokens; batch row ``b`` lives on rank ``b // R`` (the trainer's
rank-major row order). A *lane* is one group's row slot ``j``: the ``c`` rows ``(g c + i) R + j``,
``i = 0 .. c-1`` (``i`` is the rank's index inside its group). Lanes never exchange tokens.

A ``Placement`` says which document pieces every row holds, in row order: the rows of a
CP-arranged batch. Its documents are numbered batch-wide (``J`` of them); every token of every
document sits in exactly one row, and all pieces of a document lie in one lane.

* ``cp`` (per-sequence CP, Megatron / MaxText style): a lane's packed sequence of ``c T`` tokens is
  cut into ``2 c`` chunks of ``T / 2``; rank ``i`` holds chunks ``i`` and ``2c - 1 - i``
  (``cp_placement``). Tokens per rank are equal by construction.
* ``wlb`` (WLB-LLM packing + per-document CP): ``wlb_pack`` deals a global batch's documents to
  lanes, longest first, each into the lane with the least WLB workload
  ``W = sum (l / B)^2 + l / B`` among those where it fits under the per-rank token cap; each
  document is cut into ``2 c`` chunks and rank ``i`` of the lane holds chunks ``i`` and
  ``2c - 1 - i`` of every document of the lane (``wlb_placement``).

``task_tables`` turns a placement into the fixed-shape int32 arrays the device function runs
(``baselines.device.group_attention``): every piece is one CA-task (its query rows, keys
``[0, end)`` of its document); a row's tasks are one fused varlen call over a key buffer gathered from the
lane's all-gathered K/V.
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import Sequence

import numpy as np

from distca_jax import checks
from distca_jax.plan import metadata


def check_pos_int(name: str, v, lo: int = 1) -> int:
  return checks.check_int(name, v, lo)


ranges = metadata.ranges  # concatenated aranges; one implementation, in the planner


split_at = metadata.split_at  # intervals cut at multiples of a width (one implementation)


# ----------------------------------------------------------------------------------------------
# Placement.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Placement:
  """The document pieces of every row of a (CP-arranged) batch, in row order.

  Attributes:
    doc_lens_J: [J] length of every document of the batch (document ids index it).
    row_P: [P] row of each piece, non-decreasing (pieces are listed row by row, in row order).
    doc_P: [P] document of each piece.
    start_P, end_P: [P] the piece holds tokens [start, end) of its document. A row's pieces sit
      back to back from the row's first slot; the rest of the row is padding.
    num_rows: B = S * R.
    tokens_per_row: T, the (fixed) row length.
    cp_size: c, ranks per CP group (1: data parallel only).
    rows_per_rank: R.
  """
  doc_lens_J: np.ndarray
  row_P: np.ndarray
  doc_P: np.ndarray
  start_P: np.ndarray
  end_P: np.ndarray
  num_rows: int
  tokens_per_row: int
  cp_size: int = 1
  rows_per_rank: int = 1

  def __post_init__(self):
    for f in ("doc_lens_J", "row_P", "doc_P", "start_P", "end_P"):
      object.__setattr__(self, f, np.asarray(getattr(self, f), np.int64).reshape(-1))
    b = check_pos_int("num_rows", self.num_rows)
    t = check_pos_int("tokens_per_row", self.tokens_per_row)
    c = check_pos_int("cp_size", self.cp_size)
    r = check_pos_int("rows_per_rank", self.rows_per_rank)
    if b % (c * r):
      raise ValueError(f"num_rows={b} must be a multiple of cp_size={c} x rows_per_rank={r}")
    n = self.row_P.size
    if not (self.doc_P.size == self.start_P.size == self.end_P.size == n):
      raise ValueError("row_P, doc_P, start_P and end_P must have one entry per piece")
    if (self.doc_lens_J < 1).any():
      raise ValueError("every document length must be >= 1")
    if n:
      if (np.diff(self.row_P) < 0).any() or self.row_P.min() < 0 or self.row_P.max() >= b:
        raise ValueError(f"row_P must be non-decreasing within [0, {b})")
      if self.doc_P.min() < 0 or self.doc_P.max() >= self.doc_lens_J.size:
        raise ValueError("doc_P holds an unknown document id")
      if (self.start_P < 0).any() or (self.end_P <= self.start_P).any() or (
          self.end_P > self.doc_lens_J[self.doc_P]).any():
        raise ValueError("every piece needs 0 <= start < end <= its document's length")
    used = self.row_tokens()
    if used.max(initial=0) > t:
      raise ValueError(f"row {int(np.argmax(used))} holds {int(used.max())} tokens > "
                       f"tokens_per_row={t}")
    # Every document covered exactly once, all of it in one lane.
    order = np.lexsort((self.start_P, self.doc_P))
    d, s, e = self.doc_P[order], self.start_P[order], self.end_P[order]
    first = np.r_[True, d[1:] != d[:-1]] if n else np.zeros(0, bool)
    last = np.r_[d[1:] != d[:-1], True] if n else np.zeros(0, bool)
    ok = (np.unique(d).size == self.doc_lens_J.size and (s[first] == 0).all()
          and (e[last] == self.doc_lens_J[d[last]]).all()
          and (s[~first] == e[:-1][~first[1:]]).all()
          if n else self.doc_lens_J.size == 0)
    if not ok:
      raise ValueError("pieces must cover every document exactly once, without overlap")
    lane = self.lane_of_row(self.row_P)
    if n and (lane[order][~first] != lane[order][np.flatnonzero(~first) - 1]).any():
      raise ValueError("all pieces of a document must lie in one lane (one CP group's row slot)")

  @property
  def num_pieces(self) -> int:
    return int(self.row_P.size)

  @property
  def len_P(self) -> np.ndarray:
    return self.end_P - self.start_P

  @property
  def local_P(self) -> np.ndarray:
    """[P] first slot of each piece inside its row."""
    ln = self.len_P
    excl = np.cumsum(ln) - ln
    first = np.searchsorted(self.row_P, self.row_P, side="left")
    return excl - excl[first] if ln.size else excl

  def rank_of_row(self, rows) -> np.ndarray:
    return np.asarray(rows, np.int64) // self.rows_per_rank

  def group_rank_of_row(self, rows) -> np.ndarray:
    """Index ``i`` of the row's rank inside its CP group."""
    return self.rank_of_row(rows) % self.cp_size

  def lane_of_row(self, rows) -> np.ndarray:
    rows = np.asarray(rows, np.int64)
    r = self.rows_per_rank
    return (rows // r // self.cp_size) * r + rows % r

  def row_tokens(self) -> np.ndarray:
    """[B] tokens each row holds (the rest is padding)."""
    return np.bincount(self.row_P, weights=self.len_P, minlength=self.num_rows).astype(np.int64)

  def token_doc_pos(self) -> tuple[np.ndarray, np.ndarray]:
    """(document [B, T], position in the document [B, T]) of every slot; -1 at padding."""
    b, t = self.num_rows, self.tokens_per_row
    doc = np.full(b * t, -1, np.int64)
    pos = np.full(b * t, -1, np.int64)
    dst = ranges(self.row_P * t + self.local_P, self.len_P)
    doc[dst] = np.repeat(self.doc_P, self.len_P)
    pos[dst] = ranges(self.start_P, self.len_P)
    return doc.reshape(b, t), pos.reshape(b, t)

  def layout_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids [B, T], positions [B, T]) int32 of the arranged rows.

    Segment ids are batch-wide document ids + 1 (every rank holding a part of a document shows the
    same id); positions are the token's position inside its document (RoPE); 0 at padding.
    """
    doc, pos = self.token_doc_pos()
    return (doc + 1).astype(np.int32), np.maximum(pos, 0).astype(np.int32)


def natural_placement(row_doclens: Sequence[Sequence[int]], tokens_per_row: int, *,
                      rows_per_rank: int = 1) -> Placement:
  """The trainer's packed rows as a placement: every row piece is a document of its own.

  Documents are numbered row by row. ``cp_size`` is 1 (rows are independent).
  """
  lens = [np.asarray([int(x) for x in r], np.int64) for r in row_doclens]
  rows = len(lens)
  counts = np.array([x.size for x in lens], np.int64)
  doc_lens = np.concatenate(lens) if rows else np.zeros(0, np.int64)
  if (doc_lens < 1).any():
    raise ValueError(f"document lengths must be >= 1; got {doc_lens[doc_lens < 1][:4].tolist()}")
  return Placement(doc_lens, np.repeat(np.arange(rows), counts), np.arange(doc_lens.size),
                   np.zeros(doc_lens.size, np.int64), doc_lens, rows, tokens_per_row, 1,
                   rows_per_rank)


def _merge_adjacent(row, doc, start, end):
  """Merges consecutive pieces of one row that continue one document ([a, b) then [b, c))."""
  if row.size <= 1:
    return row, doc, start, end
  cont = (row[1:] == row[:-1]) & (doc[1:] == doc[:-1]) & (start[1:] == end[:-1])
  head = np.r_[True, ~cont]
  last = np.r_[np.flatnonzero(head)[1:] - 1, row.size - 1]
  return row[head], doc[head], start[head], end[last]


def _lane_rows(lanes: np.ndarray, i: np.ndarray, cp: int, rows_per_rank: int) -> np.ndarray:
  """Batch row of group rank ``i`` in lane ``lane`` (lane = group * R + slot)."""
  g, j = lanes // rows_per_rank, lanes % rows_per_rank
  return (g * cp + i) * rows_per_rank + j


# ----------------------------------------------------------------------------------------------
# cp: per-sequence context parallelism.
# ----------------------------------------------------------------------------------------------
def cp_placement(lane_doclens: Sequence[Sequence[int]], cp_size: int, tokens_per_row: int, *,
                 rows_per_rank: int = 1) -> Placement:
  """Per-sequence CP: lane ``l``'s packed sequence cut into ``2c`` head-tail chunks.

  Args:
    lane_doclens: one list of document lengths per lane (``S / c * R`` lanes, lane = group * R +
      row slot), each summing to at most ``c * T``: the lane's packed sequence, in order.
    cp_size: c.
    tokens_per_row: T (even): rank ``i`` of the lane holds sequence chunks ``i`` and
      ``2c - 1 - i`` of ``T / 2`` tokens each.
    rows_per_rank: R.

  Returns:
    The placement; documents numbered lane by lane in sequence order.
  """
  c = check_pos_int("cp_size", cp_size)
  t = check_pos_int("tokens_per_row", tokens_per_row)
  if t % 2:
    raise ValueError(f"cp needs an even tokens_per_row to cut 2 x cp_size chunks; got {t}")
  half = t // 2
  lens = [np.asarray([int(x) for x in d], np.int64) for d in lane_doclens]
  for l, x in enumerate(lens):
    if (x < 1).any() or x.sum() > c * t:
      raise ValueError(f"lane {l}: document lengths must be >= 1 and sum to at most cp_size x "
                       f"tokens_per_row = {c * t}; got sum {int(x.sum())}")
  counts = np.array([x.size for x in lens], np.int64)
  doc_lens = np.concatenate(lens) if lens else np.zeros(0, np.int64)
  doc_lane = np.repeat(np.arange(len(lens)), counts)
  in_lane = np.concatenate([np.cumsum(x) - x for x in lens]) if lens else np.zeros(0, np.int64)
  g0 = doc_lane * c * t + in_lane
  doc, block, s, e = split_at(g0, g0 + doc_lens, half)
  lane, k = block // (2 * c), block % (2 * c)
  i = np.where(k < c, k, 2 * c - 1 - k)
  row = _lane_rows(lane, i, c, rows_per_rank)
  start, end = s - g0[doc], e - g0[doc]
  order = np.lexsort((s, k >= c, row))  # by row, then head chunk before tail chunk
  row, doc, start, end = row[order], doc[order], start[order], end[order]
  row, doc, start, end = _merge_adjacent(row, doc, start, end)
  return Placement(doc_lens, row, doc, start, end, len(lens) * c, t, c, rows_per_rank)


# ----------------------------------------------------------------------------------------------
# wlb: WLB-LLM variable-length packing + per-document context parallelism.
# ----------------------------------------------------------------------------------------------
def wlb_workload(lengths, balance_len: float) -> np.ndarray:
  """WLB-LLM's per-document workload ``(l / B)^2 + l / B`` (attention + token-linear, in units of
  the token-linear work of a ``B``-token document)."""
  x = np.asarray(lengths, np.float64) / float(balance_len)
  return x * x + x


@dataclasses.dataclass(frozen=True)
class WlbPacking:
  """The result of ``wlb_pack``: documents dealt to lanes and split over each lane's ranks.

  Attributes:
    lane_J, src_J, offset_J, len_J: [J] placed piece j is tokens [offset, offset + len) of input
      document src, placed in lane ``lane`` (a document split because it fit nowhere whole
      yields several pieces, each a document of its own for attention).
    share_JxC: [J, c] tokens of piece j on each rank of its lane (sum = len_J; every rank gets
      ``2 * (len // 2c)`` plus 0, 1 or 2 of the remainder).
    load_W_L: [L] WLB workload per lane; tokens_LxC: [L, c] tokens per rank.
    num_lanes, cp_size, row_tokens, balance_len: the inputs.
    num_split: input documents cut because no lane had room for them whole.
    num_oversize: input documents longer than a whole lane (``c * row_tokens``): no packing fits
      them whole, so this DP x CP split cannot train them uncut (WLB-LLM raises CP for those).
  """
  lane_J: np.ndarray
  src_J: np.ndarray
  offset_J: np.ndarray
  len_J: np.ndarray
  share_JxC: np.ndarray
  load_W_L: np.ndarray
  tokens_LxC: np.ndarray
  num_lanes: int
  cp_size: int
  row_tokens: int
  balance_len: float
  num_split: int
  num_oversize: int

  def chunks(self) -> tuple[np.ndarray, np.ndarray]:
    """(start [J, 2c], end [J, 2c]) of each piece's chunks; chunk k < c is rank k's head chunk,
    chunk 2c - 1 - i is rank i's tail chunk."""
    c = self.cp_size
    base = (self.len_J // (2 * c))[:, None]
    e = self.share_JxC - 2 * base
    head = base + (e >= 1)
    tail = base + (e == 2)
    sizes = np.concatenate([head, tail[:, ::-1]], axis=1)
    end = np.cumsum(sizes, axis=1)
    return end - sizes, end


def _distribute(room_C: np.ndarray, tokens_C: np.ndarray, m: int, c: int) -> np.ndarray | None:
  """Per-rank shares of an ``m``-token document in a lane with ``room_C`` free slots, or None.

  Every rank gets ``2 base`` (``base = m // 2c``); the remainder goes one token at a time to the
  least-loaded ranks with room (at most 2 extra each), which keeps a lane's ranks within 2 tokens.
  """
  base, rem = divmod(m, 2 * c)
  free = room_C - 2 * base
  if (free < 0).any() or np.minimum(free, 2).sum() < rem:
    return None
  share = np.full(c, 2 * base, np.int64)
  if rem:
    order = np.lexsort((np.arange(c), tokens_C))
    for extra in (1, 2):
      if rem == 0:
        break
      cand = order[free[order] >= extra]
      take = cand[:rem]
      share[take] += 1
      rem -= take.size
  return share


def wlb_pack(doc_lens: Sequence[int], num_lanes: int, cp_size: int, row_tokens: int,
             balance_len: float) -> WlbPacking:
  """WLB-LLM variable-length packing of one global batch over ``num_lanes`` lanes.

  Documents are taken longest first; each goes to the lane with the least WLB workload ``W``
  (ties: lowest lane) among the lanes where it fits whole, i.e. where every rank of the lane stays
  at most ``row_tokens`` (= Lmax, alpha times the average per-rank budget) once the document is
  cut into ``2c`` chunks. A document that fits in no lane (longer than a lane's free room) is cut:
  the longest prefix that fits goes to the lane with the most free tokens, and the rest returns to
  the queue (WLB-LLM defers such documents to a later batch; a static per-batch analysis cannot, so
  we apply the data pipeline's split rule instead and count it in ``num_split``).

  Args:
    doc_lens: the global batch's document lengths (any order).
    num_lanes: L = DP groups x rows per rank.
    cp_size: c, ranks per lane.
    row_tokens: per-rank token cap Lmax (the arranged rows' fixed length).
    balance_len: B, the document length whose attention FLOPs equal its token-linear FLOPs.

  Returns:
    The ``WlbPacking``.
  """
  lanes = check_pos_int("num_lanes", num_lanes)
  c = check_pos_int("cp_size", cp_size)
  cap = check_pos_int("row_tokens", row_tokens)
  if not balance_len > 0:
    raise ValueError(f"{balance_len=} must be positive")
  lens = np.asarray([int(x) for x in doc_lens], np.int64)
  if (lens < 1).any():
    raise ValueError(f"document lengths must be >= 1; got {lens[lens < 1][:4].tolist()}")
  if lens.sum() > lanes * c * cap:
    raise ValueError(f"the batch holds {int(lens.sum())} tokens > num_lanes={lanes} x "
                     f"cp_size={c} x row_tokens={cap}; raise row_tokens "
                     "(attention.baselines.wlb_alpha)")
  tokens = np.zeros((lanes, c), np.int64)
  free = np.full(lanes, c * cap, np.int64)
  load = np.zeros(lanes, np.float64)
  # Max-heap of pending pieces by length (ties: input order); (-len, src, offset).
  queue = [(-int(l), j, 0) for j, l in enumerate(lens.tolist())]
  heapq.heapify(queue)
  out_lane, out_src, out_off, out_len, out_share = [], [], [], [], []
  split_src = set()
  while queue:
    neg, src, off = heapq.heappop(queue)
    m = -neg
    # Candidate lanes by workload; the least-loaded one where the piece fits whole wins.
    order = np.argsort(load, kind="stable")  # ties: lowest lane
    placed = False
    for lane in order[free[order] >= m].tolist():
      share = _distribute(cap - tokens[lane], tokens[lane], m, c)
      if share is not None:
        placed = True
        break
    if not placed:
      # Fits nowhere whole: the longest prefix that fits into the lane with the most room.
      lane = int(np.argmax(free))
      lo, hi = 0, min(m - 1, int(free[lane]))
      while lo < hi:  # largest p in [0, hi] that fits (fitting is monotone in p)
        mid = (lo + hi + 1) // 2
        if _distribute(cap - tokens[lane], tokens[lane], mid, c) is not None:
          lo = mid
        else:
          hi = mid - 1
      if lo == 0:
        raise ValueError(f"wlb_pack: a {m}-token piece fits in no lane (free tokens per lane "
                         f"{free.tolist()[:8]}...); raise row_tokens "
                         "(attention.baselines.wlb_alpha)")
      share = _distribute(cap - tokens[lane], tokens[lane], lo, c)
      heapq.heappush(queue, (-(m - lo), src, off + lo))
      split_src.add(src)
      m = lo
    tokens[lane] += share
    free[lane] -= m
    load[lane] += float(wlb_workload(m, balance_len))
    out_lane.append(lane)
    out_src.append(src)
    out_off.append(off)
    out_len.append(m)
    out_share.append(share)
  share_arr = np.asarray(out_share, np.int64).reshape(-1, c)
  return WlbPacking(np.asarray(out_lane, np.int64), np.asarray(out_src, np.int64),
                    np.asarray(out_off, np.int64), np.asarray(out_len, np.int64), share_arr,
                    load, tokens, lanes, c, cap, float(balance_len), len(split_src),
                    int((lens > c * cap).sum()))


def wlb_placement(packing: WlbPacking, *, rows_per_rank: int = 1) -> Placement:
  """Per-document CP rows of a WLB packing: rank ``i`` of a lane holds, for every document of the
  lane in placement order, its chunks ``i`` then ``2c - 1 - i``. Document ids are the packing's
  piece ids (``J`` order)."""
  c, t = packing.cp_size, packing.row_tokens
  r = check_pos_int("rows_per_rank", rows_per_rank)
  if packing.num_lanes % r:
    raise ValueError(f"num_lanes={packing.num_lanes} must be a multiple of {rows_per_rank=}")
  start, end = packing.chunks()  # [J, 2c]
  j_n = packing.len_J.size
  k = np.arange(2 * c)
  i = np.where(k < c, k, 2 * c - 1 - k)
  doc = np.repeat(np.arange(j_n), 2 * c)
  kk = np.tile(k, j_n)
  row = _lane_rows(packing.lane_J[doc], np.tile(i, j_n), c, r)
  s, e = start.reshape(-1), end.reshape(-1)
  keep = e > s
  doc, kk, row, s, e = doc[keep], kk[keep], row[keep], s[keep], e[keep]
  # Row order: documents in placement order (j), head chunk before tail chunk.
  order = np.lexsort((kk >= c, doc, row))
  row, doc, s, e = row[order], doc[order], s[order], e[order]
  row, doc, s, e = _merge_adjacent(row, doc, s, e)
  return Placement(packing.len_J, row, doc, s, e, packing.num_lanes * c, t, c, r)


# ----------------------------------------------------------------------------------------------
# Task tables: the fixed-shape arrays the device function runs.
# ----------------------------------------------------------------------------------------------
def default_kv_rows(cp_size: int, tokens_per_row: int) -> int:
  """Default key-buffer rows per row: ``(c + 1) T``.

  A piece ``[a, b)`` needs keys ``[0, b)``; a rank's head and tail chunks of one document need
  about ``l (2c + 1) / 2c`` keys together, so a row needs about its lane's tokens plus its own.
  """
  return (int(cp_size) + 1) * int(tokens_per_row)


MAX_DOCS_KEY = "config.attention.baselines.max_docs_per_row"
WLB_TASKS_KEY = "config.attention.baselines.wlb_tasks_per_row"


def task_tables(placement: Placement, *, max_tasks: int, kv_rows: int | None = None,
                cap_key: str = MAX_DOCS_KEY) -> dict[str, np.ndarray]:
  """Fixed-shape int32 task tables of a placement, leading axis = batch row.

  For row ``b`` (group rank ``i``): task ``n`` is the row's ``n``-th piece, queries
  ``[cu_seqlens_q[b, n], cu_seqlens_q[b, n + 1])`` of the row, keys
  ``[cu_seqlens_k[b, n], cu_seqlens_k[b, n + 1])`` of the row's key buffer, which is
  ``gathered[kv_index[b]]`` with ``gathered`` the lane's K (or V) rows all-gathered in group-rank
  order (``c T`` rows: group rank ``i'`` at ``[i' T, (i' + 1) T)``). Unused entries: ``kv_index``
  holds the sentinel ``c T`` (gather with ``mode='fill'``), cu_seqlens repeat their last value.

  Args:
    placement: from ``cp_placement`` / ``wlb_placement`` / ``natural_placement``.
    max_tasks: task slots per row (``Nt``): pieces a row may hold.
    kv_rows: key-buffer rows per row (``Nkv``); default ``default_kv_rows``.
    cap_key: the config key of ``max_tasks`` that an overflow's error names.

  Returns:
    ``kv_index`` [B, Nkv], ``cu_seqlens_q`` [B, Nt + 1], ``cu_seqlens_k`` [B, Nt + 1].
  """
  p = placement
  b, t, c = p.num_rows, p.tokens_per_row, p.cp_size
  nt = check_pos_int("max_tasks", max_tasks)
  nkv = default_kv_rows(c, t) if kv_rows is None else check_pos_int("kv_rows", kv_rows)
  ntask = np.bincount(p.row_P, minlength=b)
  if ntask.max(initial=0) > nt:
    r = int(np.argmax(ntask))
    raise ValueError(f"row {r} holds {int(ntask[r])} document pieces > max_tasks={nt}; raise "
                     f"{cap_key} to at least {int(ntask[r])}")
  keys_P = p.end_P
  keys_row = np.bincount(p.row_P, weights=keys_P, minlength=b).astype(np.int64)
  if keys_row.max(initial=0) > nkv:
    r = int(np.argmax(keys_row))
    raise ValueError(f"row {r} needs {int(keys_row[r])} key rows > kv_rows={nkv}; raise kv_rows")
  # Where every document token lives: group rank and slot (row-major over docs).
  doc_off = np.cumsum(p.doc_lens_J) - p.doc_lens_J
  home_rank = np.zeros(int(p.doc_lens_J.sum()), np.int64)
  home_slot = np.zeros_like(home_rank)
  src = ranges(doc_off[p.doc_P] + p.start_P, p.len_P)
  home_rank[src] = np.repeat(p.group_rank_of_row(p.row_P), p.len_P)
  home_slot[src] = ranges(p.local_P, p.len_P)
  # Keys of every task: positions [0, end) of its document, in task order.
  keys = ranges(doc_off[p.doc_P], keys_P)
  k_row = np.repeat(p.row_P, keys_P)
  first = np.searchsorted(k_row, k_row, side="left")
  k_dst = np.arange(keys.size) - first
  kv_index = np.full((b, nkv), c * t, np.int64)
  kv_index[k_row, k_dst] = home_rank[keys] * t + home_slot[keys]
  cu_q = np.zeros((b, nt + 1), np.int64)
  cu_k = np.zeros((b, nt + 1), np.int64)
  first_p = np.searchsorted(p.row_P, np.arange(b), side="left")
  n_in_row = np.arange(p.num_pieces) - first_p[p.row_P]
  lq = np.zeros((b, nt), np.int64)
  lk = np.zeros((b, nt), np.int64)
  lq[p.row_P, n_in_row] = p.len_P
  lk[p.row_P, n_in_row] = keys_P
  cu_q[:, 1:] = np.cumsum(lq, axis=1)
  cu_k[:, 1:] = np.cumsum(lk, axis=1)
  return {"kv_index": kv_index.astype(np.int32), "cu_seqlens_q": cu_q.astype(np.int32),
          "cu_seqlens_k": cu_k.astype(np.int32)}


def packed_doc_lens(row_doclens: Sequence[Sequence[int]], tokens_per_row: int,
                    max_docs: int) -> np.ndarray:
  """``packed_dp``'s host table: [B, max_docs] int32 document lengths per row, zero-padded."""
  nd = check_pos_int("max_docs", max_docs)
  out = np.zeros((len(row_doclens), nd), np.int32)
  for r, lens in enumerate(row_doclens):
    lens = [int(x) for x in lens]
    if len(lens) > nd:
      raise ValueError(f"row {r} holds {len(lens)} documents > max_docs={nd}; raise "
                       f"{MAX_DOCS_KEY} to at least {len(lens)}")
    if any(x < 1 for x in lens) or sum(lens) > tokens_per_row:
      raise ValueError(f"row {r}: document lengths {lens[:8]}... must be >= 1 and sum to at most "
                       f"{tokens_per_row=}")
    out[r, :len(lens)] = lens
  return out


# ----------------------------------------------------------------------------------------------
# Arranging a trainer batch (the data-path hook; see the package docstring).
# ----------------------------------------------------------------------------------------------
def arrange_arrays(np_batch: dict[str, np.ndarray], natural: Placement,
                   arranged: Placement, src_doc_J: np.ndarray, src_offset_J: np.ndarray
                   ) -> dict[str, np.ndarray]:
  """Moves a natural batch's per-token arrays into an arranged placement's rows.

  Args:
    np_batch: the trainer's batch, arrays [B, T] (``inputs``, ``targets``, ``loss_mask``, ...).
    natural: the batch's own layout (``natural_placement`` of its per-row document lengths).
    arranged: the target placement.
    src_doc_J, src_offset_J: [J] arranged document j is natural document ``src_doc_J[j]`` from
      token ``src_offset_J[j]`` on.

  Returns:
    The arranged batch [B', T']: per-token arrays gathered (0 at padding), ``segment_ids`` and
    ``positions`` from ``arranged.layout_arrays()``.
  """
  n_doc, n_pos = natural.token_doc_pos()
  t_nat = natural.tokens_per_row
  nat_off = np.cumsum(natural.doc_lens_J) - natural.doc_lens_J
  where = np.full(int(natural.doc_lens_J.sum()), -1, np.int64)
  ok = n_doc >= 0
  where[nat_off[n_doc[ok]] + n_pos[ok]] = np.flatnonzero(ok.reshape(-1))
  a_doc, a_pos = arranged.token_doc_pos()
  real = a_doc >= 0
  src = np.full(a_doc.shape, -1, np.int64)
  src[real] = where[nat_off[src_doc_J[a_doc[real]]] + src_offset_J[a_doc[real]] + a_pos[real]]
  if (src[real] < 0).any():
    raise ValueError("arranged placement refers to tokens outside the natural batch")
  out = {}
  for k, a in np_batch.items():
    flat = np.asarray(a).reshape(natural.num_rows * t_nat, *np.asarray(a).shape[2:])
    g = np.zeros(src.shape + flat.shape[1:], flat.dtype)
    g[real] = flat[src[real]]
    out[k] = g
  seg, pos = arranged.layout_arrays()
  out["segment_ids"], out["positions"] = seg, pos
  return out
