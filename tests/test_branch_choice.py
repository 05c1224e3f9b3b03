"""plan.choice: the per-step choice between CAD and the local branch, and the replay's sums."""

import math
import os

import numpy as np
import pytest

from distca_jax.plan import choice
from experiments import branch_replay

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_predicted_faster_cad_is_chosen_beyond_the_margin():
  o = choice.ChoiceOptions(margin=0.02, sigma0=0.0, sigma_min=0.0)
  assert choice.BranchChooser(o).choose(0.8, 1.0).branch == "cad"
  # Faster, but not by the margin: local.
  assert choice.BranchChooser(o).choose(0.99, 1.0).branch == "local"
  assert choice.BranchChooser(o).choose(1.2, 1.0).branch == "local"
  # An infinite CAD price (CAD impossible) is never chosen.
  assert choice.BranchChooser(o).choose(math.inf, 1.0).branch == "local"


def test_the_first_step_needs_the_uncertainty_within_the_budget():
  # Before any measurement CAD must beat local by about sigma0 minus the budget's slack.
  o = choice.ChoiceOptions(margin=0.0, budget=0.01, sigma0=0.05)
  assert choice.BranchChooser(o).choose(0.97, 1.0).branch == "local"
  c = choice.BranchChooser(o).choose(0.9, 1.0)
  assert c.branch == "cad"
  assert c.margin == pytest.approx(0.05 - 0.01 / 0.9)


def test_a_drifting_ratio_is_corrected(seed):
  rng = np.random.default_rng(seed)
  o = choice.ChoiceOptions(margin=0.01, sigma0=0.05, ema=0.3)
  ch = choice.BranchChooser(o)
  # The model prices CAD 10% faster; CAD's measured / predicted ratio drifts from 1.0 to 1.25.
  drift = np.linspace(1.0, 1.25, 40)
  local_after = None
  for k, q in enumerate(drift):
    pc, pl = 0.9 * (1 + 0.01 * rng.standard_normal()), 1.0
    c = ch.choose(pc, pl)
    if c.branch == "cad":
      ch.observe(c, q * pc)
      assert ch.ratio["cad"] == pytest.approx(q, abs=0.06)
    else:
      ch.observe(c, pl)
      local_after = k if local_after is None else local_after
  # Once CAD's corrected price (ratio x 0.9) exceeds local's, the rule stays local.
  assert local_after is not None and drift[local_after] > 1.05
  assert ch.choose(0.9, 1.0).branch == "local"
  assert ch.ratio["local"] == pytest.approx(1.0)


def test_a_branch_ratio_is_not_borrowed():
  ch = choice.BranchChooser(choice.ChoiceOptions(sigma0=0.02, margin=0.0))
  c = ch.choose(0.5, 1.0)
  assert c.branch == "cad"
  ch.observe(c, 0.75)  # CAD 1.5x its price
  assert ch.ratio == {"cad": 1.5, "local": 1.0}
  # CAD's price is now 1.5x the model's and its sigma grew (0.26): 0.6 -> 0.9 x 1.24 > 1.
  c = ch.choose(0.6, 1.0)
  assert c.branch == "local"
  assert ch.sigma == pytest.approx(0.5 * 0.02 + 0.5 * 0.5)
  ch.observe(c, 1.0)
  assert ch.state()["local_steps"] == 1 and ch.state()["cad_steps"] == 1


@pytest.mark.parametrize("budget", [0.0, 0.01])
def test_the_guard_bounds_regret_when_cad_lands_within_sigma(seed, budget):
  """Adversary: CAD steps come in at the edges of what the rule allows, alternately its
  corrected price x (1 + sigma) and x (1 - sigma) (so its ratio stays near the truth and only
  the guard stands between the noise and the regret); the model prices CAD 0-10% faster, local
  as priced. The regret stays under the budget of the elapsed time after every step (0 with a
  zero budget), and the guard did raise the margin."""
  rng = np.random.default_rng(seed)
  o = choice.ChoiceOptions(margin=0.0, budget=budget, sigma0=0.05, sigma_min=0.01)
  ch = choice.BranchChooser(o)
  cad_steps, margins = 0, []
  for _ in range(300):
    pl = float(rng.uniform(0.5, 2.0))
    pc = pl * float(rng.uniform(0.9, 1.0))
    sigma = ch.sigma
    c = ch.choose(pc, pl)
    margins.append(c.margin)
    if c.branch == "cad":
      cad_steps += 1
      ch.observe(c, c.cad_s * (1.0 + sigma if cad_steps % 2 else 1.0 - sigma))
    else:
      ch.observe(c, c.local_s)
    assert ch.regret_s <= o.budget * ch.elapsed_s + 1e-12
  assert cad_steps > 10
  assert max(margins) > o.margin  # the guard was active
  if budget == 0.0:
    assert ch.regret_s == 0.0


