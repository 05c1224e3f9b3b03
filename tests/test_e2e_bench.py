"""experiments/e2e_bench.py's derived numbers (speedups, fraction of the bound, twin ratios, loss
agreement) and its balance ceiling, on hand-made results."""

import pytest

from distca_jax.model import ModelConfig
from experiments import e2e_bench


def _run(backend, step_ms, nano=1, losses=(5.0, 4.0), ceiling=1.2, workload="pretrain",
         tokens_per_s=None):
  return dict(workload=workload, tokens=65536, backend=backend, nano_batches=nano,
              step_ms_median=step_ms, losses=list(losses), ceiling=ceiling,
              tokens_per_s=tokens_per_s or 1e8 / step_ms)


def test_derive_ratios_and_twins():
  res = [_run("packed_dp", 1200.0),
         _run("distca", 1000.0, losses=(5.0, 4.01), tokens_per_s=1e8 / 1200.0 * 1.1),
         _run("distca+signal", 980.0, losses=(5.0, 4.5)),
         _run("packed_dp+pingpong", 1150.0, nano=2), _run("distca+pingpong", 900.0, nano=2),
         _run("packed_dp", 800.0, workload="prolong", ceiling=1.0),
         dict(workload="pretrain", tokens=65536, backend="wlb", error="boom")]
  e2e_bench.derive(res)
  dp, ca, sig, _, ca_pp, prolong, _ = res
  assert ca["speedup_vs_packed_dp"] == pytest.approx(1.2)
  assert ca["fraction_of_bound_gain"] == pytest.approx(1.0)  # (1.2 - 1) / (1.2 - 1)
  # The mean-based twin (total time over the batches, like the ceiling): its own numbers.
  assert ca["tokens_per_s_ratio"] == pytest.approx(1.1)
  assert ca["fraction_of_bound_gain_tokens"] == pytest.approx(0.5)
  assert ca["max_loss_diff_vs_packed_dp"] == pytest.approx(0.01)
  assert ca["step_over_signal_only"] == pytest.approx(1000.0 / 980.0)
  assert sig["max_loss_diff_vs_packed_dp"] == pytest.approx(0.5)
  # Ping-pong rows compare with the ping-pong baseline and with their single-stream twin.
  assert ca_pp["speedup_vs_packed_dp"] == pytest.approx(1150.0 / 900.0)
  assert ca_pp["pingpong_speedup"] == pytest.approx(1000.0 / 900.0)
  assert dp["speedup_vs_packed_dp"] == pytest.approx(1.0)
  assert prolong["fraction_of_bound_gain"] is None  # ceiling 1: no gain to take
  assert prolong["fraction_of_bound_gain_tokens"] is None


def test_ceiling_is_max_over_mean_of_step_work():
  cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32)
  # One step, two ranks with the same tokens: the ceiling is set by attention (sum l^2) alone.
  balanced = e2e_bench.ceiling(cfg, [[[[4, 4]], [[4, 4]]]])
  skewed = e2e_bench.ceiling(cfg, [[[[8]], [[1] * 8]]])
  assert balanced == pytest.approx(1.0)
  assert skewed > 1.0
  # Identical work on every rank in every step is never above 1, whatever the lengths.
  assert e2e_bench.ceiling(cfg, [[[[3, 5]], [[5, 3]]], [[[7]], [[7]]]]) == pytest.approx(1.0)
  # By hand, in the shared work model: 6 N per token, 4 x 3.5 Hq D per causal pair and layer.
  from distca_jax import metrics
  n = metrics.matmul_params(cfg)
  work = [6 * n * 8 + 14 * 2 * 8 * p for p in (8 * 9 / 2, 8 * 1)]
  assert skewed == pytest.approx(max(work) / (sum(work) / 2))
  # The LM head's share of MFU's FLOPs over every row of every step.
  share = e2e_bench.lm_head_share(cfg, [[[[8]], [[1] * 8]], [[[4, 4]], [[2]]]])
  assert share == pytest.approx(6 * 16 * 64 * 26 / metrics.step_flops(cfg, [8] + [1] * 8 + [4, 4, 2]))


