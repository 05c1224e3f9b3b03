"""Fuzzing the planner and the data plane with adversarial layouts.

Planner (host, NumPy): random layouts of the shapes that break balancers — 1-token documents, one
document filling a rank, all-equal lengths, empty ranks, one document over every rank — on 2 to
512 servers, every tolerance from 0 to "never move", with and without caps. Each plan must cover
every query token exactly once, conserve the work, respect every cap, and execute (the NumPy
executor) to per-document attention. Data plane (8 fake devices): CAD outputs and gradients
against per-document attention on a few seeded layouts of the same kinds. Every failure names
its seed and layout.
"""

import numpy as np
import pytest

from distca_jax import plan as sc
from test_dispatch import D, H, KH, SPEC, S, T, _check, _inputs, _make_run, _mesh, _reference, _segments
from test_scheduler import _check_plan, _initial_needs

KINDS = ("one_token", "rank_filling", "all_equal", "empty_ranks", "one_doc_all_ranks", "mixed")
SERVERS = (2, 3, 5, 8, 17, 64, 128, 512)
TOLERANCES = (0.0, 1e-3, 0.02, 0.1, 0.5, 1.0, 1e9)


def random_layout(rng, kind: str, s: int, t: int):
  """Per-rank document lengths (a list per rank) or a flat list (documents spanning ranks)."""
  if kind == "one_token":  # every document is 1 token; ranks filled to a random level
    return [[1] * int(rng.integers(0, t + 1)) for _ in range(s)]
  if kind == "rank_filling":  # one document fills a whole rank, the others short or empty
    rows = [[int(x) for x in rng.integers(1, max(2, t // 4), size=int(rng.integers(0, 4)))]
            for _ in range(s)]
    for r in rng.choice(s, size=int(rng.integers(1, max(2, s // 4))), replace=False):
      rows[int(r)] = [t]
    return [row if sum(row) <= t else [t] for row in rows]
  if kind == "all_equal":  # the same length everywhere (a divisor of t or not)
    n = int(rng.integers(1, t + 1))
    return [[n] * (t // n) for _ in range(s)]
  if kind == "empty_ranks":  # most ranks empty, some full of short documents
    rows = [[] for _ in range(s)]
    for r in rng.choice(s, size=int(rng.integers(1, max(2, s // 3))), replace=False):
      left, row = t, []
      while left > 0:
        n = int(min(left, rng.integers(1, max(2, t // 2))))
        row.append(n)
        left -= n
      rows[int(r)] = row
    return rows
  if kind == "one_doc_all_ranks":  # one document over every rank, with or without padding
    return [int(rng.integers(s * t // 2, s * t + 1))]
  total, out = int(rng.integers(1, s * t + 1)), []  # mixed lengths spanning ranks
  while total > 0:
    n = int(min(total, rng.integers(1, 3 * t)))
    out.append(n)
    total -= n
  return out


def check_plan(plan: sc.Plan, tol: float) -> None:
  """test_scheduler's plan checks; a layout without documents plans no task and no load."""
  if plan.doc_lens.size == 0:
    assert plan.tasks.shape == (0, 4) and not plan.loads_after.any() and not plan.degraded
    return
  _check_plan(plan, tol)


def _describe(doc_lens) -> str:
  flat = [x for row in doc_lens for x in (row if isinstance(row, list) else [row])]
  return f"{len(flat)} docs, {sum(flat)} tokens, max {max(flat, default=0)}"


@pytest.mark.parametrize("seed", [
    0, *(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 8))])
def test_planner_fuzz_coverage_work_and_caps(seed):
  rng = np.random.default_rng(seed)
  trials = 0
  for kind in KINDS:
    for _ in range(3):
      s = int(rng.choice(SERVERS))
      if kind == "one_doc_all_ranks":  # one document over 512 ranks takes minutes to balance
        s = min(s, 64)                 # (results/reliability.md); test_planner_fuzz_extremes
      t = int(rng.integers(1, 9)) * (8 if s >= 128 else 32)  # keep 512 servers cheap
      tol = float(rng.choice(TOLERANCES))
      doc_lens = random_layout(rng, kind, s, t)
      min_shard = int(rng.integers(1, 9))
      what = f"{seed=} {kind} S={s} T={t} eps={tol} min_shard={min_shard} ({_describe(doc_lens)})"
      try:
        plan = sc.schedule(doc_lens, s, tokens_per_rank=t,
                           options=sc.PlanOptions(tolerance=tol, min_shard=min_shard))
        check_plan(plan, tol)
        # Caps between what the layout needs before any move and what the free plan used: the
        # planner must stay inside them (and say why when it stops above the tolerance).
        need, free = _initial_needs(doc_lens, s, t), sc.required_capacity(plan)
        cap = sc.Capacity(**{f: max(1, getattr(need, f),
                                    int(getattr(free, f) * rng.uniform(0.3, 1.0)))
                             for f in sc.CAP_FIELDS})
        capped = sc.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap,
                             options=sc.PlanOptions(tolerance=tol, min_shard=min_shard))
        check_plan(capped, tol)
        got = sc.required_capacity(capped)
        for f in sc.CAP_FIELDS:
          assert getattr(got, f) <= getattr(cap, f), (f, got, cap)
        # Small plans execute on the host to per-document attention (the metadata contract).
        if s * t <= 1024 and capped.tasks.size:
          meta = sc.plan_to_metadata(capped, cap)
          h, kh, d = 2, 1, 4
          q = rng.standard_normal((s, t, h, d)).astype(np.float32)
          k = rng.standard_normal((s, t, kh, d)).astype(np.float32)
          v = rng.standard_normal((s, t, kh, d)).astype(np.float32)
          for got, want in zip(sc.reference_execute(meta, q, k, v),
                               sc.reference_document_attention(doc_lens, q, k, v)):
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
      except Exception as e:
        raise AssertionError(f"planner fuzz failed: {what}: {e}") from e
      trials += 1
  assert trials == 3 * len(KINDS)


@pytest.mark.slow
def test_planner_fuzz_extremes_by_hand():
  """The corners the random draw may miss: everything empty, 512 servers of 1-token documents,
  every rank one full document, one document over 512 ranks (default min_shard: it stays put)."""
  for doc_lens, s, t, tols in (([[] for _ in range(4)], 4, 16, (0.0, 0.02, 1e9)),
                               ([[1] * 8] * 512, 512, 8, (0.0, 0.02)),
                               ([[16]] * 64, 64, 16, (0.0, 0.02)),
                               ([512 * 8], 512, 8, (0.02,))):
    for tol in tols:
      plan = sc.schedule(doc_lens, s, tokens_per_rank=t, options=sc.PlanOptions(tolerance=tol))
      check_plan(plan, tol)


# ---------------------------------------------------------------------------------------------
# Data plane on 8 fake devices
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cad_run():
  """CAD's jitted outputs and VJP on 8 devices; the plan is an argument, so every seed's layouts
  run one compiled program."""
  return _make_run(_mesh(), SPEC)


@pytest.mark.parametrize("seed", [11, 12])
def test_cad_outputs_and_grads_on_fuzzed_layouts(seed, cad_run):
  rng = np.random.default_rng(seed)
  run = cad_run
  ran = []
  for kind in KINDS:
    doc_lens = random_layout(rng, kind, S, T)
    tol = float(rng.choice(TOLERANCES[:5]))
    what = f"{seed=} {kind} eps={tol} ({_describe(doc_lens)})"
    try:
      hp = sc.host_plan(doc_lens, SPEC,
                        options=sc.PlanOptions(tolerance=tol, q_heads=H, kv_heads=KH, head_dim=D,
                                               dtype_bytes=4, min_shard=None))
    except ValueError as e:  # a layout beyond the fixed test caps must say which cap to raise
      assert "cannot plan this batch" in str(e) and "config.attention.distca" in str(e), what
      continue
    q, k, v, ct = _inputs(rng)
    got = run(q, k, v, hp.packed, ct)
    want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
    _check(got, want, f"CAD fuzz: {what} {hp.plan.summary()}")
    ran.append(kind)
  assert len(ran) >= 4, f"{seed=}: only {ran} fit the test caps"
