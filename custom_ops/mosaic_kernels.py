"""Pallas Mosaic GPU kernels of ``custom_ops/mosaic_attention.py`` (Hopper).

The forward kernel (O and log2-domain LSE), the dQ kernel, the dK/dV kernel and the fused
backward kernel (dQ, dK, dV over key tiles), each over the work lists of
``custom_ops/mosaic_worklists.py``, plus the shared in-kernel pieces: the producer
warpgroup's TMA streaming, key-tile loops, causal masks and row-piece stores. Their calls
(grids, scratch, outputs): ``custom_ops/mosaic_calls.py``. The layout and scheduling are
described in ``custom_ops/mosaic_attention.py``.
"""

from __future__ import annotations

import functools
import math

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from custom_ops.mosaic_worklists import (
    KT_K_ROW, KT_MOFF_W, KT_NQ, KT_Q_ROW, KT_Q_ROW8, KT_QA, KT_QA_W, KT_QE_W, KT_QF_W, KT_QW_W,
    KT_VA_W, KT_VN_W,
    KV_ROW_MULTIPLE, NUM_COMPUTE_WGS, QT_DIAG, QT_KB8, QT_LK, QT_NFULL, QT_NKV, QT_NMAX,
    QT_Q_ROW8, QT_Q_TILE, QT_SHIFT, QT_VA_W, QT_VN_W, BlockSizes)

# Finite logit for masked keys: times the log2 scale it stays finite, so a row whose keys are all
# masked has a finite running max (no inf - inf); its probabilities are zeroed explicitly.
_MASK_VALUE = -1e30
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Registers per thread after setmaxnreg: 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536. A
# request the register file cannot meet blocks the warpgroup forever.
_COMPUTE_REGISTERS, _PRODUCER_REGISTERS = 232, 40


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------


def smem_tile(shape, dtype, swizzle: int = 128):
  """A tile in the swizzled layout warpgroup MMA reads (rows of ``swizzle`` bytes per tile)."""
  tiling = plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize))
  return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def _wgmma_result(a, b, shape):
  """a @ b into a fresh f32 accumulator, returned as a value."""
  def body(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))


def _wgmma_pair(a1, b1, a2, b2, shape):
  """(a1 @ b1, a2 @ b2) into fresh f32 accumulators, both issued before either is awaited."""
  def body(acc1, acc2):
    plgpu.wgmma(acc1, a1, b1)
    plgpu.wgmma(acc2, a2, b2)
    return acc1[...], acc2[...]
  return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


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


def _key_tile_loops(step, skip, meta_ref, tile, wg, carry, window: int = 0):
  """A compute warpgroup's pass over its task's key tiles: masked tile 0 when the tiles start
  before the task's keys (with a window: every tile before the first one its rows see whole,
  the table's last fields), the unmasked tiles, the masked diagonal / last tiles, then the
  tiles only the other warpgroup needs (``skip``)."""
  shift, n_max = meta_ref[QT_SHIFT, tile], meta_ref[QT_NMAX, tile]
  n_full, n_kv = meta_ref[QT_NFULL + wg, tile], meta_ref[QT_NKV + wg, tile]
  a = jnp.minimum(jnp.where(shift > 0, 1, 0), n_kv)
  if window:
    whole = meta_ref[meta_ref.shape[0] - NUM_COMPUTE_WGS + wg, tile]
    a = jnp.minimum(jnp.maximum(a, whole), n_kv)
  b = jnp.maximum(a, jnp.minimum(n_full, n_kv))
  carry = lax.fori_loop(0, a, functools.partial(step, masked=True), carry)
  carry = lax.fori_loop(a, b, functools.partial(step, masked=False), carry)
  carry = lax.fori_loop(b, n_kv, functools.partial(step, masked=True), carry)
  lax.fori_loop(n_kv, n_max, skip, None)
  return carry


