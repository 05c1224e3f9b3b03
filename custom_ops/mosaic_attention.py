"""Core attention over a fused batch of CA-tasks: Pallas Mosaic GPU kernels (Hopper) and reference.

Same contract as ``custom_ops/varlen_attention.py`` (task ``i`` owns query rows
``[cu_q[i], cu_q[i+1])`` and key/value rows ``[cu_k[i], cu_k[i+1])``; bottom-right causal mask
inside each task; GQA; rows that see no key get output 0 and log-sum-exp ``-inf``; key rows
outside every task get dK = dV = 0). Inputs bf16 or fp16, head dim 64 or 128, f32 accumulation.
The kernels run only on Hopper GPUs (warpgroup MMA, TMA); ``mosaic_attention_reference`` is the
plain-jnp oracle (the same function as ``varlen_attention_reference``).

Letters in names: T query tokens, U key/value tokens, H query heads, K key/value heads, D head dim,
N tasks (``N1`` = N + 1), P padded rows, F table fields, B tiles.

Layout (why it looks like this):
* Queries go to an aligned copy. TMA copies whole tiles, and a query tile that straddles two
  tasks would write the neighbour's output rows. So each task's query rows are gathered (inside
  jit, plain jnp on ``cu_seqlens``) into a buffer where every task starts at a multiple of the
  CTA tile (``BlockSizes.align_q`` rows; rows between tasks are zeros), and O, LSE and dQ are
  gathered back. The padded length is static (``padded_rows``: each task adds at most
  ``align - 1`` rows), so one compiled kernel serves every task table of the same shapes.
* Keys and values are read in place. Key tiles start at multiples of ``KV_ROW_MULTIPLE`` (8)
  rows, the granularity at which Mosaic GPU issues tiled TMA copies; a task's first tile may
  start up to 7 rows early and its last runs past its end, both masked. Tiles that would reach
  outside the tasks' rows ``[cu_k[0], cu_k[-1])`` (padding, any value, or past the buffer) read a
  zero-padded copy of those edge rows instead (``kv_edges``), so NaN in padding never meets a
  zero probability. The dK/dV kernel tiles the packed buffer the same way (the two padding
  segments included, which get zeros) and stores each warpgroup's rows of its own segment from
  untiled staging buffers in power-of-two row pieces. K/V buffers whose row count is not a
  multiple of 8 are padded first (one copy; Mosaic GPU tiles the whole buffer).
* Work lists. ``q_tile_table`` lists, for every CTA query tile (two warpgroups of ``block_q``
  rows each), its task's key rows and, per warpgroup, how many key tiles it visits and which of
  them need no causal mask. ``kv_tile_table_in_place`` lists, for every CTA key tile of the dK/dV
  kernel, the query tiles of its own task that see it: per warpgroup the first one that sees any
  of its keys and the first that sees all of them. No (query tile, key tile) pair outside a
  task's key range or above its causal diagonal is visited; tiles are ordered by descending work
  (longest-processing-time first).
* Kernels are warp-specialized: two compute warpgroups and one producer warpgroup that streams
  tiles through ``max_concurrent_steps`` shared-memory slots with TMA (``mbarrier`` handshakes
  per slot). Forward: FlashAttention-3 style online softmax, optional ping-pong scheduling of the
  two compute warpgroups (softmax of one overlaps the matrix products of the other). Backward:
  FlashAttention-2 style without atomics: a dQ kernel over query tiles and a dK/dV kernel over
  key tiles that loops over its GQA group's heads and its task's visible query tiles.

Measured against FlashAttention-3 on one H200: custom_ops/MOSAIC_NOTES.md and
results/kernel_bench_mosaic.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from custom_ops import varlen_attention as va

# Finite logit for masked keys: times the log2 scale it stays finite, so a row whose keys are all
# masked has a finite running max (no inf - inf); its probabilities are zeroed explicitly.
_MASK_VALUE = -1e30
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_NUM_COMPUTE_WGS = 2
# Registers per thread after setmaxnreg: 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536. A
# request the register file cannot meet blocks the warpgroup forever.
_COMPUTE_REGISTERS, _PRODUCER_REGISTERS = 232, 40

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the three kernels (all static).

  Attributes:
    block_q: query rows per compute warpgroup in the forward and dQ kernels (a CTA takes two).
    block_kv: key rows per forward step.
    block_kv_dq: key rows per dQ step.
    block_kv_dkv: key rows per compute warpgroup in the dK/dV kernel (a CTA takes two).
    block_q_dkv: query rows per dK/dV step.
    max_concurrent_steps: shared-memory slots the producer warpgroup fills ahead.
    pingpong: forward only: make the two compute warpgroups alternate (FA3 scheduling).
    dkv_in_place: the dK/dV kernel reads K/V and writes dK/dV in the packed buffers (8-row
      aligned tile starts, partial tiles stored in power-of-two row pieces); False: on an aligned
      copy of K/V, gathered before and after the kernel (two more passes over K/V and dK/dV).
  """
  block_q: int = 64
  block_kv: int = 128
  block_kv_dq: int = 64
  block_kv_dkv: int = 64
  block_q_dkv: int = 64
  max_concurrent_steps: int = 2
  pingpong: bool = True
  dkv_in_place: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("pingpong", "dkv_in_place"):
        if not isinstance(value, bool):
          raise ValueError(f"BlockSizes.{field.name}={value!r} must be a bool")
        continue
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int")
      if field.name.startswith("block_") and value % 64:
        raise ValueError(
            f"BlockSizes.{field.name}={value} must be a multiple of 64 (warpgroup MMA tiles)")
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
    return _NUM_COMPUTE_WGS * self.block_q

  @property
  def edge_block(self) -> int:
    """Key-tile size the edge copies of K/V are cut for (``kv_edges``): the largest read."""
    return max(self.block_kv, self.block_kv_dq, self.align_k)

  @property
  def align_k(self) -> int:
    """Key rows of a CTA tile of the dK/dV kernel; tasks' keys start at multiples of it."""
    return _NUM_COMPUTE_WGS * self.block_kv_dkv


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1) -> None:
  """The varlen contract's checks plus this kernel's dtype and head-dim limits."""
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  dtype, head_dim = q_TxHxD.dtype, q_TxHxD.shape[2]
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"mosaic attention takes bf16 or fp16 inputs; got {dtype=} (cast, or use the 'pallas' "
        "kernel for f32)")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"mosaic attention supports head dims {SUPPORTED_HEAD_DIMS}; got {head_dim=} (use the "
        "'pallas' kernel for others)")