def test_pipeline_ceiling_is_per_tick_with_bubble_slots_as_servers():
  """Under a pipeline the bound is sum over ticks of the slowest slot over the sum of the mean
  slot; a bubble slot computes the linear layers on its empty rows and can take attention."""
  from distca_jax import metrics
  cfg = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32)
  t = 8
  # 2 stages, 2 microbatches of one row on one data rank, both rows [8]: ticks hold (mb0, -),
  # (mb1, mb0), (-, mb1); every tick's slowest slot is lin + att, its mean (lin + att) or
  # (2 lin + att) / 2.
  lin = float(metrics.work_flops(metrics.matmul_params(cfg), 2, 2, 8, t, 0))
  att = float(metrics.work_flops(metrics.matmul_params(cfg), 2, 2, 8, 0, t * (t + 1) / 2))
  got = e2e_bench.ceiling(cfg, [[[[t], [t]]]], stages=2, microbatches=2, tokens_per_row=t)
  assert got == pytest.approx(3 * (lin + att) / (3 * lin + 2 * att))
  # One stage is the data-parallel bound, whatever the keyword arguments.
  assert e2e_bench.ceiling(cfg, [[[[t]], [[t]]]], tokens_per_row=t) == pytest.approx(1.0)
  with pytest.raises(ValueError, match="tokens_per_row"):
    e2e_bench.ceiling(cfg, [[[[t], [t]]]], stages=2, microbatches=2)
  # Per stage (pool_stages=False) with one data rank per stage nothing can move: 1. With two data
  # ranks, rank 0's rows [8] and rank 1's [1] x 8 (attention a), every tick's slowest slot is
  # lin + att and the balanced tick its busy stage's mean, lin + (att + a) / 2.
  assert e2e_bench.ceiling(cfg, [[[[t], [t]]]], stages=2, microbatches=2, tokens_per_row=t,
                           pool_stages=False) == pytest.approx(1.0)
  a = float(metrics.work_flops(metrics.matmul_params(cfg), 2, 2, 8, 0, t))
  two = [[[[t], [t]], [[1] * t, [1] * t]]]
  per_stage = e2e_bench.ceiling(cfg, two, stages=2, microbatches=2, tokens_per_row=t,
                                pool_stages=False)
  assert per_stage == pytest.approx((lin + att) / (lin + (att + a) / 2))
  assert 1.0 < per_stage < e2e_bench.ceiling(cfg, two, stages=2, microbatches=2,
                                             tokens_per_row=t)


def test_per_batch_bound_on_rebuilt_batches(seed):
  """per_batch_bound rebuilds a run's batches from its overrides (the recorded ceiling must
  match), and its 'best of both' and 'gate' ratios follow from the per-batch step times."""
  import numpy as np
  from experiments import per_batch_bound as pbb
  from distca_jax import config as config_lib
  over = ["data.workload=prolong", "tokens_per_rank=4096", "model.n_layers=2",
          "attention.backend=packed_dp", "rows_per_rank=1", "model.dim=256", "model.mlp_dim=512",
          "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=64", "model.vocab_size=1024"]
  steps, devices, fixed = 6, 2, 0.01
  c, doclens = pbb.batch_doclens(pbb.parse_args(["x"]).config, over, devices, 2, steps)
  ceiling = e2e_bench.ceiling(config_lib.model_config(c), doclens)
  rng = np.random.default_rng(seed)
  packed = list(rng.uniform(100, 200, steps))
  distca = [p * f for p, f in zip(packed, rng.uniform(0.8, 1.1, steps))]
  ca_over = [x.replace("=packed_dp", "=distca") for x in over]
  run = lambda name, ms: dict(
      workload="prolong", tokens=4096, devices=devices, backend=name, step_ms_all=ms,
      overrides=over if name == "packed_dp" else ca_over, ceiling=ceiling)
  # Each batch's predicted gain, from the planner the gate runs (one plan per batch here).
  from distca_jax import trainer
  c_ca = pbb.batch_doclens(pbb.parse_args(["x"]).config, ca_over, devices, 2, 1)[0]
  c_ca.mesh.data, c_ca.attention.distca.min_gain = devices, 0.0
  backend = trainer.make_backend(c_ca)
  gains = [backend.host_plans([r for rank in b for r in rank], 4096)[0].plan.predicted_gain
           for b in doclens]
  mid = float(np.median(gains))
  for min_gain in (0.0, 10.0, mid):  # never gate, always gate, the batches below the median
    rec = pbb.analyse(run("packed_dp", packed), run("distca", distca), fixed,
                      pbb.parse_args(["x"]).config, 2, min_gain)
    assert rec["ceiling"] == pytest.approx(ceiling)
    assert rec["measured_ratio"] == pytest.approx(sum(packed) / sum(distca))
    best = sum(min(d, p * (1 + fixed)) for p, d in zip(packed, distca))
    assert rec["best_of_both_ratio"] == pytest.approx(sum(packed) / best)
    gated = [g < min_gain for g in gains]
    assert [b["gated"] for b in rec["batches"]] == gated
    assert rec["gated_batches"] == sum(gated)
    assert rec["gate_ratio"] == pytest.approx(
        sum(packed) / sum(p * (1 + fixed) if g else d for p, d, g in zip(packed, distca, gated)))
  assert 0 < sum(g < mid for g in gains) < steps  # the middle case gates some batches only
  with pytest.raises(ValueError, match="ceiling"):
    bad = dict(run("packed_dp", packed), ceiling=ceiling + 0.1)
    pbb.analyse(bad, run("distca", distca), fixed, pbb.parse_args(["x"]).config, 2, 0.0)


