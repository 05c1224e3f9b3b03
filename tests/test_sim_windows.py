"""Mixed local / global attention in the simulator (``sim.windows``): windowed pair counts and
key/value rows against brute force, kernel seconds, and steps of a model with window layers."""

import dataclasses

import numpy as np
import pytest

from distca_jax import plan as plan_lib
from distca_jax.sim import costs, step, windows


def _brute_pairs(lo: int, hi: int, w: int) -> int:
  return sum(p + 1 if w == 0 else min(p + 1, w) for p in range(lo, hi))


def test_window_pairs_match_brute_force(seed):
  rng = np.random.default_rng(seed)
  for _ in range(300):
    lo = int(rng.integers(0, 300))
    hi = lo + int(rng.integers(1, 300))
    w = int(rng.choice([0, 1, 2, int(rng.integers(1, 400))]))
    assert int(windows.window_pairs(lo, hi, w)) == _brute_pairs(lo, hi, w), (lo, hi, w)
  lo = rng.integers(0, 500, 64)
  hi = lo + rng.integers(1, 500, 64)
  got = windows.window_pairs(lo, hi, 37)
  assert got.tolist() == [_brute_pairs(a, b, 37) for a, b in zip(lo.tolist(), hi.tolist())]


def _plan(seed: int, s: int = 4, t: int = 64):
  rng = np.random.default_rng(seed)
  lens, total = [], int(rng.integers(s * t // 2, s * t + 1))
  while total > 0:
    n = int(min(total, rng.integers(1, 3 * t)))
    lens.append(n)
    total -= n
  return plan_lib.schedule(lens, s, tokens_per_rank=t,
                           options=plan_lib.PlanOptions(tolerance=0.0, min_shard=2))


def _brute_kv_rows(plan, w: int) -> np.ndarray:
  s, t = plan.num_servers, plan.tokens_per_rank
  need: dict[tuple[int, int], set[int]] = {}
  for doc, a, b, srv in plan.tasks.tolist():
    g = int(plan.doc_starts[doc])
    lo = 0 if w == 0 else max(0, a - w + 1)
    need.setdefault((doc, srv), set()).update(range(g + lo, g + b))
  out = np.zeros((s, s))
  for (_, srv), rows in need.items():
    for x in rows:
      if x // t != srv:
        out[x // t, srv] += 1
  return out


@pytest.mark.parametrize("w", [0, 1, 5, 16, 40, 1000])
def test_window_kv_rows_match_brute_force(seed, w):
  for k in range(4):
    plan = _plan(seed + k)
    assert (windows.window_kv_rows(plan, w) == _brute_kv_rows(plan, w)).all()
  # A window no shorter than every document reads what a global layer reads.
  assert (windows.window_kv_rows(plan, 10**6) == plan.pair_kv_rows).all()


def test_window_seconds():
  km, dims = costs.KernelModel(), costs.model_spec("llama3_8b").dims
  lo = np.array([0, 100, 1000, 5000, 30000, 0])
  hi = np.array([64, 3000, 9000, 5100, 60000, 100000])
  glob = km.task_seconds(hi - lo, hi, dims)
  assert np.array_equal(windows.window_task_seconds(km, lo, hi, 0, dims), glob)
  # A window as long as the documents is global attention.
  np.testing.assert_allclose(windows.window_task_seconds(km, lo, hi, 10**6, dims), glob,
                             rtol=1e-12)
  w = windows.window_task_seconds(km, lo, hi, 1024, dims)
  assert (w <= glob * (1 + 1e-12)).all() and (w[hi > 2048] < glob[hi > 2048]).all()
  # Seconds follow the pairs at a fixed shape: the long task's windowed work is ~ its rows x w.
  ratio = windows.window_pairs(30000, 60000, 1024) / plan_lib.pairs(30000, 60000)
  assert ratio < 0.05 and w[4] < 0.2 * glob[4]


def test_layer_types_checked_and_spec_keeps_them():
  spec = costs.model_spec("llama3_8b")
  assert spec.attention_layers == ()
  mixed = dataclasses.replace(spec, attention_layers=((5, 1024), (1, 0)))
  assert mixed.with_layers(4).attention_layers == ((5, 1024), (1, 0))
  assert windows.layer_fractions(mixed.attention_layers) == [(5 / 6, 1024), (1 / 6, 0)]
  for bad in (((0, 1024),), ((1, -1),), ((1.5, 2),), (("a", 1),), ((1,),)):
    with pytest.raises(ValueError, match="attention_layers entry"):
      dataclasses.replace(spec, attention_layers=bad)
  with pytest.raises(ValueError, match="packed_dp and distca only"):
    step.run_cp([[100], [200]], 256, mixed, costs.KernelModel(), 2)


def test_steps_with_window_layers():
  spec = costs.model_spec("llama3_8b", n_layers=6)
  lay, t = step.Layout(gpus=4), 32768
  batches = step.sample_batches("prolong", t, lay, 2, seed=1)
  opts = step.Options(min_gain=0.0, local_gain=0.0)
  sim = lambda sp: step.simulate(batches, sp, lay, t, opts=opts,
                                 strategies=("packed_dp", "distca"))
  glob = sim(spec)
  # Explicit all-global layer types price exactly as the default.
  same = sim(dataclasses.replace(spec, attention_layers=((3, 0),)))
  for k in ("packed_dp", "distca"):
    assert same[k]["step_s"] == glob[k]["step_s"]
  mixed = sim(dataclasses.replace(spec, attention_layers=((5, 1024), (1, 0))))
  for k in ("packed_dp", "distca"):
    g, m = glob[k]["per_rank_s"], mixed[k]["per_rank_s"]
    assert np.sum(m["attention"]) < np.sum(g["attention"])
    assert m["linear"] == g["linear"]
  # distca's window layers move fewer key/value rows: less exchange time.
  assert np.max(mixed["distca"]["per_rank_s"]["exchange"]) < np.max(
      glob["distca"]["per_rank_s"]["exchange"])


def test_mixed_attention_experiment_row():
  from experiments import mixed_attention_sim as mas
  cal = costs.Calibration()
  r = mas.run_row("llama3_8b", "prolong", 4, 1, 32768, 1, cal, costs.KernelModel(),
                  step.Options(min_gain=0.0, local_gain=0.0))
  g, m, w = r["global"], r["mixed"], r["mixed_local"]
  assert w["attention_layers"] == m["attention_layers"]
  assert m["attention_layers"] == [[5, 1024], [1, 0]] and g["attention_layers"] == []
  assert m["packed_dp_attention_s"] < g["packed_dp_attention_s"]
  for x in (g, m, w):
    assert x["gain"] == pytest.approx(x["packed_dp_s"] / x["distca_s"])
  md = mas._markdown({"command": "c", "commit": "x", "date": "d", "machine": "m", "batches": 1,
                      "rows": [r]})
  assert md[-1].startswith("| prolong | 4 (1) | 4 | 32K |")


def test_window_layers_local():
  spec = dataclasses.replace(costs.model_spec("llama3_8b", n_layers=6),
                             attention_layers=((1, 512),))
  lay, t = step.Layout(gpus=4), 16384
  batches = step.sample_batches("prolong", t, lay, 1, seed=2)
  opts = step.Options(min_gain=0.0, local_gain=0.0, window_layers_local=True)
  res = step.simulate(batches, spec, lay, t, opts=opts, strategies=("packed_dp", "distca"))
  p, d = res["packed_dp"]["per_rank_s"], res["distca"]["per_rank_s"]
  # Every layer a window layer run locally: packed_dp's attention, no exchange, no dispatch.
  np.testing.assert_allclose(d["attention"], p["attention"], rtol=1e-12)
  assert not np.any(d["exchange"]) and not np.any(d["dispatch"])
  # Mixed: the global layers' share of the exchange and dispatch.
  mixed = dataclasses.replace(spec, attention_layers=((5, 512), (1, 0)))
  run = lambda local: step.simulate(
      batches, mixed, lay, t, opts=dataclasses.replace(opts, window_layers_local=local),
      strategies=("distca",))["distca"]["per_rank_s"]
  on, off = run(True), run(False)
  np.testing.assert_allclose(on["dispatch"], np.asarray(off["dispatch"]) / 6, rtol=1e-12)
  assert 0 < np.max(on["exchange"]) < np.max(off["exchange"])