def _key_mask(meta_ref, tile, wg, j, shape, block_kv: int, window: int = 0):
  """Visibility of a [rows, keys] tile: local key 0 <= j <= row + diag and j < lk (and
  j > row + diag - window with a window)."""
  rows = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
  cols = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
  kpos = cols + (j * block_kv - meta_ref[QT_SHIFT, tile])
  diag, lk = meta_ref[QT_DIAG + wg, tile], meta_ref[QT_LK, tile]
  vis = (kpos >= 0) & (kpos <= rows + diag) & (kpos < lk)
  if window:
    vis &= kpos > rows + diag - window
  return vis


def _head_at(bs: BlockSizes, group: int, heads_index, group_index):
  """The query head of the forward / dQ CTA at grid indices ``heads`` and ``group``."""
  return heads_index * group + group_index if bs.group_adjacent else heads_index


def _query_head(bs: BlockSizes, group: int):
  """The query head of this CTA of a forward or dQ kernel (see ``query_grid``)."""
  return _head_at(bs, group, lax.axis_index("heads"),
                  lax.axis_index("group") if bs.group_adjacent else 0)


def query_grid(bs: BlockSizes, num_heads: int, group: int, num_tiles: int):
  """(grid, grid_names) of a forward or dQ kernel. The last grid axis varies fastest in launch
  order: with ``group_adjacent`` the ``group`` query heads of one KV head are neighbours, then
  the query tiles, then the KV heads (``heads`` counts KV heads there)."""
  if bs.group_adjacent:
    return (num_heads // group, num_tiles, group), ("heads", "tiles", "group")
  return (num_heads, num_tiles), ("heads", "tiles")


def _store_row_pieces(pairs, row0, first, count, col, piece: int):
  """Rows [first, first + count) of each (untiled staging buffer, buffer) pair, stored at
  ``row0 + first`` of column ``col`` in power-of-two row pieces (``piece``, ``piece / 2``, ...,
  1): TMA stores of whole tiles would overwrite the neighbours' rows. The caller commits."""
  while piece >= 1:
    def store(first=first, piece=piece):
      for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src.at[pl.ds(first, piece)],
                                dst.at[pl.ds(row0 + first, piece), col], commit_group=False)
    pl.when((count & piece) != 0)(store)
    first = first + (count & piece)
    piece //= 2


