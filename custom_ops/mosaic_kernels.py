"""Pallas Mosaic GPU kernels of ``custom_ops/mosaic_attention.py`` and their calls (Hopper).

The forward kernel (O and log2-domain LSE), the dQ kernel and the dK/dV kernel, each over the
work lists of ``custom_ops/mosaic_worklists.py``, plus the shared in-kernel pieces: the producer
warpgroup's TMA streaming, key-tile loops and causal masks. The layout and scheduling are
described in ``custom_ops/mosaic_attention.py``.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from custom_ops.mosaic_worklists import (
    KT_K_ROW, KT_MOFF_W, KT_NQ, KT_Q_ROW, KT_QA, KT_QA_W, KT_QF_W, KT_VA_W, KT_VN_W,
    KV_ROW_MULTIPLE, NUM_COMPUTE_WGS, QT_DIAG, QT_KB8, QT_LK, QT_NFULL, QT_NKV, QT_NMAX,
    QT_Q_TILE, QT_SHIFT, BlockSizes)

# Finite logit for masked keys: times the log2 scale it stays finite, so a row whose keys are all
# masked has a finite running max (no inf - inf); its probabilities are zeroed explicitly.
_MASK_VALUE = -1e30
_LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Registers per thread after setmaxnreg: 2 x 128 x 232 + 128 x 40 = 64512 of the SM's 65536. A
# request the register file cannot meet blocks the warpgroup forever.
_COMPUTE_REGISTERS, _PRODUCER_REGISTERS = 232, 40


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

  @pl.when(wg < NUM_COMPUTE_WGS)
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
    lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(l_safe) * (1.0 / LN2), -jnp.inf)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qs, o_ref.at[rows, h], commit_group=False)
    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == NUM_COMPUTE_WGS)
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

  @pl.when(wg == NUM_COMPUTE_WGS)
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

  @pl.when(wg < NUM_COMPUTE_WGS)
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

  @pl.when(wg == NUM_COMPUTE_WGS)
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


def forward_aligned(meta, edges, q_p, k, v, k_edge, v_edge, *, bs: BlockSizes, scale: float):
  """O [P, H, D] and log2-domain LSE [H, P] of the aligned query buffer."""
  num_p, num_heads, head_dim = q_p.shape
  group = num_heads // k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  kernel = plgpu.kernel(
      functools.partial(_fwd_kernel, bs=bs, scale2=scale * _LOG2E, group=group),
      out_type=[jax.ShapeDtypeStruct(q_p.shape, dtype),
                jax.ShapeDtypeStruct((num_heads, num_p), jnp.float32)],
      scratch_types=[
          _smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((slots, bs.block_kv, head_dim), dtype),
          _smem_tile((slots, bs.block_kv, head_dim), dtype),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
      ],
      grid=(num_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name="mosaic_attention_fwd",  # the name profiles show
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge)


def dq_aligned(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *,
                bs: BlockSizes, scale: float):
  num_p, num_heads, head_dim = q_p.shape
  group = num_heads // k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  kernel = plgpu.kernel(
      functools.partial(_dq_kernel, bs=bs, scale=scale, group=group),
      out_type=jax.ShapeDtypeStruct(q_p.shape, dtype),
      scratch_types=[
          _smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          _smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          _smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots),
      ],
      grid=(num_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name="mosaic_attention_dq",  # the name profiles show
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p)


def dkv_call(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *,
              bs: BlockSizes, scale: float, num_k_rows: int):
  """dK, dV [num_k_rows, K, D]: in the packed buffers (``bs.dkv_in_place``) or in the aligned
  copies k, v."""
  num_heads, head_dim = q_p.shape[1], q_p.shape[2]
  num_kv_heads = k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  stage = [plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype)] * 2
  kernel = plgpu.kernel(
      functools.partial(_dkv_kernel, bs=bs, scale=scale, group=num_heads // num_kv_heads),
      out_type=[jax.ShapeDtypeStruct((num_k_rows, *k.shape[1:]), dtype)] * 2,
      scratch_types=[
          _smem_tile((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          _smem_tile((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          _smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          _smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          *(stage if bs.dkv_in_place else []),
          plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_barriers=slots),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots),
      ],
      grid=(num_kv_heads, meta.shape[1]),
      grid_names=("heads", "tiles"),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      kernel_name="mosaic_attention_dkv",  # the name profiles show
      compiler_params=_compiler_params(),
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p)