def test_the_guard_stops_a_cad_branch_that_always_loses(seed):
  """Adversary outside sigma: the model prices CAD 5-20% faster, CAD always runs 10% slower than
  local. One step teaches the ratio; regret ends far under 1% of a long run."""
  rng = np.random.default_rng(seed)
  ch = choice.BranchChooser()
  for _ in range(200):
    pl = float(rng.uniform(0.8, 1.2))
    c = ch.choose(pl * float(rng.uniform(0.8, 0.95)), pl)
    ch.observe(c, 1.1 * pl if c.branch == "cad" else pl)
  s = ch.state()
  assert s["cad_steps"] <= 2
  assert s["regret_fraction"] < 0.001


def test_bad_input_names_the_value():
  ch = choice.BranchChooser()
  with pytest.raises(ValueError, match="predicted_cad_s=-1"):
    ch.choose(-1, 1.0)
  with pytest.raises(ValueError, match="predicted_local_s=nan"):
    ch.choose(1.0, float("nan"))
  with pytest.raises(ValueError, match="must be the Choice"):
    ch.observe(None, 1.0)
  c = ch.choose(1.0, 1.0)
  with pytest.raises(ValueError, match="measured_s=0"):
    ch.observe(c, 0)
  with pytest.raises(ValueError, match="ema=0"):
    choice.ChoiceOptions(ema=0)
  with pytest.raises(ValueError, match="budget=-0.1"):
    choice.ChoiceOptions(budget=-0.1)


def test_replay_sums_on_a_hand_made_run():
  # Steps: CAD wins the first two (0.8 vs 1.0, 0.7 vs 1.0), loses the third (1.2 vs 1.0).
  cad_t, local_t = [0.8, 0.7, 1.2], [1.0, 1.0, 1.0]
  t = branch_replay.totals(cad_t, local_t, rule_s=0.8 + 0.7 + 1.2)
  assert t["oracle_s"] == pytest.approx(2.5)
  assert t["cad_s"] == pytest.approx(2.7) and t["local_s"] == pytest.approx(3.0)
  assert t["regret"] == pytest.approx(0.2 / 2.5)
  assert t["gain_kept"] == pytest.approx((3.0 - 2.7) / (3.0 - 2.5))
  # The rule with exact predictions: CAD on steps 1-2, local on step 3 (priced slower).
  o = choice.ChoiceOptions(margin=0.0, sigma0=0.0, sigma_min=0.0)
  r = branch_replay.replay_run(cad_t, local_t, cad_t, local_t, o)
  assert r["chosen"] == ["cad", "cad", "local"]
  assert r["rule_s"] == pytest.approx(2.5) and r["regret"] == pytest.approx(0.0)
  assert r["gain_kept"] == pytest.approx(1.0)
  # The rule sees only the chosen branch: CAD priced at half its time on step 1 is learned
  # from step 1's measurement (ratio 2, sigma 0.5): step 2 corrects to 0.7, and with sigma's
  # margin (0.7 x 1.47 > 1.0) runs local; step 3 corrects to 1.2: local.
  r = branch_replay.replay_run(cad_t, local_t, [0.4, 0.35, 0.6], local_t, o)
  assert r["chosen"][0] == "cad" and r["guard"]["ratio_cad"] == pytest.approx(2.0)
  assert r["chosen"][1:] == ["local", "local"]
  # No step where CAD wins: gain kept is undefined.
  assert branch_replay.totals([1.1], [1.0], 1.0)["gain_kept"] is None


PRICE_RUN = {"mesh.data": 4, "mesh.tensor": 2, "num_steps": 5, "log_every": 1,
             "checkpoint_every": 0, "tensorboard": False, "optim.warmup_steps": 1,
             "attention.backend": "distca", "attention.distca.tolerance": 0.0,
             "attention.distca.min_gain": 0.0, "attention.distca.local_gain": 0.0,
             "model.remat": "save_attention", "model.n_kv_heads": 4, "model.n_heads": 8,
             "model.head_dim": 16}