def fwd_kernel(meta_ref, edges_ref, q_ref, qe_ref, k_ref, v_ref, ke_ref, ve_ref, o_ref,
                lse_ref, q_smem, o_st, k_smem, v_smem, lse_smem, q_bar, k_bar, v_bar, k_free,
                v_free, sched_bar, *, bs: BlockSizes, scale2: float, group: int,
                window: int = 0):
  """One CTA query tile of one head (``q_tile_table_in_place``): O of its two warpgroup blocks
  in place, and their log2-domain LSE in the tile's slot (``window``: the sliding window)."""
  h, tile, wg = _query_head(bs, group), lax.axis_index("tiles"), lax.axis_index("wg")
  bq, bkv, slots = bs.block_q, bs.block_kv, bs.max_concurrent_steps
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  def sched_sync():
    if bs.pingpong:
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

  @pl.when(wg < NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    qs = q_smem.at[wg]
    m8 = KV_ROW_MULTIPLE
    row8 = meta_ref[QT_Q_ROW8, tile] + wg * (bq // m8)
    # A block reaching past the buffer's last row reads the copy of the buffer's tail rows.
    tail8 = (q_ref.shape[0] - bq) // m8
    past = row8 > tail8
    pl.when(past)(lambda: plgpu.copy_gmem_to_smem(
        qe_ref.at[pl.ds(jnp.minimum(row8 - tail8, bq // m8) * m8, bq), h], qs, q_bar.at[wg]))
    pl.when(jnp.logical_not(past))(lambda: plgpu.copy_gmem_to_smem(
        q_ref.at[pl.ds(row8 * m8, bq), h], qs, q_bar.at[wg]))
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
        vis = _key_mask(meta_ref, tile, wg, j, s.shape, bkv, window)
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
    acc, m_run, l = _key_tile_loops(step, skip, meta_ref, tile, wg, carry, window)
    pl.when(wg == 0)(sched_sync)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    o = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
    lse_smem.at[wg][...] = jnp.where(seen, m_run + jnp.log(l_safe) * (1.0 / LN2), -jnp.inf)
    first, count = meta_ref[QT_VA_W + wg, tile], meta_ref[QT_VN_W + wg, tile]

    @pl.when(count == bq)
    def _store_block():
      qs[...] = o
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(qs, o_ref.at[pl.ds(row8 * m8, bq), h], commit_group=False)

    @pl.when((count > 0) & (count < bq))
    def _store_pieces():  # a block holding rows of another segment
      o_st.at[wg][...] = o
      plgpu.commit_smem()
      _store_row_pieces([(o_st.at[wg], o_ref)], row8 * m8, first, count, h, bq // 2)

    slot = meta_ref[QT_Q_TILE, tile]
    plgpu.commit_smem()
    pl.when(slot >= 0)(lambda: plgpu.copy_smem_to_gmem(
        lse_smem.at[wg], lse_ref.at[h, pl.ds(slot * bs.align_q + wg * bq, bq)],
        commit_group=False))
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    _stream_key_tiles(meta_ref, edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_smem, v_smem, k_bar,
                      v_bar, k_free, v_free, tile=tile, kvh=lax.div(h, group), block_kv=bkv,
                      edge_block=bs.edge_block, slots=slots)


def dq_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, do_ref, lse_ref,
               delta_ref, dq_ref, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, in_bar,
               k_bar, v_bar, k_free, v_free, *, bs: BlockSizes, scale: float, group: int,
               window: int = 0):
  """One CTA query tile of one head: dQ = scale * sum over visible key tiles of dS K.

  ``bs.bwd_pairs``: S and dP are issued together (one wait)."""
  h, tile, wg = _query_head(bs, group), lax.axis_index("tiles"), lax.axis_index("wg")
  bq, bkv, slots = bs.block_q, bs.block_kv_dq, bs.max_concurrent_steps
  scale2 = scale * LOG2E
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype

  @pl.when(wg < NUM_COMPUTE_WGS)
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
      if bs.bwd_pairs:
        plgpu.barrier_wait(v_bar.at[slot])
        s, dp = _wgmma_pair(qs, k_smem.at[slot].transpose((1, 0)),
                            dos, v_smem.at[slot].transpose((1, 0)), (bq, bkv))
      else:
        s = _wgmma_result(qs, k_smem.at[slot].transpose((1, 0)), (bq, bkv))
        plgpu.barrier_wait(v_bar.at[slot])
        dp = _wgmma_result(dos, v_smem.at[slot].transpose((1, 0)), (bq, bkv))
      plgpu.barrier_arrive(v_free.at[slot])
      p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(lse, s.shape, [0]))
      if masked:
        p = jnp.where(_key_mask(meta_ref, tile, wg, j, s.shape, bkv, window), p, 0.0)
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
    dq = _key_tile_loops(step, skip, meta_ref, tile, wg, dq, window)
    qs[...] = (dq * scale).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qs, dq_ref.at[rows, h])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_COMPUTE_WGS)
  def _producer():
    plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")
    _stream_key_tiles(meta_ref, edges_ref, k_ref, v_ref, ke_ref, ve_ref, k_smem, v_smem, k_bar,
                      v_bar, k_free, v_free, tile=tile, kvh=lax.div(h, group), block_kv=bkv,
                      edge_block=bs.edge_block, slots=slots)


def _dkv_visible(key, row, moff, window: int):
  """dK/dV tiles: local query row ``row`` of the task sees key ``key`` of the block (its key
  ``key + moff`` in row units): causal, and inside the window when there is one."""
  vis = key + moff <= row
  if window:
    vis &= row < key + moff + window
  return vis


def _dkv_probabilities(st, lse_s, vis, *, scale2: float):
  """P^T of a [keys, rows] score tile S^T (log2-domain LSE of the rows), masked by ``vis``."""
  shape = st.shape
  lse = plgpu.load(lse_s, layout=plgpu.Layout.WGMMA.reduce(0))
  pt = jnp.exp2(st * scale2 - lax.broadcast_in_dim(lse, shape, [1]))
  if vis is not None:
    key = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    pt = jnp.where(vis(key, row), pt, 0.0)
  return pt


def _dkv_ds_transposed(pt, dpt, delta_s, dtype):
  """dS^T = P^T (dP^T - delta) in ``dtype`` (unscaled)."""
  delta = plgpu.load(delta_s, layout=plgpu.Layout.WGMMA.reduce(0))
  return (pt * (dpt - lax.broadcast_in_dim(delta, pt.shape, [1]))).astype(dtype)


def _dkv_products(ks, vs, q_s, do_s, lse_s, delta_s, carry, vis, *, scale2: float,
                  paired: bool, then=None):
  """One query step of a key block (dK/dV and fused kernels): S^T = K Q^T, P^T, dV += P^T dO,
  dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q.

  ``vis(key, row)`` (iota tiles of the block's keys and the step's query rows) masks P^T; None:
  every pair is visible. ``paired``: issue S^T with dP^T, then dV with dK (two waits per step);
  else S^T, then dV with dP^T, then dK (three). ``then`` (paired only): ``(init, issue)``, an
  extra f32 accumulator and ``issue(dst, acc_ref)``, called right after dV and dK are issued and
  awaited with them. Returns dK, dV and the extra accumulator (None without ``then``).
  """
  dk, dv = carry
  dtype = q_s.dtype
  shape = (ks.shape[0], q_s.shape[0])
  if paired:
    st, dpt = _wgmma_pair(ks, q_s.transpose((1, 0)), vs, do_s.transpose((1, 0)), shape)
    pt = _dkv_probabilities(st, lse_s, vis, scale2=scale2)
    dst = _dkv_ds_transposed(pt, dpt, delta_s, dtype)

    def dv_dk_body(refs):
      dv_ref, dk_ref, *extra_ref = refs
      plgpu.wgmma(dv_ref, pt.astype(dtype), do_s)
      plgpu.wgmma(dk_ref, dst, q_s)
      if then is not None:
        then[1](dst, *extra_ref)
    accs = (dv, dk) + ((then[0],) if then is not None else ())
    dv, dk, *extra = pl.run_state(dv_dk_body)(tuple(plgpu.ACC.init(a) for a in accs))
    return dk, dv, (extra[0] if extra else None)

  pt = _dkv_probabilities(_wgmma_result(ks, q_s.transpose((1, 0)), shape), lse_s, vis,
                          scale2=scale2)

  def dv_dp_body(refs):
    dv_ref, dpt_ref = refs
    plgpu.wgmma(dv_ref, pt.astype(dtype), do_s)
    plgpu.wgmma(dpt_ref, vs, do_s.transpose((1, 0)))
  zeros = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
  dv, dpt = pl.run_state(dv_dp_body)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
  dst = _dkv_ds_transposed(pt, dpt, delta_s, dtype)

  def dk_body(acc_ref):
    plgpu.wgmma(acc_ref, dst, q_s)
  dk = pl.run_state(dk_body)(plgpu.ACC.init(dk))
  return dk, dv, None


def _store_key_rows(dk, dv, dk_st, dv_st, dk_ref, dv_ref, meta_ref, tile, wg, kvh, *,
                    scale: float):
  """Stores rows [va, va + vn) of a warpgroup's dK/dV block (``kv_tile_table_in_place``) from
  untiled staging buffers, in power-of-two row pieces; the caller commits and waits."""
  dtype = dk_st.dtype
  bkd = dk_st.shape[0]
  dk_st[...] = (dk * scale).astype(dtype)
  dv_st[...] = dv.astype(dtype)
  plgpu.commit_smem()
  _store_row_pieces([(dk_st, dk_ref), (dv_st, dv_ref)],
                    meta_ref[KT_K_ROW, tile] * KV_ROW_MULTIPLE + wg * bkd,
                    meta_ref[KT_VA_W + wg, tile], meta_ref[KT_VN_W + wg, tile], kvh, bkd)


def _key_tile_steps(meta_ref, tile, bs: BlockSizes, group: int):
  """A key tile's ``kv_tile_table_in_place`` / ``kv_tile_table`` entries: its first row / 8,
  its task's first aligned query row, query tiles ``n_q``, first streamed tile ``qa``, steps
  per head and in all (over the GQA group)."""
  k_row, q_row, n_q, qa = (meta_ref[f, tile] for f in (KT_K_ROW, KT_Q_ROW, KT_NQ, KT_QA))
  per_head = n_q - qa
  return k_row, q_row * bs.align_q, n_q, qa, per_head, group * per_head


def _wait_query_tile(bars, slot):
  for bar in bars:
    plgpu.barrier_wait(bar.at[slot])


def _stream_query_tiles(q_ref, do_ref, lse_ref, delta_ref, q_smem, do_smem, lse_smem, delta_smem,
                        bars, free, *, kvh, group: int, per_head, q_row, qa, block: int,
                        num_steps, slots: int, in_place=None):
  """Producer warpgroup of the dK/dV and fused kernels: step s streams query tile
  ``qa + s % per_head`` of head ``kvh * group + s // per_head`` (Q, dO, LSE, delta). LSE and
  delta rows start at ``q_row``; Q and dO rows too, or with ``in_place`` = (edges, Q edge copy,
  dO edge copy, first row / 8, edge block) at that row of the packed buffers
  (``_read_key_rows``)."""
  plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

  def load(s, slot):
    h = kvh * group + lax.div(s, per_head)
    qt = qa + lax.rem(s, per_head)
    rows = pl.ds(q_row + qt * block, block)
    loads = [(lse_ref.at[h, rows], lse_smem, bars[2]), (delta_ref.at[h, rows], delta_smem, bars[3])]
    if in_place is None:
      loads += [(q_ref.at[rows, h], q_smem, bars[0]), (do_ref.at[rows, h], do_smem, bars[1])]
    else:
      edges_ref, qe_ref, doe_ref, q_row8, edge_block = in_place

      def copy(src_q, src_do, rows8):
        plgpu.copy_gmem_to_smem(src_q.at[rows8, h], q_smem.at[slot], bars[0].at[slot])
        plgpu.copy_gmem_to_smem(src_do.at[rows8, h], do_smem.at[slot], bars[1].at[slot])
      _read_key_rows(edges_ref, q_ref, do_ref, qe_ref, doe_ref,
                     q_row8 + qt * (block // KV_ROW_MULTIPLE), block, edge_block, copy)
    for src, dst, bar in loads:
      plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])

  _stream(num_steps, slots, load, lambda slot: plgpu.barrier_wait(free.at[slot]))


def _load_key_block(edges_ref, k_ref, v_ref, ke_ref, ve_ref, ks, vs, bar, kvh, start8,
                    edge_block: int):
  """A compute warpgroup's own K/V block, rows [start8 * 8, + block), in place or from the edge
  copies (``_read_key_rows``); waits for it."""
  def copy(src_k, src_v, rows):
    plgpu.copy_gmem_to_smem(src_k.at[rows, kvh], ks, bar)
    plgpu.barrier_wait(bar)
    plgpu.copy_gmem_to_smem(src_v.at[rows, kvh], vs, bar)
    plgpu.barrier_wait(bar)
  _read_key_rows(edges_ref, k_ref, v_ref, ke_ref, ve_ref, start8, ks.shape[0], edge_block, copy)


def dkv_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, do_ref, lse_ref,
               delta_ref, qedges_ref, qe_ref, doe_ref, dk_ref, dv_ref, *scratch, bs: BlockSizes,
               scale: float, group: int, window: int = 0):
  """One CTA key tile of one KV head: dK, dV over its GQA group's heads and visible queries.

  In place (``bs.dkv_in_place``): K/V and Q/dO rows come from the packed buffers
  (``_read_key_rows``; ``qedges_ref``, ``qe_ref``, ``doe_ref``: the query side's edges) and
  each warpgroup stores only its segment's rows of dK/dV, from untiled staging buffers in
  power-of-two row pieces (TMA stores of whole tiles would overwrite the neighbours' rows).
  ``bs.bwd_pairs``: see ``_dkv_products``.
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
  scale2 = scale * LOG2E
  head_dim = q_ref.shape[-1]
  dtype = q_ref.dtype
  k_row, q_row, n_q, qa, per_head, num_steps = _key_tile_steps(meta_ref, tile, bs, group)

  @pl.when(wg < NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    ks, vs = k_smem.at[wg], v_smem.at[wg]

    @pl.when(num_steps > 0)
    def _load_keys():
      if bs.dkv_in_place:
        _load_key_block(edges_ref, k_ref, v_ref, ke_ref, ve_ref, ks, vs, kv_bar.at[wg], kvh,
                        k_row + wg * (bkd // m), bs.edge_block)
      else:
        rows = pl.ds(k_row * bs.align_k + wg * bkd, bkd)
        for src, dst in ((k_ref, ks), (v_ref, vs)):
          plgpu.copy_gmem_to_smem(src.at[rows, kvh], dst, kv_bar.at[wg])
          plgpu.barrier_wait(kv_bar.at[wg])
    qa_w = meta_ref[KT_QA_W + wg, tile]
    qf_w = meta_ref[KT_QF_W + wg, tile]
    moff = meta_ref[KT_MOFF_W + wg, tile]

    wait_loaded = functools.partial(_wait_query_tile, (q_bar, do_bar, lse_bar, delta_bar))

    def step(qt, carry, base, masked: bool):
      slot = lax.rem(base + qt, slots)
      wait_loaded(slot)
      vis = None
      if masked:
        vis = lambda key, row: _dkv_visible(key, row + qt * bqd, moff, window)
      dk, dv, _ = _dkv_products(ks, vs, q_smem.at[slot], do_smem.at[slot], lse_smem.at[slot],
                                delta_smem.at[slot], carry, vis, scale2=scale2,
                                paired=bs.bwd_pairs)
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
      if not window:
        return lax.fori_loop(qf_w, n_q, functools.partial(step, base=base, masked=False), carry)
      qw_w, qe_w = meta_ref[KT_QW_W + wg, tile], meta_ref[KT_QE_W + wg, tile]
      carry = lax.fori_loop(qf_w, qw_w, functools.partial(step, base=base, masked=False), carry)
      carry = lax.fori_loop(qw_w, qe_w, functools.partial(step, base=base, masked=True), carry)
      lax.fori_loop(qe_w, n_q, functools.partial(skip, base=base), None)
      return carry

    zeros = plgpu.layout_cast(jnp.zeros((bkd, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    if bs.dkv_in_place:
      _store_key_rows(dk, dv, dk_stage.at[wg], dv_stage.at[wg], dk_ref, dv_ref, meta_ref, tile,
                      wg, kvh, scale=scale)
    else:
      ks[...] = (dk * scale).astype(dtype)
      vs[...] = dv.astype(dtype)
      plgpu.commit_smem()
      rows = pl.ds(k_row * bs.align_k + wg * bkd, bkd)
      plgpu.copy_smem_to_gmem(ks, dk_ref.at[rows, kvh], commit_group=False)
      plgpu.copy_smem_to_gmem(vs, dv_ref.at[rows, kvh], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  in_place = ((qedges_ref, qe_ref, doe_ref, meta_ref[KT_Q_ROW8, tile], bs.block_q_dkv)
              if bs.dkv_in_place else None)
  pl.when(wg == NUM_COMPUTE_WGS)(functools.partial(
      _stream_query_tiles, q_ref, do_ref, lse_ref, delta_ref, q_smem, do_smem, lse_smem,
      delta_smem, (q_bar, do_bar, lse_bar, delta_bar), free, kvh=kvh, group=group,
      per_head=per_head, q_row=q_row, qa=qa, block=bqd, num_steps=num_steps, slots=slots,
      in_place=in_place))


def bwd_fused_kernel(meta_ref, edges_ref, q_ref, k_ref, v_ref, ke_ref, ve_ref, do_ref, lse_ref,
                     delta_ref, qedges_ref, qe_ref, doe_ref, dq_ref, dk_ref, dv_ref, k_smem,
                     v_smem, q_smem, do_smem, lse_smem, delta_smem, union, kv_bar, q_bar, do_bar,
                     lse_bar, delta_bar, free, ds_bar, *, bs: BlockSizes, scale: float,
                     group: int, window: int = 0):
  """One CTA key tile of one KV head: dK, dV as the dK/dV kernel, plus dQ of every query step.

  Per step, each warpgroup writes its dS^T block [block_kv_dkv, block_q_dkv] to shared memory;
  after both have (``ds_bar``), warpgroup ``w`` computes columns ``[w * D/2, (w + 1) * D/2)`` of
  the step's dQ over both key blocks (dS K, two products) and adds them to the f32 ``dq_ref``
  (unscaled) with a TMA reduce-add store. Both warpgroups run every step of the CTA: a warpgroup
  whose keys no row of the step sees contributes zeros. A key block that reaches outside its
  task's keys (rows of a neighbouring task or padding) is masked on every step, since its dS
  feeds dQ. A step issues S^T with dP^T (one wait), then its dV and dK products, shares dS^T and
  issues its dQ products behind them, and waits once for all three. With a ``window``, the
  steps past the warpgroup's unmasked ones are masked up to ``KT_QE_W`` and zero after
  (``kv_tile_table_in_place``).
  """
  (ds_smem, dq_stage), (dk_stage, dv_stage) = union
  kvh, tile, wg = lax.axis_index("heads"), lax.axis_index("tiles"), lax.axis_index("wg")
  bkd, bqd, slots = bs.block_kv_dkv, bs.block_q_dkv, bs.max_concurrent_steps
  scale2 = scale * LOG2E
  head_dim = q_ref.shape[-1]
  half = head_dim // NUM_COMPUTE_WGS
  dtype = q_ref.dtype
  k_row, q_row, n_q, qa, per_head, num_steps = _key_tile_steps(meta_ref, tile, bs, group)
  q_row8 = meta_ref[KT_Q_ROW8, tile]

  @pl.when(wg < NUM_COMPUTE_WGS)
  def _compute():
    plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
    ks, vs = k_smem.at[wg], v_smem.at[wg]
    pl.when(num_steps > 0)(lambda: _load_key_block(
        edges_ref, k_ref, v_ref, ke_ref, ve_ref, ks, vs, kv_bar.at[wg], kvh,
        k_row + wg * (bkd // KV_ROW_MULTIPLE), bs.edge_block))
    qa_w, qf_w, moff, va, vn = (meta_ref[f + wg, tile]
                                for f in (KT_QA_W, KT_QF_W, KT_MOFF_W, KT_VA_W, KT_VN_W))
    # A block holding rows outside its task's keys is masked on every step it visits.
    inside = (va == 0) & (vn == bkd)
    if window:
      qe_w = meta_ref[KT_QE_W + wg, tile]
      qf = jnp.where(inside, qf_w, qe_w)
      qw = jnp.where(inside, meta_ref[KT_QW_W + wg, tile], qe_w)
    else:
      qf = jnp.where(inside, qf_w, n_q)
    cols = pl.ds(wg * half, half)

    wait_loaded = functools.partial(_wait_query_tile, (q_bar, do_bar, lse_bar, delta_bar))

    def store_dq(dq, qt, g):
      """Reduce-adds this warpgroup's dQ columns of query tile qt of head g to dq_ref."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous step's store read its stage
      dq_stage.at[wg][...] = dq
      plgpu.commit_smem()
      rows = pl.ds((q_row8 + qt * (bqd // KV_ROW_MULTIPLE)) * KV_ROW_MULTIPLE, bqd)
      plgpu.copy_smem_to_gmem(dq_stage.at[wg], dq_ref.at[rows, kvh * group + g, cols],
                              reduction_op="add")

    def share_ds_and_issue_dq(dst, par, dq_acc):
      """Writes this warpgroup's dS^T to dS buffer ``par``, waits for the other's, and issues
      this warpgroup's dQ columns over both key blocks (dS K) into ``dq_acc``."""
      ds_smem.at[par, wg][...] = dst
      plgpu.commit_smem()
      plgpu.barrier_arrive(ds_bar)
      plgpu.barrier_wait(ds_bar)
      for w in range(NUM_COMPUTE_WGS):
        plgpu.wgmma(dq_acc, ds_smem.at[par, w].transpose((1, 0)), k_smem.at[w].at[:, cols])

    zeros_dq = lambda: plgpu.layout_cast(jnp.zeros((bqd, half), jnp.float32), plgpu.Layout.WGMMA)

    def step(qt, carry, base, g, mode: str):
      """Query step ``base + qt``: S^T with dP^T; then dV, dK and the dQ products, awaited
      together. ``mode`` "zero": none of this warpgroup's keys is visible (its dS^T is zero)."""
      s = base + qt
      slot = lax.rem(s, slots)
      par = lax.rem(s, 2)  # two dS buffers: a warpgroup writes one while the other may read one
      wait_loaded(slot)
      if mode == "zero":
        plgpu.barrier_arrive(free.at[slot])
        dst = plgpu.layout_cast(jnp.zeros((bkd, bqd), dtype), plgpu.Layout.WGMMA)
        dq = pl.run_state(lambda acc: share_ds_and_issue_dq(dst, par, acc))(
            plgpu.ACC.init(zeros_dq()))
        store_dq(dq, qt, g)
        return carry
      vis = ((lambda key, row: (key >= va) & (key < va + vn)
                                & _dkv_visible(key, row + qt * bqd, moff, window))
             if mode == "masked" else None)
      dk, dv, dq = _dkv_products(
          ks, vs, q_smem.at[slot], do_smem.at[slot], lse_smem.at[slot], delta_smem.at[slot],
          carry, vis, scale2=scale2, paired=True,
          then=(zeros_dq(), lambda dst, acc: share_ds_and_issue_dq(dst, par, acc)))
      plgpu.barrier_arrive(free.at[slot])
      store_dq(dq, qt, g)
      return dk, dv

    def head(g, carry):
      base = g * per_head - qa  # step index of query tile qt of head g is base + qt
      modes = (((qa, qa_w, "zero"), (qa_w, qf, "masked"), (qf, qw, "full"), (qw, qe_w, "masked"),
                (qe_w, n_q, "zero")) if window else
               ((qa, qa_w, "zero"), (qa_w, qf, "masked"), (qf, n_q, "full")))
      for lo, hi, mode in modes:
        carry = lax.fori_loop(lo, hi, functools.partial(step, base=base, g=g, mode=mode), carry)
      return carry

    zeros = plgpu.layout_cast(jnp.zeros((bkd, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    # The dK/dV staging buffers share memory with the dS and dQ buffers: wait for this
    # warpgroup's dQ stores to read theirs and for the other warpgroup's last dQ products.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.barrier_arrive(ds_bar)
    plgpu.barrier_wait(ds_bar)
    _store_key_rows(dk, dv, dk_stage.at[wg], dv_stage.at[wg], dk_ref, dv_ref, meta_ref, tile, wg,
                    kvh, scale=scale)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  pl.when(wg == NUM_COMPUTE_WGS)(functools.partial(
      _stream_query_tiles, q_ref, do_ref, lse_ref, delta_ref, q_smem, do_smem, lse_smem,
      delta_smem, (q_bar, do_bar, lse_bar, delta_bar), free, kvh=kvh, group=group,
      per_head=per_head, q_row=q_row, qa=qa, block=bqd, num_steps=num_steps, slots=slots,
      in_place=(qedges_ref, qe_ref, doe_ref, q_row8, bqd)))
