"""Property tests of the core-attention scheduler (host, NumPy) and its metadata contract."""

import dataclasses
import json

import numpy as np
import pytest

from distca_jax import plan as plan_lib
from distca_jax.data.workloads import WorkloadSampler

K = 1024
_TOKEN_BUDGETS = (16 * K, 32 * K, 64 * K, 128 * K, 256 * K, 512 * K)
_SERVERS = (2, 3, 4, 8, 16, 32, 64, 128, 512)


def _sweep_cases(n: int, seed: int):
  """Seeded (workload, tokens_per_rank, servers, tolerance, nested, step) tuples."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    t = int(rng.choice(_TOKEN_BUDGETS))
    s = int(rng.choice(_SERVERS))
    if s * t > 64 * 512 * K:  # keep the sweep fast: at most 32M tokens per batch
      s = max(2, (64 * 512 * K) // t)
    tol = 0.0 if i % 7 == 0 else float(rng.uniform(0.0, 0.3))
    out.append(("pretrain" if i % 2 == 0 else "prolong", t, s, tol, bool(i % 3 == 2),
                int(rng.integers(0, 50))))
  return out


def _layout(name, t, s, nested, step, seed=0):
  w = WorkloadSampler(name, t, seed=seed)
  return w.step_doclens(step, s) if nested else w.flat_doclens(step, s)


def _check_plan(plan: plan_lib.Plan, tol: float) -> None:
  """Coverage, key ranges, conservation, bookkeeping and the imbalance guarantee."""
  lens, s = plan.doc_lens, plan.num_servers
  tasks = plan.tasks
  assert tasks.ndim == 2 and tasks.shape[1] == 4 and tasks.dtype == np.int64
  doc, a, b, srv = tasks.T
  assert ((srv >= 0) & (srv < s)).all()
  assert ((a >= 0) & (a < b) & (b <= lens[doc])).all()
  # Every query token of every document is covered exactly once: sorted by (doc, start), the
  # shards of one document tile [0, L).
  order = np.lexsort((a, doc))
  d_s, a_s, b_s = doc[order], a[order], b[order]
  first = np.r_[True, d_s[1:] != d_s[:-1]]
  last = np.r_[d_s[1:] != d_s[:-1], True]
  assert np.array_equal(np.unique(d_s), np.arange(lens.size))
  assert (a_s[first] == 0).all()
  assert (b_s[last] == lens[d_s[last]]).all()
  assert (a_s[~first] == b_s[np.flatnonzero(~first) - 1]).all()
  # Work is conserved, and the reported loads are the tasks' loads.
  total = int((lens * (lens + 1) // 2).sum())
  assert int(plan_lib.pairs(a, b).sum()) == total
  assert plan.loads_before.sum() == total and plan.loads_after.sum() == total
  np.testing.assert_array_equal(plan.loads_after, plan_lib.server_loads(plan))
  assert plan.imbalance_after == pytest.approx(plan_lib.imbalance(plan.loads_after))
  # Traffic bookkeeping agrees with an independent recount from the tasks.
  q_rows, kv_rows = plan_lib.traffic_rows(plan)
  np.testing.assert_array_equal(q_rows, plan.pair_q_rows)
  np.testing.assert_array_equal(kv_rows, plan.pair_kv_rows)
  assert (np.diag(q_rows) == 0).all() and (np.diag(kv_rows) == 0).all()
  # Balancing never raises the maximum load; a plan that is not degraded is within tolerance.
  assert plan.loads_after.max() <= plan.loads_before.max()
  if plan.degraded:
    assert plan.degraded_reason
  else:
    assert plan.imbalance_after <= (1 + tol) * (1 + 1e-9)
  # Merged tasks: no two adjacent shards of one document on one server.
  same = (d_s[1:] == d_s[:-1]) & (srv[order][1:] == srv[order][:-1])
  assert not (same & (a_s[1:] == b_s[:-1])).any()


def _granularity(plan: plan_lib.Plan) -> float:
  """Largest smallest-move: the balance tolerance the greedy is guaranteed to reach uncapped."""
  return 4.0 * plan.min_shard * (float(plan.doc_lens.max(initial=0)) + 1)


@pytest.mark.parametrize("case", _sweep_cases(36, seed=3), ids=lambda c: "-".join(map(str, c)))
def test_properties_on_workloads(case):
  name, t, s, tol, nested, step = case
  doc_lens = _layout(name, t, s, nested, step)
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(tolerance=tol))
  _check_plan(plan, tol)
  mean = plan.loads_after.mean()
  if _granularity(plan) <= tol * mean:
    # Exact balance is feasible (no caps, shards of min_shard fit any destination's room).
    assert not plan.degraded, plan.degraded_reason
    assert plan.imbalance_after <= 1 + tol + 1e-9


def test_tolerance_reached_when_feasible():
  """Large budgets where the min_shard granularity is far below tolerance * mean."""
  hits = 0
  for name in ("pretrain", "prolong"):
    for s, t, tol in ((8, 512 * K, 0.05), (64, 256 * K, 0.1), (16, 128 * K, 0.2)):
      plan = plan_lib.schedule(_layout(name, t, s, False, 7), s, tokens_per_rank=t,
                               options=plan_lib.PlanOptions(tolerance=tol))
      _check_plan(plan, tol)
      if _granularity(plan) <= tol * plan.loads_after.mean():
        hits += 1
        assert plan.imbalance_after <= 1 + tol + 1e-9
        assert plan.imbalance_before > 1 + tol  # the test exercises real balancing
  assert hits >= 4


def _initial_needs(doc_lens, s, t) -> plan_lib.Capacity:
  """Caps the layout needs before any move (plan with tolerance so high nothing moves)."""
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(tolerance=1e9))
  assert plan.num_moves == 0
  return plan_lib.required_capacity(plan)


@pytest.mark.parametrize("seed", range(8))
def test_caps_never_exceeded(seed):
  rng = np.random.default_rng(seed)
  name = ("pretrain", "prolong")[seed % 2]
  s = int(rng.choice([4, 8, 16, 32]))
  t = int(rng.choice([16 * K, 64 * K, 128 * K]))
  tol = float(rng.uniform(0.0, 0.3))
  doc_lens = _layout(name, t, s, seed % 3 == 0, seed)
  free = plan_lib.required_capacity(
      plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                        options=plan_lib.PlanOptions(tolerance=tol)))
  need = _initial_needs(doc_lens, s, t)
  frac = rng.uniform(0.2, 1.0, size=len(plan_lib.CAP_FIELDS))
  cap = plan_lib.Capacity(**{f: max(getattr(need, f), int(getattr(free, f) * x))
                             for f, x in zip(plan_lib.CAP_FIELDS, frac)})
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap,
                           options=plan_lib.PlanOptions(tolerance=tol))
  _check_plan(plan, tol)
  got = plan_lib.required_capacity(plan)
  for f in plan_lib.CAP_FIELDS:
    assert getattr(got, f) <= getattr(cap, f), (f, got, cap)
  if plan.imbalance_after > (1 + tol) * (1 + 1e-9):
    assert plan.degraded and plan.degraded_reason
  assert plan.imbalance_after <= plan.imbalance_before
  # The metadata builds in exactly the configured shapes.
  if s <= 8 and t <= 16 * K:
    meta = plan_lib.plan_to_metadata(plan, cap)
    assert meta.q_send_idx.shape == (s, cap.q_send)
    assert meta.o_send_idx.shape == (s, cap.q_recv)
    assert meta.kv_routes.shape == (s, 6, s)
    assert meta.kv_attn_idx.shape == (s, cap.kv_tokens)
    assert meta.cu_seqlens_q.shape == (s, cap.tasks + 1)


def test_caps_never_exceeded_small_layouts():
  """Many small layouts with spanning documents and tight random caps (exact-check paths)."""
  rng = np.random.default_rng(7)
  capped = 0
  for trial in range(150):
    kind = ("flat", "huge", "rank_huge", "nested")[trial % 4]
    doc_lens, s, t = _random_small_layout(rng, kind)
    # Longer ranks and two more empty ranks: more spanning documents, more destinations.
    t *= 8
    if kind in ("flat", "huge"):
      doc_lens = [8 * v for v in doc_lens]
    else:
      doc_lens = [[8 * v for v in row] for row in doc_lens] + [[], []]
    s += 2
    tol = float(rng.uniform(0.0, 0.3))
    m0 = int(rng.integers(2, 16))
    free = plan_lib.required_capacity(
        plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                          options=plan_lib.PlanOptions(tolerance=tol, min_shard=m0)))
    need = _initial_needs(doc_lens, s, t)
    cap = plan_lib.Capacity(**{
        f: max(getattr(need, f), int(getattr(free, f) * rng.uniform(0.3, 1.0)))
        for f in plan_lib.CAP_FIELDS})
    plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap,
                             options=plan_lib.PlanOptions(tolerance=tol, min_shard=m0))
    _check_plan(plan, tol)
    got = plan_lib.required_capacity(plan)
    for f in plan_lib.CAP_FIELDS:
      assert getattr(got, f) <= getattr(cap, f), (trial, f, got, cap)
    capped += plan.degraded
  assert capped > 10  # the caps really bind in many trials


def test_caps_degrade_with_reason():
  # One 1000-token document on rank 0 of 2: the other rank may take at most 10 query rows.
  plan = plan_lib.schedule([[1000], []], 2, tokens_per_rank=1000,
                           capacity=plan_lib.Capacity(q_tokens=1000, q_recv=10),
                           options=plan_lib.PlanOptions(min_shard=8))
  assert plan.degraded and "q_recv" in plan.degraded_reason
  assert plan_lib.required_capacity(plan).q_recv <= 10
  # A sender's total is capped too: rank 0 may send at most 10 query rows to all servers.
  plan = plan_lib.schedule([[1000], [], [], []], 4, tokens_per_rank=1000,
                           capacity=plan_lib.Capacity(q_send=10),
                           options=plan_lib.PlanOptions(min_shard=4))
  assert plan.degraded and "q_send" in plan.degraded_reason
  assert plan_lib.required_capacity(plan).q_send <= 10 and plan.num_moves > 0
  free = plan_lib.schedule([[1000], []], 2, tokens_per_rank=1000,
                           options=plan_lib.PlanOptions(min_shard=8))
  assert not free.degraded and free.imbalance_after <= 1.1 + 1e-9


def test_min_shard_degrades_with_reason():
  plan = plan_lib.schedule([[1000], []], 2, tokens_per_rank=1000,
                           options=plan_lib.PlanOptions(min_shard=512))
  assert plan.degraded and "min_shard" in plan.degraded_reason
  assert plan.imbalance_after == pytest.approx(2.0)
  # Mirrored split exactness: 250 mirrored pairs of a 1000-token document cost 250 * 1001.
  ok = plan_lib.schedule([[1000], []], 2, tokens_per_rank=1000,
                         options=plan_lib.PlanOptions(min_shard=64, tolerance=0.0,
                                                      split="mirrored"))
  assert ok.loads_after.max() - ok.loads_after.min() <= 2 * 1001


# (tokens_per_rank, sampler seed, step) of Pretrain layouts on 64 servers where tolerance 0 once
# ended worse than 0.01 (1.0127 vs 1.0100 at 128K; 1.0212 vs 1.0100 at 64K), plus seeded draws.
_MONOTONE_CASES = ((128 * K, 3, 8), (64 * K, 1, 4)) + tuple(
    (int(t), int(seed), int(step)) for t, seed, step in zip(
        np.random.default_rng(5).choice((64 * K, 128 * K), 2),
        np.random.default_rng(6).integers(0, 10, 2), np.random.default_rng(7).integers(0, 20, 2)))


@pytest.mark.parametrize("case", _MONOTONE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_smaller_tolerance_never_ends_worse(case):
  """imbalance_after is non-increasing as the tolerance decreases (same layout and min_shard)."""
  t, seed, step = case
  doc_lens = _layout("pretrain", t, 64, False, step, seed=seed)
  imb = [plan_lib.schedule(doc_lens, 64, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(tolerance=tol, min_shard=512)
                           ).imbalance_after for tol in (0.1, 0.05, 0.02, 0.01, 0.0)]
  assert all(b <= a * (1 + 1e-12) for a, b in zip(imb, imb[1:])), imb


def test_mirrored_pairs_identity():
  rng = np.random.default_rng(0)
  for _ in range(200):
    length = int(rng.integers(2, 10**6))
    m = int(rng.integers(1, length // 2 + 1))
    s0 = int(rng.integers(0, length // 2 - m + 1))
    got = plan_lib.pairs(s0, s0 + m) + plan_lib.pairs(length - s0 - m, length - s0)
    assert got == m * (length + 1)


def test_determinism_and_input_forms():
  doc_lens = _layout("prolong", 64 * K, 16, False, 3)
  p1 = plan_lib.schedule(doc_lens, 16, tokens_per_rank=64 * K,
                         options=plan_lib.PlanOptions(tolerance=0.05))
  p2 = plan_lib.schedule(tuple(doc_lens), 16, tokens_per_rank=64 * K,
                         options=plan_lib.PlanOptions(tolerance=0.05))
  p3 = plan_lib.schedule(np.asarray(doc_lens), 16, tokens_per_rank=64 * K,
                         options=plan_lib.PlanOptions(tolerance=0.05))
  for p in (p2, p3):
    np.testing.assert_array_equal(p1.tasks, p.tasks)
    np.testing.assert_array_equal(p1.loads_after, p.loads_after)
    np.testing.assert_array_equal(p1.pair_kv_rows, p.pair_kv_rows)
  assert p1.num_moves > 0
  # The nested form with every document inside one rank equals the flat form.
  nested = [[100, 28], [64, 64], [128]]
  flat = [100, 28, 64, 64, 128]
  a = plan_lib.schedule(nested, 3, tokens_per_rank=128, options=plan_lib.PlanOptions(min_shard=4))
  b = plan_lib.schedule(flat, 3, tokens_per_rank=128, options=plan_lib.PlanOptions(min_shard=4))
  np.testing.assert_array_equal(a.tasks, b.tasks)


@pytest.mark.parametrize("split", ["mirrored", "suffix"])
def test_split_modes(split):
  doc_lens = _layout("pretrain", 128 * K, 8, False, 1)
  plan = plan_lib.schedule(doc_lens, 8, tokens_per_rank=128 * K,
                           options=plan_lib.PlanOptions(tolerance=0.1, split=split))
  _check_plan(plan, 0.1)
  auto = plan_lib.schedule(doc_lens, 8, tokens_per_rank=128 * K,
                           options=plan_lib.PlanOptions(tolerance=0.1))
  assert auto.num_moves > 0 and plan.num_moves > 0


# ---------------------------------------------------------------------------------------------
# Metadata round trip through the NumPy reference executor.
# ---------------------------------------------------------------------------------------------
def _random_small_layout(rng, kind: str):
  s = int(rng.integers(2, 7))
  t = int(rng.integers(12, 72))
  if kind == "huge":  # one document spanning every rank (and padding at the end)
    return [int(rng.integers(s * t // 2, s * t + 1))], s, t
  if kind == "rank_huge":  # rank 0 holds one huge document, the others short ones
    nested = [[t]] + [[int(v) for v in _split_total(rng, int(rng.integers(0, t + 1)), t // 3)]
                      for _ in range(s - 1)]
    return nested, s, t
  if kind == "nested":
    return [[int(v) for v in _split_total(rng, int(rng.integers(0, t + 1)), t)]
            for _ in range(s)], s, t
  total = int(rng.integers(s * t // 2, s * t + 1))
  return [int(v) for v in _split_total(rng, total, 2 * t)], s, t


def _split_total(rng, total: int, max_len: int) -> list[int]:
  out = []
  while total > 0:
    n = int(min(total, rng.integers(1, max(2, max_len))))
    out.append(n)
    total -= n
  return out


def _global_tokens(meta: plan_lib.PlanMetadata, d: int):
  """Global token id of every attention Q and KV row of server ``d`` (-1 for padding)."""
  s, t = meta.num_servers, meta.tokens_per_rank
  cap = meta.capacity

  def resolve(idx, recv_rows, send, routes):
    # Received row r came from sender p (the group holding r) at p's send row
    # peer_send_off[p] + (r - recv_off[p]).
    out = np.full(idx.shape, -1, np.int64)
    own = idx < t
    out[own] = d * t + idx[own]
    rec = (idx >= t) & (idx < t + recv_rows)
    r = idx[rec] - t
    off, ln, src = routes[d, 2], routes[d, 3], routes[d, 5]
    p = np.searchsorted(off, r, side="right") - 1
    while (r >= off[p] + ln[p]).any():  # skip empty groups that share an offset
      p = np.where(r >= off[p] + ln[p], p + 1, p)
    assert (r < off[p] + ln[p]).all(), "an attention row points past the received groups"
    row = send[p, src[p] + r - off[p]]
    assert (row < t).all(), "an attention row points at a padding row"
    out[rec] = p * t + row
    return out

  return (resolve(meta.q_attn_idx[d], cap.q_recv, meta.q_send_idx, meta.q_routes),
          resolve(meta.kv_attn_idx[d], cap.kv_recv, meta.kv_send_idx, meta.kv_routes))


def _check_metadata_structure(plan: plan_lib.Plan, meta: plan_lib.PlanMetadata) -> None:
  s, t = plan.num_servers, plan.tokens_per_rank
  for f in plan_lib.PlanMetadata.DEVICE_FIELDS:
    assert getattr(meta, f).dtype == np.int32, f
  cap = meta.capacity
  for p in range(s):  # own rows never cross the wire
    assert meta.q_routes[p, 1, p] == 0 and meta.kv_routes[p, 1, p] == 0
  # Every task's queries are rows [a, b) of its document and its keys rows [0, b), aligned.
  for d in range(s):
    gq, gk = _global_tokens(meta, d)
    cu_q, cu_k = meta.cu_seqlens_q[d], meta.cu_seqlens_k[d]
    assert (np.diff(cu_q) >= 0).all() and (np.diff(cu_k) >= 0).all()
    for i in range(cap.tasks):
      ti = meta.task_index[d, i]
      if ti < 0:
        assert cu_q[i + 1] == cu_q[i] and cu_k[i + 1] == cu_k[i]
        continue
      doc, a, b, srv = plan.tasks[ti]
      assert srv == d
      g = plan.doc_starts[doc]
      np.testing.assert_array_equal(gq[cu_q[i]:cu_q[i + 1]], g + np.arange(a, b))
      np.testing.assert_array_equal(gk[cu_k[i]:cu_k[i + 1]], g + np.arange(0, b))
    # Each KV row is sent at most once per (sender, server) pair.
    for p in range(s):
      off, n = meta.kv_routes[p, 0, d], meta.kv_routes[p, 1, d]
      rows = meta.kv_send_idx[p, off:off + n]
      assert (rows < t).all() and np.unique(rows).size == rows.size
  # Every non-padding local query row gets exactly one output row back.
  lens, starts = plan.doc_lens, plan.doc_starts
  real = np.zeros(s * t, bool)
  for g, n in zip(starts, lens):
    real[g:g + n] = True
  assert ((meta.o_local_idx.reshape(-1) < cap.q_tokens + cap.q_send) == real).all()


@pytest.mark.parametrize("seed", range(24))
def test_metadata_round_trip(seed):
  rng = np.random.default_rng(100 + seed)
  kind = ("flat", "huge", "rank_huge", "nested")[seed % 4]
  doc_lens, s, t = _random_small_layout(rng, kind)
  tol = float(rng.choice([0.0, 0.05, 0.3]))
  options = plan_lib.PlanOptions(tolerance=tol, min_shard=int(rng.integers(1, 6)), q_heads=4,
                                 kv_heads=2, head_dim=8,
                                 split=("auto", "mirrored", "suffix")[seed % 3])
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, options=options)
  _check_plan(plan, tol)
  tight = plan_lib.required_capacity(plan)
  if seed % 2:  # padded buffers: every cap a little larger than needed
    cap = plan_lib.Capacity(**{f: getattr(tight, f) + int(rng.integers(0, 5))
                               for f in plan_lib.CAP_FIELDS})
  else:
    cap = None
  o_ref = _check_executes(plan, cap, doc_lens, rng)
  if kind != "huge" or plan.num_moves:
    assert np.abs(o_ref).max() > 0


def _check_executes(plan: plan_lib.Plan, cap, doc_lens, rng) -> np.ndarray:
  """The plan's metadata (under ``cap``) is well formed and executes (NumPy, 4 query heads, 2
  key/value heads, head dim 8) to per-document attention on random inputs; returns the output."""
  s, t = plan.num_servers, plan.tokens_per_rank
  meta = plan_lib.plan_to_metadata(plan, cap)
  _check_metadata_structure(plan, meta)
  q = rng.standard_normal((s, t, 4, 8))
  k = rng.standard_normal((s, t, 2, 8))
  v = rng.standard_normal((s, t, 2, 8))
  o, lse = plan_lib.reference_execute(meta, q, k, v)
  o_ref, lse_ref = plan_lib.reference_document_attention(doc_lens, q, k, v)
  np.testing.assert_allclose(o, o_ref, atol=1e-10, rtol=1e-10)
  np.testing.assert_allclose(lse, lse_ref, atol=1e-10, rtol=1e-10)
  return o_ref


def test_metadata_from_workload_layout():
  """A real (scaled-down) layout: spanning documents, many tasks, padded caps."""
  t, s = K, 4
  doc_lens = WorkloadSampler("prolong", t, seed=5, context_length=8 * K).flat_doclens(2, s)
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(tolerance=0.05, min_shard=16, q_heads=2,
                                                        kv_heads=1, head_dim=4))
  assert plan.num_moves > 0
  cap = plan_lib.Capacity.envelope([plan_lib.required_capacity(plan)], multiple=64)
  meta = plan_lib.plan_to_metadata(plan, cap)
  _check_metadata_structure(plan, meta)
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((s, t, h, 4)) for h in (2, 1, 1))
  o, _ = plan_lib.reference_execute(meta, q, k, v)
  o_ref, _ = plan_lib.reference_document_attention(doc_lens, q, k, v)
  np.testing.assert_allclose(o, o_ref, atol=1e-10)


def test_metadata_rank_subset():
  doc_lens = [50, 90, 30, 10, 60]
  plan = plan_lib.schedule(doc_lens, 4, tokens_per_rank=64,
                           options=plan_lib.PlanOptions(min_shard=4, tolerance=0.0))
  full = plan_lib.plan_to_metadata(plan)
  part = plan_lib.plan_to_metadata(plan, ranks=[2, 0])
  for f in plan_lib.PlanMetadata.DEVICE_FIELDS:
    np.testing.assert_array_equal(getattr(part, f), getattr(full, f)[[2, 0]], err_msg=f)
  with pytest.raises(ValueError, match="ranks"):
    plan_lib.plan_to_metadata(plan, ranks=[0, 0])


def test_metadata_capacity_too_small():
  plan = plan_lib.schedule([40, 30, 20, 38], 2, tokens_per_rank=64,
                           options=plan_lib.PlanOptions(min_shard=2))
  need = plan_lib.required_capacity(plan)
  for f in plan_lib.CAP_FIELDS:
    if getattr(need, f) > 1:
      small = dataclasses.replace(need, **{f: getattr(need, f) - 1})
      with pytest.raises(ValueError, match=f):
        plan_lib.plan_to_metadata(plan, small)


# ---------------------------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,kwargs,match", [
    (([10, 0, 5], 2), {"tokens_per_rank": 16}, "positive"),
    (([10, -1], 2), {"tokens_per_rank": 16}, "positive"),
    (([10, 2.5], 2), {"tokens_per_rank": 16}, "positive int"),
    (([40], 2), {"tokens_per_rank": 16}, "tokens_per_rank"),
    (([[10], [5]], 3), {"tokens_per_rank": 16}, "num_servers"),
    (([[10, 10], [5]], 2), {"tokens_per_rank": 16}, "rank 0"),
    (([[10], 5], 2), {"tokens_per_rank": 16}, "mixes"),
    (([10], 0), {"tokens_per_rank": 16}, "num_servers"),
    (([10], 2), {"tokens_per_rank": 0}, "tokens_per_rank"),
    (([10], 2), {"tokens_per_rank": 16, "tolerance": -0.1}, "tolerance"),
    (([10], 2), {"tokens_per_rank": 16, "tolerance": float("nan")}, "tolerance"),
    (([10], 2), {"tokens_per_rank": 16, "min_shard": 0}, "min_shard"),
    (([10], 2), {"tokens_per_rank": 16, "split": "middle"}, "split"),
    (([10], 2), {"tokens_per_rank": 16, "capacity": {"slots": 3}}, "unknown capacity"),
    (([10], 2), {"tokens_per_rank": 16, "capacity": {"tasks": 0}}, "tasks"),
    (([10], 2), {"tokens_per_rank": 16, "q_heads": 6, "kv_heads": 4}, "multiple"),
    (([20, 12], 2), {"tokens_per_rank": 16, "capacity": {"kv_recv": 8}}, "kv_recv >= 16"),
    (([20, 12], 2), {"tokens_per_rank": 16, "capacity": {"kv_send": 8}}, "kv_send >= 16"),
    (([[3, 3, 3], [4]], 2), {"tokens_per_rank": 16, "capacity": {"tasks": 2}}, "tasks >= 3"),
    (([10], 2), {"tokens_per_rank": 16, "min_gain": -0.01}, "min_gain"),
    (([10], 2), {"tokens_per_rank": 16, "min_gain": True}, "min_gain"),
    (([10], 2), {"tokens_per_rank": 16, "linear_pairs_per_token": float("inf")},
     "linear_pairs_per_token"),
])
def test_bad_input(args, kwargs, match):
  fields = {f.name for f in dataclasses.fields(plan_lib.PlanOptions)}
  options = plan_lib.PlanOptions(**{k: v for k, v in kwargs.items() if k in fields})
  with pytest.raises(ValueError, match=match):
    plan_lib.schedule(*args, **{k: v for k, v in kwargs.items() if k not in fields},
                      options=options)


def test_predicted_step_gain_by_hand():
  # Two servers of T = 100 token slots: one document of 100 tokens (5050 pairs) against one of
  # 10 (55 pairs). mean 2552.5; linear work 3 pairs per token = 300 per server.
  loads = [plan_lib.pairs(0, 100), plan_lib.pairs(0, 10)]
  assert plan_lib.predicted_step_gain(loads, 100, 3.0) == pytest.approx(
      (5050 - 2552.5) / (2552.5 + 300))
  assert plan_lib.predicted_step_gain(loads, 100, 0.0) == pytest.approx(5050 / 2552.5 - 1)
  assert plan_lib.predicted_step_gain([0, 0], 100, 0.0) == 0.0


def test_gate_moves_nothing_below_min_gain_and_balances_above(seed):
  """The gate compares the layout's predicted step gain with min_gain: below it the plan is
  every row where it lives (gated, not degraded); at or above it, the same balance as without
  a gate."""
  rng = np.random.default_rng(seed)
  t, s = 32 * K, 4
  lin = float(rng.uniform(500, 5000))
  seen = {True: 0, False: 0}
  for step in range(12):
    layout = _layout("prolong" if step % 2 else "pretrain", t, s, True, step, seed=seed)
    free = plan_lib.schedule(layout, s, tokens_per_rank=t,
                             options=plan_lib.PlanOptions(tolerance=0.05))
    gain = plan_lib.predicted_step_gain(free.loads_before, t, lin)
    # No linear weight given: attention alone.
    assert free.predicted_gain == pytest.approx(free.imbalance_before - 1) and not free.gated
    for min_gain in (gain * 0.5, gain * 2.0 + 1e-9):
      p = plan_lib.schedule(layout, s, tokens_per_rank=t,
                            options=plan_lib.PlanOptions(tolerance=0.05, min_gain=min_gain,
                                                         linear_pairs_per_token=lin))
      assert p.predicted_gain == pytest.approx(gain)
      if gain < min_gain:
        assert p.gated and not p.degraded and p.num_moves == 0 and p.bytes_total == 0
        np.testing.assert_array_equal(p.loads_after, p.loads_before)
        assert "GATED" in p.summary()
      else:
        assert not p.gated
        np.testing.assert_array_equal(p.tasks, free.tasks)
        np.testing.assert_array_equal(p.loads_after, free.loads_after)
      seen[p.gated] += 1
  assert seen[True] and seen[False]


def test_bad_types():
  with pytest.raises(TypeError, match="doc_lens"):
    plan_lib.schedule("100", 2, tokens_per_rank=64)
  with pytest.raises(TypeError, match="capacity"):
    plan_lib.schedule([10], 2, tokens_per_rank=64, capacity=5)
  with pytest.raises(TypeError, match="cost_model"):
    plan_lib.schedule([10], 2, tokens_per_rank=64, options=plan_lib.PlanOptions(cost_model=3))


def test_empty_layout():
  plan = plan_lib.schedule([], 4, tokens_per_rank=64)
  assert plan.tasks.shape == (0, 4) and plan.imbalance_after == 1.0 and not plan.degraded
  meta = plan_lib.plan_to_metadata(plan)
  assert (meta.o_local_idx == meta.capacity.q_tokens + meta.capacity.q_send).all()


# ---------------------------------------------------------------------------------------------
# Cost model, capacities, diagnostics.
# ---------------------------------------------------------------------------------------------
def _power_table(q_lens, kv_lens):
  """A power law t = c q^0.8 kv^0.6: log-bilinear interpolation reproduces it exactly."""
  q = np.asarray(q_lens, float)[:, None]
  kv = np.asarray(kv_lens, float)[None, :]
  t = 1e-9 * q**0.8 * kv**0.6
  return np.where(q <= kv, t, np.nan)


def test_cost_table_interpolation(tmp_path):
  q_lens, kv_lens = [64, 256, 1024, 4096], [256, 1024, 4096, 16384]
  grid = _power_table(q_lens, kv_lens)
  path = tmp_path / "table.json"
  path.write_text(json.dumps({"q_lens": q_lens, "kv_lens": kv_lens,
                              "fwd_bwd_s": [[None if np.isnan(x) else x for x in row]
                                            for row in grid]}))
  table = plan_lib.CostTable.from_json(str(path))
  rng = np.random.default_rng(0)
  kv = np.exp(rng.uniform(np.log(256), np.log(16384), 50))
  q = np.minimum(np.exp(rng.uniform(np.log(64), np.log(4096), 50)), kv)
  # Inside the triangle away from the diagonal's filled cells the power law is exact.
  inner = (q * 4 <= kv)
  np.testing.assert_allclose(table.time(q[inner], kv[inner]),
                             1e-9 * q[inner]**0.8 * kv[inner]**0.6, rtol=1e-9)
  np.testing.assert_allclose(table.time(1024, 4096), grid[2, 2], rtol=1e-12)
  # Beyond the grid: scaled by causal pairs.
  big = table.time(4096, 65536)
  ref = grid[3, 3] * (4096 * (2 * 65536 - 4096 + 1)) / (4096 * (2 * 16384 - 4096 + 1))
  assert big == pytest.approx(ref, rel=1e-12)
  with pytest.raises(ValueError, match="q_len <= kv_len"):
    table.time(100, 50)


def test_cost_table_in_plan(tmp_path):
  q_lens, kv_lens = [64, 512, 4096, 32768], [512, 4096, 32768, 262144]
  grid = _power_table(q_lens, kv_lens)
  table = plan_lib.CostTable.from_arrays(q_lens, kv_lens, grid, meta={"device": "synthetic"})
  doc_lens = _layout("pretrain", 64 * K, 8, False, 0)
  plan = plan_lib.schedule(doc_lens, 8, tokens_per_rank=64 * K,
                           options=plan_lib.PlanOptions(cost_model=table))
  t = plan.tasks
  want = np.bincount(t[:, 3], weights=table.time(t[:, 2] - t[:, 1], t[:, 2]), minlength=8)
  np.testing.assert_allclose(plan.times_after, want)
  assert plan.times_before.sum() > 0
  diag = plan_lib.diagnostics(plan)
  assert diag["time_imbalance_after"] == pytest.approx(plan_lib.imbalance(plan.times_after))
  path = tmp_path / "t.json"
  path.write_text(json.dumps({"q_lens": q_lens, "kv_lens": kv_lens, "fwd_bwd_s": [[
      None if np.isnan(x) else x for x in row] for row in grid]}))
  again = plan_lib.schedule(doc_lens, 8, tokens_per_rank=64 * K,
                            options=plan_lib.PlanOptions(cost_model=str(path)))
  np.testing.assert_allclose(again.times_after, plan.times_after)


@pytest.mark.parametrize("bad,match", [
    (dict(q_lens=[64, 32], kv_lens=[64], time_s=[[1.0], [1.0]]), "increasing"),
    (dict(q_lens=[64], kv_lens=[64, 128], time_s=[[1.0]]), "shape"),
    (dict(q_lens=[64], kv_lens=[64], time_s=[[-1.0]]), "positive"),
    (dict(q_lens=[64], kv_lens=[128], time_s=[[None]]), "positive"),
])
def test_cost_table_bad(bad, match):
  with pytest.raises(ValueError, match=match):
    plan_lib.CostTable.from_arrays(**bad)


def test_cost_table_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="cost_table.py"):
    plan_lib.schedule([10], 2, tokens_per_rank=16,
                      options=plan_lib.PlanOptions(cost_model=str(tmp_path / "nope.json")))


def test_capacity_memory_and_envelope():
  cap = plan_lib.Capacity(q_send=1024, kv_send=4096, q_recv=1536, kv_recv=2048, q_tokens=8192,
                          kv_tokens=16384, tasks=64)
  mem = cap.memory_bytes(8, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
  bq, bkv = 32 * 128 * 2, 8 * 128 * 2
  assert mem["q_exchange"] == (1024 + 1536) * bq
  assert mem["kv_exchange"] == 2 * (4096 + 2048) * bkv
  assert mem["attention_kv"] == 2 * 16384 * bkv
  assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
  # No buffer depends on the number of servers; only the routes' int32 [6, S] do.
  big = cap.memory_bytes(512, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2)
  assert {k: v for k, v in big.items() if k not in ("metadata", "total")} == {
      k: v for k, v in mem.items() if k not in ("metadata", "total")}
  assert big["metadata"] - mem["metadata"] == 4 * 12 * (512 - 8)
  env = plan_lib.Capacity.envelope([cap, dataclasses.replace(cap, q_send=1500, tasks=70)])
  assert env.q_send == 1536 and env.tasks == 72 and env.kv_recv == 2048
  with pytest.raises(ValueError, match="every cap"):
    plan_lib.Capacity(q_send=4).memory_bytes(8)
  with pytest.raises(ValueError, match="q_recv"):
    plan_lib.Capacity(q_recv=-3)


def test_diagnostics_and_plot():
  doc_lens = _layout("prolong", 32 * K, 8, False, 4)
  plan = plan_lib.schedule(doc_lens, 8, tokens_per_rank=32 * K)
  diag = plan_lib.diagnostics(plan)
  assert diag["bytes_total"] == plan.bytes_q + plan.bytes_kv
  np.testing.assert_array_equal(plan_lib.pair_bytes(plan), plan.pair_bytes)
  assert plan.pair_bytes.sum() == plan.bytes_total
  assert plan.summary().startswith("servers=8")
  try:
    import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    with pytest.raises(ImportError, match="pip install matplotlib"):
      plan_lib.plot_loads(plan)
  else:
    fig = plan_lib.plot_loads(plan)
    assert fig.axes


def test_plan_options_auto_min_shard_is_resolved_per_row():
  """min_shard=None is auto: schedule needs a number (it cannot know the rows), for_rows gives
  auto_min_shard of the tokens per row, and host_plan resolves it with the spec's rows."""
  auto = plan_lib.PlanOptions(min_shard=None, tolerance=0.0)
  with pytest.raises(ValueError, match=r"min_shard=None \(auto\)"):
    plan_lib.schedule([[40, 30], [5]], 2, tokens_per_rank=128, options=auto)
  with pytest.raises(TypeError, match="must be a plan.PlanOptions"):
    plan_lib.schedule([[40, 30], [5]], 2, tokens_per_rank=128, options={"tolerance": 0.0})
  assert auto.for_rows(128).min_shard == plan_lib.auto_min_shard(128) == 8
  assert auto.for_rows(64 * K).min_shard == plan_lib.DEFAULT_MIN_SHARD
  fixed = plan_lib.PlanOptions(min_shard=16)
  assert fixed.for_rows(128) is fixed
  cap = plan_lib.Capacity(**{f: 256 for f in plan_lib.CAP_FIELDS})
  spec = plan_lib.PlanSpec(num_servers=2, tokens_per_row=128, rows_per_device=1, capacity=cap)
  hp = plan_lib.host_plan([[120], [5]], spec, auto)
  assert hp.plan.min_shard == 8 and hp.plan.num_moves > 0
