"""Mosaic GPU core attention (custom_ops/mosaic_attention.py and its kernel and work-list modules).

On CPU: the aligned layouts round-trip rows, and the work lists cover exactly the visible (query,
key) pairs of random task tables (every visible pair in a visited tile, every unmasked tile fully
visible; the fused backward's steps count no pair outside its task; every query, key and value
row read in place or from its zero-padded edge copy; every output row stored once), in NumPy;
forward and both backward paths cross-lower for CUDA. On a Hopper GPU (JAX_PLATFORMS=cuda): outputs, LSE and gradients of the
kernels against the plain-jnp reference on random task tables (empty tasks, length-1 tasks, more
queries than keys, tasks ending at their key end, padding rows holding NaN, GQA ratios 1/2/4,
head dims 64/128).

Run: .venv/bin/python -m pytest -q tests/test_mosaic_attention.py            (CPU part)
     JAX_PLATFORMS=cuda python3 -m pytest -q tests/test_mosaic_attention.py  (on an H100/H200)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_ops import mosaic_attention as ma
from custom_ops import mosaic_worklists as mw

ON_HOPPER = jax.default_backend() == "gpu" and any(
    name in jax.devices()[0].device_kind for name in ("H100", "H200", "H800", "H20"))
needs_hopper = pytest.mark.skipif(
    not ON_HOPPER, reason="Mosaic GPU kernels need a Hopper GPU (H100/H200; warpgroup MMA and "
    f"TMA); default backend here is {jax.default_backend()!r}")


def random_table(rng: np.random.Generator, num_tasks: int, max_len: int):
  """Task lengths mixing empty tasks, 1-token tasks, lq == lk, lq < lk and lq > lk."""
  lq = rng.integers(0, max_len + 1, size=num_tasks)
  lk = rng.integers(0, max_len + 1, size=num_tasks)
  kind = rng.integers(0, 6, size=num_tasks)
  lq = np.where(kind == 0, 0, lq)
  lq = np.where(kind == 1, 1, lq)
  lk = np.where(kind == 2, lq, lk)  # ordinary causal: the task ends at its key end
  lk = np.where(kind == 3, 0, lk)
  lk = np.where(kind == 4, lq + rng.integers(0, 3 * max_len + 1, size=num_tasks), lk)
  head_q, head_k = int(rng.integers(0, 5)), int(rng.integers(0, 5))
  cu_q = np.concatenate([[0], np.cumsum(lq)]) + head_q
  cu_k = np.concatenate([[0], np.cumsum(lk)]) + head_k
  return cu_q.astype(np.int32), cu_k.astype(np.int32)


# ------------------------------------------------------------------------------------------------
# CPU: layout and work lists
# ------------------------------------------------------------------------------------------------
def _compiled(fn, *arrays):
  """``fn(*arrays)`` compiled as one program, its results as NumPy: how the kernels' callers run
  these jnp work lists (inside jit). Run eagerly, each of their ops would compile on its own, for
  every new table size (about 4x the time on CPU)."""
  return jax.tree.map(np.asarray, jax.jit(fn)(*(jnp.asarray(a) for a in arrays)))



@pytest.mark.parametrize("seed", range(4))
def test_aligned_layout_round_trips(seed):
  rng = np.random.default_rng(seed)
  cu, _ = random_table(rng, 6, 150)
  total = int(cu[-1]) + int(rng.integers(0, 9))
  x = rng.standard_normal((total, 3)).astype(np.float32)

  def round_trip(cu, x):
    lay = mw.aligned_layout(cu, total, 128)
    xp = mw.gather_rows(x, lay.src_P)
    return xp, mw.gather_rows(xp, lay.dst_T), lay.start_N

  xp, back, start = _compiled(round_trip, cu, x)
  assert xp.shape[0] == mw.padded_rows(total, 6, 128)
  inside = (np.arange(total) >= cu[0]) & (np.arange(total) < cu[-1])
  np.testing.assert_array_equal(back[inside], x[inside], err_msg=f"{seed=}")
  assert (back[~inside] == 0).all(), f"{seed=}"
  assert (start % 128 == 0).all() and (np.diff(start) >= 0).all(), f"{seed=} {start=}"


def _visible(lq, lk):
  r = np.arange(lq)[:, None]
  j = np.arange(lk)[None, :]
  return j <= r + (lk - lq)


def _check_edge_read(edge, start, num_rows, edge_block, total, err):
  """A read of rows [start, start + num_rows) (``_read_key_rows``): in place when inside the
  tasks' rows [lo, hi), else from the edge copy of ``kv_edges`` at the offset the kernel
  computes, which must hold exactly those rows (a zero row, index ``total``, outside [lo, hi))."""
  (lo, hi, hb8, tb8), edge_rows = edge
  assert start % 8 == 0 and start >= 0, err
  if lo <= start and start + num_rows <= hi:
    return
  e = (start // 8 - hb8 if start < lo else edge_block // 8 + start // 8 - tb8) * 8
  assert 0 <= e and e + num_rows <= edge_rows.shape[0], f"{err} {start=}"
  want = np.arange(start, start + num_rows)
  np.testing.assert_array_equal(edge_rows[e:e + num_rows],
                                np.where((want >= lo) & (want < hi), want, total), err_msg=err)


def _check_key_tiles(col, w, r, task, cu_k, kv_edge, covered, block_kv, err):
  """A query block's key tiles (``q_tile_table`` fields of ``col``; ``r``: the task-local rows
  of the block that are checked): each read inside [cu_k[0], cu_k[-1]) or from the zero-padded
  edge copy, unmasked tiles wholly visible; adds the visible pairs it visits to ``covered``."""
  (lo, hi, hb8, tb8), edge_rows, edge_block, total_k = kv_edge
  kb, shift, lk = col[mw.QT_KB8] * 8, col[mw.QT_SHIFT], col[mw.QT_LK]
  n_full, n_kv = col[mw.QT_NFULL + w], col[mw.QT_NKV + w]
  assert 0 <= n_kv <= col[mw.QT_NMAX], err
  lq = cu_q_len = covered[task].shape[0]
  assert lk == cu_k[task + 1] - cu_k[task] and kb + shift == cu_k[task], err
  assert r.size and r[0] < cu_q_len, f"{err}: a block past its task's rows visits key tiles"
  vis = _visible(lq, lk)
  a = min(int(shift > 0), n_kv)
  b = max(a, min(n_full, n_kv))
  for j in range(n_kv):
    _check_edge_read(((lo, hi, hb8, tb8), edge_rows), kb + j * block_kv, block_kv, edge_block,
                     total_k, err)
    kpos = j * block_kv + np.arange(block_kv) - shift
    real = kpos[(kpos >= 0) & (kpos < lk)]
    assert real.size, f"{err}: key tile {j} holds none of the task's keys"
    if a <= j < b:
      assert kpos[0] >= 0 and kpos[-1] < lk and vis[np.ix_(r, kpos)].all(), (
          f"{err}: unmasked tile {j}")
    covered[task][np.ix_(r, real)] += vis[np.ix_(r, real)]


def _kv_edge(cu_k, total_k, bs):
  edges, edge_rows = _compiled(lambda cu_k: mw.kv_edges(cu_k, total_k, bs.edge_block), cu_k)
  return edges, edge_rows, bs.edge_block, total_k


def _assert_covered_once(covered, err):
  for task, cov in enumerate(covered):
    vis = _visible(*cov.shape)
    assert (cov[vis] == 1).all(), f"{err} task {task}: visible pairs visited != once"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_kv", [64, 128])
def test_q_tile_table_covers_exactly_the_visible_pairs(seed, block_kv):
  """Every visible pair in exactly one visited tile, unmasked tiles wholly visible, and every
  key tile read either inside [cu_k[0], cu_k[-1]) or from the zero-padded edge copy."""
  rng = np.random.default_rng(seed)
  bs = ma.BlockSizes()
  cu_q, cu_k = random_table(rng, 7, 300)
  total_q, total_k = int(cu_q[-1]) + 3, int(cu_k[-1]) + 5

  def lists(cu_q, cu_k):
    lay_q = mw.aligned_layout(cu_q, total_q, bs.align_q)
    return mw.q_tile_table(cu_q, cu_k, lay_q, total_q, bs, block_kv), lay_q.start_N

  table, start_q = _compiled(lists, cu_q, cu_k)
  kv_edge = _kv_edge(cu_k, total_k, bs)
  covered = [np.zeros((b - a, d - c), int) for a, b, c, d in
             zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
  for col in table.T:
    for w in range(2):
      if col[mw.QT_NKV + w] == 0:
        continue
      row0 = col[mw.QT_Q_TILE] * bs.align_q + w * bs.block_q
      task = int(np.searchsorted(start_q, row0, side="right") - 1)
      r = np.arange(row0, row0 + bs.block_q) - start_q[task]
      r = r[r < cu_q[task + 1] - cu_q[task]]
      _check_key_tiles(col, w, r, task, cu_k, kv_edge, covered, block_kv, f"{seed=} {col=}")
  _assert_covered_once(covered, f"{seed=}")


@pytest.mark.parametrize("seed", range(8))
def test_q_tile_table_in_place_stores_every_row_once_and_covers_the_visible_pairs(seed):
  """The forward's in-place tiles: every query row of the buffer stored exactly once (task rows
  by their task's tile, padding rows by a key-less tile), each stored task row's visible pairs
  visited once, its LSE slot the row's place in the ``front`` aligned layout, and every query
  block read inside the buffer or from the tail copy."""
  rng = np.random.default_rng(seed)
  bs = ma.BlockSizes()
  bq = bs.block_q
  cu_q, cu_k = random_table(rng, 7, 300)
  total_q = int(cu_q[-1]) + int(rng.integers(0, 3)) * 8  # a multiple of 8 iff cu_q[-1] is
  total_q += -total_q % 8
  total_k = int(cu_k[-1]) + 5

  def lists(cu_q, cu_k):
    lay_f = mw.aligned_layout(cu_q, total_q, bs.align_q, front=True)
    return (mw.q_tile_table_in_place(cu_q, cu_k, total_q, bs, bs.block_kv), lay_f.dst_T,
            mw.q_tail_rows(total_q, total_q, bq))

  table, dst_f, tail = _compiled(lists, cu_q, cu_k)
  assert table.shape == (mw.QT_FIELDS_IN_PLACE, table.shape[1])
  kv_edge = _kv_edge(cu_k, total_k, bs)
  stored = np.zeros(total_q, int)
  covered = [np.zeros((b - a, d - c), int) for a, b, c, d in
             zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
  for col in table.T:
    err = f"{seed=} {col=}"
    for w in range(2):
      row0 = col[mw.QT_Q_ROW8] * 8 + w * bq
      va, vn = col[mw.QT_VA_W + w], col[mw.QT_VN_W + w]
      assert 0 <= va and va + vn <= bq, err
      if row0 + bq > total_q:  # the kernel reads the tail copy at this offset
        off = min(row0 - (total_q - bq), bq)
        want = np.arange(row0, row0 + bq)
        got = tail[off:off + bq]
        keep = np.arange(bq) < va + vn
        np.testing.assert_array_equal(got[keep], want[keep], err_msg=err)
      else:
        assert row0 >= 0 and row0 % 8 == 0, err
      rows = np.arange(row0 + va, row0 + va + vn)
      stored[rows] += 1
      if vn == 0:
        continue
      task = int(np.searchsorted(cu_q, rows[0], side="right") - 1)
      if rows[0] < cu_q[0] or rows[0] >= cu_q[-1]:  # padding: zeros, no LSE slot
        assert col[mw.QT_NKV + w] == 0 and col[mw.QT_Q_TILE] == -1, err
        continue
      assert rows[-1] < cu_q[task + 1], f"{err}: a block stores rows of two tasks"
      slots = col[mw.QT_Q_TILE] * bs.align_q + w * bq + np.arange(va, va + vn)
      np.testing.assert_array_equal(slots, dst_f[rows], err_msg=f"{err}: LSE slots")
      r = rows - cu_q[task]
      if cu_k[task + 1] > cu_k[task]:
        _check_key_tiles(col, w, r, task, cu_k, kv_edge, covered, bs.block_kv, err)
      else:
        assert col[mw.QT_NKV + w] == 0, err
  np.testing.assert_array_equal(stored, 1, err_msg=f"{seed=}: query rows stored != once")
  _assert_covered_once(covered, f"{seed=}")


@pytest.mark.parametrize("seed", range(6))
def test_kv_tile_table_covers_exactly_the_visible_pairs(seed):
  rng = np.random.default_rng(seed)
  bs = ma.BlockSizes()
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  cu_q, cu_k = random_table(rng, 7, 300)
  total_q, total_k = int(cu_q[-1]) + 2, int(cu_k[-1]) + 7

  def lists(cu_q, cu_k):
    lay_q = mw.aligned_layout(cu_q, total_q, bs.align_q)
    lay_k = mw.aligned_layout(cu_k, total_k, bs.align_k)
    return mw.kv_tile_table(cu_q, cu_k, lay_q, lay_k, total_k, bs), lay_q.start_N, lay_k.start_N

  table, start_q, start_k = _compiled(lists, cu_q, cu_k)
  covered = [np.zeros((b - a, d - c), int) for a, b, c, d in
             zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
  for col in table.T:
    k_row, q_row = col[mw.KT_K_ROW] * bs.align_k, col[mw.KT_Q_ROW] * bs.align_q
    n_q, qa = col[mw.KT_NQ], col[mw.KT_QA]
    for w in range(2):
      qa_w, qf_w, moff = col[mw.KT_QA_W + w], col[mw.KT_QF_W + w], col[mw.KT_MOFF_W + w]
      assert qa <= qa_w <= qf_w <= n_q, f"{seed=} {col=}"
      if qa_w == n_q:
        continue
      k0 = k_row + w * bkd
      task = int(np.searchsorted(start_k, k0, side="right") - 1)
      while cu_k[task + 1] == cu_k[task]:
        task += 1
      lq, lk = cu_q[task + 1] - cu_q[task], cu_k[task + 1] - cu_k[task]
      assert q_row == start_q[task] and n_q == -(-lq // bqd), f"{seed=} {col=} {task=}"
      keys = np.arange(k0, k0 + bkd) - start_k[task]
      assert keys[0] < lk, f"{seed=}: a key block past its task's keys streams queries"
      keys = keys[keys < lk]
      vis = _visible(lq, lk)
      for qt in range(qa_w, n_q):
        rows = np.arange(qt * bqd, (qt + 1) * bqd)
        rows = rows[rows < lq]
        mask = (keys[None, :] + moff - keys[0] <= rows[:, None])
        np.testing.assert_array_equal(mask, vis[np.ix_(rows, keys)], err_msg=f"{seed=}")
        if qt >= qf_w:
          assert mask.all(), f"{seed=}: unmasked query tile {qt} has invisible pairs"
        covered[task][np.ix_(rows, keys)] += mask
  for task, cov in enumerate(covered):
    vis = _visible(*cov.shape)
    assert (cov[vis] == 1).all() and (cov[~vis] == 0).all(), f"{seed=} task {task}"


def _in_place_table(rng, bs):
  """A random task table of 7 tasks, its buffer sizes, the tasks' first rows in the front-shifted
  aligned query layout (LSE / delta rows) and the in-place dK/dV work list."""
  cu_q, cu_k = random_table(rng, 7, 300)
  total_q, total_k = int(cu_q[-1]) + 2, int(cu_k[-1]) + int(rng.integers(0, 200))

  def lists(cu_q, cu_k):
    lay_f = mw.aligned_layout(cu_q, total_q, bs.align_q, front=True)
    return mw.kv_tile_table_in_place(cu_q, cu_k, lay_f, total_k, bs), lay_f.start_N

  table, start_f = _compiled(lists, cu_q, cu_k)
  return cu_q, cu_k, total_q, total_k, start_f, table


@pytest.mark.parametrize("seed", range(6))
def test_kv_tile_table_in_place_covers_pairs_and_stores_every_row_once(seed):
  rng = np.random.default_rng(seed)
  bs = ma.BlockSizes()
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  cu_q, cu_k, total_q, total_k, start_q, table = _in_place_table(rng, bs)
  (edges, edge_rows), q_edge = _compiled(lambda cu_k, cu_q: (
      mw.kv_edges(cu_k, total_k, bs.edge_block), mw.kv_edges(cu_q, total_q, bqd)), cu_k, cu_q)
  stored = np.zeros(total_k, int)
  covered = [np.zeros((b - a, d - c), int) for a, b, c, d in
             zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
  for col in table.T:
    n_q, qa = col[mw.KT_NQ], col[mw.KT_QA]
    for w in range(2):
      row0 = col[mw.KT_K_ROW] * 8 + w * bkd
      va, vn = col[mw.KT_VA_W + w], col[mw.KT_VN_W + w]
      assert 0 <= va and va + vn <= bkd, f"{seed=} {col=}"
      stored[row0 + va:row0 + va + vn] += 1
      if n_q > qa:  # the kernel reads this block's K/V rows
        _check_edge_read((edges, edge_rows), row0, bkd, bs.edge_block, total_k, f"{seed=}")
      qa_w, qf_w, moff = col[mw.KT_QA_W + w], col[mw.KT_QF_W + w], col[mw.KT_MOFF_W + w]
      assert qa <= qa_w <= qf_w <= n_q, f"{seed=} {col=}"
      if qa_w == n_q:
        continue
      task = int(np.searchsorted(cu_k[1:], row0 + va, side="right"))
      lq, lk = cu_q[task + 1] - cu_q[task], cu_k[task + 1] - cu_k[task]
      front = cu_q[task] % 8  # query tiles start at cu_q rounded down to 8
      assert col[mw.KT_Q_ROW] * bs.align_q == start_q[task], f"{seed=}"
      assert col[mw.KT_Q_ROW8] * 8 == cu_q[task] - front, f"{seed=}"
      assert n_q == -(-(lq + front) // bqd), f"{seed=}"
      keys = row0 + np.arange(bkd) - cu_k[task]  # local key index of each row of the block
      ok = (keys >= 0) & (keys < lk)
      vis = _visible(lq, lk)
      for qt in range(qa, n_q):  # the query tiles the producer streams: Q / dO rows in place
        start = cu_q[task] - front + qt * bqd
        _check_edge_read(q_edge, start, bqd, bqd, total_q, f"{seed=} {task=} {qt=}")
      for qt in range(qa_w, n_q):
        tile_rows = np.arange(qt * bqd, (qt + 1) * bqd)  # counted from the tiles' first row
        real = (tile_rows >= front) & (tile_rows < front + lq)
        rows = tile_rows[real] - front
        mask = (np.arange(bkd)[None, :] + moff <= tile_rows[:, None])[real]
        np.testing.assert_array_equal(mask[:, ok], vis[np.ix_(rows, keys[ok])], err_msg=f"{seed=}")
        if qt >= qf_w:
          assert mask[:, ok].all(), f"{seed=}: unmasked query tile {qt} has invisible pairs"
        covered[task][np.ix_(rows, keys[ok])] += mask[:, ok]
  np.testing.assert_array_equal(stored, 1, err_msg=f"{seed=}: dK/dV rows stored != once")
  for task, cov in enumerate(covered):
    vis = _visible(*cov.shape)
    assert (cov[vis] == 1).all() and (cov[~vis] == 0).all(), f"{seed=} task {task}"


@pytest.mark.parametrize("seed", range(6))
def test_fused_bwd_steps_cover_exactly_the_visible_pairs(seed):
  """The fused backward's per-warpgroup steps over ``kv_tile_table_in_place``: zero steps before
  ``qa_w``, masked steps (keys in [va, va + vn) and the causal offset) up to ``qf_w`` (to
  ``n_q`` for a block that holds rows outside its task), unmasked steps after. Its dS feeds dQ,
  so every (query, key) pair it counts must be a visible pair of its own task, once."""
  rng = np.random.default_rng(seed)
  bs = ma.BlockSizes(fused_bwd=True)
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  cu_q, cu_k, total_q, total_k, start_f, table = _in_place_table(rng, bs)
  start_q = start_f + cu_q[:-1] % 8  # aligned row of each task's first query
  # counts[aligned query row, key row]: visits of a pair with a non-zero mask
  counts = np.zeros((mw.padded_rows(total_q, 7, bs.align_q, front=True), total_k), int)
  for col in table.T:
    n_q, qa, q_row = col[mw.KT_NQ], col[mw.KT_QA], col[mw.KT_Q_ROW] * bs.align_q
    for w in range(2):
      row0 = col[mw.KT_K_ROW] * 8 + w * bkd
      qa_w, qf_w, moff = col[mw.KT_QA_W + w], col[mw.KT_QF_W + w], col[mw.KT_MOFF_W + w]
      va, vn = col[mw.KT_VA_W + w], col[mw.KT_VN_W + w]
      qf = qf_w if (va == 0 and vn == bkd) else n_q
      assert qa <= qa_w <= qf <= n_q, f"{seed=} {col=}"
      key = np.arange(bkd)[None, :]
      for qt in range(qa_w, n_q):
        row = np.arange(bqd)[:, None] + qt * bqd
        if qt < qf:
          mask = (key >= va) & (key < va + vn) & (key + moff <= row)
        else:
          mask = np.ones((bqd, bkd), bool)
        rows = q_row + row[:, 0]
        np.add.at(counts, (rows[:, None], row0 + key), mask.astype(int))
  want = np.zeros_like(counts)
  for i in range(7):
    lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
    want[start_q[i]:start_q[i] + lq, cu_k[i]:cu_k[i + 1]] = _visible(lq, lk)
  real_rows = np.zeros(counts.shape[0], bool)  # aligned rows holding a task's query
  for i in range(7):
    real_rows[start_q[i]:start_q[i] + cu_q[i + 1] - cu_q[i]] = True
  np.testing.assert_array_equal(counts[real_rows], want[real_rows], err_msg=f"{seed=}")


# The fast tier lowers the default kernels (in place, fused backward) at both head sizes; the
# other variants are slow.
@pytest.mark.parametrize("num_q_rows,num_k_rows,head_dim,in_place,fused,adjacent,pairs", [
    (1000, 2045, 128, True, True, True, True), (1003, 2048, 64, True, True, True, True),
    *(pytest.param(*v, marks=pytest.mark.slow) for v in (
        (1000, 2045, 128, True, False, True, True), (1000, 2048, 64, False, False, True, True),
        (1000, 2045, 128, True, False, True, False), (1000, 2045, 128, True, True, False, True)))])
def test_kernels_lower_for_cuda(num_q_rows, num_k_rows, head_dim, in_place, fused, adjacent,
                                pairs):
  """Forward and backward lower to Mosaic GPU modules without a GPU (cross-platform lowering):
  catches layout-inference and TMA-shape errors (e.g. Q or K/V row counts off a multiple of
  8)."""
  bs = ma.BlockSizes(dkv_in_place=in_place, fused_bwd=fused, group_adjacent=adjacent,
                     bwd_pairs=pairs)
  q = jax.ShapeDtypeStruct((num_q_rows, 4, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((num_k_rows, 2, head_dim), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((5,), jnp.int32)

  def loss(q, k, v, cu_q, cu_k):
    o, lse = ma.mosaic_attention(q, k, v, cu_q, cu_k, block_sizes=bs)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, k, cu, cu).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "mosaic_attention_fwd" in text
  kernels = ["mosaic_attention_bwd"] if fused else ["mosaic_attention_dq", "mosaic_attention_dkv"]
  for name in ("mosaic_attention_bwd", "mosaic_attention_dq", "mosaic_attention_dkv"):
    assert (name in text) == (name in kernels), f"{name=} {fused=}"


@pytest.mark.parametrize("num_heads,group", [(32, 4), (8, 1), (6, 6), (16, 2)])
def test_query_grid_visits_every_head_and_tile_once(num_heads, group):
  """Both launch orders of the forward / dQ grid cover every (query head, tile) exactly once, and
  the group-adjacent order puts the query heads of one KV head in consecutive CTAs."""
  from custom_ops import mosaic_kernels  # pylint: disable=import-outside-toplevel
  num_tiles = 5
  for adjacent in (True, False):
    bs = ma.BlockSizes(group_adjacent=adjacent)
    grid, names = mosaic_kernels.query_grid(bs, num_heads, group, num_tiles)
    seen = []
    for idx in np.ndindex(*grid):  # last axis fastest: the launch order
      at = dict(zip(names, idx))
      h = mosaic_kernels._head_at(bs, group, at["heads"], at.get("group", 0))  # pylint: disable=protected-access
      seen.append((h, at["tiles"]))
    assert sorted(seen) == [(h, t) for h in range(num_heads) for t in range(num_tiles)], (
        f"{adjacent=} {num_heads=} {group=}")
    if adjacent:  # consecutive CTAs: the group's heads on one tile, then the next tile
      for start in range(0, len(seen), group):
        chunk = seen[start:start + group]
        assert len({h // group for h, _ in chunk}) == 1 and len({t for _, t in chunk}) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_ops_backend_mosaic_needs_a_gpu():
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  q = jnp.zeros((8, 4, 128), jnp.bfloat16)
  cu = jnp.asarray([0, 8], jnp.int32)
  assert "mosaic" in ops.KERNELS
  with pytest.raises(ops.KernelUnavailableError, match="kernel='mosaic'.*Hopper"):
    ops.core_attention(q, q[:, :2], q[:, :2], cu, cu, kernel="mosaic")


def test_validation_messages():
  q = jnp.zeros((8, 4, 128), jnp.float32)
  cu = jnp.asarray([0, 8], jnp.int32)
  with pytest.raises(ValueError, match="bf16 or fp16"):
    ma.validate_inputs(q, q[:, :2], q[:, :2], cu, cu)
  q = jnp.zeros((8, 4, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="head dims"):
    ma.validate_inputs(q, q[:, :2], q[:, :2], cu, cu)
  with pytest.raises(ValueError, match="multiple of 64"):
    ma.BlockSizes(block_q=32)
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    ma.BlockSizes(max_concurrent_steps=1)
  with pytest.raises(ValueError, match="fused_bwd=True.*dkv_in_place=True"):
    ma.BlockSizes(dkv_in_place=False)


# ------------------------------------------------------------------------------------------------
# GPU: kernels against the reference
# ------------------------------------------------------------------------------------------------


def _rel(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


_CASES = [  # (seed, tasks, max task length, H, K, D)
    (0, 6, 300, 4, 1, 128),
    (1, 9, 200, 8, 2, 128),
    (2, 5, 700, 4, 4, 128),
    (3, 12, 100, 8, 2, 64),
    (4, 3, 1000, 2, 1, 128),
]
# ... and the backward: "fused" (the default: one kernel, dQ through reduce-add stores),
# "two" (dQ kernel + in-place dK/dV kernel, products in pairs), "unpaired" (the same, one product
# per wait) or "gather" (two kernels, dK/dV on an aligned copy).
GPU_CASES = ([c + ("fused",) for c in _CASES] + [c + ("two",) for c in _CASES]
             + [(5, 8, 300, 4, 1, 128, "gather"), (6, 5, 500, 8, 2, 64, "gather"),
                (7, 4, 2000, 8, 1, 128, "fused"), (8, 7, 900, 8, 2, 128, "unpaired"),
                (9, 6, 400, 4, 1, 64, "unpaired"), (10, 7, 600, 8, 2, 128, "tight"),
                (11, 5, 300, 4, 4, 64, "tight")])
# "tight": the default kernels on buffers without padding rows (queries rounded up to 8 rows).
_BACKWARD_OPTIONS = {"fused": {}, "tight": {}, "two": dict(fused_bwd=False),
                     "unpaired": dict(fused_bwd=False, bwd_pairs=False),
                     "gather": dict(fused_bwd=False, dkv_in_place=False)}


@needs_hopper
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"seed{c[0]}-H{c[3]}K{c[4]}D{c[5]}-{c[6]}")
def test_kernels_match_reference(case):
  seed, num_tasks, max_len, num_heads, num_kv_heads, head_dim, backward = case
  bs = ma.BlockSizes(**_BACKWARD_OPTIONS[backward])
  rng = np.random.default_rng(seed)
  cu_q, cu_k = random_table(rng, num_tasks, max_len)
  total_q, total_k = int(cu_q[-1]) + 37, int(cu_k[-1]) + 11
  if backward == "tight":
    total_q, total_k = -(-int(cu_q[-1]) // 8) * 8, int(cu_k[-1])
  dt = jnp.bfloat16
  q = rng.standard_normal((total_q, num_heads, head_dim)).astype(np.float32)
  k = rng.standard_normal((total_k, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((total_k, num_kv_heads, head_dim)).astype(np.float32)
  for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k)):  # padding rows must not leak
    x[:cu[0]] = np.nan
    x[cu[-1]:] = np.nan
  q, k, v = (jnp.asarray(x, dt) for x in (q, k, v))
  do = jnp.asarray(rng.standard_normal((total_q, num_heads, head_dim)), dt)
  dlse = jnp.asarray(rng.standard_normal((total_q, num_heads)), jnp.float32)
  cu_q, cu_k = jnp.asarray(cu_q), jnp.asarray(cu_k)

  def loss(fn, q, k, v):
    o, lse = fn(q, k, v, cu_q, cu_k)
    return (jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)), (o, lse)

  got_fn = jax.jit(jax.value_and_grad(
      lambda *a: loss(functools.partial(ma.mosaic_attention, block_sizes=bs), *a), (0, 1, 2),
      has_aux=True))
  (_, (o, lse)), (dq, dk, dv) = got_fn(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  ref_fn = jax.jit(jax.value_and_grad(
      lambda *a: loss(ma.mosaic_attention_reference, *(f32(x) for x in a)), (0, 1, 2),
      has_aux=True))
  (_, (o_r, lse_r)), (dq_r, dk_r, dv_r) = ref_fn(q, k, v)
  errs = dict(o=_rel(o, o_r), dq=_rel(dq, dq_r), dk=_rel(dk, dk_r), dv=_rel(dv, dv_r))
  lse, lse_r = np.asarray(lse), np.asarray(lse_r)
  print(f"{case=} rel errors {errs}")
  for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.isfinite(np.asarray(x, np.float32)).all(), f"{case=}: {name} not finite"
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_r), err_msg=f"{case=}")
  fin = np.isfinite(lse_r)
  np.testing.assert_allclose(lse[fin], lse_r[fin], atol=2e-2, rtol=0, err_msg=f"{case=}")
  for name, err in errs.items():
    assert err < 2e-2, f"{case=}: {name} relative error {err:.2e} (bf16 inputs)"


def test_save_attention_keeps_the_forward_outputs_instead_of_rerunning_the_kernel():
  """Under the 'save_attention' remat policy the backward takes the forward kernel's O and LSE
  from saved residuals (named ``KERNEL_OUTPUTS_NAME``): the kernel is an ``mpmd_map``, not a
  ``pallas_call``, so without the names the policy saved only q, k, v and every layer's backward
  reran the forward kernel (8 forward calls for 4 layers in a GPU profile)."""
  import contextlib
  import io
  from jax.ad_checkpoint import print_saved_residuals
  from custom_ops import KERNEL_OUTPUTS_NAME
  from distca_jax import model
  q = jnp.zeros((1000, 4, 128), jnp.bfloat16)
  k = jnp.zeros((2048, 2, 128), jnp.bfloat16)
  cu = jnp.asarray([0, 100, 200, 300, 1000], jnp.int32)

  def loss(q, k, v):
    o, _ = ma.mosaic_attention(q, k, v, cu, cu)
    return jnp.sum(jnp.sin(o.astype(jnp.float32)))
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(jax.checkpoint(loss, policy=model.REMAT_POLICIES["save_attention"]),
                          q, k, k)
  named = [line for line in buf.getvalue().splitlines() if f"'{KERNEL_OUTPUTS_NAME}'" in line]
  assert len(named) == 2, buf.getvalue()
  assert any(line.startswith("bf16[") and ",4,128]" in line for line in named), named  # O
  assert any(line.startswith("f32[4,") for line in named), named  # log2 LSE [H, P]
