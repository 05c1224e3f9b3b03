"""The host-aware balancer (``PlanOptions.servers_per_host``, host NumPy): host-blind plans stay
as they were, host-aware plans are valid and execute to per-document attention, they send fewer
bytes between hosts, and bad values fail with one line."""

import hashlib

import numpy as np
import pytest

from distca_jax import plan as plan_lib
from distca_jax.data.workloads import WorkloadSampler
from test_scheduler import _check_executes, _check_plan, _initial_needs, _random_small_layout

_SHAPES = dict(q_heads=4, kv_heads=2, head_dim=8)


def _digest(plan: plan_lib.Plan) -> str:
  """Everything a plan decides: tasks, traffic, loads, moves and the degraded reason."""
  h = hashlib.sha256()
  for a in (plan.tasks, plan.pair_q_rows, plan.pair_kv_rows, plan.loads_after):
    h.update(np.ascontiguousarray(a).tobytes())
  h.update(repr((plan.num_moves, plan.degraded, plan.degraded_reason, plan.bytes_q,
                 plan.bytes_kv)).encode())
  return h.hexdigest()[:16]


def _blind_cases():
  """(name, doc_lens, servers, tokens_per_rank, options, capacity): workload batches and random
  small layouts, some capped."""
  out = []
  for w, s, t, step in (("pretrain", 16, 65536, 0), ("prolong", 16, 65536, 2),
                        ("pretrain", 64, 131072, 1), ("prolong", 64, 131072, 0)):
    out.append((f"{w}-{s}-{t}-{step}", WorkloadSampler(w, t, seed=0).flat_doclens(step, s), s,
                t, {}, None))
  rng = np.random.default_rng(0)
  for i in range(8):
    s, t = int(rng.integers(2, 9)), int(rng.integers(16, 80))
    total, lens = int(rng.integers(s * t // 2, s * t + 1)), []
    while total > 0:
      n = int(min(total, rng.integers(1, 2 * t)))
      lens.append(n)
      total -= n
    opts = dict(tolerance=float(rng.choice([0.0, 0.05, 0.3])), min_shard=int(rng.integers(1, 6)),
                split=("auto", "mirrored", "suffix")[i % 3])
    cap = dict(q_recv=t, kv_recv=2 * t, tasks=8) if i % 4 == 1 else None
    out.append((f"rand{i}", lens, s, t, opts, cap))
  return out


# The digests of these cases' host-blind plans as the planner made them at eb2ae4e, the commit
# before the planner knew hosts: servers_per_host=None must keep making exactly these plans.
_BLIND_DIGESTS = {
    "pretrain-16-65536-0": "a751751bd79e9f8c", "prolong-16-65536-2": "ccd74227a00f807b",
    "pretrain-64-131072-1": "48cd12def069c0c8",
    "prolong-64-131072-0": "5d43c6bf7f6f777b",
    "rand0": "afeeef2a0fff95f5", "rand1": "2ef4f3806d41766a", "rand2": "e3502a4d6204f3c1", "rand3": "f0ddf2d4f95f1fab",
    "rand4": "b9cf44703a2134d2", "rand5": "1dca426bfc9b8605", "rand6": "4e507f475ae22581", "rand7": "463e60d33811b3cc",
}


@pytest.mark.parametrize("case", _blind_cases(), ids=lambda c: c[0])
def test_host_blind_plans_unchanged(case):
  name, doc_lens, s, t, opts, cap = case
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap,
                           options=plan_lib.PlanOptions(**opts))
  assert _digest(plan) == _BLIND_DIGESTS[name]
  # One host (None or every server) and the link rates leave the host-blind plan as it is.
  for extra in (dict(servers_per_host=s), dict(intra_host_gbps=1.0, inter_host_gbps=1000.0)):
    same = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap,
                             options=plan_lib.PlanOptions(**opts, **extra))
    assert _digest(same) == _BLIND_DIGESTS[name]
  assert plan.inter_host_bytes == 0 and plan.intra_host_bytes == plan.bytes_total


def _link_split(plan: plan_lib.Plan, per_host: int) -> tuple[int, int]:
  """(inside hosts, between hosts) dispatch bytes recounted from the tasks."""
  q_rows, kv_rows = plan_lib.traffic_rows(plan)
  pb = (q_rows * plan.q_heads * plan.head_dim * plan.dtype_bytes
        + kv_rows * 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes)
  host = np.arange(plan.num_servers) // per_host
  same = host[:, None] == host[None, :]
  return int(pb[same].sum()), int(pb[~same].sum())


