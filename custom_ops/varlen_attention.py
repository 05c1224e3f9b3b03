"""Core attention over a fused batch of CA-tasks: a Pallas (Triton backend) kernel and reference.

Contract (the same as FlashAttention's varlen call with separate ``cu_seqlens_q``/``cu_seqlens_k``):
task ``i`` owns query rows ``[cu_q[i], cu_q[i+1])`` of the packed query buffer and key/value rows
``[cu_k[i], cu_k[i+1])`` of the packed key/value buffers. Inside a task the causal mask is aligned
bottom-right: local query row ``r`` of a task with ``lq`` queries and ``lk`` keys sees local keys
``j <= r + (lk - lq)`` (for ``lq == lk`` this is ordinary causal attention; the last query row
always sees every key). Query heads are a multiple of key/value heads (GQA: query head ``h`` reads KV head
``h // (H // K)``). Inputs are bf16, fp16 or f32; all accumulation is f32.

Rows that see no key (padding rows outside every task, rows of empty tasks, and the first rows of
a task with ``lq > lk``) get output 0 and log-sum-exp ``-inf``; their gradients are 0. Key rows outside
every task get dK = dV = 0. Nothing is NaN.

Preconditions that cannot be checked on traced values (checked when the tables are concrete):
``cu_seqlens`` are non-decreasing, start at >= 0 and end at <= the buffer length.

Letters in names: T query tokens, U key/value tokens, H query heads, K key/value heads, D head dim,
N tasks (``N1`` = N + 1), B blocks of rows.

Kernel layout (why it looks like this):
* Tasks start at arbitrary rows of the packed buffers, so the grid is over *row blocks* from a
  block table computed outside the kernel (plain jnp on ``cu_seqlens``, inside jit): every query
  block knows its task, first row, valid row count and causal offset. The number of blocks is
  static (``ceil(T / block) + N + 2``: each task and the two padding segments add at most one
  partial block), so one compiled kernel serves every task table of the same shapes. Padding rows
  form two pseudo-tasks without keys, so every output row is written exactly once (to zero).
* Each query block loops only over its own task's key blocks up to its causal limit: first the
  blocks every row sees in full (no mask), then the few diagonal blocks (masked).
* The grid is (heads, blocks) with heads fastest, so the query heads of one GQA group read the
  same K/V tiles at about the same time (L2 reuse), and blocks are sorted by descending work
  (longest-processing-time order) so that no long block starts last.
* Backward is FlashAttention-2 style without atomics: a dK/dV kernel over key blocks (looping over
  the GQA group's query heads and the task's query rows that see the block) and a dQ kernel over
  query blocks. Both recompute P from the saved log-sum-exp.

Why the Triton backend of Pallas (not Mosaic GPU): it runs under ``interpret=True`` on CPU, so
every test of this contract runs in CI, and its scalar loads make the data-dependent block tables
easy. Its price, measured on an H200 (results/archive/ef54cb6/kernel_gap.md,
experiments/kernel_profile.py): 0.54x
FlashAttention-3's forward and 0.53-0.80x its forward+backward on shards >= 512 tokens, because
the lowering gives one 8-warp program per SM (246 registers, 12.5% occupancy) with no warp
specialization, TMA or persistent grid, and this backward recomputes P in two kernels (1.41x the
useful FLOPs). Closing that gap means Hopper warpgroup code (Mosaic GPU); until then the GPU
configs use ``flash3`` and this kernel is the portable, tested one (and the faster one on
128-token shards with long contexts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

# A finite "minus infinity" for masked logits: exp2(MASK - m) is 0 and MASK - MASK is 0, not NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and Triton launch parameters of the three kernels (all static).

  Attributes:
    block_q: query rows per forward program.
    block_k: key rows per forward inner-loop step.
    num_warps: warps per forward program.
    num_stages: software-pipelining depth of the forward key loop.
    block_q_dq: query rows per dQ program.
    block_k_dq: key rows per dQ inner-loop step.
    num_warps_dq: warps per dQ program.
    num_stages_dq: pipelining depth of the dQ key loop.
    block_k_dkv: key rows per dK/dV program.
    block_q_dkv: query rows per dK/dV inner-loop step.
    num_warps_dkv: warps per dK/dV program.
    num_stages_dkv: pipelining depth of the dK/dV query loop.
  """
  # Defaults: the fastest tilings of two sweeps on one H200 (bf16, D=128, 32/8 heads; see
  # results/archive/be09cdd/kernel_sweep{1,2}.md): forward 128 x 128 at 8 warps, 3 stages (342
  # TFLOP/s dense 16K; 128 x 64 at 4 warps spills: 213); backward 64 x 64 at 4 warps, 2 stages
  # (3 stages: 35% slower). With 64-token shards half of each 128-row query tile is idle:
  # block_q=64, block_k=64, num_warps=4 forwards those at ~320 TFLOP/s instead.
  block_q: int = 128
  block_k: int = 128
  num_warps: int = 8
  num_stages: int = 3
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps_dq: int = 4
  num_stages_dq: int = 2
  block_k_dkv: int = 64
  block_q_dkv: int = 64
  num_warps_dkv: int = 4
  num_stages_dkv: int = 2

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"BlockSizes.{field.name}={value!r} must be a positive int")
      if field.name.startswith("block_") and (value < 16 or value & (value - 1)):
        raise ValueError(
            f"BlockSizes.{field.name}={value} must be a power of two >= 16 (Triton tile shapes "
            "are powers of two and its matrix units need at least 16 rows)")

  @classmethod
  def default_for(cls, dtype, head_dim: int) -> BlockSizes:
    """Default tiles for a dtype and head dim.

    bf16/fp16 with D <= 128 get the measured-fastest ``BlockSizes()``. f32 (no tensor-core path
    for IEEE f32 products) and D > 128 get the 64 x 64 forward tile that was validated on an
    H200 for f32 D = 64, 80 and 128, and rows of 1 KiB (f32, D > 128) also 32-row backward tiles;
    bf16 D > 128 and f32 D > 128 were not run on a GPU.
    """
    itemsize = jnp.dtype(dtype).itemsize
    row_bytes = itemsize * pl.next_power_of_2(head_dim)
    if itemsize <= 2 and row_bytes <= 256:
      return cls()
    if row_bytes <= 512:
      return cls(block_q=64, block_k=64, num_warps=4, num_stages=3)
    return cls(block_q=32, block_k=32, num_warps=4, num_stages=2, block_q_dq=32, block_k_dq=32,
               block_k_dkv=32, block_q_dkv=32)

  @classmethod
  def for_interpret(cls) -> BlockSizes:
    """Small tiles: on CPU (interpret mode) they keep tests fast and make tasks span blocks."""
    return cls(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_k_dkv=16,
               block_q_dkv=16)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def validate_inputs(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                    cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array) -> None:
  """Raises ValueError naming the bad value and the fix; checks values only when concrete."""
  q, k, v = q_TxHxD, k_UxKxD, v_UxKxD
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError(
        f"q, k, v must be [tokens, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got {k.shape=}, {v.shape=}")
  if q.shape[2] != k.shape[2]:
    raise ValueError(f"q and k must share head_dim; got {q.shape=}, {k.shape=}")
  num_q_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"query heads must be a positive multiple of kv heads (GQA); got {num_q_heads=}, "
        f"{num_kv_heads=}")
  if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
    raise ValueError(
        f"{head_dim=} is outside the supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  if q.dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{q.dtype=} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
  for name, cu in (("cu_seqlens_q", cu_seqlens_q_N1), ("cu_seqlens_k", cu_seqlens_k_N1)):
    if cu.ndim != 1 or cu.shape[0] < 2:
      raise ValueError(
          f"{name} must be 1-D [tasks + 1] with tasks >= 1; got {name}.shape={cu.shape}")
    if cu.dtype != jnp.int32:
      raise ValueError(
          f"{name} must be int32; got {name}.dtype={cu.dtype} (cast with .astype(int32))")
  if cu_seqlens_q_N1.shape != cu_seqlens_k_N1.shape:
    raise ValueError(
        f"cu_seqlens_q and cu_seqlens_k must have one entry per task boundary each; got "
        f"{cu_seqlens_q_N1.shape=}, {cu_seqlens_k_N1.shape=}")
  for name, cu, total in (("cu_seqlens_q", cu_seqlens_q_N1, q.shape[0]),
                          ("cu_seqlens_k", cu_seqlens_k_N1, k.shape[0])):
    if isinstance(cu, jax.core.Tracer):
      continue  # values unknown at trace time; the module docstring states the precondition
    cu_np = np.asarray(cu)
    if cu_np[0] < 0 or (np.diff(cu_np) < 0).any() or cu_np[-1] > total:
      raise ValueError(
          f"{name}={cu_np.tolist()} must be non-decreasing within [0, {total}] (the buffer length)")


# ------------------------------------------------------------------------------------------------
# Block tables (plain jnp on cu_seqlens, computed inside jit)
# ------------------------------------------------------------------------------------------------


def num_row_blocks(total_rows: int, num_tasks: int, block: int) -> int:
  """Static bound on the row blocks of a buffer cut into N tasks plus two padding segments."""
  return -(-total_rows // block) + num_tasks + 2


def _row_blocks(cu_N1: jax.Array, total_rows: int, block: int):
  """Cuts a packed buffer into per-segment row blocks.

  Segments are the N tasks, then the tail padding [cu[N], total) and the head padding [0, cu[0]).

  Returns:
    (seg_B, local_B, start_B, nrows_B, is_task_B): segment id (clamped), first local row of the
    block within its segment, first absolute row, valid rows (0 for unused blocks), and whether the
    segment is a real task.
  """
  n = cu_N1.shape[0] - 1
  cu = cu_N1.astype(jnp.int32)
  seg_start = jnp.concatenate([cu[:-1], cu[-1:], jnp.zeros((1,), jnp.int32)])
  seg_len = jnp.concatenate([cu[1:] - cu[:-1], total_rows - cu[-1:], cu[:1]])
  seg_len = jnp.maximum(seg_len, 0)
  seg_blocks = (seg_len + block - 1) // block
  blk_end = jnp.cumsum(seg_blocks)
  b = jnp.arange(num_row_blocks(total_rows, n, block), dtype=jnp.int32)
  seg = jnp.searchsorted(blk_end, b, side="right").astype(jnp.int32)
  live = seg < n + 2
  seg = jnp.minimum(seg, n + 1)
  local = (b - (blk_end[seg] - seg_blocks[seg])) * block
  start = seg_start[seg] + local
  nrows = jnp.where(live, jnp.minimum(block, seg_len[seg] - local), 0)
  is_task = live & (seg < n)
  return seg, local, start, nrows, is_task


def query_block_table(cu_q_N1, cu_k_N1, num_q_rows: int, block_q: int) -> jax.Array:
  """Per query block [5, B]: first row, valid rows, task's first key row, task's keys, diag.

  Row t of the block sees the task's local keys j <= t + diag (diag = first local row + lk - lq).
  """
  seg, local, start, nrows, is_task = _row_blocks(cu_q_N1, num_q_rows, block_q)
  n = cu_q_N1.shape[0] - 1
  task = jnp.minimum(seg, n - 1)
  lq = cu_q_N1[task + 1] - cu_q_N1[task]
  lk = cu_k_N1[task + 1] - cu_k_N1[task]
  k_start = jnp.where(is_task, cu_k_N1[task], 0)
  k_len = jnp.where(is_task, lk, 0)
  diag = jnp.where(is_task, local + lk - lq, 0)
  meta = jnp.stack([start, nrows, k_start, k_len, diag]).astype(jnp.int32)
  # Heaviest blocks first (longest-processing-time order) so no long block starts last.
  work = jnp.maximum(jnp.minimum(k_len, nrows + diag), 0)
  return meta[:, jnp.argsort(-work, stable=True)]


def key_block_table(cu_q_N1, cu_k_N1, num_k_rows: int, block_k: int) -> jax.Array:
  """Per key block [5, B]: first key row, valid keys, task's first query row, task's queries, c.

  Local query row r of the task sees key t of the block iff r >= c + t (c = j0 - (lk - lq)).
  """
  seg, local, start, nrows, is_task = _row_blocks(cu_k_N1, num_k_rows, block_k)
  n = cu_k_N1.shape[0] - 1
  task = jnp.minimum(seg, n - 1)
  lq = cu_q_N1[task + 1] - cu_q_N1[task]
  lk = cu_k_N1[task + 1] - cu_k_N1[task]
  q_start = jnp.where(is_task, cu_q_N1[task], 0)
  q_len = jnp.where(is_task, lq, 0)
  first_row = jnp.where(is_task, local - (lk - lq), 0)
  meta = jnp.stack([start, nrows, q_start, q_len, first_row]).astype(jnp.int32)
  work = jnp.maximum(q_len - jnp.maximum(first_row, 0), 0)
  return meta[:, jnp.argsort(-work, stable=True)]


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def _cdiv(a, b: int):
  # pl.cdiv and // do not lower for traced int32 scalars in the Triton backend; lax.div does.
  return lax.div(a + (b - 1), b)


def _dot_precision(dtype) -> Any:
  # Triton treats DEFAULT f32 dots as tf32; f32 inputs ask for full f32 products.
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _cols(head_dim: int):
  """Padded width, column slice and [1, Dp] mask of a head-dim tile (mask None if unpadded).

  Triton tiles are powers of two, so D = 80 or 96 is read as a masked 128-wide tile.
  """
  dpad = pl.next_power_of_2(head_dim)
  if head_dim == dpad:
    return dpad, slice(None), None
  return dpad, pl.ds(0, dpad), (jnp.arange(dpad) < head_dim)[None, :]


def _tile_mask(rows_ok_R, col_mask, num_rows: int, dpad: int):
  """Full [R, Dp] load/store mask from per-row validity (None: all rows) and the column mask."""
  if rows_ok_R is None:
    return None if col_mask is None else jnp.broadcast_to(col_mask, (num_rows, dpad))
  mask = rows_ok_R[:, None]
  if col_mask is not None:
    mask = mask & col_mask
  return jnp.broadcast_to(mask, (num_rows, dpad))


def _load(ref_view, mask, other: float = 0.0):
  if mask is None:
    return plgpu.load(ref_view)
  return plgpu.load(ref_view, mask=mask, other=other)


def key_loop_bounds(q_rows, k_len, diag, block_k: int):
  """Key blocks a query block needs, and how many of them every valid row sees in full."""
  # The last valid row (q_rows - 1) sees j < q_rows + diag; row 0 sees j <= diag.
  k_hi = jnp.maximum(jnp.minimum(k_len, q_rows + diag), 0)
  k_all_rows = jnp.maximum(jnp.minimum(k_len, diag + 1), 0)
  n_blocks = _cdiv(k_hi, block_k)
  n_full = jnp.minimum(lax.div(k_all_rows, block_k), n_blocks)
  return n_full, n_blocks


def query_window_bounds(q_len, k_rows, c, block_q: int, block_k: int):
  """dK/dV: (first local query row, query windows, masked windows) of a key block.

  Local query rows r >= c see key 0 of the block; rows r >= c + k_rows - 1 see all of it. A
  partial key block is always masked: its zero-filled key rows must not produce P > 0.
  """
  r_first = jnp.maximum(c, 0)
  n_windows = _cdiv(jnp.maximum(q_len - r_first, 0), block_q)
  n_masked = jnp.minimum(_cdiv(jnp.maximum(c + k_rows - 1 - r_first, 0), block_q), n_windows)
  return r_first, n_windows, jnp.where(k_rows < block_k, n_windows, n_masked)


def _fwd_kernel(meta_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale2: float, block_q: int,
                block_k: int, group: int, head_dim: int, precision):
  """One (query block, query head): online softmax over the task's visible key blocks."""
  h, blk = pl.program_id(0), pl.program_id(1)
  hk = lax.div(h, group)
  q_start, q_rows, k_start, k_len, diag = (meta_ref[i, blk] for i in range(5))
  dpad, cols, col_mask = _cols(head_dim)
  rows = jnp.arange(block_q, dtype=jnp.int32)
  krows = jnp.arange(block_k, dtype=jnp.int32)
  row_ok = rows < q_rows
  qmask = _tile_mask(row_ok, col_mask, block_q, dpad)
  q_slice = (pl.ds(q_start, block_q), h, cols)
  q = _load(q_ref.at[q_slice], qmask)
  n_full, n_blocks = key_loop_bounds(q_rows, k_len, diag, block_k)

  def body(j, carry, masked: bool):
    acc, m, l = carry
    kpos = j * block_k + krows
    kmask = _tile_mask(kpos < k_len if masked else None, col_mask, block_k, dpad)
    k_slice = (pl.ds(k_start + j * block_k, block_k), hk, cols)
    k = _load(k_ref.at[k_slice], kmask)
    v = _load(v_ref.at[k_slice], kmask)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale2
    if masked:
      vis = (kpos[None, :] <= rows[:, None] + diag) & (kpos[None, :] < k_len)
      s = jnp.where(vis, s, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if masked:
      p = jnp.where(vis, p, 0.0)
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l

  carry = (jnp.zeros((block_q, dpad), jnp.float32),
           jnp.full((block_q,), -jnp.inf, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
  carry = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)
  acc, m, l = carry
  seen = l > 0.0
  o = acc * (1.0 / jnp.where(seen, l, 1.0))[:, None]
  plgpu.store(o_ref.at[q_slice], o.astype(o_ref.dtype), mask=qmask)
  # log2-domain log-sum-exp of the scaled logits; -inf for rows that see no key.
  lse2 = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf)
  plgpu.store(lse_ref.at[h, pl.ds(q_start, block_q)], lse2, mask=row_ok)


def _dq_kernel(meta_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, scale: float,
               block_q: int, block_k: int, group: int, head_dim: int, precision):
  """One (query block, query head): dQ = scale * sum_j dS_j K_j over visible key blocks."""
  scale2 = scale * _LOG2E
  h, blk = pl.program_id(0), pl.program_id(1)
  hk = lax.div(h, group)
  q_start, q_rows, k_start, k_len, diag = (meta_ref[i, blk] for i in range(5))
  dpad, cols, col_mask = _cols(head_dim)
  rows = jnp.arange(block_q, dtype=jnp.int32)
  krows = jnp.arange(block_k, dtype=jnp.int32)
  row_ok = rows < q_rows
  qmask = _tile_mask(row_ok, col_mask, block_q, dpad)
  q_slice = (pl.ds(q_start, block_q), h, cols)
  q = _load(q_ref.at[q_slice], qmask)
  do = _load(do_ref.at[q_slice], qmask)
  # Invalid rows get lse=+inf and delta=0, so their P and dS are exactly 0.
  stat_slice = (h, pl.ds(q_start, block_q))
  lse2 = _load(lse_ref.at[stat_slice], row_ok, float("inf"))
  delta = _load(delta_ref.at[stat_slice], row_ok)
  n_full, n_blocks = key_loop_bounds(q_rows, k_len, diag, block_k)

  def body(j, dq, masked: bool):
    kpos = j * block_k + krows
    kmask = _tile_mask(kpos < k_len if masked else None, col_mask, block_k, dpad)
    k_slice = (pl.ds(k_start + j * block_k, block_k), hk, cols)
    k = _load(k_ref.at[k_slice], kmask)
    v = _load(v_ref.at[k_slice], kmask)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale2
    p = jnp.exp2(s - lse2[:, None])
    if masked:
      vis = (kpos[None, :] <= rows[:, None] + diag) & (kpos[None, :] < k_len)
      p = jnp.where(vis, p, 0.0)
    dp = plgpu.dot(do, v, trans_b=True, precision=precision)
    ds = p * (dp - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k, precision=precision)

  dq = jnp.zeros((block_q, dpad), jnp.float32)
  dq = lax.fori_loop(0, n_full, functools.partial(body, masked=False), dq)
  dq = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), dq)
  plgpu.store(dq_ref.at[q_slice], (dq * scale).astype(dq_ref.dtype), mask=qmask)


def _dkv_kernel(meta_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                scale: float, block_k: int, block_q: int, group: int, head_dim: int, precision):
  """One (key block, KV head): dK, dV summed over the GQA group's heads and the task's queries."""
  scale2 = scale * _LOG2E
  hk, blk = pl.program_id(0), pl.program_id(1)
  k_start, k_rows, q_start, q_len, c = (meta_ref[i, blk] for i in range(5))
  dpad, cols, col_mask = _cols(head_dim)
  krows = jnp.arange(block_k, dtype=jnp.int32)
  rows = jnp.arange(block_q, dtype=jnp.int32)
  kmask = _tile_mask(krows < k_rows, col_mask, block_k, dpad)
  k_slice = (pl.ds(k_start, block_k), hk, cols)
  k = _load(k_ref.at[k_slice], kmask)
  v = _load(v_ref.at[k_slice], kmask)

  r_first, n_windows, n_masked = query_window_bounds(q_len, k_rows, c, block_q, block_k)

  # Everything is computed transposed ([keys, queries]) so that every matmul has the key block
  # (block_k rows) as its M dimension: Hopper's wgmma wants M >= 64 per warpgroup.
  def body(w, carry, h, masked: bool):
    dk, dv = carry
    r0 = r_first + w * block_q
    row_ok = r0 + rows < q_len
    qmask = _tile_mask(row_ok, col_mask, block_q, dpad)
    q_slice = (pl.ds(q_start + r0, block_q), h, cols)
    q = _load(q_ref.at[q_slice], qmask)
    do = _load(do_ref.at[q_slice], qmask)
    # Rows past the task get q = dO = 0, lse = +inf, delta = 0: P = dS = 0 there.
    stat_slice = (h, pl.ds(q_start + r0, block_q))
    lse2 = _load(lse_ref.at[stat_slice], row_ok, float("inf"))
    delta = _load(delta_ref.at[stat_slice], row_ok)
    s_t = plgpu.dot(k, q, trans_b=True, precision=precision) * scale2  # [block_k, block_q]
    p_t = jnp.exp2(s_t - lse2[None, :])
    if masked:
      vis = ((r0 + rows)[None, :] >= c + krows[:, None]) & (krows[:, None] < k_rows)
      p_t = jnp.where(vis, p_t, 0.0)
    dv = dv + plgpu.dot(p_t.astype(do.dtype), do, precision=precision)
    dp_t = plgpu.dot(v, do, trans_b=True, precision=precision)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + plgpu.dot(ds_t.astype(q.dtype), q, precision=precision)
    return dk, dv

  def head_body(i, carry):
    h = hk * group + i
    carry = lax.fori_loop(0, n_masked, functools.partial(body, h=h, masked=True), carry)
    return lax.fori_loop(n_masked, n_windows, functools.partial(body, h=h, masked=False), carry)

  zeros = jnp.zeros((block_k, dpad), jnp.float32)
  dk, dv = lax.fori_loop(0, group, head_body, (zeros, zeros))
  plgpu.store(dk_ref.at[k_slice], (dk * scale).astype(dk_ref.dtype), mask=kmask)
  plgpu.store(dv_ref.at[k_slice], dv.astype(dv_ref.dtype), mask=kmask)


# ------------------------------------------------------------------------------------------------
# pallas_call wrappers
# ------------------------------------------------------------------------------------------------


def _compiler_params(num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _forward(q, k, v, cu_q, cu_k, scale: float, bs: BlockSizes, interpret: bool):
  """Returns o [T, H, D] (q dtype) and lse2 [H, T] (f32, log2 domain of the scaled logits)."""
  num_q_rows, num_heads, head_dim = q.shape
  group = num_heads // k.shape[1]
  meta = query_block_table(cu_q, cu_k, num_q_rows, bs.block_q)
  kernel = functools.partial(
      _fwd_kernel, scale2=scale * _LOG2E, block_q=bs.block_q, block_k=bs.block_k, group=group,
      head_dim=head_dim, precision=_dot_precision(q.dtype))
  return pl.pallas_call(
      kernel,
      grid=(num_heads, meta.shape[1]),
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((num_heads, num_q_rows), jnp.float32)],
      compiler_params=_compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name="varlen_attention_fwd",
  )(meta, q, k, v)


def _backward(q, k, v, cu_q, cu_k, o, lse2, do, dlse_TxH, scale: float, bs: BlockSizes,
              interpret: bool):
  num_q_rows, num_heads, head_dim = q.shape
  num_k_rows, num_kv_heads, _ = k.shape
  group = num_heads // num_kv_heads
  precision = _dot_precision(q.dtype)
  # delta_i = sum_d O_id dO_id - dLSE_i: the row term of dS = P * (dP - delta).
  delta = jnp.einsum("thd,thd->ht", o.astype(jnp.float32), do.astype(jnp.float32))
  delta = delta - dlse_TxH.astype(jnp.float32).T

  meta_q = query_block_table(cu_q, cu_k, num_q_rows, bs.block_q_dq)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, block_q=bs.block_q_dq, block_k=bs.block_k_dq,
                        group=group, head_dim=head_dim, precision=precision),
      grid=(num_heads, meta_q.shape[1]),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      compiler_params=_compiler_params(bs.num_warps_dq, bs.num_stages_dq),
      interpret=interpret,
      name="varlen_attention_dq",
  )(meta_q, q, k, v, do, lse2, delta)

  meta_k = key_block_table(cu_q, cu_k, num_k_rows, bs.block_k_dkv)
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, scale=scale, block_k=bs.block_k_dkv, block_q=bs.block_q_dkv,
                        group=group, head_dim=head_dim, precision=precision),
      grid=(num_kv_heads, meta_k.shape[1]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=_compiler_params(bs.num_warps_dkv, bs.num_stages_dkv),
      interpret=interpret,
      name="varlen_attention_dkv",
  )(meta_k, q, k, v, do, lse2, delta)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, cu_q, cu_k, scale, bs, interpret):
  o, lse2 = _forward(q, k, v, cu_q, cu_k, scale, bs, interpret)
  return o, (lse2 * _LN2).T


