"""experiments/host_plan_bench's diagnostics: bytes between hosts if each key/value row crossed
once per host (``inter_host_bytes_once_per_host``) and the key/value share."""

import numpy as np
import pytest

from distca_jax import plan as plan_lib
from experiments import host_plan_bench as hpb
from test_scheduler import _random_small_layout


@pytest.mark.parametrize("kind", ["flat", "huge", "rank_huge"])
def test_once_per_host_bounds(seed, kind):
  rng = np.random.default_rng(seed)
  lens, s, t = _random_small_layout(rng, kind)
  plan = plan_lib.schedule(lens, s, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(min_shard=2, tolerance=0.0))
  # One server per host: each key/value row already crosses once per host.
  assert hpb.inter_host_bytes_once_per_host(plan, 1) == plan.link_bytes(1)[1]
  # One host: nothing crosses.
  assert hpb.inter_host_bytes_once_per_host(plan, s) == 0
  for per_host in range(2, s):
    if s % per_host == 0:
      once = hpb.inter_host_bytes_once_per_host(plan, per_host)
      assert 0 <= once <= plan.link_bytes(per_host)[1]
      share = hpb._kv_share(plan, per_host)
      assert 0.0 <= share <= 1.0


def test_once_per_host_counts_a_shared_prefix_once():
  # One 48-token document on server 0 of 4 (two hosts of 2); servers 2 and 3 both read its
  # keys [0, 48) from host 0: sent per server that is twice, once per host once.
  plan = plan_lib.schedule([48, 16, 16, 16], 4, tokens_per_rank=48,
                           options=plan_lib.PlanOptions(min_shard=4, tolerance=0.0))
  cross = [(d, b) for doc, _, b, d in plan.tasks.tolist() if doc == 0 and d >= 2]
  assert len({d for d, _ in cross}) == 2, plan.tasks
  kvb = 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes
  per_server = sum(b for _, b in cross)
  q = int(plan.pair_q_rows[:2, 2:].sum()) * plan.q_heads * plan.head_dim * plan.dtype_bytes
  assert plan.link_bytes(2)[1] == q + per_server * kvb
  assert hpb.inter_host_bytes_once_per_host(plan, 2) == q + max(b for _, b in cross) * kvb
