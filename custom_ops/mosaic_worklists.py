"""Tiling and device-side work lists of the Mosaic GPU attention kernels (plain jnp, inside jit).

``BlockSizes`` (the kernels' tiles), the aligned query layout (``aligned_layout``), the key edge
copies (``kv_edges``) and the work lists the kernels read (``q_tile_table`` for the forward and
dQ kernels, ``kv_tile_table`` / ``kv_tile_table_in_place`` for the dK/dV kernel), with the field
indices of those tables. Why the layout looks like this: ``custom_ops/mosaic_attention.py``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from custom_ops import varlen_attention as va

# Compute warpgroups per CTA (each takes one block of rows; a producer warpgroup streams tiles).
NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles and options of the kernels (all static).

  Attributes:
    block_q: query rows per compute warpgroup in the forward and dQ kernels (a CTA takes two).
    block_kv: key rows per forward step.
    block_kv_dq: key rows per dQ step.
    block_kv_dkv: key rows per compute warpgroup in the dK/dV kernel (a CTA takes two).
    block_q_dkv: query rows per dK/dV step.
    max_concurrent_steps: shared-memory slots the producer warpgroup fills ahead.
    pingpong: forward only: make the two compute warpgroups alternate (FA3 scheduling).
    dkv_in_place: the dK/dV kernel reads K/V, Q and dO and writes dK/dV in the packed buffers
      (8-row aligned tile starts, partial tiles stored in power-of-two row pieces); False: on
      aligned copies of K/V and Q/dO, gathered before and after the kernel (two more passes
      over K/V and dK/dV).
    fused_bwd: one backward kernel over key tiles (dK/dV in place as above, and dQ accumulated
      in f32 through TMA reduce-add stores: 5 matrix products per tile pair; each step issues
      S^T with dP^T, then dV, dK and the step's dQ products, awaited together); False: a dQ
      kernel over query tiles beside the dK/dV kernel (7 products). Needs ``dkv_in_place``.
    group_adjacent: the forward and dQ kernels launch the query heads of one KV head in
      adjacent CTAs (grid order: KV head, query tile, head of the group), so the CTAs reading a
      K/V tile run together and share it through L2; False: head-major order (every tile of
      one query head, then the next head).
    bwd_pairs: the two-kernel backward (``fused_bwd=False``) issues its matrix products two at
      a time: S with dP (dQ kernel); S^T with dP^T, then dV with dK (dK/dV kernel); False: the
      dQ kernel waits for each product, the dK/dV kernel issues S^T, dV with dP^T, then dK.
  """
  block_q: int = 64
  block_kv: int = 128
  block_kv_dq: int = 64
  block_kv_dkv: int = 64
  block_q_dkv: int = 64
  max_concurrent_steps: int = 2
  pingpong: bool = True
  dkv_in_place: bool = True
  fused_bwd: bool = True
  group_adjacent: bool = True
  bwd_pairs: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("pingpong", "dkv_in_place", "fused_bwd", "group_adjacent", "bwd_pairs"):
        if not isinstance(value, bool):
          raise ValueError(f"BlockSizes.{field.name}={value!r} must be a bool")
        continue
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int")
      if field.name.startswith("block_") and value % 64:
        raise ValueError(
            f"BlockSizes.{field.name}={value} must be a multiple of 64 (warpgroup MMA tiles)")
    if self.fused_bwd and not self.dkv_in_place:
      raise ValueError("BlockSizes(fused_bwd=True) (the default) needs dkv_in_place=True: the "
                       "fused backward reads K/V and writes dK/dV in the packed buffers; pass "
                       "fused_bwd=False with dkv_in_place=False")
    if self.max_concurrent_steps < 2:
      raise ValueError(
          f"BlockSizes.max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
    if self.align_q % self.block_q_dkv:
      raise ValueError(
          f"BlockSizes: block_q_dkv={self.block_q_dkv} must divide the query tile "
          f"2 * block_q={self.align_q}")
    if self.align_k % self.block_kv or self.align_k % self.block_kv_dq:
      raise ValueError(
          f"BlockSizes: block_kv={self.block_kv} and block_kv_dq={self.block_kv_dq} must divide "
          f"the key tile 2 * block_kv_dkv={self.align_k}")

  @property
  def align_q(self) -> int:
    """Query rows of a CTA tile of the forward and dQ kernels; tasks start at multiples of it."""
    return NUM_COMPUTE_WGS * self.block_q

  @property
  def edge_block(self) -> int:
    """Key-tile size the edge copies of K/V are cut for (``kv_edges``): the largest read."""
    return max(self.block_kv, self.block_kv_dq, self.align_k)

  @property
  def align_k(self) -> int:
    """Key rows of a CTA tile of the dK/dV kernel; tasks' keys start at multiples of it."""
    return NUM_COMPUTE_WGS * self.block_kv_dkv


# ------------------------------------------------------------------------------------------------
# Aligned layout and work lists (plain jnp on cu_seqlens, inside jit)
# ------------------------------------------------------------------------------------------------


def padded_rows(total_rows: int, num_tasks: int, align: int, front: bool = False) -> int:
  """Static length of the aligned buffer: each task (after its ``front`` rows, < 8) rounded up
  to a multiple of ``align``."""
  extra = (KV_ROW_MULTIPLE - 1) * num_tasks if front else 0
  return (-(-(total_rows + extra) // align) + num_tasks) * align


@dataclasses.dataclass(frozen=True)
class AlignedLayout:
  """Where each task's rows live in the aligned buffer.

  With ``front``, task ``i``'s rows start ``cu[i] % 8`` rows after its aligned start, so that
  row ``r`` of an aligned tile is row ``r`` of the in-place tile starting at ``cu[i]`` rounded
  down to 8 (``q_tile_table_in_place``): the forward kernel's LSE slots.

  Attributes:
    start_N: first aligned row of each task's tiles (a multiple of ``align``).
    src_P: for each aligned row, its row in the packed buffer, or ``total_rows`` (a zero row).
    dst_T: for each packed row, its aligned row, or ``P`` (rows outside every task).
    front_N: rows each task starts after ``start_N`` (``cu[i] % 8`` with ``front``, else 0).
  """
  start_N: jax.Array
  src_P: jax.Array
  dst_T: jax.Array
  front_N: jax.Array


def aligned_layout(cu_N1: jax.Array, total_rows: int, align: int,
                   front: bool = False) -> AlignedLayout:
  n = cu_N1.shape[0] - 1
  cu = cu_N1.astype(jnp.int32)
  len_N = jnp.maximum(cu[1:] - cu[:-1], 0)
  front_N = cu[:-1] % KV_ROW_MULTIPLE if front else jnp.zeros_like(len_N)
  plen_N = jnp.where(len_N > 0, (len_N + front_N + align - 1) // align * align, 0)
  end_N = jnp.cumsum(plen_N)
  start_N = end_N - plen_N
  num_p = padded_rows(total_rows, n, align, front)
  p = jnp.arange(num_p, dtype=jnp.int32)
  task = jnp.minimum(jnp.searchsorted(end_N, p, side="right"), n - 1).astype(jnp.int32)
  local = p - start_N[task] - front_N[task]
  valid = (p < end_N[-1]) & (local >= 0) & (local < len_N[task])
  src_P = jnp.where(valid, cu[task] + local, total_rows)
  t_task, t_local, t_valid = va.rows_to_tasks(cu, total_rows)
  dst_T = jnp.where(t_valid, start_N[t_task] + front_N[t_task] + t_local, num_p)
  return AlignedLayout(start_N=start_N, src_P=src_P, dst_T=dst_T, front_N=front_N)


def gather_rows(x, index, fill=0.0, axis=0):
  return jnp.take(x, index, axis=axis, mode="fill", fill_value=fill)


# q_tile_table fields (rows of the [F, B] table).
QT_Q_TILE, QT_KB8, QT_SHIFT, QT_LK, QT_NMAX, QT_DIAG, QT_NFULL, QT_NKV = 0, 1, 2, 3, 4, 5, 7, 9
QT_FIELDS = 11
# Key tiles of the forward and dQ kernels are read from the packed K/V buffers in place, starting
# at multiples of 8 rows (what Mosaic GPU proves for a tiled TMA destination): a task's tile j
# holds local keys [j * block_kv - shift, (j + 1) * block_kv - shift), shift = cu_k[i] % 8.
KV_ROW_MULTIPLE = 8


def _task_of_tile(start_N, len_N, tile_rows: int, num_tiles: int, tile_start_multiple: int):
  """Task and first local row of each aligned tile, and whether it holds task rows."""
  n = start_N.shape[0]
  plen_N = (len_N + tile_start_multiple - 1) // tile_start_multiple * tile_start_multiple
  end_N = start_N + plen_N
  row = jnp.arange(num_tiles, dtype=jnp.int32) * tile_rows
  task = jnp.minimum(jnp.searchsorted(end_N, row, side="right"), n - 1).astype(jnp.int32)
  local = row - start_N[task]
  live = (row < end_N[-1]) & (local < len_N[task])
  return task, jnp.where(live, local, 0), live


def _key_tile_fields(r0, lq, lk, ks, bs: BlockSizes, block_kv: int):
  """The key-tile fields of a query tile whose first row is its task's local row ``r0`` (may be
  negative: rows before the task): ``[kb8, shift, lk, n_max, diag_0, diag_1, n_full_0,
  n_full_1, n_kv_0, n_kv_1]`` (see ``q_tile_table``)."""
  shift = ks % KV_ROW_MULTIPLE
  off = lk - lq
  n_kv_w, n_full_w, diag_w = [], [], []
  for w in range(NUM_COMPUTE_WGS):
    rw = r0 + w * bs.block_q
    diag = rw + off
    # Keys the block's last row sees (rows past the task see every key), and its first row of
    # the task (rows before it are not stored); a block wholly past its task's rows visits
    # nothing.
    hi = jnp.where(rw < lq, jnp.clip(diag + bs.block_q, 0, lk), 0)
    lo = jnp.where(rw < lq, jnp.clip(jnp.maximum(rw, 0) + off + 1, 0, lk), 0)
    n_kv_w.append(jnp.where(hi > 0, (hi + shift + block_kv - 1) // block_kv, 0))
    n_full_w.append((lo + shift) // block_kv)
    diag_w.append(diag)
  n_max = jnp.maximum(*n_kv_w)
  return [ks // KV_ROW_MULTIPLE, shift, lk, n_max, *diag_w, *n_full_w, *n_kv_w]


def _window_keys(r0, lq, lk, ks, block_kv: int, window: int):
  """A window layer's query tile (first row its task's local row ``r0``): (keys, first key row)
  of the task as the tile's key tiles see them. Its tiles start at the key tile holding the
  first key its first stored row sees (``max(r0, 0) + lk - lq - window + 1``; later rows' windows
  start later), so no key tile wholly before every row's window is visited: the task's keys are
  cut to start there (a multiple of 8 rows: the rounded-down start plus whole key tiles)."""
  shift = ks % KV_ROW_MULTIPLE
  first = jnp.maximum(r0, 0)
  j_lo = jnp.where((first < lq) & (lk > 0),
                   jnp.maximum(first + lk - lq - window + 1 + shift, 0) // block_kv, 0)
  cut = jnp.where(j_lo > 0, j_lo * block_kv - shift, 0)
  return lk - cut, ks + cut


def _window_full_tiles(fields, bs: BlockSizes, block_kv: int, window: int):
  """Per warpgroup, the first key tile every row of its block sees whole under the window
  (tiles before it are masked): from ``_key_tile_fields``' fields."""
  shift = fields[1]
  out = []
  for w in range(NUM_COMPUTE_WGS):
    diag, n_kv = fields[4 + w], fields[8 + w]
    # The block's last row sees keys from last + diag - window + 1.
    out.append(jnp.clip((bs.block_q + diag - window + shift + block_kv - 1) // block_kv, 0,
                        n_kv))
  return out


def q_tile_table(cu_q_N1, cu_k_N1, lay_q: AlignedLayout, num_q_rows: int, bs: BlockSizes,
                 block_kv: int, window: int = 0) -> jax.Array:
  """dQ work list [QT_FIELDS, B] over the CTA query tiles of the aligned query buffer.

  Per tile: its index (first aligned query row / ``align_q``), the task's first key row rounded
  down to ``KV_ROW_MULTIPLE`` (in those units) and the rows it was rounded by (``shift``), the
  task's keys ``lk``, the key tiles the producer streams (max over warpgroups), and per
  warpgroup ``w`` (fields + w): ``diag`` (row ``t`` of its block sees local keys
  ``0 <= j <= t + diag``, ``j < lk``), the end of its unmasked key tiles (tile 0 is masked when
  ``shift > 0``; tiles from ``n_full`` on are masked) and its key tiles. Sorted by descending
  key tiles. With a ``window`` (> 0) the task's keys as seen by the tile start later
  (``_window_keys``) and two fields follow: per warpgroup, the first key tile not masked by the
  window (``_window_full_tiles``).
  """
  n = cu_q_N1.shape[0] - 1
  lq_N = cu_q_N1[1:] - cu_q_N1[:-1]
  lk_N = cu_k_N1[1:] - cu_k_N1[:-1]
  num_tiles = padded_rows(num_q_rows, n, bs.align_q) // bs.align_q
  task, r0, live = _task_of_tile(lay_q.start_N, lq_N, bs.align_q, num_tiles, bs.align_q)
  lq = jnp.where(live, lq_N[task], 0)
  lk = jnp.where(live, lk_N[task], 0)
  ks = jnp.where(live, cu_k_N1[task], 0)
  if window:
    lk, ks = _window_keys(r0, lq, lk, ks, block_kv, window)
  key_fields = _key_tile_fields(r0, lq, lk, ks, bs, block_kv)
  fields = [jnp.arange(num_tiles, dtype=jnp.int32), *key_fields]
  if window:
    fields += _window_full_tiles(key_fields, bs, block_kv, window)
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-table[QT_NMAX], stable=True)]


class SegmentTiles(NamedTuple):
  """Tiles over a packed buffer cut into segments (``_segment_tiles``), per tile: its segment
  (tasks 0..N-1, then N: the tail padding, N + 1: the head padding), whether it is live, its
  index in the segment, the segment's first row % 8 (``shift``), rows (``length``) and tiles
  before it, and the tile's first row / 8."""
  seg: jax.Array
  live: jax.Array
  lt: jax.Array
  shift: jax.Array
  length: jax.Array
  before: jax.Array
  row8: jax.Array


def _segment_tiles(cu_N1, num_rows: int, tile: int) -> SegmentTiles:
  """The packed buffer's tiles of ``tile`` rows: the N tasks' row ranges, then the tail padding
  ``[cu[-1], num_rows)`` and the head padding ``[0, cu[0])``, each segment's tiles starting at
  its first row rounded down to ``KV_ROW_MULTIPLE``. The static tile count bounds the tiles of
  every segment (its rows and shift, rounded up); tiles past the last segment are not live."""
  n = cu_N1.shape[0] - 1
  m = KV_ROW_MULTIPLE
  cu = cu_N1.astype(jnp.int32)
  lo, hi = cu[:1], cu[-1:]
  seg_start = jnp.concatenate([cu[:-1], hi, jnp.zeros((1,), jnp.int32)])
  seg_len = jnp.maximum(jnp.concatenate([cu[1:] - cu[:-1], num_rows - hi, lo]), 0)
  shift_S = seg_start % m
  tiles_S = jnp.where(seg_len > 0, (seg_len + shift_S + tile - 1) // tile, 0)
  end_S = jnp.cumsum(tiles_S)
  t = jnp.arange(-(-(num_rows + (m - 1) * (n + 2)) // tile) + n + 2, dtype=jnp.int32)
  seg = jnp.minimum(jnp.searchsorted(end_S, t, side="right"), n + 1).astype(jnp.int32)
  live = t < end_S[-1]
  before = end_S[seg] - tiles_S[seg]
  lt = t - before
  shift = shift_S[seg]
  row8 = jnp.where(live, (seg_start[seg] - shift) // m + lt * (tile // m), 0)
  return SegmentTiles(seg=seg, live=live, lt=lt, shift=shift,
                      length=jnp.where(live, seg_len[seg], 0), before=before, row8=row8)


def _stored_rows(r, block: int, st: SegmentTiles):
  """(first row, rows) of a block of ``block`` rows starting at its segment's local row ``r``
  that lie in the segment: the rows the block stores."""
  first = jnp.maximum(r, 0)
  count = jnp.where(st.live, jnp.minimum(r + block, st.length) - first, 0)
  return jnp.where(count > 0, first - r, 0), jnp.maximum(count, 0)


# q_tile_table_in_place fields: those of q_tile_table (``QT_Q_TILE``: the tile's LSE slot in the
# ``front`` aligned layout, -1 for padding), then the tile's first row / 8 and, per warpgroup,
# the first row of its block holding its segment's rows and how many.
QT_Q_ROW8, QT_VA_W, QT_VN_W = 11, 12, 14
QT_FIELDS_IN_PLACE = 16


def q_tile_table_in_place(cu_q_N1, cu_k_N1, num_q_rows: int, bs: BlockSizes,
                          block_kv: int, window: int = 0) -> jax.Array:
  """Forward work list [QT_FIELDS_IN_PLACE, B] over query tiles of the packed query buffer.

  The buffer is cut into segments: the N tasks' query ranges, then the tail padding
  ``[cu_q[-1], T)`` and the head padding ``[0, cu_q[0])`` (key-less: their O = 0 is written by
  the kernel, so every row is written exactly once). A segment's tiles (``align_q`` rows) start
  at its first row rounded down to ``KV_ROW_MULTIPLE``: the rows before it and past its end are
  computed but not stored. Task tiles take LSE slots in the order of
  ``aligned_layout(cu_q, T, align_q, front=True)``. Sorted by descending key tiles. A
  ``window`` (> 0) cuts the keys and adds two fields as ``q_tile_table``'s.
  """
  n = cu_q_N1.shape[0] - 1
  st = _segment_tiles(cu_q_N1, num_q_rows, bs.align_q)
  task = st.live & (st.seg < n)
  zero = jnp.zeros((2,), jnp.int32)
  lk = jnp.where(task, jnp.concatenate([cu_k_N1[1:] - cu_k_N1[:-1], zero])[st.seg], 0)
  ks = jnp.where(task, jnp.concatenate([cu_k_N1[:-1], zero])[st.seg], 0)
  r0 = st.lt * bs.align_q - st.shift  # the segment's local index of the tile's first row
  slot = jnp.where(task, st.before + st.lt, -1)  # task segments come first
  stored = [_stored_rows(r0 + w * bs.block_q, bs.block_q, st) for w in range(NUM_COMPUTE_WGS)]
  lq = jnp.where(task, st.length, 0)
  if window:
    lk, ks = _window_keys(r0, lq, lk, ks, block_kv, window)
  key_fields = _key_tile_fields(r0, lq, lk, ks, bs, block_kv)
  fields = [slot, *key_fields, st.row8, *(va for va, _ in stored), *(vn for _, vn in stored)]
  if window:
    fields += _window_full_tiles(key_fields, bs, block_kv, window)
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-table[QT_NMAX], stable=True)]


def q_tail_rows(num_q_rows: int, num_rows8: int, block_q: int) -> jax.Array:
  """Rows ``[num_rows8 - block_q, num_rows8 + block_q)`` of the query buffer (``num_rows8``: its
  rows rounded up to 8), ``num_q_rows`` (a zero row) where outside ``[0, num_q_rows)``: the copy
  a query block reaching past the buffer's end reads instead (``gather_rows``)."""
  rows = num_rows8 - block_q + jnp.arange(2 * block_q, dtype=jnp.int32)
  return jnp.where((rows >= 0) & (rows < num_q_rows), rows, num_q_rows)


def kv_edges(cu_k_N1: jax.Array, num_k_rows: int, block_kv: int):
  """Rows around the ends of the tasks' keys, for tiles that would read outside them.

  A key tile read in place may start before ``cu_k[0]`` (by up to 7 rows) or run past
  ``cu_k[-1]``; those rows are padding (any value, NaN included) or past the buffer. Such tiles
  read a small copy instead: rows ``[hb, hb + block_kv)`` then ``[tb, tb + 2 * block_kv + 8)``
  of the buffer (``hb`` = ``cu_k[0]`` rounded down to 8, ``tb`` = ``cu_k[-1]`` rounded down to 8
  minus ``block_kv``) with every row outside ``[cu_k[0], cu_k[-1])`` zero.

  Returns:
    (edges [4] int32: cu_k[0], cu_k[-1], hb / 8, tb / 8; index rows of the copy; their validity).
  """
  m = KV_ROW_MULTIPLE
  lo, hi = cu_k_N1[0], cu_k_N1[-1]
  hb, tb = lo // m * m, hi // m * m - block_kv
  rows = jnp.concatenate([hb + jnp.arange(block_kv, dtype=jnp.int32),
                          tb + jnp.arange(2 * block_kv + m, dtype=jnp.int32)])
  valid = (rows >= lo) & (rows < hi)
  edges = jnp.stack([lo, hi, hb // m, tb // m]).astype(jnp.int32)
  return edges, jnp.where(valid, rows, num_k_rows)


# kv_tile_table fields.
KT_K_ROW, KT_Q_ROW, KT_NQ, KT_QA, KT_QA_W, KT_QF_W, KT_MOFF_W = 0, 1, 2, 3, 4, 6, 8
KT_FIELDS = 10


def kv_tile_table(cu_q_N1, cu_k_N1, lay_q: AlignedLayout, lay_k: AlignedLayout, num_k_rows: int,
                  bs: BlockSizes) -> jax.Array:
  """dK/dV work list [KT_FIELDS, B] over the CTA key tiles of the aligned buffer.

  Per tile: aligned first key row / ``align_k``, task's aligned first query row / ``align_q``,
  the task's query tiles
  (``block_q_dkv`` rows each), the first query tile any warpgroup needs, and per warpgroup ``w``
  (fields + w): first query tile that sees any of its keys, first query tile that sees all of
  them (no mask from there on), and ``moff`` (its key ``i`` is seen by local query row ``r`` iff
  ``i + moff <= r``). Sorted by descending query tiles streamed.
  """
  n = cu_q_N1.shape[0] - 1
  lq_N = cu_q_N1[1:] - cu_q_N1[:-1]
  lk_N = cu_k_N1[1:] - cu_k_N1[:-1]
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  num_tiles = padded_rows(num_k_rows, n, bs.align_k) // bs.align_k
  task, k0, live = _task_of_tile(lay_k.start_N, lk_N, bs.align_k, num_tiles, bs.align_k)
  lq = jnp.where(live, lq_N[task], 0)
  lk = jnp.where(live, lk_N[task], 0)
  off = lk - lq
  n_q = jnp.where(live, (lq + bqd - 1) // bqd, 0)
  qa_w, qf_w, moff_w = [], [], []
  for w in range(NUM_COMPUTE_WGS):
    kw = k0 + w * bkd
    empty = kw >= lk
    last = jnp.minimum(kw + bkd, lk) - 1
    qa_w.append(jnp.where(empty, n_q, jnp.clip((kw - off) // bqd, 0, n_q)))
    qf_w.append(jnp.where(empty, n_q, jnp.clip((last - off + bqd - 1) // bqd, 0, n_q)))
    moff_w.append(kw - off)
  qa = jnp.minimum(*qa_w)
  fields = [jnp.arange(num_tiles, dtype=jnp.int32),
            jnp.where(live, lay_q.start_N[task], 0) // bs.align_q, n_q, qa, *qa_w, *qf_w,
            *moff_w]
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-(n_q - qa), stable=True)]


# kv_tile_table_in_place fields: those of kv_tile_table (the first in units of 8 rows, see
# below), then per warpgroup the first row of its block holding its segment's rows and how many,
# then the first row / 8 of the task's query tiles in the packed query buffer.
KT_VA_W, KT_VN_W, KT_Q_ROW8 = 10, 12, 14
KT_FIELDS_IN_PLACE = 15
# With a window: per warpgroup the end of its unmasked query tiles and of its visible ones.
KT_QW_W, KT_QE_W = 15, 17
KT_FIELDS_WINDOW = 19


def kv_tile_table_in_place(cu_q_N1, cu_k_N1, lay_f: AlignedLayout, num_k_rows: int,
                           bs: BlockSizes, window: int = 0) -> jax.Array:
  """dK/dV work list [KT_FIELDS_IN_PLACE, B] over key tiles of the packed K/V buffers.

  Queries are read in place too: task ``i``'s query tiles (``block_q_dkv`` rows) start at
  ``cu_q[i]`` rounded down to 8 (``KT_Q_ROW8``), so its local query rows count from there (the
  first ``cu_q[i] % 8`` rows belong to no key of the task: their LSE must be +inf, which makes
  P and dS zero), and its LSE / delta rows are those of ``lay_f`` =
  ``aligned_layout(cu_q, T, align_q, front=True)`` (``KT_Q_ROW``: its first tile).

  The buffer is cut into segments: the N tasks' key ranges, then the tail padding
  ``[cu_k[-1], U)`` and the head padding ``[0, cu_k[0])`` (query-less, so their dK = dV = 0 is
  written by the kernel and every row is written exactly once). A segment's tiles start at its
  first row rounded down to ``KV_ROW_MULTIPLE``; ``KT_K_ROW`` is a tile's first row / 8 and
  ``moff`` counts from that row. Warpgroup ``w`` stores rows ``[va, va + vn)`` of its block.

  With a ``window`` (> 0; row r sees key i iff ``i + moff <= r < i + moff + window``) the CTA
  streams query tiles ``[qa, KT_NQ)`` with ``KT_NQ`` the last tile any warpgroup's keys are
  seen by, plus one, and per warpgroup: tiles ``[qa, KT_QA_W)`` see none of its keys,
  ``[KT_QA_W, KT_QF_W)`` are masked (causal edge), ``[KT_QF_W, KT_QW_W)`` are whole,
  ``[KT_QW_W, KT_QE_W)`` are masked (window edge), and from ``KT_QE_W`` on see none: query
  tiles wholly past every row's window are not visited.
  """
  n = cu_q_N1.shape[0] - 1
  m, bkd, bqd = KV_ROW_MULTIPLE, bs.block_kv_dkv, bs.block_q_dkv
  st = _segment_tiles(cu_k_N1, num_k_rows, bs.align_k)
  zero = jnp.zeros((2,), jnp.int32)
  cu_q = cu_q_N1.astype(jnp.int32)
  # A task's query rows counted from its first tile row: its front rows, then its own.
  lq_N = jnp.where(cu_q[1:] > cu_q[:-1], cu_q[1:] - cu_q[:-1] + lay_f.front_N, 0)
  lq = jnp.where(st.live, jnp.concatenate([lq_N, zero])[st.seg], 0)
  q_row8 = jnp.where(st.live, jnp.concatenate([(cu_q[:-1] - lay_f.front_N) // m,
                                               zero])[st.seg], 0)
  seg_q = jnp.where(st.live,
                    jnp.concatenate([lay_f.start_N // bs.align_q, zero])[st.seg], 0)
  lk = jnp.where(st.seg < n, st.length, 0)
  off = lk - lq
  n_q = (lq + bqd - 1) // bqd
  qa_w, qf_w, moff_w, va_w, vn_w, qw_w, qe_w = [], [], [], [], [], [], []
  for w in range(NUM_COMPUTE_WGS):
    kw = st.lt * bs.align_k + w * bkd - st.shift  # the segment's local index of its first row
    first = jnp.maximum(kw, 0)
    last_key = jnp.minimum(kw + bkd, lk) - 1
    empty = (kw + bkd <= 0) | (kw >= lk)
    qa_w.append(jnp.where(empty, n_q, jnp.clip((first - off) // bqd, 0, n_q)))
    qf_w.append(jnp.where(empty, n_q, jnp.clip((last_key - off + bqd - 1) // bqd, 0, n_q)))
    moff_w.append(kw - off)
    va, vn = _stored_rows(kw, bkd, st)
    va_w.append(va)
    vn_w.append(vn)
    if window:  # the first tile with a row past its first key's window; past its last key's
      qw_w.append(jnp.clip((first - off + window) // bqd, 0, n_q))
      qe_w.append(jnp.where(empty, 0, jnp.clip((last_key - off + window - 1) // bqd + 1, 0,
                                               n_q)))
  if window:
    n_q = jnp.maximum(*qe_w)  # the streamed tiles end there
    qa = jnp.minimum(jnp.minimum(*qa_w), n_q)
    qa_w = [jnp.clip(x, qa, n_q) for x in qa_w]
    qf_w = [jnp.clip(x, a, n_q) for x, a in zip(qf_w, qa_w)]
    qe_w = [jnp.clip(x, f, n_q) for x, f in zip(qe_w, qf_w)]
    qw_w = [jnp.clip(x, f, e) for x, f, e in zip(qw_w, qf_w, qe_w)]
  else:
    qa = jnp.minimum(*qa_w)
  fields = [st.row8, seg_q, n_q, qa, *qa_w, *qf_w, *moff_w, *va_w, *vn_w, q_row8, *qw_w, *qe_w]
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-(n_q - qa), stable=True)]