def _attention_fwd(q, k, v, cu_q, cu_k, scale, bs, interpret):
  o, lse2 = _forward(q, k, v, cu_q, cu_k, scale, bs, interpret)
  return (o, (lse2 * _LN2).T), (q, k, v, cu_q, cu_k, o, lse2)


def _attention_bwd(scale, bs, interpret, residuals, cotangents):
  q, k, v, cu_q, cu_k, o, lse2 = residuals
  do, dlse = cotangents
  dq, dk, dv = _backward(q, k, v, cu_q, cu_k, o, lse2, do, dlse, scale, bs, interpret)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def varlen_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                     cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                     softmax_scale: float | None = None, block_sizes: BlockSizes | None = None,
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Causal (bottom-right) GQA attention of every CA-task of a fused batch; Pallas kernel.

  Args:
    q_TxHxD: packed queries [T, H, D], bf16/fp16/f32.
    k_UxKxD: packed keys [U, K, D], H a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1]; task i owns query rows [cu_q[i], cu_q[i+1]).
    cu_seqlens_k_N1: int32 [N + 1]; task i owns key rows [cu_k[i], cu_k[i+1]).
    softmax_scale: logit scale; default 1 / sqrt(D).
    block_sizes: kernel tiles; default ``BlockSizes.default_for(dtype, D)`` (``for_interpret()``
      when interpreting).
    interpret: run the kernels in the Pallas interpreter (CPU).

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key) and lse_TxH (f32 natural-log log-sum-exp of the
    scaled logits; -inf on rows that see no key). Differentiable in q, k, v (and through lse).
  """
  validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  if block_sizes is None:
    block_sizes = (BlockSizes.for_interpret() if interpret else
                   BlockSizes.default_for(q_TxHxD.dtype, q_TxHxD.shape[2]))
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes; got {type(block_sizes).__name__}")
  head_dim = q_TxHxD.shape[2]
  scale = float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
  return _attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, scale,
                    block_sizes, bool(interpret))


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def rows_to_tasks(cu_N1: jax.Array, total_rows: int):
  """Task id (clamped), local index and validity ([T] each) of every row of a packed buffer."""
  t = jnp.arange(total_rows, dtype=jnp.int32)
  task = jnp.searchsorted(cu_N1[1:], t, side="right").astype(jnp.int32)
  valid = (t >= cu_N1[0]) & (t < cu_N1[-1])
  task = jnp.minimum(task, cu_N1.shape[0] - 2)
  return task, t - cu_N1[task], valid


def varlen_attention_reference(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                               cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                               softmax_scale: float | None = None) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp dense masked attention with the same contract as ``varlen_attention``.

  Materializes [H, T, U] logits in f32: a test oracle and fallback for small buffers only.
  """
  validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  num_q_rows, num_heads, head_dim = q_TxHxD.shape
  num_k_rows, num_kv_heads, _ = k_UxKxD.shape
  group = num_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
  cu_q, cu_k = cu_seqlens_q_N1, cu_seqlens_k_N1
  lq_N = cu_q[1:] - cu_q[:-1]
  lk_N = cu_k[1:] - cu_k[:-1]
  q_task, q_local, q_valid = rows_to_tasks(cu_q, num_q_rows)
  k_task, k_local, k_valid = rows_to_tasks(cu_k, num_k_rows)
  limit_T = q_local + (lk_N - lq_N)[q_task]
  mask_TxU = (q_valid[:, None] & k_valid[None, :] & (q_task[:, None] == k_task[None, :])
              & (k_local[None, :] <= limit_T[:, None]))

  # Padding rows are zeroed first so that whatever they hold (even NaN) cannot leak through 0 * x.
  q = jnp.where(q_valid[:, None, None], q_TxHxD.astype(jnp.float32), 0.0)
  q = q.reshape(num_q_rows, num_kv_heads, group, head_dim)
  k = jnp.where(k_valid[:, None, None], k_UxKxD.astype(jnp.float32), 0.0)
  v = jnp.where(k_valid[:, None, None], v_UxKxD.astype(jnp.float32), 0.0)
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("tkgd,ukd->kgtu", q, k, precision=hi) * scale
  mask = mask_TxU[None, None]
  m = lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(jnp.where(mask, s - m, 0.0)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  seen = l > 0.0
  l_safe = jnp.where(seen, l, 1.0)
  o = jnp.einsum("kgtu,ukd->tkgd", p / l_safe, v, precision=hi)
  lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # [K, G, T]
  o_TxHxD = o.reshape(num_q_rows, num_heads, head_dim).astype(q_TxHxD.dtype)
  lse_TxH = lse.reshape(num_heads, num_q_rows).T
  return o_TxHxD, lse_TxH