@pytest.mark.parametrize("seed", range(16))
def test_host_aware_plans_execute(seed):
  """Random small layouts (spanning documents, one huge document, per-rank lists), a random
  divisor of the servers per host, optionally capped: the plan is valid, counts its bytes by
  link, and executes (NumPy) to per-document attention."""
  rng = np.random.default_rng(700 + seed)
  kind = ("flat", "huge", "rank_huge", "nested")[seed % 4]
  doc_lens, s, t = _random_small_layout(rng, kind)
  per_host = int(rng.choice([d for d in range(1, s + 1) if s % d == 0]))
  tol = float(rng.choice([0.0, 0.05, 0.3]))
  options = plan_lib.PlanOptions(tolerance=tol, min_shard=int(rng.integers(1, 6)),
                                 split=("auto", "mirrored", "suffix")[seed % 3],
                                 servers_per_host=per_host, **_SHAPES)
  cap = None
  if seed % 5 == 4:
    blind = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, options=plan_lib.PlanOptions(
        tolerance=tol, min_shard=options.min_shard, **_SHAPES))
    need, first = plan_lib.required_capacity(blind), _initial_needs(doc_lens, s, t)
    cap = plan_lib.Capacity(**{f: max(getattr(need, f), getattr(first, f)) + 2
                               for f in plan_lib.CAP_FIELDS})
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, capacity=cap, options=options)
  _check_plan(plan, tol)
  if cap is not None:
    need = plan_lib.required_capacity(plan)
    assert all(getattr(need, f) <= getattr(cap, f) for f in plan_lib.CAP_FIELDS)
  assert plan.servers_per_host == per_host
  assert plan.link_bytes() == _link_split(plan, per_host)
  assert sum(plan.link_bytes()) == plan.bytes_total
  diag = plan_lib.diagnostics(plan)
  assert (diag["intra_host_bytes"], diag["inter_host_bytes"]) == plan.link_bytes()
  _check_executes(plan, cap, doc_lens, rng)


def _workload_layout(seed: int):
  """A random workload-shaped batch: Pretrain or ProLong lengths scaled to short rows."""
  rng = np.random.default_rng(seed)
  t = int(rng.choice([1024, 4096]))
  per_host, hosts = int(rng.choice([2, 4, 8])), 8
  s = per_host * hosts
  w = ("pretrain", "prolong")[seed % 2]
  doc_lens = WorkloadSampler(w, t, seed=seed, context_length=8 * t).flat_doclens(
      int(rng.integers(0, 50)), s)
  options = dict(tolerance=float(rng.choice([0.0, 0.02, 0.1, 0.3])),
                 min_shard=int(rng.choice([16, 64])))
  return doc_lens, s, t, per_host, options


@pytest.mark.parametrize("seed", range(10))
def test_host_aware_sends_fewer_bytes_between_hosts(seed):
  """On random workload-shaped batches over 8 hosts, the host-aware plan sends no more bytes
  between hosts than the host-blind one and balances as well (within 0.01)."""
  doc_lens, s, t, per_host, options = _workload_layout(seed)
  blind = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                            options=plan_lib.PlanOptions(**options))
  aware = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                            options=plan_lib.PlanOptions(servers_per_host=per_host, **options))
  _check_plan(aware, options["tolerance"])
  assert aware.inter_host_bytes <= blind.link_bytes(per_host)[1]
  assert aware.imbalance_after <= blind.imbalance_after + 0.01


@pytest.mark.parametrize("bad, match", [
    (dict(servers_per_host=3), "servers_per_host=3 must be a positive divisor of num_servers=8"),
    (dict(servers_per_host=0), "servers_per_host=0 must be a positive divisor"),
    (dict(servers_per_host=2.0), "servers_per_host=2.0 must be a positive divisor"),
    (dict(servers_per_host=True), "servers_per_host=True must be a positive divisor"),
    (dict(inter_host_gbps=0.0), "inter_host_gbps=0.0 must be a positive finite rate"),
    (dict(intra_host_gbps=float("inf")), "intra_host_gbps=inf must be a positive finite rate"),
])
def test_bad_host_values(bad, match):
  with pytest.raises(ValueError, match=match):
    plan_lib.schedule([100] * 8, 8, tokens_per_rank=128,
                      options=plan_lib.PlanOptions(min_shard=8, **bad))
  plan = plan_lib.schedule([100] * 8, 8, tokens_per_rank=128,
                           options=plan_lib.PlanOptions(min_shard=8))
  if "servers_per_host" in bad:
    with pytest.raises(ValueError, match=match):
      plan.link_bytes(bad["servers_per_host"])


def test_config_host_keys_reach_the_planner(monkeypatch):
  """attention.distca.servers_per_host and the link rates reach every plan the distca backend
  makes; bad values stop config validation with one line."""
  from distca_jax import backends
  from distca_jax import config as config_lib
  from distca_jax.backends import distca as distca_backend
  from distca_jax.errors import UserError
  c = config_lib.base_config()
  c.attention.distca.servers_per_host = 2
  c.attention.distca.inter_host_gbps = 25.0
  o = distca_backend.Options.from_config(c).plan_options_for(8)
  assert (o.servers_per_host, o.intra_host_gbps, o.inter_host_gbps) == (2, 344.0, 25.0)
  c.attention.distca.servers_per_host = 0  # auto: one process drives every server, one host
  assert distca_backend.Options.from_config(c).plan_options_for(8).servers_per_host is None
  seen = []
  real = plan_lib.schedule

  def spy(*a, **kw):
    seen.append(kw["options"])
    return real(*a, **kw)

  monkeypatch.setattr(plan_lib.spec, "schedule", spy)
  backend = backends.get("distca", servers_per_host=1, inter_host_gbps=10.0, q_heads=4,
                         kv_heads=2, head_dim=16)
  (hp,) = backend.host_plans([[100, 28], [60, 60, 8]], 128)
  assert seen and all((o.servers_per_host, o.inter_host_gbps) == (1, 10.0) for o in seen)
  assert hp.plan.servers_per_host == 1
  c.attention.distca.servers_per_host = -1
  with pytest.raises(UserError, match=r"servers_per_host=-1 must be an int >= 0"):
    config_lib.validate(c)