def test_per_batch_bound_checks_batches_by_mfu_flops():
  """A run that recorded MFU is matched by its MFU FLOPs (a convention independent of the
  ceiling's work model); a run without MFU by its recorded ceiling."""
  from experiments import per_batch_bound as pbb
  from distca_jax import metrics
  cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32)
  doclens = [[[[8]], [[1] * 8]], [[[4, 4]], [[2, 6]]]]
  ms = [10.0, 20.0]
  flops = sum(metrics.step_flops(cfg, [r for rank in s for r in rank]) for s in doclens)
  mfu = flops / 0.03 / (989e12 * 2)
  ceiling = e2e_bench.ceiling(cfg, doclens)
  run = dict(device="NVIDIA H200", devices=2, step_ms_all=ms, mfu=mfu, ceiling=ceiling + 0.5)
  pbb.check_rebuilt(run, cfg, doclens, ceiling)  # the stale ceiling is not what is checked
  with pytest.raises(ValueError, match="MFU"):
    pbb.check_rebuilt(dict(run, mfu=mfu * 1.01), cfg, doclens, ceiling)
  with pytest.raises(ValueError, match="ceiling"):
    pbb.check_rebuilt(dict(devices=2, ceiling=ceiling + 0.5), cfg, doclens, ceiling)


def test_backend_overrides_are_options_not_config_keys():
  """``backend.KEY=VALUE`` items (a variant's signal-only twin) become backend options with
  parsed values; config overrides are left to the config."""
  got = e2e_bench.backend_overrides(["attention.distca.tolerance=0", "backend.signal_only=true",
                                     "backend.collective=dense", "backend.tolerance=0.5",
                                     "backend.cost_table=results/x.json"])
  assert got == {"signal_only": True, "collective": "dense", "tolerance": 0.5,
                 "cost_table": "results/x.json"}


@pytest.mark.slow
def test_pipeline_runs_train_with_default_rows_and_report_pipeline_ceilings(tmp_path):
  """Under `--extra mesh.pipe=2` the benchmark picks one row per microbatch by default, both
  backends train, the ceiling is the pipeline's, and the distca plan stats are per tick."""
  out = str(tmp_path / "e2e")
  e2e_bench.main(["--tiny", "--backends", "distca,packed_dp", "--workloads", "pretrain",
                  "--tokens", "256", "--layers", "2", "--steps", "1", "--warmup", "1",
                  "--extra", "mesh.pipe=2", "--plan-stats", "--out", out])
  import json
  res = json.load(open(out + ".json"))["results"]
  assert [r["backend"] for r in res] == ["distca", "packed_dp"], res
  for r in res:
    assert "error" not in r, r
    assert "rows_per_rank=4" in r["overrides"], r["overrides"]  # M = 2 x pipe microbatches
    assert r["ceiling"] >= 1.0
  assert res[0]["ceiling"] == res[1]["ceiling"]  # the same batches
  assert 0.0 <= res[0]["plan_moved"] <= 1.0
  assert res[0]["plan_imbalance_after"] <= res[0]["plan_imbalance_before"] + 1e-9


