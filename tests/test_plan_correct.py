"""The balancer's scalar exact scores without caps (``Balancer._correct_uncapped``) equal the
general path's (``_exact`` then ``_move_bytes``) at every call of real plans, host-blind and
host-aware."""

import numpy as np
import pytest

from distca_jax import plan as plan_lib
from distca_jax.plan.balancer import Balancer
from distca_jax.plan.capacity import Capacity
from distca_jax.data.workloads import WorkloadSampler
from test_scheduler import _random_small_layout


def _reference(bal, i, p, d, prio, upper, tu, room):
  """The general path of ``Balancer._correct`` (each option through ``_exact`` and
  ``_move_bytes``), taken under a cap no move reaches."""
  saved = bal.capacity
  bal.capacity = Capacity(tasks=10**9)
  try:
    bal._correct(i, p, d, prio, upper, tu, room, True)
  finally:
    bal.capacity = saved


def _layouts():
  out = [(WorkloadSampler(w, 32768, seed=0).flat_doclens(step, 16), 16, 32768)
         for w, step in (("pretrain", 0), ("prolong", 1), ("prolong", 2))]
  rng = np.random.default_rng(5)
  for kind in ("flat", "huge", "rank_huge", "nested", "flat", "flat", "huge", "flat"):
    lens, s, t = _random_small_layout(rng, kind)
    out.append((lens, s, t))
  return out


@pytest.mark.parametrize("per_host", [None, 2, 4])
@pytest.mark.parametrize("split", ["auto", "mirrored", "suffix"])
def test_scalar_correction_matches_exact_path(monkeypatch, per_host, split):
  fast = Balancer._correct_uncapped
  calls = []

  def both(self, i, p, j, d, have, prio, upper, tu, room):
    ref_prio, ref_upper = prio.copy(), upper.copy()
    _reference(self, i, p, d, ref_prio, ref_upper, tu, room)
    fast(self, i, p, j, d, have, prio, upper, tu, room)
    np.testing.assert_allclose(prio[:, p], ref_prio[:, p], rtol=1e-12)
    assert (upper[:, p] == ref_upper[:, p]).all()
    calls.append(p)

  monkeypatch.setattr(Balancer, "_correct_uncapped", both)
  for lens, s, t in _layouts():
    if per_host is not None and s % per_host:
      continue
    plan_lib.schedule(lens, s, tokens_per_rank=t, options=plan_lib.PlanOptions(
        servers_per_host=per_host, split=split, min_shard=4, tolerance=0.02))
  assert len(calls) > 50


@pytest.mark.parametrize("per_host,window", [(None, 0), (2, 0), (None, 40)])
def test_scalar_derive_matches_arrays(monkeypatch, per_host, window):
  one = Balancer._derive_one
  calls = []

  def both(self, i):
    got = one(self, i)
    ref = self._derive(np.asarray([i]))
    assert set(got) == set(ref)
    for k, v in ref.items():
      assert got[k] == v[0], (k, got[k], v[0])
    calls.append(i)
    return got

  monkeypatch.setattr(Balancer, "_derive_one", both)
  for lens, s, t in _layouts():
    if per_host is None or s % per_host == 0:
      plan_lib.schedule(lens, s, tokens_per_rank=t, options=plan_lib.PlanOptions(
          servers_per_host=per_host, min_shard=4, tolerance=0.02, window=window))
  assert len(calls) > (5 if window else 20)
