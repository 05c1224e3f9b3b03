"""The simulator prices capacity buckets as the host chooses them (``sim.step.bucket_capacity``)."""

from __future__ import annotations

import pytest

from distca_jax import plan as plan_lib
from distca_jax.plan.buckets import bucket_capacities
from distca_jax.plan.capacity import CAP_FIELDS
from distca_jax.sim import costs, step


def _fits(need, cap):
  return all(getattr(need, f) <= getattr(cap, f) for f in CAP_FIELDS)


@pytest.mark.parametrize("workload", ["pretrain", "prolong"])
def test_bucket_capacity_is_the_smallest_bucket_the_plan_fits(seed, workload):
  t = 16384
  lay = step.Layout(gpus=4)
  batches = step.sample_batches(workload, t, lay, 6, seed=seed)
  plans = [plan_lib.schedule(mb, 4,
                             tokens_per_rank=t, options=plan_lib.PlanOptions(tolerance=0.05))
           for b in batches for mb in b]
  caps = step.distca_caps(plans, t, 1.1)
  picked = set()
  for p in plans:
    need = plan_lib.required_capacity(p)
    assert step.bucket_capacity(caps, p, 1, t) == caps
    got = step.bucket_capacity(caps, p, 4, t)
    ladder = bucket_capacities(caps, 4, t)
    assert got in ladder and _fits(need, got), (seed, need, got)
    k = ladder.index(got)
    assert k == 0 or not _fits(need, ladder[k - 1]), (seed, need, ladder[k - 1])
    picked.add(k)
  assert picked != {len(bucket_capacities(caps, 4, t)) - 1}, f"seed {seed}: every plan in the last"


def test_buckets_lower_the_priced_dispatch_and_nothing_else(seed):
  spec = costs.model_spec("llama3_8b", n_layers=2)
  lay, t = step.Layout(gpus=4), 16384
  batches = step.sample_batches("prolong", t, lay, 4, seed=seed)
  sizing = step.sample_batches("prolong", t, lay, 16, seed=seed + 1)  # caps from other batches
  cal, km = costs.Calibration(), costs.KernelModel()
  run = lambda n: step.simulate(batches, spec, lay, t, cal=cal, km=km, strategies=("distca",),
                                opts=step.Options(buckets=n, local_steps=False, min_gain=0.0),
                                caps_batches=sizing)["distca"]
  one, four = run(1), run(4)
  assert four["caps"] == one["caps"] and four["memory_gb"] == one["memory_gb"]  # the largest
  assert all(a <= b + 1e-12 for a, b in zip(four["step_s_per_batch"], one["step_s_per_batch"]))
  assert four["step_s"] < one["step_s"], (seed, four["step_s"], one["step_s"])


def test_buckets_refused_below_one():
  with pytest.raises(ValueError, match="buckets"):
    step.Options(buckets=0)