def test_tiny_defaults_to_cpu_sized_rows():
  """`--tiny` alone runs CPU-sized rows (the GPU default, 64K and 128K tokens, needs 0.3-3.6 TB
  per fake CPU device with the tiny config's dense kernel); `--tokens` still wins."""
  assert e2e_bench.parse_args(["--tiny"]).tokens == "1024"
  assert e2e_bench.parse_args(["--tiny", "--tokens", "256"]).tokens == "256"
  assert e2e_bench.parse_args([]).tokens == "65536,131072"


def test_plan_stats_report_after_equal_to_before_when_no_plan_moves(seed):
  """`--plan-stats` on the same batches: plans gated by min_gain move nothing and report
  after = before, moved 0 and no useful dispatch bytes; ungated plans move rows and end no
  worse than before."""
  import os

  from distca_jax import configs_io, trainer
  from distca_jax.data import make_source
  c = configs_io.load_config(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "configs", "tiny_cpu.py"))
  data, rows = 4, 2
  c.mesh.data, c.rows_per_rank, c.seed = data, rows, seed
  c.attention.backend = "distca"
  c.attention.distca.caps_from_batches = 4
  c.attention.distca.tolerance = 0.05
  src = make_source(c.data, rows=data * rows, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  c.attention.distca.min_gain = 0.0
  c.attention.distca.local_gain = 0.0
  free = trainer.make_backend(c)
  # Batches the balancer has work on, so the ungated plans must move rows.
  steps = [s for s in range(60) if free.host_plans(src.doclens(s), c.tokens_per_rank)[0]
           .plan.imbalance_before > 1.2][:3]
  assert steps, f"no imbalanced batch in 60 (seed={seed})"
  per_step = [e2e_bench.rows_by_rank(src.doclens(s), data, rows) for s in steps]
  moving = e2e_bench.plan_stats(c, free, per_step)
  assert moving["plan_moved"] > 0 and moving["plan_dispatch_useful_mb"] > 0, moving
  assert moving["plan_imbalance_after"] < moving["plan_imbalance_before"], moving
  c.attention.distca.min_gain = 1e9  # above any predicted step gain: every plan is gated
  still = e2e_bench.plan_stats(c, trainer.make_backend(c), per_step)
  assert still["plan_moved"] == 0 and still["plan_dispatch_useful_mb"] == 0, still
  assert still["plan_imbalance_after"] == still["plan_imbalance_before"], still
  assert still["plan_imbalance_before"] == moving["plan_imbalance_before"], (still, moving)


def test_replan_plans_each_nano_batch_of_the_timed_batches(tmp_path):
  """experiments.replan: the timed batches' plans per (workload, nano-batches), one plan per
  nano-batch per step; per-step bytes are the per-plan mean times the plans per step; the table
  has a row per record."""
  from experiments import replan
  a = replan.parse_args(["--config", "configs/tiny_cpu.py", "--workloads", "pretrain",
                         "--tokens", "256", "--rows-per-rank", "2", "--nano-batches", "1,2",
                         "--warmup", "1", "--steps", "3", "--out", str(tmp_path / "replan")])
  records = replan.replan(a)
  assert [(r["nano_batches"], r["plans_per_step"]) for r in records] == [(1, 1.0), (2, 2.0)]
  for r in records:
    assert r["plan_count"] == 3 * r["nano_batches"], r
    assert r["plan_imbalance_after"] <= r["plan_imbalance_before"] + 1e-9, r
    assert r["useful_mb_per_step"] == pytest.approx(r["plan_dispatch_useful_mb"]
                                                    * r["nano_batches"])
  replan.write(a, records)
  rows = [l for l in (tmp_path / "replan.md").read_text().splitlines() if l.startswith("| pretrain")]
  assert len(rows) == 2


def test_replan_rejects_a_negative_device_count():
  from experiments import replan
  with pytest.raises(SystemExit):
    replan.parse_args(["--devices", "-1"])
