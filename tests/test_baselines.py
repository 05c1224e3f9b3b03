"""Baselines (`packed_dp`, `cp`, `wlb`): outputs and gradients equal the reference on 8 fake CPU
devices with fresh random layouts; host packing, placements, tables and metrics hold their
invariants."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import attention as attn
from distca_jax import backends
from distca_jax import baselines as bl
from distca_jax import config as config_lib
from distca_jax import plan as plan_lib
from distca_jax import sharding as shard_lib
from distca_jax import trainer
from distca_jax.baselines import packing
from distca_jax.data import make_source
from distca_jax.data.batch import layout_arrays
from distca_jax.data.workloads import WorkloadSampler, split_into_rows

S = 8          # fake devices = data ranks
H, K, D = 4, 2, 16
SCALE = 1.0 / np.sqrt(D)


def _rand_lens(rng, total, max_len):
  """Random positive lengths summing to at most ``total`` (often a little less: padding)."""
  out, used = [], 0
  target = total - int(rng.integers(0, 4))
  while used < target:
    l = int(min(rng.integers(1, max_len + 1), target - used))
    out.append(l)
    used += l
  return out


def _mesh():
  return shard_lib.make_mesh(data=S, tensor=1, devices=jax.devices()[:S])


def _qkvw(rng, rows, t):
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return f(rows, t, H, D), f(rows, t, K, D), f(rows, t, K, D), f(rows, t, H, D)


def _close(a, b, atol=2e-5, rtol=1e-4):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------
# Device correctness.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows_per_rank", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_packed_dp_equals_local_and_reference(seed, rows_per_rank):
  rng = np.random.default_rng(seed)
  t, rows = 32, S * rows_per_rank
  doclens = [_rand_lens(rng, t, 12) for _ in range(rows)]
  seg, pos = layout_arrays(doclens, t)
  layout = attn.Layout(jnp.asarray(seg), jnp.asarray(pos))
  backend = backends.get("packed_dp", max_docs_per_row=32)
  extra = {k: jnp.asarray(v) for k, v in backend.host_prepare(doclens, t).items()}
  q, k, v, w = _qkvw(rng, rows, t)

  def run(q, k, v):
    return backend.fn(q, k, v, attn.Layout(layout.segment_ids_BxT, layout.positions_BxT, extra),
                      softmax_scale=SCALE)

  def loss(f):
    return lambda q, k, v: (f(q, k, v) * w).sum()

  ref = lambda q, k, v: attn.dense_reference(q, k, v, layout, softmax_scale=SCALE)
  loc = lambda q, k, v: attn.local_attention(q, k, v, layout, softmax_scale=SCALE, block_q=8,
                                             block_k=8)
  with jax.set_mesh(_mesh()):
    o, g = jax.jit(lambda *a: (run(*a), jax.grad(loss(run), argnums=(0, 1, 2))(*a)))(q, k, v)
  _close(o, jax.jit(ref)(q, k, v))
  _close(o, jax.jit(loc)(q, k, v))
  assert np.all(np.asarray(o)[seg == 0] == 0)
  for a, b in zip(g, jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)):
    _close(a, b, atol=5e-5)


def _reference_rows(pl: packing.Placement):
  """A reference layout: each lane's documents back to back in one row (in document-id order).

  Returns (segment_ids [L, W], positions [L, W], src [B, T] flat index into [L * W] of every
  arranged slot, -1 at padding).
  """
  lanes = pl.num_rows // pl.cp_size
  doc_lane = np.zeros(pl.doc_lens_J.size, np.int64)
  doc_lane[pl.doc_P] = pl.lane_of_row(pl.row_P)
  width = max(int(np.bincount(doc_lane, weights=pl.doc_lens_J, minlength=lanes).max()), 1)
  per_lane = [np.flatnonzero(doc_lane == l) for l in range(lanes)]
  seg, pos = layout_arrays([pl.doc_lens_J[d].tolist() for d in per_lane], width)
  doc_row = np.zeros(pl.doc_lens_J.size, np.int64)
  doc_col = np.zeros(pl.doc_lens_J.size, np.int64)
  for l, d in enumerate(per_lane):
    doc_row[d] = l
    doc_col[d] = np.cumsum(pl.doc_lens_J[d]) - pl.doc_lens_J[d]
  a_doc, a_pos = pl.token_doc_pos()
  src = np.where(a_doc >= 0, doc_row[a_doc] * width + doc_col[a_doc] + a_pos, -1)
  return seg, pos, src


def _check_group_backend(rng, name, pl: packing.Placement, backend_opts):
  """The backend on the arranged rows equals the dense reference on the lanes' documents."""
  seg_r, pos_r, src = _reference_rows(pl)
  ref_layout = attn.Layout(jnp.asarray(seg_r), jnp.asarray(pos_r))
  lanes, width = seg_r.shape
  q, k, v, w = _qkvw(rng, lanes, width)
  seg_a, pos_a = pl.layout_arrays()
  extra = {kk: jnp.asarray(vv) for kk, vv in packing.task_tables(pl, max_tasks=64).items()}
  layout = attn.Layout(jnp.asarray(seg_a), jnp.asarray(pos_a), extra)
  backend = backends.get(name, **backend_opts)
  src_j = jnp.asarray(src.reshape(-1))
  b, t = src.shape

  def arranged(x):  # reference rows -> arranged rows (0 at padding)
    flat = x.reshape(lanes * width, *x.shape[2:])
    return jnp.take(flat, src_j, axis=0, mode="fill", fill_value=0).reshape(b, t, *x.shape[2:])

  def run(q, k, v):
    return backend.fn(arranged(q), arranged(k), arranged(v), layout, softmax_scale=SCALE)

  w_a = arranged(w)
  with jax.set_mesh(_mesh()):
    o, g = jax.jit(lambda *a: (run(*a), jax.grad(lambda *x: (run(*x) * w_a).sum(),
                                                 argnums=(0, 1, 2))(*a)))(q, k, v)
  ref = lambda q, k, v: attn.dense_reference(q, k, v, ref_layout, softmax_scale=SCALE)
  o_ref = jax.jit(ref)(q, k, v)
  g_ref = jax.jit(jax.grad(lambda *x: (ref(*x) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
  o = np.asarray(o)
  real = src >= 0
  _close(o[real], np.asarray(o_ref).reshape(lanes * width, H, D)[src[real]])
  assert np.all(o[~real] == 0)
  for a, r in zip(g, g_ref):
    _close(a, r, atol=5e-5)


@pytest.mark.parametrize("cp_size,rows_per_rank", [
    (2, 1), pytest.param(8, 1, marks=pytest.mark.slow), pytest.param(4, 2, marks=pytest.mark.slow)])
def test_cp_equals_reference(seed, cp_size, rows_per_rank):
  rng = np.random.default_rng(seed)
  t = 32
  lanes = S // cp_size * rows_per_rank
  # Documents up to the whole sequence: they cross chunks and ranks.
  lane_docs = [_rand_lens(rng, cp_size * t, cp_size * t // 2) for _ in range(lanes)]
  pl = packing.cp_placement(lane_docs, cp_size, t, rows_per_rank=rows_per_rank)
  assert (pl.row_tokens() <= t).all()
  _check_group_backend(rng, "cp", pl, dict(cp_size=cp_size))


@pytest.mark.parametrize("cp_size,rows_per_rank,alpha", [
    pytest.param(1, 1, 1.2, marks=pytest.mark.slow), (2, 1, 1.0),
    pytest.param(4, 2, 1.1, marks=pytest.mark.slow)])
def test_wlb_equals_reference(seed, cp_size, rows_per_rank, alpha):
  rng = np.random.default_rng(seed)
  t = 32
  lens = _rand_lens(rng, S * rows_per_rank * t, 2 * t)
  pk = packing.wlb_pack(lens, S // cp_size * rows_per_rank, cp_size,
                        bl.wlb_row_tokens(alpha, t), balance_len=24.0)
  pl = packing.wlb_placement(pk, rows_per_rank=rows_per_rank)
  _check_group_backend(rng, "wlb", pl, dict(cp_size=cp_size, alpha=alpha, balance_len=24.0))


def _host_arranged(backend, batch, doclens):
  """The backend's host step on a trainer batch [S, t] whose token ids tag where each token
  went (a token's id is its natural flat index + 1): (arranged batch, natural flat index of
  each arranged slot (-1 at padding), the arranged layout, natural [S, t, ...] -> arranged)."""
  seg = batch["segment_ids"]
  s, t = seg.shape
  tagged = dict(batch, inputs=np.where(seg > 0, np.arange(s * t).reshape(s, t) + 1, 0))
  out = backend.host_arrange(tagged, doclens)
  src = out["inputs"].astype(np.int64) - 1
  extra = {kk[len(bl.EXTRA_PREFIX):]: jnp.asarray(vv) for kk, vv in out.items()
           if kk.startswith(bl.EXTRA_PREFIX)}
  layout = attn.Layout(jnp.asarray(out["segment_ids"]), jnp.asarray(out["positions"]), extra)
  src_j = jnp.asarray(src.reshape(-1))
  take = lambda x: jnp.take(x.reshape(s * t, *x.shape[2:]), src_j, axis=0, mode="fill",
                            fill_value=0).reshape(*src.shape, *x.shape[2:])
  return out, src, layout, take


def test_arrange_batch_feeds_the_backend_and_keeps_every_token(seed):
  """Trainer batch -> arrange_batch -> the backend equals the reference on the natural rows."""
  rng = np.random.default_rng(seed)
  t = 32
  doclens = [_rand_lens(rng, t, 20) for _ in range(S)]
  seg, pos = layout_arrays(doclens, t)
  batch = {"segment_ids": seg, "positions": pos,
           "inputs": rng.integers(1, 1000, size=(S, t)).astype(np.int32)}
  batch["inputs"][seg == 0] = 0
  q, k, v, w = _qkvw(rng, S, t)
  ref_layout = attn.Layout(jnp.asarray(seg), jnp.asarray(pos))
  o_ref = np.asarray(attn.dense_reference(q, k, v, ref_layout, softmax_scale=SCALE))
  for name, opts in (("cp", dict(cp_size=4)), ("wlb", dict(cp_size=2, alpha=1.2,
                                                           balance_len=20.0))):
    backend = backends.get(name, **opts)
    out, src, layout, take = _host_arranged(backend, batch, doclens)
    real = src >= 0
    assert sorted(src[real].tolist()) == np.flatnonzero(seg.reshape(-1) > 0).tolist()
    assert np.array_equal(out["positions"][real], pos.reshape(-1)[src[real]])
    with jax.set_mesh(_mesh()):
      o = jax.jit(lambda q, k, v: backend.fn(take(q), take(k), take(v), layout,
                                             softmax_scale=SCALE))(q, k, v)
    _close(np.asarray(o)[real], o_ref.reshape(S * t, H, D)[src[real]])
  assert bl.EXTRA_PREFIX == trainer.EXTRA_PREFIX


def test_cp_at_its_chosen_size_equals_reference(seed):
  """The CP size ``ideal.choose_cp`` picks for a trainer batch (a model whose attention
  dominates and whose K/V traffic is cheap, so a size > 1 wins) runs that batch, arranged by the
  backend's own host step, with the dense reference's outputs and gradients."""
  from distca_jax.baselines import ideal
  rng = np.random.default_rng(seed)
  t = 32
  # Rank 0 holds one whole-row document, the others short ones: packed_dp's split is slow.
  doclens = [[t]] + [_rand_lens(rng, t, 6) for _ in range(S - 1)]
  dims = bl.ModelDims(q_heads=H, kv_heads=K, head_dim=D, n_layers=1, matmul_params=1,
                      layer_matmul_params=1, dtype_bytes=4)
  choice = ideal.choose_cp([doclens], t, dims, hw=bl.Hardware(intra_node_bw=1e15))
  assert [x[0] for x in choice.candidates] == [1, 2, 4, 8]
  assert choice.cp_size > 1, (choice.candidates, seed)
  seg, pos = layout_arrays(doclens, t)
  backend = backends.get("cp", cp_size=choice.cp_size)
  batch = {"segment_ids": seg, "positions": pos, "inputs": np.zeros_like(seg)}
  _, src, layout, take = _host_arranged(backend, batch, doclens)
  q, k, v, w = _qkvw(rng, S, t)
  w = w * jnp.asarray(seg > 0, jnp.float32)[:, :, None, None]  # no weight on padding
  run = lambda q, k, v: backend.fn(take(q), take(k), take(v), layout, softmax_scale=SCALE)
  ref_layout = attn.Layout(jnp.asarray(seg), jnp.asarray(pos))
  ref = lambda q, k, v: attn.dense_reference(q, k, v, ref_layout, softmax_scale=SCALE)
  with jax.set_mesh(_mesh()):
    o, g = jax.jit(lambda *a: (run(*a), jax.grad(lambda *x: (run(*x) * take(w)).sum(),
                                                 argnums=(0, 1, 2))(*a)))(q, k, v)
  g_ref = jax.jit(jax.grad(lambda *x: (ref(*x) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
  real = src >= 0
  _close(np.asarray(o)[real], np.asarray(ref(q, k, v)).reshape(S * t, H, D)[src[real]])
  for a, r in zip(g, g_ref):
    _close(a, r, atol=5e-5)


@pytest.mark.slow
def test_model_loss_and_grads_with_baselines_equal_local(seed):
  """The real model on a data=4 x tensor=2 mesh: packed_dp (trainer.add_host_plan), cp and wlb
  (host_arrange) give the dense reference backend's loss and parameter gradients."""
  c = config_lib.base_config()
  c.model.update(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16,
                 mlp_dim=64, dtype="float32", remat="none", loss_chunk=64)
  c.update(tokens_per_rank=32, seed=seed)
  c.mesh.update(data=4, tensor=2)
  c.data.context_length = 48
  c.attention.update(block_q=16, block_k=16)
  t, rows = c.tokens_per_rank, 4
  mesh = shard_lib.make_mesh(data=4, tensor=2, devices=jax.devices()[:8])
  src = make_source(c.data, rows=rows, tokens_per_row=t, vocab_size=c.model.vocab_size, seed=seed)
  step = int(np.random.default_rng(seed).integers(100))
  batch, doclens = src.batch(step), src.doclens(step)
  dims = bl.ModelDims.from_model(config_lib.model_config(c))

  # Core attention has no parameters: one state serves every backend.
  state = trainer.create_train_state(c, trainer.make_model(c, backends.get("reference")),
                                     trainer.make_optimizer(c), mesh)

  def loss_and_grads(backend, np_batch):
    model = trainer.make_model(c, backend)

    def f(params, b):
      total, count = model.apply({"params": params}, b["inputs"], b["targets"], b["loss_mask"],
                                 trainer.layout_of(b), method=model.loss)
      return total / count

    with trainer.mesh_context(mesh):
      loss, g = jax.jit(jax.value_and_grad(f))(state.params, trainer.device_batch(np_batch, mesh))
    return float(loss), jax.tree.leaves(jax.device_get(g))

  loss_ref, g_ref = loss_and_grads(backends.get("reference"), batch)
  pdp = backends.get("packed_dp", max_docs_per_row=32)
  cp = backends.get("cp", cp_size=2)
  wlb = backends.get("wlb", cp_size=2, alpha=1.25, balance_len=dims.balance_len)
  for backend, b in ((pdp, trainer.add_host_plan(batch, pdp, doclens, t)),
                     (cp, cp.host_arrange(batch, doclens)),
                     (wlb, wlb.host_arrange(batch, doclens))):
    loss, g = loss_and_grads(backend, b)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
    for a, r in zip(g, g_ref):
      np.testing.assert_allclose(a, r, rtol=2e-4, atol=2e-6)


def test_unarranged_batch_and_bad_options_are_clear_errors(seed):
  rng = np.random.default_rng(seed)
  q, k, v, _ = _qkvw(rng, S, 16)
  layout = attn.Layout(jnp.ones((S, 16), jnp.int32), jnp.tile(jnp.arange(16), (S, 1)))
  with jax.set_mesh(_mesh()), pytest.raises(ValueError, match="arrange_batch"):
    backends.get("cp", cp_size=2).fn(q, k, v, layout, softmax_scale=SCALE)
  with pytest.raises(ValueError, match="no mesh"):
    backends.get("packed_dp").fn(q, k, v, attn.Layout(layout.segment_ids_BxT,
                                                          layout.positions_BxT,
                                                          {"doc_lens": jnp.zeros((S, 2))}),
                                     softmax_scale=SCALE)
  with pytest.raises(ValueError, match="cp_size"):
    backends.get("wlb", balance_len=10.0)
  with pytest.raises(ValueError, match="balance_len"):
    backends.get("wlb", cp_size=2)
  with pytest.raises(ValueError, match="alpha"):
    backends.get("wlb", cp_size=2, alpha=0.9, balance_len=1.0)
  with pytest.raises(ValueError, match="kernel"):
    backends.get("packed_dp", kernel="cuda")
  with pytest.raises(ValueError, match="max_docs_per_row"):
    backends.get("packed_dp", max_docs_per_row=2).host_prepare([[1, 1, 1]], 8)


# ----------------------------------------------------------------------------------------------
# Host planning.
# ----------------------------------------------------------------------------------------------
def test_wlb_pack_places_every_token_under_the_cap_longest_first(seed):
  rng = np.random.default_rng(seed)
  for _ in range(20):
    lanes, c, t = int(rng.integers(1, 9)), int(rng.choice([1, 2, 3, 4])), int(rng.integers(8, 200))
    alpha = float(rng.choice([1.0, 1.1, 1.5]))
    lens = _rand_lens(rng, lanes * c * t, int(rng.integers(1, 3 * t)))
    cap = bl.wlb_row_tokens(alpha, t)
    pk = packing.wlb_pack(lens, lanes, c, cap, balance_len=float(rng.uniform(5, 500)))
    assert (pk.tokens_LxC <= cap).all()
    assert (pk.share_JxC.sum(1) == pk.len_J).all()
    assert np.array_equal(np.bincount(pk.src_J, weights=pk.len_J, minlength=len(lens)), lens)
    # Pieces of each source document tile it.
    for j in np.unique(pk.src_J):
      sel = np.flatnonzero(pk.src_J == j)
      o = np.argsort(pk.offset_J[sel])
      ends = pk.offset_J[sel][o] + pk.len_J[sel][o]
      assert pk.offset_J[sel][o][0] == 0 and np.array_equal(pk.offset_J[sel][o][1:], ends[:-1])
    # Ranks of a lane stay within 2 tokens of each other (the remainder goes least-loaded first).
    assert (pk.tokens_LxC.max(1) - pk.tokens_LxC.min(1) <= 2).all()
    pl = packing.wlb_placement(pk)
    assert np.array_equal(pl.row_tokens(), pk.tokens_LxC.reshape(-1))


def test_wlb_pack_balances_workload_by_hand_example():
  # Longest first into the least-W lane: 10 -> lane 0, 9 -> lane 1, 6 -> lane 1 (W(9) < W(10)),
  # 5 -> lane 0 ... with B = 5: W(l) = (l/5)^2 + l/5.
  pk = packing.wlb_pack([5, 9, 6, 10], 2, 1, row_tokens=100, balance_len=5.0)
  lanes = {int(s): int(l) for s, l in zip(pk.src_J, pk.lane_J)}
  assert lanes == {3: 0, 1: 1, 2: 1, 0: 0}
  w = packing.wlb_workload
  _close(pk.load_W_L, [w(10, 5) + w(5, 5), w(9, 5) + w(6, 5)])
  # Alpha = 1 at full load forces a split; the cap still holds.
  pk = packing.wlb_pack([7, 7, 2], 2, 1, row_tokens=8, balance_len=5.0)
  assert pk.num_split == 1 and (pk.tokens_LxC <= 8).all()


def test_cp_placement_is_head_tail():
  # One lane of c = 2 ranks, T = 8: a 16-token document -> chunks [0,4) [4,8) [8,12) [12,16);
  # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (adjacent: merged into one piece).
  pl = packing.cp_placement([[16]], 2, 8)
  assert pl.row_P.tolist() == [0, 0, 1]
  assert list(zip(pl.start_P.tolist(), pl.end_P.tolist())) == [(0, 4), (12, 16), (4, 12)]
  tab = packing.task_tables(pl, max_tasks=2)
  assert tab["cu_seqlens_q"].tolist() == [[0, 4, 8], [0, 8, 8]]
  assert tab["cu_seqlens_k"].tolist() == [[0, 4, 20], [0, 12, 12]]
  # Keys of rank 0's tail task: document tokens 0..15; token p lives on rank (chunk owner).
  home = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6, 7]
  assert tab["kv_index"][0, 4:20].tolist() == home
  with pytest.raises(ValueError, match="max_docs_per_row"):
    packing.task_tables(pl, max_tasks=1)
  with pytest.raises(ValueError, match="kv_rows"):
    packing.task_tables(pl, max_tasks=2, kv_rows=12)
  with pytest.raises(ValueError, match="even"):
    packing.cp_placement([[3]], 2, 7)


def test_placement_rejects_bad_pieces():
  with pytest.raises(ValueError, match="exactly once"):
    packing.Placement(np.array([4]), [0, 0], [0, 0], [0, 1], [2, 4], 1, 8)
  with pytest.raises(ValueError, match="one lane"):
    packing.Placement(np.array([4]), [0, 1], [0, 0], [0, 2], [2, 4], 2, 8)
  with pytest.raises(ValueError, match="tokens_per_row"):
    packing.Placement(np.array([9]), [0], [0], [0], [9], 1, 8)


# ----------------------------------------------------------------------------------------------
# Metrics.
# ----------------------------------------------------------------------------------------------
def _total_pairs(lens):
  return int(plan_lib.pairs(0, np.asarray(lens, np.int64)).sum())


def test_metrics_conserve_work_and_tokens(seed):
  rng = np.random.default_rng(seed)
  dims = bl.ModelDims()
  t, s = 4096, 16
  sampler = WorkloadSampler("prolong", t, seed=int(rng.integers(1 << 20)))
  step = int(rng.integers(0, 20))
  flat = sampler.flat_doclens(step, s)
  rows = split_into_rows(flat, t, s)
  m = bl.packed_dp_metrics(rows, t, dims)
  assert m.pairs_S.sum() == _total_pairs([x for r in rows for x in r])
  assert (m.bytes_S == 0).all() and m.tokens_S.tolist() == [sum(r) for r in rows]
  for c in (2, 4, 16):
    lanes = split_into_rows(flat, c * t, s // c)
    m = bl.cp_metrics(lanes, c, t, dims)
    assert m.pairs_S.sum() == _total_pairs([x for r in lanes for x in r])
    assert m.tokens_S.sum() == sum(flat) and m.tokens_S.max() <= t
    lane_tok = np.repeat([sum(r) for r in lanes], c)
    np.testing.assert_array_equal(m.bytes_S, (lane_tok - m.tokens_S) * dims.kv_row_bytes)
  for c, alpha in ((1, 1.0), (2, 1.2), (4, 1.1)):
    pk = bl.wlb_pack(flat, s // c, c, bl.wlb_row_tokens(alpha, t), dims.balance_len)
    m = bl.wlb_metrics(pk, dims)
    assert m.pairs_S.sum() == _total_pairs(pk.len_J)
    assert m.tokens_S.max() <= alpha * t and m.tokens_S.sum() == sum(flat)
    ref = bl.placement_metrics(bl.wlb_placement(pk), dims, "wlb")
    for f in ("pairs_S", "tokens_S", "bytes_S", "kv_rows_S"):
      np.testing.assert_allclose(getattr(m, f), getattr(ref, f))
  plan = plan_lib.schedule(flat, s, tokens_per_rank=t, options=plan_lib.PlanOptions(tolerance=0.1))
  m = bl.distca_metrics(plan)
  assert m.pairs_S.sum() == _total_pairs(flat)
  assert m.tokens_S.sum() == sum(flat)
  assert m.kv_rows_S.max() == plan_lib.required_capacity(plan).kv_tokens
  assert m.summary()["attention_imbalance"] == pytest.approx(plan.imbalance_after)
  bq, bkv = dims.q_row_bytes, dims.kv_row_bytes
  assert m.bytes_S.sum() == pytest.approx(2 * plan.bytes_q + plan.bytes_kv)
  assert bq * plan.pair_q_rows.sum() == plan.bytes_q and bkv * plan.pair_kv_rows.sum() == (
      plan.bytes_kv)


def test_rank_metrics_from_trainer_rows_and_model_dims(seed):
  path = os.path.join(os.path.dirname(__file__), "..", "configs", "llama3_8b_128k.py")
  spec = importlib.util.spec_from_file_location("cfg", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  dims = bl.ModelDims.from_model(config_lib.model_config(mod.get_config()))
  assert dims == bl.ModelDims()
  assert 50_000 < dims.balance_len < 62_000  # ~57K tokens for Llama-3-8B
  rng = np.random.default_rng(seed)
  t = 2048
  rows = WorkloadSampler("pretrain", t, seed=int(rng.integers(1 << 20))).step_doclens(3, S)
  out = {name: bl.rank_metrics(name, rows, t, cp_size=2, alpha=1.2).summary(dims)
         for name in ("packed_dp", "cp", "wlb", "distca")}
  assert out["cp"]["token_imbalance"] == pytest.approx(1.0, abs=0.02)
  assert out["packed_dp"]["bytes_max"] == 0
  assert all(v["layer_seconds"] > 0 for v in out.values())
  with pytest.raises(ValueError, match="strategy"):
    bl.rank_metrics("ring", rows, t)


def _named_key(err: str) -> str:
  """The config key an overflow error asks to raise (``raise config.X to at least N``)."""
  return err.split("raise ")[1].split(" to at least")[0].removeprefix("config.")


def test_task_overflow_errors_name_a_real_config_key():
  """A packed_dp, cp or wlb row with more pieces than task slots names a key the config has
  (passing it is no 'unknown config key'): max_docs_per_row for packed_dp / cp,
  wlb_tasks_per_row for wlb."""
  from distca_jax import configs_io
  with pytest.raises(ValueError, match="max_docs_per_row") as e_pdp:
    backends.get("packed_dp", max_docs_per_row=2).host_prepare([[1, 1, 1]], 8)
  with pytest.raises(ValueError, match="max_docs_per_row") as e_cp:
    packing.task_tables(packing.cp_placement([[16]], 2, 8), max_tasks=1)
  rows = [[1] * 6, [1] * 6]
  batch = {"inputs": np.zeros((2, 8), np.int32), "segment_ids": np.zeros((2, 8), np.int32)}
  with pytest.raises(ValueError, match="wlb_tasks_per_row") as e_wlb:
    bl.arrange_batch("wlb", batch, rows, cp_size=2, balance_len=4.0, max_docs_per_row=3)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for err in (e_pdp, e_cp, e_wlb):
    key = _named_key(str(err.value))
    configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), [f"{key}=256"])


def test_wlb_sizes_its_task_tables_for_its_configuration(seed):
  """wlb_tasks_per_row = 0: the backend sizes its task slots for the configuration it runs from
  batches the run never trains on, so every trained batch of the run arranges without overflow,
  on data whose rows hold more pieces than the packed_dp default (128)."""
  from distca_jax import configs_io
  from distca_jax.backends import wlb
  from distca_jax.baselines import ideal
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), [
      "attention.backend=wlb", "attention.baselines.cp_size=4", "attention.baselines.wlb_alpha=1",
      "mesh.data=4", "tokens_per_rank=4096", "rows_per_rank=2", "num_steps=6",
      f"seed={seed % 1000}"])
  assert c.attention.baselines.wlb_tasks_per_row == 0
  options = wlb.from_first_batches(c, wlb.Options.from_config(c))
  m = config_lib.model_config(c)
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank, vocab_size=m.vocab_size,
                    seed=c.seed)
  dims = bl.ModelDims.from_model(m)
  sized = [ideal.wlb_row_tasks(src.doclens(s), c.tokens_per_rank, 4, 1.0, dims.balance_len,
                               rows_per_rank=2) for s in ideal.sizing_steps(c)]
  assert options.max_docs_per_row == ideal.tasks_with_headroom(max(sized)), seed
  assert options.max_docs_per_row % ideal.TASKS_MULTIPLE == 0
  backend = wlb.make(options)
  for step in range(c.num_steps):  # the trained batches: none overflows
    out = trainer.add_host_plan(src.batch(step), backend, src.doclens(step), c.tokens_per_rank)
    assert out[bl.EXTRA_PREFIX + "cu_seqlens_q"].shape[1] == options.max_docs_per_row + 1
  # A given size stays as given.
  c.attention.baselines.wlb_tasks_per_row = 48
  assert wlb.from_first_batches(c, wlb.Options.from_config(c)).max_docs_per_row == 48