@pytest.mark.slow
def test_price_branch_trains_like_cad_and_logs_each_step(tmp_path, monkeypatch):
  """attention.distca.branch='price' in the real loop: with the rule's choices flipped to
  alternate (so both branches run whatever the CPU's prices say), the losses equal the run that
  sends every batch through CAD (both branches compute exact attention); every step's branch
  and reason is in branches.jsonl, the logged records carry the guard's regret, and the steps
  sent to the local branch are the ones metrics count as local."""
  import dataclasses
  import json
  import os
  from distca_jax import trainer
  from tests.test_train import tiny_config

  cad = [r["loss"] for r in trainer.train_and_evaluate(tiny_config(**PRICE_RUN),
                                                       str(tmp_path / "cad"))]
  real_choose = choice.BranchChooser.choose
  flips = []

  def alternate(self, p_cad, p_local):
    c = real_choose(self, p_cad, p_local)
    flips.append("cad" if len(flips) % 2 else "local")
    return dataclasses.replace(c, branch=flips[-1])

  monkeypatch.setattr(choice.BranchChooser, "choose", alternate)
  workdir = str(tmp_path / "price")
  recs = trainer.train_and_evaluate(
      tiny_config(**PRICE_RUN, **{"attention.distca.branch": "price"}), workdir)
  np.testing.assert_allclose([r["loss"] for r in recs], cad, rtol=2e-5)
  with open(os.path.join(workdir, "branches.jsonl")) as f:
    lines = [json.loads(x) for x in f]
  assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
  moved = [x for x in lines if x["reason"] != "no plan moves a row"]
  assert [x["branch"] for x in moved] == flips and {"cad", "local"} <= set(flips)
  assert all(x["cad_ms"] > 0 and x["local_ms"] > 0 for x in moved)
  # Steps after the first (compiling) one are timed: metrics count the local ones.
  local = [x["branch"] == "local" for x in lines]
  assert [r["local_step_share"] for r in recs[1:]] == [float(v) for v in local[1:]]
  assert all("branch_regret_fraction" in r for r in recs)


def test_price_branch_config_errors():
  from distca_jax import config as config_lib
  from distca_jax.errors import UserError
  from tests.test_train import tiny_config
  with pytest.raises(UserError, match="attention.distca.branch='fast'"):
    config_lib.validate(tiny_config(**{"attention.distca.branch": "fast"}))
  with pytest.raises(UserError, match="needs attention.distca.local_steps=True"):
    config_lib.validate(tiny_config(**{"attention.backend": "distca",
                                       "attention.distca.branch": "price",
                                       "attention.distca.local_steps": False}))


def test_pricer_prices_a_step_as_the_simulator():
  """sim.price.BranchPricer on a batch's host plans (gpu_bench shapes, 4 servers, Pretrain 128K)
  equals the simulator's price of the same batch: packed_dp exactly, CAD with caps sized from
  the run's first 32 batches as the backend sizes them."""
  from distca_jax import config as config_lib
  from distca_jax import configs_io, trainer
  from distca_jax.data import run_source
  from distca_jax.sim import costs, price, step
  c = configs_io.load_config(os.path.join(ROOT, "configs", "gpu_bench.py"), [
      "data.workload=pretrain", "tokens_per_rank=131072", "mesh.data=4", "model.n_layers=2",
      "model.remat=save_attention"])
  be, src = trainer.make_backend(c), run_source(c, 4)
  pr = price.BranchPricer(config_lib.model_config(c), remat="save_attention", nano_batches=1,
                          collective="auto", memory_mode="keep", exchange_buckets=8,
                          device_kind="NVIDIA H200")
  assert pr.era == "h200"
  d = src.doclens(3)
  cad, local = pr.prices(be.host_plans(d, 131072), d, 131072)
  spec = costs.spec_of_model("run", config_lib.model_config(c))
  opts = step.Options(collective="auto", memory_mode="keep", remat="save_attention",
                      local_steps=False)
  kw = dict(cal=pr.cal, km=pr.km, opts=opts)
  sim = step.simulate([[d]], spec, step.Layout(gpus=4), 131072, strategies=("packed_dp",), **kw)
  assert local == pytest.approx(sim["packed_dp"]["step_s"], rel=1e-9)
  sim = step.simulate([[d]], spec, step.Layout(gpus=4), 131072, strategies=("distca",),
                      caps_batches=[[src.doclens(s)] for s in range(32)], **kw)
  assert cad == pytest.approx(sim["distca"]["step_s"], rel=0.01)
  assert cad < local  # Pretrain 128K: CAD priced faster (measured 1.27-1.31x, four/README)


def test_pricer_errors_name_the_setting():
  from distca_jax.model import ModelConfig
  from distca_jax.sim import price
  kw = dict(nano_batches=1, memory_mode="keep", exchange_buckets=8, device_kind="cpu")
  cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128,
                    vocab_size=256)
  with pytest.raises(ValueError, match="collective='ring' is not priced"):
    price.BranchPricer(cfg, remat="full", collective="ring", **kw)
  with pytest.raises(ValueError, match="remat='none'.*branch='gain'"):
    price.BranchPricer(cfg, remat="none", collective="auto", **kw)
  with pytest.raises(FileNotFoundError, match="branch='gain'"):
    price.load_calibration("h100", path="/nonexistent.json")