# ------------------------------------------------------------------------------------------------
# Aligned layout and work lists (plain jnp on cu_seqlens, inside jit)
# ------------------------------------------------------------------------------------------------


def padded_rows(total_rows: int, num_tasks: int, align: int) -> int:
  """Static length of the aligned buffer: each task rounded up to a multiple of ``align``."""
  return (-(-total_rows // align) + num_tasks) * align


@dataclasses.dataclass(frozen=True)
class AlignedLayout:
  """Where each task's rows live in the aligned buffer.

  Attributes:
    start_N: first aligned row of each task (a multiple of ``align``).
    src_P: for each aligned row, its row in the packed buffer, or ``total_rows`` (a zero row).
    dst_T: for each packed row, its aligned row, or ``P`` (rows outside every task).
  """
  start_N: jax.Array
  src_P: jax.Array
  dst_T: jax.Array


def aligned_layout(cu_N1: jax.Array, total_rows: int, align: int) -> AlignedLayout:
  n = cu_N1.shape[0] - 1
  cu = cu_N1.astype(jnp.int32)
  len_N = jnp.maximum(cu[1:] - cu[:-1], 0)
  plen_N = (len_N + align - 1) // align * align
  end_N = jnp.cumsum(plen_N)
  start_N = end_N - plen_N
  num_p = padded_rows(total_rows, n, align)
  p = jnp.arange(num_p, dtype=jnp.int32)
  task = jnp.minimum(jnp.searchsorted(end_N, p, side="right"), n - 1).astype(jnp.int32)
  local = p - start_N[task]
  valid = (p < end_N[-1]) & (local < len_N[task])
  src_P = jnp.where(valid, cu[task] + local, total_rows)
  t_task, t_local, t_valid = va.rows_to_tasks(cu, total_rows)
  dst_T = jnp.where(t_valid, start_N[t_task] + t_local, num_p)
  return AlignedLayout(start_N=start_N, src_P=src_P, dst_T=dst_T)


def _gather_rows(x, index, fill=0.0, axis=0):
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


def q_tile_table(cu_q_N1, cu_k_N1, lay_q: AlignedLayout, num_q_rows: int, bs: BlockSizes,
                 block_kv: int) -> jax.Array:
  """Forward / dQ work list [QT_FIELDS, B] over the CTA query tiles of the aligned query buffer.

  Per tile: its index (first aligned query row / ``align_q``), the task's first key row rounded
  down to ``KV_ROW_MULTIPLE`` (in those units) and the rows it was rounded by (``shift``), the
  task's keys ``lk``, the key tiles the producer streams (max over warpgroups), and per
  warpgroup ``w`` (fields + w): ``diag`` (row ``t`` of its block sees local keys
  ``0 <= j <= t + diag``, ``j < lk``), the end of its unmasked key tiles (tile 0 is masked when
  ``shift > 0``; tiles from ``n_full`` on are masked) and its key tiles. Sorted by descending
  key tiles.
  """
  n = cu_q_N1.shape[0] - 1
  lq_N = cu_q_N1[1:] - cu_q_N1[:-1]
  lk_N = cu_k_N1[1:] - cu_k_N1[:-1]
  num_tiles = padded_rows(num_q_rows, n, bs.align_q) // bs.align_q
  task, r0, live = _task_of_tile(lay_q.start_N, lq_N, bs.align_q, num_tiles, bs.align_q)
  lq = jnp.where(live, lq_N[task], 0)
  lk = jnp.where(live, lk_N[task], 0)
  ks = jnp.where(live, cu_k_N1[task], 0)
  shift = ks % KV_ROW_MULTIPLE
  off = lk - lq
  n_kv_w, n_full_w, diag_w = [], [], []
  for w in range(_NUM_COMPUTE_WGS):
    rw = r0 + w * bs.block_q
    diag = rw + off
    # Keys the block's last row sees (rows past the task see every key), and its first row; a
    # block wholly past its task's rows visits nothing.
    hi = jnp.where(rw < lq, jnp.clip(diag + bs.block_q, 0, lk), 0)
    lo = jnp.where(rw < lq, jnp.clip(diag + 1, 0, lk), 0)
    n_kv_w.append(jnp.where(hi > 0, (hi + shift + block_kv - 1) // block_kv, 0))
    n_full_w.append((lo + shift) // block_kv)
    diag_w.append(diag)
  n_max = jnp.maximum(*n_kv_w)
  fields = [jnp.arange(num_tiles, dtype=jnp.int32), ks // KV_ROW_MULTIPLE, shift, lk, n_max,
            *diag_w, *n_full_w, *n_kv_w]
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-n_max, stable=True)]


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
  for w in range(_NUM_COMPUTE_WGS):
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
# below), then per warpgroup the first row of its block holding its segment's rows and how many.
KT_VA_W, KT_VN_W = 10, 12
KT_FIELDS_IN_PLACE = 14


def kv_tile_table_in_place(cu_q_N1, cu_k_N1, lay_q: AlignedLayout, num_k_rows: int,
                           bs: BlockSizes) -> jax.Array:
  """dK/dV work list [KT_FIELDS_IN_PLACE, B] over key tiles of the packed K/V buffers.

  The buffer is cut into segments: the N tasks' key ranges, then the tail padding
  ``[cu_k[-1], U)`` and the head padding ``[0, cu_k[0])`` (query-less, so their dK = dV = 0 is
  written by the kernel and every row is written exactly once). A segment's tiles start at its
  first row rounded down to ``KV_ROW_MULTIPLE``; ``KT_K_ROW`` is a tile's first row / 8 and
  ``moff`` counts from that row. Warpgroup ``w`` stores rows ``[va, va + vn)`` of its block.
  """
  n = cu_q_N1.shape[0] - 1
  m, tile, bkd, bqd = KV_ROW_MULTIPLE, bs.align_k, bs.block_kv_dkv, bs.block_q_dkv
  cu_k = cu_k_N1.astype(jnp.int32)
  lo, hi = cu_k[:1], cu_k[-1:]
  zero = jnp.zeros((1,), jnp.int32)
  seg_start = jnp.concatenate([cu_k[:-1], hi, zero])
  seg_len = jnp.maximum(jnp.concatenate([cu_k[1:] - cu_k[:-1], num_k_rows - hi, lo]), 0)
  seg_lq = jnp.concatenate([cu_q_N1[1:] - cu_q_N1[:-1], zero, zero])
  seg_q = jnp.concatenate([lay_q.start_N // bs.align_q, zero, zero])
  shift_S = seg_start % m
  tiles_S = jnp.where(seg_len > 0, (seg_len + shift_S + tile - 1) // tile, 0)
  end_S = jnp.cumsum(tiles_S)
  num_tiles = -(-num_k_rows // tile) + 2 * (n + 2)  # each segment adds < 2 partial tiles
  t = jnp.arange(num_tiles, dtype=jnp.int32)
  seg = jnp.minimum(jnp.searchsorted(end_S, t, side="right"), n + 1).astype(jnp.int32)
  live = t < end_S[-1]
  lt = t - (end_S[seg] - tiles_S[seg])
  shift = shift_S[seg]
  row8 = jnp.where(live, (seg_start[seg] - shift) // m + lt * (tile // m), 0)
  length = jnp.where(live, seg_len[seg], 0)
  lq = jnp.where(live, seg_lq[seg], 0)
  lk = jnp.where(seg < n, length, 0)
  off = lk - lq
  n_q = (lq + bqd - 1) // bqd
  qa_w, qf_w, moff_w, va_w, vn_w = [], [], [], [], []
  for w in range(_NUM_COMPUTE_WGS):
    kw = lt * tile + w * bkd - shift  # the segment's local index of the block's first row
    first = jnp.maximum(kw, 0)
    last_key = jnp.minimum(kw + bkd, lk) - 1
    empty = (kw + bkd <= 0) | (kw >= lk)
    qa_w.append(jnp.where(empty, n_q, jnp.clip((first - off) // bqd, 0, n_q)))
    qf_w.append(jnp.where(empty, n_q, jnp.clip((last_key - off + bqd - 1) // bqd, 0, n_q)))
    moff_w.append(kw - off)
    count = jnp.where(live, jnp.minimum(kw + bkd, length) - first, 0)
    va_w.append(jnp.where(count > 0, first - kw, 0))
    vn_w.append(jnp.maximum(count, 0))
  qa = jnp.minimum(*qa_w)
  fields = [row8, jnp.where(live, seg_q[seg], 0), n_q, qa, *qa_w, *qf_w, *moff_w, *va_w, *vn_w]
  table = jnp.stack([f.astype(jnp.int32) for f in fields])
  return table[:, jnp.argsort(-(n_q - qa), stable=True)]


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _smem_tile(shape, dtype):
  """A bf16/fp16 tile in the swizzled layout warpgroup MMA reads."""
  swizzle = 128
  tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
  return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _wgmma_result(a, b, shape):
  """a @ b into a fresh f32 accumulator, returned as a value."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _row_vector(value, n: int, dim: int):
  """A length-n f32 vector laid out as rows (dim=1 reduced) or columns of a WGMMA tile."""
  return plgpu.layout_cast(jnp.full((n,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(dim))


def _stream(num_steps, slots: int, load_step, wait_free):
  """Producer loop: fills slot ``s % slots`` for step s, after the consumers freed it."""
  for s in range(slots):
    pl.when(s < num_steps)(functools.partial(load_step, s, s))

  def body(s, _):
    slot = lax.rem(s, slots)
    wait_free(slot)
    load_step(s, slot)
  lax.fori_loop(slots, num_steps, body, None)


def _read_key_rows(edges_ref, k_ref, v_ref, ke_ref, ve_ref, start8, num_rows: int,
                   edge_block: int, copy):
  """``copy(k_src, v_src, rows)`` for key rows [start8 * 8, + num_rows): in place when they lie
  inside the tasks' keys [cu_k[0], cu_k[-1]), else from the zero-padded edge copies."""
  m = KV_ROW_MULTIPLE
  lo, hi, hb8, tb8 = (edges_ref[i] for i in range(4))
  head = start8 * m < lo
  outside = head | (start8 * m + num_rows > hi)
  edge8 = jnp.where(head, start8 - hb8, edge_block // m + start8 - tb8)
  pl.when(outside)(lambda: copy(ke_ref, ve_ref, pl.ds(edge8 * m, num_rows)))
  pl.when(jnp.logical_not(outside))(lambda: copy(k_ref, v_ref, pl.ds(start8 * m, num_rows)))


def _stream_key_tiles(meta_ref, edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_smem, v_smem, k_bar,
                      v_bar, k_free, v_free, *, tile, kvh, block_kv: int, edge_block: int,
                      slots: int):
  """Producer of the forward / dQ kernels: the task's key tiles, read in place from K and V
  (or from the edge copies ``ke_ref`` / ``ve_ref`` when a tile reaches outside the tasks' keys;
  see ``kv_edges``)."""
  kb8, n_max = meta_ref[QT_KB8, tile], meta_ref[QT_NMAX, tile]

  def load(j, slot):
    def copy(src_k, src_v, rows):
      plgpu.copy_gmem_to_smem(src_k.at[rows, kvh], k_smem.at[slot], k_bar.at[slot])
      plgpu.copy_gmem_to_smem(src_v.at[rows, kvh], v_smem.at[slot], v_bar.at[slot])
    _read_key_rows(edges_ref, k_ref, v_ref, ke_ref, ve_ref, kb8 + j * (block_kv // KV_ROW_MULTIPLE),
                   block_kv, edge_block, copy)

  def wait_free(slot):
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])
  _stream(n_max, slots, load, wait_free)


def _key_tile_loops(step, skip, meta_ref, tile, wg, carry):
  """A compute warpgroup's pass over its task's key tiles: masked tile 0 when the tiles start
  before the task's keys, the unmasked tiles, the masked diagonal / last tiles, then the tiles
  only the other warpgroup needs (``skip``)."""
  shift, n_max = meta_ref[QT_SHIFT, tile], meta_ref[QT_NMAX, tile]
  n_full, n_kv = meta_ref[QT_NFULL + wg, tile], meta_ref[QT_NKV + wg, tile]
  a = jnp.minimum(jnp.where(shift > 0, 1, 0), n_kv)
  b = jnp.maximum(a, jnp.minimum(n_full, n_kv))
  carry = lax.fori_loop(0, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(b, n_kv, functools.partial(step, masked=True), carry)
  lax.fori_loop(n_kv, n_max, skip, None)
  return carry


def _key_mask(meta_ref, tile, wg, j, shape, block_kv: int):
  """Visibility of a [rows, keys] tile: local key 0 <= j <= row + diag and j < lk."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  kpos = cols + (j * block_kv - meta_ref[QT_SHIFT, tile])
  diag, lk = meta_ref[QT_DIAG + wg, tile], meta_ref[QT_LK, tile]
  return (kpos >= 0) & (kpos <= rows + diag) & (kpos < lk)


def _fwd_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, o_ref, lse_ref,
                q_smem, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, k_free, v_free,
                sched_bar, *, bs: BlockSizes, scale2: float, group: int):
  """One CTA query tile of one head: O and the log2-domain LSE of its two warpgroup blocks."""
  h, tile, wg = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("wg")
  bq, bkv, slots = bs.block_q, bs.block_kv, bs.max_concurrent_steps
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  def sched_sync():
    if bs.pingpong:
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

  @pl.when(wg < _NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    qs = q_smem.at[wg]
    rows = pl.ds(meta_ref[QT_Q_TILE, tile] * bs.align_q + wg * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[rows, h], qs, q_bar.at[wg])
    plgpu.barrier_wait(q_bar.at[wg])

    def step(j, carry, masked: bool):
      acc, m, l = carry
      slot = lax.rem(j, slots)
      plgpu.barrier_wait(k_bar.at[slot])

      def qk_body(acc_ref):
        plgpu.wgmma(acc_ref, qs, k_smem.at[slot].transpose((1, 0)))
        sched_sync()
        return acc_ref[...]
      s = pl.run_scoped(qk_body, plgpu.ACC((bq, bkv), jnp.float32))
      plgpu.barrier_arrive(k_free.at[slot])
      if masked:
        vis = _key_mask(meta_ref, tile, wg, j, s.shape, bkv)
        s = jnp.where(vis, s, _MASK_VALUE)
      m_new = jnp.maximum(m, s.max(axis=1) * scale2)
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
      if masked:
        p = jnp.where(vis, p, 0.0)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      if bs.pingpong:
        plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(v_bar.at[slot])
      if bs.pingpong:
        plgpu.barrier_wait(sched_bar)

      def pv_body(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
      acc = pl.run_state(pv_body)(plgpu.ACC.init(acc))
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    def skip(j, _):
      # Tiles the other warpgroup still needs: keep the barrier phases and slots in step.
      slot = lax.rem(j, slots)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])
      sched_sync()
      sched_sync()
      plgpu.barrier_wait(v_bar.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])

    carry = (plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA),
             _row_vector(-jnp.inf, bq, 1), _row_vector(0.0, bq, 1))
    pl.when(wg == 1)(sched_sync)
    acc, m, l = _key_tile_loops(step, skip, meta_ref, tile, wg, carry)
    pl.when(wg == 0)(sched_sync)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    qs[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
    lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(l_safe) * (1.0 / _LN2), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qs, o_ref.at[rows, h], commit_group=False)
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _NUM_COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    _stream_key_tiles(meta_ref, edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_smem, v_smem, k_bar,
                      v_bar, k_free, v_free, tile=tile, kvh=lax.div(h, group), block_kv=bkv,
                      edge_block=bs.edge_block, slots=slots)


def _dq_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, do_ref, lse_ref,
               delta_ref, dq_ref, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, in_bar,
               k_bar, v_bar, k_free, v_free, *, bs: BlockSizes, scale: float, group: int):
  """One CTA query tile of one head: dQ = scale * sum over visible key tiles of dS K."""
  h, tile, wg = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("wg")
  bq, bkv, slots = bs.block_q, bs.block_kv_dq, bs.max_concurrent_steps
  scale2 = scale * _LOG2E
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  @pl.when(wg < _NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    qs, dos, lses, deltas = q_smem.at[wg], do_smem.at[wg], lse_smem.at[wg], delta_smem.at[wg]
    rows = pl.ds(meta_ref[QT_Q_TILE, tile] * bs.align_q + wg * bq, bq)
    bar = in_bar.at[wg]
    for src, dst in ((q_ref.at[rows, h], qs), (do_ref.at[rows, h], dos),
                     (lse_ref.at[h, rows], lses), (delta_ref.at[h, rows], deltas)):
      plgpu.copy_gmem_to_smem(src, dst, bar)
      plgpu.barrier_wait(bar)
    lse = plgpu.load(lses, layout=plgpu.Layout.WGMMA.reduce(1))
    delta = plgpu.load(deltas, layout=plgpu.Layout.WGMMA.reduce(1))

    def step(j, dq, masked: bool):
      slot = lax.rem(j, slots)
      plgpu.barrier_wait(k_bar.at[slot])
      s = _wgmma_result(qs, k_smem.at[slot].transpose((1, 0)), (bq, bkv))
      plgpu.barrier_wait(v_bar.at[slot])
      dp = _wgmma_result(dos, v_smem.at[slot].transpose((1, 0)), (bq, bkv))
      plgpu.barrier_arrive(v_free.at[slot])
      p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(lse, s.shape, [0]))
      if masked:
        p = jnp.where(_key_mask(meta_ref, tile, wg, j, s.shape, bkv), p, 0.0)
      ds = p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))

      def dq_body(acc_ref):
        plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])
      dq = pl.run_state(dq_body)(plgpu.ACC.init(dq))
      plgpu.barrier_arrive(k_free.at[slot])
      return dq

    def skip(j, _):
      slot = lax.rem(j, slots)
      plgpu.barrier_wait(k_bar.at[slot])
      plgpu.barrier_wait(v_bar.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      plgpu.barrier_arrive(k_free.at[slot])

    dq = plgpu.layout_cast(jnp.zeros((bq, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dq = _key_tile_loops(step, skip, meta_ref, tile, wg, dq)
    qs[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qs, dq_ref.at[rows, h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _NUM_COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    _stream_key_tiles(meta_ref, edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_smem, v_smem, k_bar,
                      v_bar, k_free, v_free, tile=tile, kvh=lax.div(h, group), block_kv=bkv,
                      edge_block=bs.edge_block, slots=slots)


def _dkv_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, do_ref, lse_ref,
                delta_ref, dk_ref, dv_ref, *scratch, bs: BlockSizes, scale: float, group: int):
  """One CTA key tile of one KV head: dK, dV over its GQA group's heads and visible queries.

  In place (``bs.dkv_in_place``): K/V rows come from the packed buffers (``_read_key_rows``) and
  each warpgroup stores only its segment's rows of dK/dV, from untiled staging buffers in
  power-of-two row pieces (TMA stores of whole tiles would overwrite the neighbours' rows).
  """
  if bs.dkv_in_place:
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, dk_stage, dv_stage, kv_bar, q_bar,
     do_bar, lse_bar, delta_bar, free) = scratch
  else:
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, kv_bar, q_bar, do_bar, lse_bar,
     delta_bar, free) = scratch
  kvh, tile, wg = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("wg")
  bkd, bqd, slots = bs.block_kv_dkv, bs.block_q_dkv, bs.max_concurrent_steps
  m = KV_ROW_MULTIPLE
  scale2 = scale * _LOG2E
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  k_row, q_row, n_q, qa = (meta_ref[f, tile] for f in (KT_K_ROW, KT_Q_ROW, KT_NQ, KT_QA))
  q_row = q_row * bs.align_q
  per_head = n_q - qa
  num_steps = group * per_head

  @pl.when(wg < _NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    ks, vs = k_smem.at[wg], v_smem.at[wg]

    def copy(src_k, src_v, rows):
      plgpu.copy_gmem_to_smem(src_k.at[rows, kvh], ks, kv_bar.at[wg])
      plgpu.barrier_wait(kv_bar.at[wg])
      plgpu.copy_gmem_to_smem(src_v.at[rows, kvh], vs, kv_bar.at[wg])
      plgpu.barrier_wait(kv_bar.at[wg])

    @pl.when(num_steps > 0)
    def _load_keys():
      if bs.dkv_in_place:
        _read_key_rows(edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_row + wg * (bkd // m), bkd,
                       bs.edge_block, copy)
      else:
        copy(k_ref, v_ref, pl.ds(k_row * bs.align_k + wg * bkd, bkd))
    qa_w = meta_ref[KT_QA_W + wg, tile]
    qf_w = meta_ref[KT_QF_W + wg, tile]
    moff = meta_ref[KT_MOFF_W + wg, tile]

    def wait_loaded(slot):
      for bar in (q_bar, do_bar, lse_bar, delta_bar):
        plgpu.barrier_wait(bar.at[slot])

    def step(qt, carry, base, masked: bool):
      dk, dv = carry
      slot = lax.rem(base + qt, slots)
      wait_loaded(slot)
      st = _wgmma_result(ks, q_smem.at[slot].transpose((1, 0)), (bkd, bqd))
      lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      pt = jnp.exp2(st * scale2 - lax.broadcast_in_dim(lse, st.shape, [1]))
      if masked:
        key = plgpu.broadcasted_iota(jnp.int32, (bkd, bqd), 0, layout=plgpu.Layout.WGMMA)
        row = plgpu.broadcasted_iota(jnp.int32, (bkd, bqd), 1, layout=plgpu.Layout.WGMMA)
        pt = jnp.where(key + moff <= row + qt * bqd, pt, 0.0)

      def dv_dp_body(refs):
        dv_ref, dpt_ref = refs
        plgpu.wgmma(dv_ref, pt.astype(dtype), do_smem.at[slot])
        plgpu.wgmma(dpt_ref, vs, do_smem.at[slot].transpose((1, 0)))
      zeros = plgpu.layout_cast(jnp.zeros((bkd, bqd), jnp.float32), plgpu.Layout.WGMMA)
      dv, dpt = pl.run_state(dv_dp_body)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
      delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
      dst = pt * (dpt - lax.broadcast_in_dim(delta, dpt.shape, [1]))

      def dk_body(acc_ref):
        plgpu.wgmma(acc_ref, dst.astype(dtype), q_smem.at[slot])
      dk = pl.run_state(dk_body)(plgpu.ACC.init(dk))
      plgpu.barrier_arrive(free.at[slot])
      return dk, dv

    def skip(qt, _, base):
      slot = lax.rem(base + qt, slots)
      wait_loaded(slot)
      plgpu.barrier_arrive(free.at[slot])

    def head(g, carry):
      base = g * per_head - qa  # step index of query tile qt of head g is base + qt
      lax.fori_loop(qa, qa_w, functools.partial(skip, base=base), None)
      carry = lax.fori_loop(qa_w, qf_w, functools.partial(step, base=base, masked=True), carry)
      return lax.fori_loop(qf_w, n_q, functools.partial(step, base=base, masked=False), carry)

    zeros = plgpu.layout_cast(jnp.zeros((bkd, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    if bs.dkv_in_place:
      dk_st, dv_st = dk_stage.at[wg], dv_stage.at[wg]
      dk_st[...] = (dk * scale).astype(dtype)
      dv_st[...] = dv.astype(dtype)
      plgpu.commit_smem()
      row0 = k_row * m + wg * bkd
      first = meta_ref[KT_VA_W + wg, tile]
      count = meta_ref[KT_VN_W + wg, tile]
      piece = bkd
      while piece >= 1:  # rows [first, first + count) as pieces of 64, 32, ..., 1 rows
        def store(first=first, piece=piece):
          for src, dst in ((dk_st, dk_ref), (dv_st, dv_ref)):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(first, piece)],
                                    dst.at[pl.ds(row0 + first, piece), kvh], commit_group=False)
        pl.when((count & piece) != 0)(store)
        first = first + (count & piece)
        piece //= 2
    else:
      ks[...] = (dk * scale).astype(dtype)
      vs[...] = dv.astype(dtype)
      plgpu.commit_smem()
      rows = pl.ds(k_row * bs.align_k + wg * bkd, bkd)
      plgpu.copy_smem_to_gmem(ks, dk_ref.at[rows, kvh], commit_group=False)
      plgpu.copy_smem_to_gmem(vs, dv_ref.at[rows, kvh], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == _NUM_COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

    def load(s, slot):
      h = kvh * group + lax.div(s, per_head)
      rows = pl.ds(q_row + (qa + lax.rem(s, per_head)) * bqd, bqd)
      plgpu.copy_gmem_to_smem(q_ref.at[rows, h], q_smem.at[slot], q_bar.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[rows, h], do_smem.at[slot], do_bar.at[slot])
      plgpu.copy_gmem_to_smem(lse_ref.at[h, rows], lse_smem.at[slot], lse_bar.at[slot])
      plgpu.copy_gmem_to_smem(delta_ref.at[h, rows], delta_smem.at[slot], delta_bar.at[slot])

    _stream(num_steps, slots, load, lambda slot: plgpu.barrier_wait(free.at[slot]))


# ------------------------------------------------------------------------------------------------
# Kernel calls on the aligned buffers
# ------------------------------------------------------------------------------------------------


def _compiler_params():
  return plgpu.CompilerParams(approx_math=True)


def _forward_aligned(meta, edges, q_p, k, v, k_edge, v_edge, *, bs: BlockSizes, scale: float):
  """O [P, H, D] and log2-domain LSE [H, P] of the aligned query buffer."""
  num_p, num_heads, head_dim = q_p.shape
  group = num_heads // k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  kernel = plgpu.kernel(
      functools.partial(_fwd_kernel, bs=bs, scale2=scale * _LOG2E, group=group),
      out_type=[jax.ShapeDtypeStruct(q_p.shape, dtype),
                jax.ShapeDtypeStruct((num_heads, num_p), jnp.float32)],
      scratch_types=[
          _smem_tile((_NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((slots, bs.block_kv, head_dim), dtype),
          _smem_tile((slots, bs.block_kv, head_dim), dtype),
          plgpu.SMEM((_NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS),
      ],
      grid=(num_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge)


def _dq_aligned(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *,
                bs: BlockSizes, scale: float):
  num_p, num_heads, head_dim = q_p.shape
  group = num_heads // k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  kernel = plgpu.kernel(
      functools.partial(_dq_kernel, bs=bs, scale=scale, group=group),
      out_type=jax.ShapeDtypeStruct(q_p.shape, dtype),
      scratch_types=[
          _smem_tile((_NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((_NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          _smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          plgpu.SMEM((_NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.SMEM((_NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=slots),
      ],
      grid=(num_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p)


def _dkv_call(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *,
              bs: BlockSizes, scale: float, num_k_rows: int):
  """dK, dV [num_k_rows, K, D]: in the packed buffers (``bs.dkv_in_place``) or in the aligned
  copies k, v."""
  num_heads, head_dim = q_p.shape[1], q_p.shape[2]
  num_kv_heads = k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  stage = [plgpu.SMEM((_NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype)] * 2
  kernel = plgpu.kernel(
      functools.partial(_dkv_kernel, bs=bs, scale=scale, group=num_heads // num_kv_heads),
      out_type=[jax.ShapeDtypeStruct((num_k_rows, *k.shape[1:]), dtype)] * 2,
      scratch_types=[
          _smem_tile((_NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          _smem_tile((_NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          _smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          _smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          *(stage if bs.dkv_in_place else []),
          plgpu.Barrier(num_barriers=_NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=slots),
      ],
      grid=(num_kv_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p)


# ------------------------------------------------------------------------------------------------
# custom_vjp over packed buffers
# ------------------------------------------------------------------------------------------------


def _key_edges(k, v, cu_k, bs):
  edges, rows = kv_edges(cu_k, k.shape[0], bs.edge_block)
  return edges, _gather_rows(k, rows), _gather_rows(v, rows)


def _rows_to_multiple(x, multiple: int):
  """x with zero rows appended up to a multiple of ``multiple`` rows (a copy; none if already).

  Tiled TMA reads need the K/V buffers' row count to be a multiple of 8 (Mosaic GPU tiles the
  whole buffer); callers that allocate such buffers pay no copy.
  """
  extra = -x.shape[0] % multiple
  return x if extra == 0 else jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _forward(q, k, v, cu_q, cu_k, scale, bs):
  lay_q = aligned_layout(cu_q, q.shape[0], bs.align_q)
  q_p = _gather_rows(q, lay_q.src_P)
  edges, k_edge, v_edge = _key_edges(k, v, cu_k, bs)
  k, v = _rows_to_multiple(k, KV_ROW_MULTIPLE), _rows_to_multiple(v, KV_ROW_MULTIPLE)
  meta = q_tile_table(cu_q, cu_k, lay_q, q.shape[0], bs, bs.block_kv)
  o_p, lse2_p = _forward_aligned(meta, edges, q_p, k, v, k_edge, v_edge, bs=bs, scale=scale)
  o = _gather_rows(o_p, lay_q.dst_T)
  lse_TxH = _gather_rows(lse2_p, lay_q.dst_T, fill=-jnp.inf, axis=1).T * _LN2
  return (o, lse_TxH), (q_p, k, v, o_p, lse2_p, cu_q, cu_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, cu_q, cu_k, scale, bs):
  return _forward(q, k, v, cu_q, cu_k, scale, bs)[0]


def _attention_fwd(q, k, v, cu_q, cu_k, scale, bs):
  out, res = _forward(q, k, v, cu_q, cu_k, scale, bs)
  return out, (res, q.shape[0], k.shape[0])


def _attention_bwd(scale, bs, residuals, cotangents):
  # k, v: the forward's buffers, rows padded to a multiple of 8; num_k_rows: the caller's rows.
  (q_p, k, v, o_p, lse2_p, cu_q, cu_k), num_q_rows, num_k_rows = residuals
  do, dlse_TxH = cotangents
  lay_q = aligned_layout(cu_q, num_q_rows, bs.align_q)
  do_p = _gather_rows(do, lay_q.src_P)
  dlse_p = _gather_rows(dlse_TxH.astype(jnp.float32).T, lay_q.src_P, axis=1)
  # delta_i = sum_d O_id dO_id - dLSE_i: the row term of dS = P * (dP - delta).
  delta_p = jnp.einsum("phd,phd->hp", o_p.astype(jnp.float32), do_p.astype(jnp.float32)) - dlse_p
  # Rows that see no key (LSE -inf) get +inf: their P, hence dS, is exactly 0.
  lse2_b = jnp.where(jnp.isneginf(lse2_p), jnp.inf, lse2_p)
  edges, k_edge, v_edge = _key_edges(k, v, cu_k, bs)
  meta_q = q_tile_table(cu_q, cu_k, lay_q, num_q_rows, bs, bs.block_kv_dq)
  dq_p = _dq_aligned(meta_q, edges, q_p, k, v, k_edge, v_edge, do_p, lse2_b, delta_p, bs=bs,
                     scale=scale)
  if bs.dkv_in_place:
    # dK/dV are stored untiled, so they take the caller's row count.
    meta_k = kv_tile_table_in_place(cu_q, cu_k, lay_q, num_k_rows, bs)
    dk, dv = _dkv_call(meta_k, edges, q_p, k, v, k_edge, v_edge, do_p, lse2_b, delta_p, bs=bs,
                       scale=scale, num_k_rows=num_k_rows)
  else:
    k, v = k[:num_k_rows], v[:num_k_rows]
    lay_k = aligned_layout(cu_k, num_k_rows, bs.align_k)
    k_p, v_p = _gather_rows(k, lay_k.src_P), _gather_rows(v, lay_k.src_P)
    meta_k = kv_tile_table(cu_q, cu_k, lay_q, lay_k, k.shape[0], bs)
    dk_p, dv_p = _dkv_call(meta_k, edges, q_p, k_p, v_p, k_p, v_p, do_p, lse2_b, delta_p, bs=bs,
                           scale=scale, num_k_rows=k_p.shape[0])
    dk, dv = _gather_rows(dk_p, lay_k.dst_T), _gather_rows(dv_p, lay_k.dst_T)
  dq = _gather_rows(dq_p, lay_q.dst_T)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                     cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                     softmax_scale: float | None = None,
                     block_sizes: BlockSizes | None = None) -> tuple[jax.Array, jax.Array]:
  """Causal (bottom-right) GQA attention of every CA-task of a fused batch; Mosaic GPU kernels.

  Args:
    q_TxHxD: packed queries [T, H, D], bf16/fp16, D in ``SUPPORTED_HEAD_DIMS``.
    k_UxKxD: packed keys [U, K, D], H a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1]; task i owns query rows [cu_q[i], cu_q[i+1]).
    cu_seqlens_k_N1: int32 [N + 1]; task i owns key rows [cu_k[i], cu_k[i+1]).
    softmax_scale: logit scale; default 1 / sqrt(D).
    block_sizes: kernel tiles; default ``BlockSizes()``.

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key) and lse_TxH (f32 natural-log log-sum-exp of the
    scaled logits; -inf on rows that see no key). Differentiable in q, k, v (and through lse).
  """
  validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a mosaic_attention.BlockSizes; got {block_sizes=}")
  head_dim = q_TxHxD.shape[2]
  scale = float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
  return _attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, scale,
                    block_sizes)


# The oracle: the plain-jnp dense masked attention of the shared contract.
mosaic_attention_reference = va.varlen_attention_reference
