"""The step simulator (distca_jax.sim): hand-computed steps, imbalance, pipeline bubbles, memory,
the shared work model, WLB-ideal's choice and the replays of committed measurements."""

import dataclasses
import json

import numpy as np
import pytest

from distca_jax import metrics
from distca_jax import plan as plan_lib
from distca_jax.baselines import ideal
from distca_jax.baselines import metrics as bm
from distca_jax.model import ModelConfig
from distca_jax.sim import costs, step, validate


def _flat_table() -> costs.KernelModel:
  """One grid point: every task is clamped to it and scaled by its causal pairs, so a task
  costs exactly 1 ns per pair (hand computation is easy)."""
  return costs.KernelModel(plan_lib.CostTable.from_arrays([64], [64], [[64 * 65 / 2 * 1e-9]]))


def _cal(**kw) -> costs.Calibration:
  return dataclasses.replace(costs.Calibration(matmul_tflops=500.0, step_fixed_s=0.0,
                                               attention_scale=1.0), **kw)


def test_one_gpu_step_matches_hand_computation():
  spec = costs.model_spec("llama3_8b", n_layers=2)
  km, cal = _flat_table(), _cal(step_fixed_s=0.01)
  t = 4096
  docs = [1000, 3000]
  res = step.simulate([[[docs]]], spec, step.Layout(gpus=1), t, cal=cal, km=km,
                      strategies=("packed_dp",))["packed_dp"]
  d = spec.dims
  linear = 6.0 * t * (2 * d.layer_matmul_params * cal.remat_factor + spec.head_params) / 500e12
  attn = 2 * sum(l * (l + 1) / 2 * 1e-9 for l in docs)
  assert res["step_s"] == pytest.approx(0.01 + linear + attn, rel=1e-6)
  assert res["fits_memory"]


def test_more_imbalance_means_longer_packed_dp_steps():
  spec = costs.model_spec("llama3_8b", n_layers=2)
  km, cal, lay, t = _flat_table(), _cal(), step.Layout(gpus=2), 8192
  balanced = [[[[4096, 4096], [4096, 4096]]]]
  skewed = [[[[8192], [1024] * 8]]]
  # No gate: the skewed batch's gain is below the default's (its step would be packed_dp's).
  sim = lambda b: step.simulate(b, spec, lay, t, cal=cal, km=km,
                                opts=step.Options(min_gain=0.0, local_gain=0.0),
                                strategies=("packed_dp", "distca"))
  bal, skw = sim(balanced), sim(skewed)
  assert skw["packed_dp"]["step_s"] > bal["packed_dp"]["step_s"]
  assert skw["packed_dp"]["attention_imbalance"] > bal["packed_dp"]["attention_imbalance"]
  # CAD balances the skewed batch: faster than packed_dp there, no worse than the ideal split.
  assert skw["distca"]["step_s"] < skw["packed_dp"]["step_s"]
  assert skw["distca"]["attention_imbalance"] < 1.05


@pytest.mark.parametrize("stages,micro", [(1, 4), (2, 4), (4, 8), (8, 3)])
def test_pipeline_bubble_matches_formula(stages, micro):
  u = 0.25
  total = costs.pipeline_seconds(np.full(micro, u), stages)
  busy = micro * u
  assert 1 - busy / total == pytest.approx(costs.pipeline_bubble_fraction(stages, micro))
  # step_seconds: the slowest rank of a sync group sets each micro-batch's stage time.
  per = np.full((micro, 4), u)
  per[:, 1] = 2 * u
  assert step.step_seconds(per, 4, stages) == pytest.approx(2 * (micro + stages - 1) * u)
  # Without a pipeline, independent ranks (group 1) accumulate their own micro-batches.
  assert step.step_seconds(per, 1, 1) == pytest.approx(2 * micro * u)


def test_layout_and_bubble_errors():
  with pytest.raises(ValueError, match="multiple of tensor"):
    step.Layout(gpus=12, tensor=8)
  with pytest.raises(ValueError, match="micro_batches"):
    costs.pipeline_bubble_fraction(2, 0)
  with pytest.raises(ValueError, match="unknown model"):
    costs.model_spec("gpt2")


def test_memory_that_does_not_fit_is_reported():
  spec = costs.model_spec("llama3_8b")
  cal = costs.Calibration()
  small = costs.memory_bytes(spec, cal, tokens=32768, layers=32, tp=8, pp=1)
  big = costs.memory_bytes(spec, cal, tokens=1 << 20, layers=32, tp=1, pp=1)
  assert small["fits"] and not big["fits"]
  assert big["total"] == pytest.approx(big["state"] + big["activations"])


def test_shared_work_model_counts_attention_at_3_5x_forward():
  cfg = ModelConfig(vocab_size=64, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32)
  docs = [5, 7]
  n = metrics.matmul_params(cfg)
  pairs = sum(l * (l + 1) / 2 for l in docs)
  by_hand = 6 * n * 12 + 3 * 4 * 3.5 * 2 * 8 * pairs
  assert metrics.step_work(cfg, docs) == pytest.approx(by_hand)
  dims = bm.ModelDims.from_model(cfg)
  assert float(costs.step_work(dims, 12, pairs)) == pytest.approx(by_hand)
  # The gate's weight: one token's linear work in pairs of the same model.
  assert metrics.linear_pairs_per_token(cfg) == pytest.approx(6 * n / (3 * 4 * 3.5 * 2 * 8))
  assert costs.linear_pairs_per_token(dims) == pytest.approx(metrics.linear_pairs_per_token(cfg))
  # MFU keeps its convention (3x forward), so it counts less attention than the work model.
  assert metrics.step_flops(cfg, docs) < metrics.step_work(cfg, docs)
  share = metrics.lm_head_share(cfg, docs)
  assert share == pytest.approx(6 * 16 * 64 * 12 / metrics.step_flops(cfg, docs))


def test_wlb_ideal_picks_the_best_fitting_candidate():
  rng = np.random.default_rng(0)
  t, ranks = 4096, 4
  batches = []
  for _ in range(2):
    rows = []
    for _ in range(ranks):
      lens = list(rng.integers(64, 2048, 6))
      while sum(lens) > t:
        lens.pop()
      rows.append([int(x) for x in lens])
    batches.append(rows)
  dims = costs.model_spec("llama3_8b", n_layers=2).dims
  ch = ideal.choose_wlb(batches, t, dims, alphas=(1.0, 1.5))
  fits = [c for c in ch.candidates if c[3]]
  assert ch.layer_seconds == pytest.approx(min(c[2] for c in fits))
  assert {c[0] for c in ch.candidates} == {1, 2, 4}
  capped = ideal.choose_wlb(batches, t, dims, alphas=(1.0, 1.5), max_row_tokens=t)
  assert capped.alpha == 1.0
  with pytest.raises(ValueError, match="no wlb candidate"):
    ideal.choose_wlb(batches, t, dims, alphas=(1.5,), max_row_tokens=t)


def test_alpha_beta_fit_recovers_parameters():
  mb = [10.0, 100.0, 400.0]
  ms = [0.2 + x * 1e6 / 250e9 * 1e3 for x in mb]
  lat, bw = costs.fit_alpha_beta(mb, ms)
  assert lat == pytest.approx(2e-4) and bw == pytest.approx(250e9)


@pytest.fixture(scope="module")
def validation():
  return validate.validate()


def test_validation_replays_committed_runs(validation):
  cases = validation["cases"]
  kinds = {c["kind"] for c in cases}
  assert kinds == {"e2e", "kernel", "exchange", "speedup", "memory"}
  held = [c for c in cases if c["role"] == "held-out" and c["within_10pct"]]
  assert len(held) >= 4
  # Every 2-GPU end-to-end run is a held-out case of its era.
  two_gpu = [c for c in cases if c["kind"] == "e2e" and "2 GPU" in c["name"]]
  assert two_gpu and all(c["role"] == "held-out" for c in two_gpu)
  # Measured 2-GPU speedups of distca are predicted from one-GPU calibration alone.
  speedups = [c for c in cases if c["kind"] == "speedup"]
  assert len(speedups) >= 4 and all(c["within_10pct"] for c in speedups)
  assert validation["max_abs_error"] == max(abs(c["error"]) for c in cases)


def test_wlb_choice_takes_the_fastest_candidate_that_fits_memory(seed):
  """fastest_that_fits walks the candidates fastest predicted first, estimating each one's need
  at its own task slots, and takes the first within the capacity; the faster ones it skipped are
  reported as excluded for memory; none fitting is one line naming the least needs."""
  rng = np.random.default_rng(seed)
  cands = [(c, a, float(rng.uniform(1, 2)), True) for c in (1, 2, 4) for a in (1.0, 1.2)]
  cands.append((8, 1.0, 0.5, False))  # over the token cap: never tried
  need = {(c, a): int(rng.integers(50, 100)) << 30 for c, a, _, _ in cands}
  choice = ideal.WlbChoice(0, 0.0, 0.0, tuple(cands))
  order = ideal.ranked(choice)
  assert [x[0] for x in order if x[0] == 8] == [] and len(order) == 6
  cap = need[order[2][:2]]  # the third fastest fits exactly; make the first two not fit
  for x in order[:2]:
    need[x[:2]] = cap + (1 << 30)
  calls = []
  tasks_fn = lambda c, a: 8 * c
  need_fn = lambda c, a, t: calls.append((c, a, t)) or need[(c, a)]
  got = ideal.fastest_that_fits(choice, tasks_fn, need_fn, cap)
  assert (got.cp_size, got.alpha, got.layer_seconds) == order[2][:3], seed
  assert got.tasks_per_row == 8 * got.cp_size and got.capacity_bytes == cap
  assert calls == [(c, a, 8 * c) for c, a, _, _ in order[:3]]
  assert [m[:2] for m in got.excluded_for_memory()] == [x[:2] for x in order[:2]]
  assert got.memory[-1][3] <= cap
  # No capacity: the fastest, sized, nothing estimated.
  free = ideal.fastest_that_fits(choice, tasks_fn, need_fn, None)
  assert (free.cp_size, free.alpha) == order[0][:2] and free.memory == ()
  with pytest.raises(ValueError, match=r"no wlb configuration fits .*cp_size=\d wlb_alpha="):
    ideal.fastest_that_fits(choice, tasks_fn, need_fn, 1)


@pytest.mark.slow
def test_wlb_need_is_the_compiled_step_and_excludes_what_does_not_fit(monkeypatch):
  """aot.baseline_need_bytes compiles a flash3 wlb step on the CPU with the kernel's shape-only
  stand-in: its workspace is FA3's backward accumulators at the configuration's rows, key buffer
  and task slots (memory.flash3_bwd_workspace_bytes); and the backend's choice, given a capacity just under the fastest candidate's need, takes another one
  that fits and reports the fastest as excluded."""
  import os
  import jax
  from custom_ops import flash3_attention as fa3
  from distca_jax import aot, choose, configs_io, memory
  from distca_jax import config as config_lib
  from distca_jax import baselines
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), [
      "attention.backend=wlb", "attention.kernel=flash3", "model.head_dim=128", "model.dim=256",
      "model.n_heads=2", "model.n_kv_heads=1", "model.dtype=bfloat16", "model.n_layers=2",
      "mesh.data=4", "rows_per_rank=1", "attention.baselines.cp_size=0",
      "attention.baselines.wlb_alpha=1", "attention.baselines.memory_gib=0"])
  devices = jax.devices()[:4]
  need = aot.baseline_need_bytes(c, "wlb", 2, 1.0, 24, devices=devices)
  with fa3.shape_only():
    v = config_lib.with_overrides(c, {"attention.baselines.cp_size": 2,
                                      "attention.baselines.wlb_alpha": 1.0,
                                      "attention.baselines.wlb_tasks_per_row": 24})
    _, info = aot.compile_train_step(v, devices=devices)
  t = c.tokens_per_rank
  assert info["kernel_workspace_bytes"] == memory.flash3_bwd_workspace_bytes(t, 3 * t, 2, 1, 128,
                                                                             24)
  assert need == info["need_per_device_bytes"] > info["kernel_workspace_bytes"] > 0
  # The tables grow the workspace by 128 rows per slot.
  assert aot.baseline_need_bytes(c, "wlb", 2, 1.0, 32, devices=devices) > need
  # CP 1, 2, 4 at alpha 1. A tiny model's time model ranks CP 1 first, which also needs the
  # least memory; ranked here by CP, largest first (the largest key buffers, the most memory),
  # so the walk must skip the fastest.
  real = ideal.choose_wlb

  def by_cp(*a, **kw):
    ch = real(*a, **kw)
    return dataclasses.replace(ch, candidates=tuple((x[0], x[1], 1.0 / x[0], x[3])
                                                    for x in ch.candidates))

  monkeypatch.setattr(ideal, "choose_wlb", by_cp)
  monkeypatch.setattr(baselines, "_CHOICES", {})  # the choice memo: nothing from other tests
  choice = ideal.wlb_choice_from_config(c)
  assert ideal.ranked(choice)[0][0] == 4, choice.candidates
  first = aot.baseline_need_bytes(c, "wlb", 4, 1.0, choice.tasks_per_row, devices=devices)
  c.attention.baselines.memory_gib = (first - 1) / 2**30
  got = choose.baseline_choice(c, "wlb")
  assert got.memory[0][:2] == (4, 1.0) and got.memory[0][3] == first > got.capacity_bytes
  assert got.cp_size in (1, 2) and got.memory[-1][3] <= got.capacity_bytes
  assert [m[:2] for m in got.excluded_for_memory()] == [m[:2] for m in got.memory[:-1]]


def test_wlb_ideal_from_config_reaches_the_backend():
  """attention.baselines.cp_size = wlb_alpha = 0: the wlb backend takes choose_wlb's pick on the
  batches the run never trains on (steps from num_steps on)."""
  import os
  from distca_jax import configs_io, trainer
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), [
      "attention.backend=wlb", "attention.baselines.cp_size=0", "attention.baselines.wlb_alpha=0",
      "mesh.data=4"])
  opts = ideal.wlb_choice_from_config(c)
  assert 4 % opts.cp_size == 0 and opts.alpha in ideal.DEFAULT_ALPHAS
  from distca_jax.backends import wlb
  options = wlb.from_first_batches(c, wlb.Options.from_config(c))
  assert (options.cp_size, options.alpha) == (opts.cp_size, opts.alpha)
  assert trainer.make_backend(c).host_arrange is not None
  # A field given stays as given.
  c.attention.baselines.cp_size = 2
  assert ideal.wlb_choice_from_config(c).cp_size == 2


def test_cli_writes_every_strategy(tmp_path):
  import json
  from experiments import simulate
  out = tmp_path / "sim.json"
  simulate.main(["--gpus", "8", "--tensor", "2", "--tokens", "16384", "--batches", "1",
                 "--workload", "prolong", "--json", str(out)])
  blob = json.loads(out.read_text())
  assert set(blob["strategies"]) == set(step.STRATEGIES)
  for s in blob["strategies"].values():
    assert s["step_s"] > 0 and len(s["per_rank_step_s"]) == 4
  assert blob["speedup_vs_packed_dp"] == pytest.approx(
      blob["strategies"]["packed_dp"]["step_s"] / blob["strategies"]["distca"]["step_s"])


def test_every_task_pays_the_fitted_time():
  base = _flat_table()
  km = costs.KernelModel(base.table, task_s=1e-3)
  dims = costs.model_spec("llama3_8b").dims
  q, kv = np.array([10, 32, 100]), np.array([40, 64, 200])
  extra = km.task_seconds(q, kv, dims) - base.task_seconds(q, kv, dims)
  np.testing.assert_allclose(extra, [1e-3, 1e-3, 1e-3])  # below, on and beyond the grid's 64
  # The fit: the measured excess over the table per task of the fitted ('own') tables.
  tables = [dict(table="own", q=q, kv=kv, measured_s=float(base.task_seconds(q, kv, dims).sum())
                 + 6e-3), dict(table="cad", q=q, kv=kv, measured_s=1.0)]
  assert validate.fit_task_seconds(tables, base) == pytest.approx(2e-3)


def test_memory_fit_recovers_per_token_bytes():
  spec2, spec4 = (costs.model_spec("llama3_8b", n_layers=n) for n in (2, 4))
  base = costs.Calibration()
  fixed, layer = 150e3, 60e3

  def run(layers, rows, spec):
    gb = (spec.total_params * base.state_bytes_per_param
          + rows * 65536 * (fixed + layers * layer)) / 1e9
    return validate.E2eRun("x", "pretrain", "packed_dp", 65536, layers, rows, 1, (0,), 1.0, 1.0,
                           (), gb)

  cal = validate.fit_memory([run(2, 1, spec2), run(2, 2, spec2), run(4, 2, spec4)], base)
  assert cal.act_bytes_per_token_fixed == pytest.approx(fixed)
  assert cal.act_bytes_per_token_layer == pytest.approx(layer)


def test_results_path_follows_archived_moves(tmp_path):
  root = tmp_path / "results"
  (root / "archive" / "abc").mkdir(parents=True)
  (root / "cur.json").write_text("{}")
  (root / "archive" / "abc" / "old_v1.json").write_text("{}")
  (root / "archive" / "moves.tsv").write_text(
      "old_path\tnew_path\nresults/old_v1.json\tresults/archive/abc/old_v1.json\n"
      "results/old_v2.json\tresults/cur.json\n")
  assert validate.results_path("cur", str(root)) == str(root / "cur.json")
  assert validate.results_path("old_v1", str(root)) == str(root / "archive" / "abc" / "old_v1.json")
  assert validate.results_path("old_v2", str(root)) == str(root / "cur.json")
  with pytest.raises(FileNotFoundError, match="nope"):
    validate.results_path("nope", str(root))


def test_wlb_kernel_check_rows_and_imbalance(tmp_path):
  """experiments/wlb_kernel_check: per-rank rows of the backend's real packing, positive
  predictions equal to the simulator's own packing, imbalance from the rows (tiny, CPU)."""
  from experiments import wlb_kernel_check as wkc
  res = wkc.main(["--tiny", "--workloads", "prolong", "--steps", "1",
                  "--out", str(tmp_path / "w")])
  (w,) = res["workloads"]
  assert (tmp_path / "w.json").exists() and (tmp_path / "w.md").exists()
  assert [r["rank"] for r in w["rows"]] == list(range(res["ranks"]))
  for r in w["rows"]:
    assert r["predicted_ms"] > 0 and r["measured_call_ms"] > 0
    assert r["sim_step_ms"] == pytest.approx(r["predicted_ms"], rel=1e-9)
    assert r["error_call"] == pytest.approx(r["predicted_ms"] / r["measured_call_ms"] - 1)
  # WLB moves documents between ranks; every token of the batch's full rows is placed once.
  assert sum(r["tokens"] for r in w["rows"]) == res["ranks"] * res["tokens"]
  (b,) = w["batches"]
  meas = [r["measured_call_ms"] for r in w["rows"]]
  pred = [r["predicted_ms"] for r in w["rows"]]
  assert b["measured_call_imbalance"] == pytest.approx(max(meas) / np.mean(meas))
  assert b["predicted_imbalance"] == pytest.approx(max(pred) / np.mean(pred))
  assert res["summary"]["prolong"]["max_abs_error_call"] == pytest.approx(
      max(abs(r["error_call"]) for r in w["rows"]))


def test_wlb_kernel_check_times_both_flash3_launch_shapes(tmp_path):
  """With kernel 'flash3' every rank is timed as the backend calls it and with tight bounds
  (here a stand-in timer: seconds = pairs x 1 ns, 2x that for the backend's call)."""
  from experiments import wlb_kernel_check as wkc
  a = wkc.parse_args(["--tiny"])
  a.kernel = "flash3"
  calls = []

  def fake(cq, ck, nq, nkv, model_cfg, kernel, iters, tight):
    calls.append(tight)
    assert kernel == "flash3" and cq[-1] <= nq and ck[-1] <= nkv
    return (1 if tight else 2) * plan_lib.attention_pairs(cq, ck) * 1e-9 + 1e-6

  km = _flat_table()
  w = wkc.check_workload(a, "pretrain", km, measure=fake)
  assert calls.count(True) == calls.count(False) == a.ranks * a.steps
  for r in w["rows"]:
    assert r["measured_call_ms"] > r["measured_tight_ms"] > 0
    assert r["error_tight"] == pytest.approx(r["predicted_ms"] / r["measured_tight_ms"] - 1)
  assert wkc.tight_bounds(np.array([0, 100, 700]), np.array([0, 100, 1500])) == (1024, 2048)
  # --validate replays a committed result: per batch, the busiest rank predicted vs measured.
  path = tmp_path / "wlb_kernel_check.json"
  path.write_text(json.dumps({"workloads": [w]}))
  cases = validate.wlb_kernel_cases(km, str(path))
  assert len(cases) == a.steps and all(c["role"] == "held-out" for c in cases)
  for c, b in zip(cases, w["batches"]):
    assert c["predicted_s"] == pytest.approx(b["predicted_max_ms"] / 1e3)
    assert c["measured_s"] == pytest.approx(b["measured_call_max_ms"] / 1e3)
  assert validate.wlb_kernel_cases(km, str(tmp_path / "absent.json")) == []


def test_remat_full_reruns_the_attention_forward_and_keeps_layer_inputs():
  spec = costs.model_spec("llama3_8b", n_layers=16)
  km, cal, t = _flat_table(), _cal(), 8192
  docs = [[[[2000, 6192]]]]
  run = lambda remat: step.simulate(docs, spec, step.Layout(gpus=1), t, cal=cal, km=km,
                                    strategies=("packed_dp",),
                                    opts=step.Options(remat=remat))["packed_dp"]
  sa, full = run("save_attention"), run("full")
  attn = 16 * sum(l * (l + 1) / 2 * 1e-9 for l in (2000, 6192))
  # One more forward of the kernel: forward = (forward + backward) / (1 + BWD_FWD_RATIO).
  assert full["step_s"] - sa["step_s"] == pytest.approx(attn / (1 + plan_lib.BWD_FWD_RATIO))
  assert full["per_rank_s"]["linear"] == sa["per_rank_s"]["linear"]
  # 'full' keeps each layer's input (E bf16 values per token) and one layer's activations.
  act = lambda r: r["memory_gb"]["activations"] * 1e9
  assert act(full) == pytest.approx(
      t * (16 * 4096 * 2 + cal.act_bytes_per_token_layer + cal.act_bytes_per_token_fixed))
  assert act(sa) == pytest.approx(
      t * (16 * cal.act_bytes_per_token_layer + cal.act_bytes_per_token_fixed))
  with pytest.raises(ValueError, match="not modelled"):
    step.Options(remat="save_dots")


def test_validation_explains_every_miss(validation):
  misses = [c for c in validation["cases"] if not c["within_10pct"]]
  assert all(c["note"] != validate.UNEXPLAINED for c in misses), [c["name"] for c in misses]
  # Notes are attached by a case's full name only: none left over for a case that passes.
  assert validation["stale_notes"] == [] and validation["unexplained"] == []
  assert all(c["note"] == validate.MISS_NOTES[c["kind"], c["name"]] for c in misses)
  # Keyed by kind too: an e2e case and a memory case of one run share a name, and a note
  # reaches only the miss of its own kind.
  named = [c for c in validation["cases"] if (c["kind"], c["name"]) in validate.MISS_NOTES]
  assert all(c.get("note") == validate.MISS_NOTES[c["kind"], c["name"]] for c in named)
  # Current code on 4 GPUs: held-out step, speedup and memory cases.
  assert validation["four_gpu_current_cases"] >= 8
  # The 16-layer one-GPU steps (remat 'save_attention' at 64K, 'full' at 128K) are held out.
  sixteen = [c for c in validation["cases"] if c["kind"] == "e2e" and "16 layers" in c["name"]]
  assert len(sixteen) == 4
  assert all(c["role"] == "held-out" and c["within_10pct"] for c in sixteen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_wire_bytes_equal_the_data_planes_block_choice(seed):
  """The simulator's wire bytes of the dense exchange use the block the data plane picks from
  its own routes (the largest group any device sends), on random plans."""
  from distca_jax.dataplane import exchange
  rng = np.random.default_rng(seed)
  s, t = 4, 2048
  docs = []
  for _ in range(s):
    lens = list(rng.integers(16, 1024, 8))
    while sum(lens) > t:
      lens.pop()
    docs.append([int(x) for x in lens])
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1,
                           capacity=plan_lib.resolve_capacity(None, t))
  hp = plan_lib.host_plan(docs, spec, plan_lib.PlanOptions(tolerance=0.02, min_shard=None))
  cap, dims = spec.capacity, costs.model_spec("llama3_8b").dims
  for buckets in (1, 3, 8):
    for part, full in (("q", min(cap.q_send, cap.q_recv)), ("kv", min(cap.kv_send, cap.kv_recv))):
      routes = getattr(hp.meta, f"{part}_routes")  # [S, 6, S] what each device's exchange reads
      sizes = exchange.dense_block_rows(full, buckets)
      need = int(routes[:, 1, :].max())  # lax.pmax over devices of max(routes[1])
      b = sizes[int(exchange.dense_block_index(sizes, need))] if len(sizes) > 1 else sizes[0]
      assert b >= need, (seed, part, buckets)
      pair = hp.plan.pair_q_rows if part == "q" else hp.plan.pair_kv_rows
      assert exchange.dense_wire_rows(pair, full, buckets) == s * b, (seed, part, buckets)
    wire = step.exchange_wire_bytes(hp.plan, cap, dims, "dense", buckets)
    bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
    want = (step.Q_EXCHANGES * exchange.dense_wire_rows(hp.plan.pair_q_rows, min(
        cap.q_send, cap.q_recv), buckets) * bq + step.KV_EXCHANGES * exchange.dense_wire_rows(
            hp.plan.pair_kv_rows, min(cap.kv_send, cap.kv_recv), buckets) * dims.kv_row_bytes)
    np.testing.assert_allclose(wire, want, err_msg=f"seed {seed}")
  # 'ragged' puts the useful rows on the wire: at most the dense bytes.
  ragged = step.exchange_wire_bytes(hp.plan, cap, dims, "ragged", 8)
  assert np.all(ragged <= step.exchange_wire_bytes(hp.plan, cap, dims, "dense", 8) + 1e-6)


def test_layout_picker_says_when_nothing_fits(monkeypatch, capsys):
  """No layout fits: the picker raises NoLayoutFits; the command prints its one line on stderr
  and exits 2 (the docstring's contract); a large memory fits the first layout."""
  from experiments import simulate
  # No gate: a gated distca keeps its buffers at their smallest, and wlb's budget is distca's need.
  argv = ["--gpus", "2", "--tokens", "8192", "--batches", "1", "--min-gain", "0"]
  a = simulate.parse_args(argv)
  km = _flat_table()
  with pytest.raises(simulate.NoLayoutFits, match="no layout of 2 GPUs fits every strategy"):
    simulate.pick_layout(a, _cal(hbm_bytes=1e9), km)
  monkeypatch.setattr(simulate, "calibration", lambda _: (_cal(hbm_bytes=1e9), km))
  capsys.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    simulate.main(argv)
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert err.startswith("error: no layout of 2 GPUs fits every strategy") and err.count("\n") == 1
  r = simulate.pick_layout(a, _cal(hbm_bytes=1e15), km)
  assert r["fits_every_strategy"] and r["layout"]["tensor"] * r["layout"]["pipe"] == 1


def test_wlb_ideal_is_chosen_on_other_batches(monkeypatch):
  """Every wlb candidate is scored on the selection batches; the scored batches see only the
  chosen setting; bound fractions are bound / step."""
  spec = costs.model_spec("llama3_8b", n_layers=2)
  lay, t = step.Layout(gpus=4), 8192
  scored = step.sample_batches("pretrain", t, lay, 1, seed=3)
  select = step.sample_batches("pretrain", t, lay, 2, seed=4)
  seen = []
  real = step.run_wlb
  monkeypatch.setattr(step, "run_wlb", lambda rows, *a: seen.append((rows, a[-2:])) or real(
      rows, *a))
  res = step.simulate(scored, spec, lay, t, cal=_cal(), km=_flat_table(),
                      strategies=("packed_dp", "wlb", "distca"), select_batches=select)
  on_scored = [cfg for rows, cfg in seen if rows is scored[0][0]]
  assert on_scored == [(res["wlb"]["cp"], res["wlb"]["alpha"])]
  assert res["wlb"]["chosen_on"] == "2 other batches"
  assert res["wlb"]["memory_gb"]["total"] <= res["distca"]["memory_gb"]["total"] + 1e-9
  for r in res.values():
    assert r["bound_fraction"] == pytest.approx(r["balance_bound_s"] / r["step_s"])


def test_pooled_ticks_plan_every_stage_together():
  batch = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 micro-batches x 2 data ranks
  ticks = step.tick_rows(batch, 2)
  assert ticks == [[[1], [2], [], []], [[3], [4], [1], [2]], [[5], [6], [3], [4]],
                   [[], [], [5], [6]]]
  spec = costs.model_spec("llama3_8b", n_layers=4)
  lay, t = step.Layout(gpus=4, pipe=2, micro_batches=4), 4096
  res = step.simulate(step.sample_batches("pretrain", t, lay, 1), spec, lay, t, cal=_cal(),
                      km=_flat_table(), strategies=("packed_dp", "distca"))
  assert res["distca"]["pooled_ticks"] and res["distca"]["servers"] == 4
  assert len(res["distca"]["per_rank_step_s"]) == 4


def test_e2e_bench_wlb_choice_never_sees_trained_batches(monkeypatch):
  import os
  from distca_jax import configs_io
  from distca_jax.data import synthetic
  from experiments import e2e_bench
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  over = e2e_bench.choice_overrides("wlb", ["attention.backend=wlb", "mesh.data=4",
                                           "num_steps=5"])
  assert "attention.baselines.cp_size=0" in over and "attention.baselines.wlb_alpha=0" in over
  c = configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), over)
  steps = []
  real = synthetic.SyntheticSource.doclens
  monkeypatch.setattr(synthetic.SyntheticSource, "doclens",
                      lambda self, s: steps.append(s) or real(self, s))
  w = e2e_bench.baseline_config(c, over)
  assert steps and min(steps) >= 5, steps
  assert 4 % w["cp_size"] == 0 and w["cp_size"] <= ideal.MAX_CP_SIZE and w["alpha"] >= 1.0
  assert "never trained or timed" in w["how"]
  # A CP size given stays as given and is named.
  fixed = e2e_bench.choice_overrides("wlb", over[:-2] + ["attention.baselines.cp_size=2"])
  c2 = configs_io.load_config(os.path.join(root, "configs", "tiny_cpu.py"), fixed)
  w2 = e2e_bench.baseline_config(c2, fixed)
  assert w2["cp_size"] == 2 and "cp_size given" in w2["how"]


def _four_gpu_distca(collective="auto", memory_mode="keep", gpus=4, **cal_kw):
  spec = costs.model_spec("llama3_8b", n_layers=2)
  lay, t = step.Layout(gpus=gpus), 16384
  batches = step.sample_batches("pretrain", t, lay, 1, seed=5)
  # No gate: the exchange's pricing is checked on a plan that moves rows.
  opts = step.Options(collective=collective, memory_mode=memory_mode, nano_batches=1,
                      min_gain=0.0, local_gain=0.0)
  cal = _cal(**cal_kw)
  res = step.simulate(batches, spec, lay, t, cal=cal, km=_flat_table(), opts=opts,
                      strategies=("distca",))["distca"]
  mr = step.run_distca(batches[0][0], t, spec, _flat_table(), opts)
  return res, mr.plan, spec, cal


def test_remote_exchange_is_priced_by_useful_bytes_at_its_measured_rate():
  """One host: 'auto' is 'remote', whose wire is the busiest device's useful rows (each row
  once) at ``remote_*``; priced as the dense exchange the same plan costs more."""
  res, plan, spec, cal = _four_gpu_distca()
  assert res["collective"] == "remote" and res["collective_asked"] == "auto"
  assert "priced_as_remote" not in res
  d = spec.dims
  bq = d.q_heads * d.head_dim * d.dtype_bytes
  q = np.maximum(plan.pair_q_rows.sum(0), plan.pair_q_rows.sum(1))
  kv = np.maximum(plan.pair_kv_rows.sum(0), plan.pair_kv_rows.sum(1))
  useful = 4 * q * bq + 2 * kv * d.kv_row_bytes  # Q, O, dO, dQ; K/V, dK/dV
  assert useful.max() > 0, "the sampled plan moves no rows"
  want = d.n_layers * (6 * cal.remote_latency_s + useful.max() / cal.remote_bw)
  np.testing.assert_allclose(res["per_rank_s"]["exchange"], want, rtol=1e-9)
  assert res["wire_bytes_per_layer_mb"] == pytest.approx(useful.max() / 1e6)
  dense, *_ = _four_gpu_distca("dense")
  assert dense["collective"] == "dense"
  assert dense["wire_bytes_per_layer_mb"] > res["wire_bytes_per_layer_mb"]
  assert max(dense["per_rank_s"]["exchange"]) > max(res["per_rank_s"]["exchange"])
  # Memory: the capped-total buffers only; 'dense' adds its S-sized blocks on top.
  assert "dense_blocks" not in res["memory_gb"] and dense["memory_gb"]["dense_blocks"] > 0
  assert dense["memory_gb"]["total"] == pytest.approx(
      res["memory_gb"]["total"] + dense["memory_gb"]["dense_blocks"])


def test_resend_keeps_less_and_sends_q_and_kv_once_more():
  keep, plan, spec, cal = _four_gpu_distca(memory_mode="keep")
  resend, *_ = _four_gpu_distca(memory_mode="resend")
  assert resend["memory_mode"] == "resend"
  assert resend["memory_gb"]["server_buffers_kept"] < keep["memory_gb"]["server_buffers_kept"]
  assert step.exchange_counts("resend") == (5, 3) and step.exchange_counts("keep") == (4, 2)
  assert resend["per_rank_s"]["exchange"][0] > keep["per_rank_s"]["exchange"][0]
  # 'auto' is the pre-flight's rule: 'keep' with 4% of the device spare, else 'resend'.
  from distca_jax.trainer import AUTO_KEEP_SPARE
  need = keep["memory_gb"]["total"] * 1e9
  roomy, *_ = _four_gpu_distca(memory_mode="auto", hbm_bytes=need / (1 - AUTO_KEEP_SPARE) * 1.001)
  tight, *_ = _four_gpu_distca(memory_mode="auto", hbm_bytes=need / (1 - AUTO_KEEP_SPARE) * 0.999)
  assert (roomy["memory_mode"], tight["memory_mode"]) == ("keep", "resend")
  with pytest.raises(ValueError, match="memory_mode='lean'"):
    step.Options(memory_mode="lean")


def test_remote_rate_is_fitted_on_the_committed_exchange_bench():
  rows = validate.remote_exchange_rows()
  fit = [r for r in rows if r["role"] == "fit"]
  assert len(fit) == 2 and len(rows) > len(fit)
  cal = validate.exchange_calibration(costs.Calibration())
  for r in fit:  # two sizes, two parameters: the line passes through both
    assert cal.remote_latency_s + r["useful"] / cal.remote_bw == pytest.approx(r["remote_s"])
  # The defaults in ``Calibration`` are this fit (rounded).
  assert costs.Calibration().remote_bw == pytest.approx(cal.remote_bw, rel=0.01)
  assert costs.Calibration().remote_latency_s == pytest.approx(cal.remote_latency_s, rel=0.01)


def test_ragged_exchange_is_priced_by_its_largest_group():
  """XLA's ragged all-to-all lasts as long as its largest (sender, server) group: per exchange
  ``ragged_latency_s`` + that group's bytes / ``ragged_bw``, whatever the other groups hold."""
  res, plan, spec, cal = _four_gpu_distca("ragged")
  assert res["collective"] == "ragged"
  d = spec.dims
  bq = d.q_heads * d.head_dim * d.dtype_bytes
  largest = 4 * plan.pair_q_rows.max() * bq + 2 * plan.pair_kv_rows.max() * d.kv_row_bytes
  assert largest > 0, "the sampled plan moves no rows"
  assert step.ragged_group_bytes(plan, d) == pytest.approx(largest)
  want = d.n_layers * (6 * cal.ragged_latency_s + largest / cal.ragged_bw)
  np.testing.assert_allclose(res["per_rank_s"]["exchange"], want, rtol=1e-9)
  # Smaller groups beside the largest cost nothing more.
  other = dataclasses.replace(plan, pair_q_rows=np.minimum(plan.pair_q_rows,
                                                           plan.pair_q_rows.max()))
  other.pair_q_rows[other.pair_q_rows == 0] = 1
  np.fill_diagonal(other.pair_q_rows, 0)
  assert step.ragged_group_bytes(other, d) == pytest.approx(largest)


def test_ragged_line_is_fitted_on_replanned_groups_and_holds_the_probe():
  """The ragged latency is the probe's call that moves nothing; its rate is fitted on the
  4 x H100 rows with their groups replanned (the replanned busiest bytes equal the recorded
  ones, checked inside); every probe pattern is predicted within 5%."""
  rows = validate.four_exchange_rows()
  probe = validate.ragged_probe_rows()
  assert rows and all(0 < r["largest_group"] <= r["useful"] for r in rows)
  assert [r["role"] for r in probe].count("fit") == 1
  lat, bw = validate.ragged_fit(rows, probe)
  assert lat == pytest.approx(next(r["ragged_s"] for r in probe if r["role"] == "fit"))
  for r in probe:
    assert lat + r["largest_group"] / bw == pytest.approx(r["ragged_s"], rel=0.05), r["name"]
  # The busiest device's bytes do not set the time: two rows with more useful bytes run faster.
  by_useful = sorted(rows, key=lambda r: r["useful"])
  assert any(a["ragged_s"] > b["ragged_s"] for a, b in zip(by_useful, by_useful[1:]))
  with pytest.raises(ValueError, match="moves no rows"):
    validate.ragged_fit(rows, [r for r in probe if r["role"] != "fit"])


def test_exchange_bench_groups_refuse_another_plan():
  import json as _json
  import os
  with open(os.path.join(validate.RESULTS, validate.FOUR_EXCHANGE_LOG)) as f:
    row = next(_json.loads(x) for x in f if x.startswith("{"))
  row = dict(row, q_busiest_mb=row["q_busiest_mb"] + 1.0)
  with pytest.raises(ValueError, match="no longer makes the plan"):
    validate.exchange_bench_groups(row)


def test_collective_cases_are_means_of_runs_of_one_device(monkeypatch):
  rows = validate.collective_rows("held-out")
  assert rows and all(len(r["samples_ms"]) == 6 for r in rows)
  assert all(r["mean_s"] == pytest.approx(np.mean(r["samples_ms"]) / 1e3) for r in rows)
  monkeypatch.setitem(validate.COLLECTIVE_RUNS, "held-out",
                      ["collective_bench", "collective_bench_h100/default_1"])
  with pytest.raises(ValueError, match="mixes devices"):
    validate.collective_rows("held-out")


@pytest.mark.parametrize("cp_size,alpha", [(1, 1.2), (2, 1.0)])
def test_wlb_memory_keeps_the_key_buffer_as_built(seed, cp_size, alpha):
  """cp / wlb memory: every layer keeps the backend's key buffer, task_tables' default
  (cp + 1) x the row's slots (the lane's gathered K/V plus the row's own), and FA3's backward
  workspace reads that many key rows."""
  from distca_jax.baselines import packing
  from distca_jax.memory import flash3_bwd_workspace_bytes
  spec = costs.model_spec("llama3_8b", n_layers=2)
  lay, t = step.Layout(gpus=4), 8192
  rows = step.sample_batches("pretrain", t, lay, 1, seed=seed % 1000)[0][0]
  mr = step.run_wlb(rows, t, spec, _flat_table(), cp_size, alpha)
  mem = step.strategy_memory([mr], spec, _cal(), lay, t, alpha=alpha)
  lmax = bm.wlb_row_tokens(alpha, t)
  kv_rows = packing.task_tables(packing.wlb_placement(packing.wlb_pack(
      [x for r in rows for x in r], 4 // cp_size, cp_size, lmax, spec.dims.balance_len)),
      max_tasks=4096)["kv_index"].shape[1]
  assert kv_rows == (cp_size + 1) * lmax
  d = spec.dims
  assert mem["group_kv_kept"] == pytest.approx(2 * kv_rows * d.kv_row_bytes), seed
  assert mem["kernel_workspace"] == pytest.approx(flash3_bwd_workspace_bytes(
      lmax, kv_rows, d.q_heads, d.kv_heads, d.head_dim, 128))


def test_per_stage_ticks_plan_each_stage_on_its_data_ranks():
  batch = [[[1], [2]], [[3], [4]], [[5], [6]]]  # 3 micro-batches x 2 data ranks
  # Tick-major, one row set per (tick, stage); a bubble stage holds empty rows.
  assert step.tick_rows(batch, 2, pooled=False) == [
      [[1], [2]], [[], []], [[3], [4]], [[1], [2]], [[5], [6]], [[3], [4]], [[], []], [[5], [6]]]
  spec = costs.model_spec("llama3_8b", n_layers=4)
  lay, t = step.Layout(gpus=4, pipe=2, micro_batches=4), 4096
  batches = step.sample_batches("pretrain", t, lay, 1)
  opts = step.Options(pool_stages=False, nano_batches=1)
  res = step.simulate(batches, spec, lay, t, cal=_cal(), km=_flat_table(), opts=opts,
                      strategies=("distca",))["distca"]
  assert not res["pooled_ticks"] and res["servers"] == 2
  # A tick lasts as long as its slowest stage plan; the LM head runs once after the scan.
  secs = [step.rank_seconds(step.run_distca(rows, t, spec, _flat_table(), opts), spec, _cal(),
                            lay, dataclasses.replace(opts, collective="remote",
                                                     memory_mode="keep"), t,
                            plan_lib.Capacity(**res["caps"]))
          for rows in step.tick_rows(batches[0], 2, pooled=False)]
  ticks = sum(max(secs[i]["layers_total"].max(), secs[i + 1]["layers_total"].max())
              for i in range(0, len(secs), 2))
  head = lay.micro_batches * secs[0]["lm_head"].max() / lay.pipe
  assert res["step_s"] == pytest.approx(ticks + head, rel=1e-9)


def test_pipeline_memory_holds_embedding_and_head_on_every_stage():
  spec, cal = costs.model_spec("llama3_8b", n_layers=4), _cal()
  d = spec.dims
  outside = spec.total_params - d.n_layers * d.layer_matmul_params  # embedding, head, norms
  t, m = 32768, 4
  pipe = costs.memory_bytes(spec, cal, tokens=t, layers=2, tp=1, pp=2, in_flight=m + 1,
                            micro_batches=m)
  assert pipe["state"] == pytest.approx((2 * d.layer_matmul_params + outside)
                                        * cal.state_bytes_per_param)
  # Every tick's layer activations are kept; the head's run once on the rank's M micro-batches
  # split over the stages.
  assert pipe["activations"] == pytest.approx(
      t * (m + 1) * 2 * cal.act_bytes_per_token_layer + t * m / 2 * cal.act_bytes_per_token_fixed)
  flat = costs.memory_bytes(spec, cal, tokens=t, layers=4, tp=1, pp=1, micro_batches=m)
  assert flat["state"] == pytest.approx(spec.total_params * cal.state_bytes_per_param)
  assert flat["activations"] == pytest.approx(
      t * (4 * cal.act_bytes_per_token_layer + cal.act_bytes_per_token_fixed))


def test_dispatch_is_priced_over_the_capped_buffers():
  res, plan, spec, cal = _four_gpu_distca(memory_mode="keep")
  caps, d = plan_lib.Capacity(**res["caps"]), spec.dims
  bq = d.q_heads * d.head_dim * d.dtype_bytes
  want = (4 * (caps.q_send + caps.q_recv) * bq + 2 * (caps.kv_send + caps.kv_recv)
          * d.kv_row_bytes)
  assert step.dispatch_buffer_bytes(caps, d, "keep") == pytest.approx(want)
  assert step.dispatch_buffer_bytes(caps, d, "resend") == pytest.approx(
      want + (caps.q_send + caps.q_recv) * bq + (caps.kv_send + caps.kv_recv) * d.kv_row_bytes)
  assert res["per_rank_s"]["dispatch"] == pytest.approx([2 * want / cal.dispatch_bw] * 4)
  # Half the rate, twice the seconds; one server moves nothing.
  slow, *_ = _four_gpu_distca(memory_mode="keep", dispatch_bw=cal.dispatch_bw / 2)
  assert slow["per_rank_s"]["dispatch"][0] == pytest.approx(2 * res["per_rank_s"]["dispatch"][0])
  one, *_ = _four_gpu_distca(memory_mode="keep", gpus=1)
  assert one["per_rank_s"]["dispatch"] == [0.0]


def test_replayed_runs_read_the_pipeline_wlb_choice_and_last_override():
  (pd, dist, per) = validate.load_runs("four/raw/s4/e2e_4gpu_4d_pretrain")
  # e2e_bench's rows_per_rank=1 comes first, the run's --extra rows_per_rank=4 last (it wins).
  assert (pd.rows_per_rank, pd.pipe, pd.micro_batches, pd.data) == (4, 2, 4, 2)
  assert dist.override("attention.distca.pool_stages", "true") == "true"
  assert per.override("attention.distca.pool_stages", "true") == "false"
  # The micro-batches the trainer's pipeline plans per tick (plan.ticks.tick_rows).
  from distca_jax.data.synthetic import SyntheticSource
  from distca_jax.plan import ticks
  src = SyntheticSource("pretrain", rows=8, tokens_per_row=32768, vocab_size=2, seed=0)
  (batch,) = validate.run_batches(pd, [pd.steps[0]])
  assert step.tick_rows(batch, 2) == ticks.tick_rows(src.doclens(pd.steps[0]), stages=2,
                                                     rows_per_rank=4, microbatches=4)
  wlb = {r.workload: (r.wlb_cp, r.wlb_alpha)
         for r in validate.load_runs("four/raw/s4/e2e_4gpu_128k_wlb")}
  assert wlb == {"pretrain": (4, 1.0), "prolong": (2, 1.0)}
  opts = validate._options(validate.load_runs("four/raw/s4/e2e_4gpu_128k_wlb")[0], "h100")
  assert (tuple(opts.cp_sizes), tuple(opts.wlb_alphas)) == ((4,), (1.0,))


def test_four_gpu_runs_of_every_strategy_are_held_out_cases(validation):
  s4 = [c for c in validation["cases"] if "four/raw/s4/" in c["name"]]
  e2e = {c["backend"] for c in s4 if c["kind"] == "e2e"}
  assert {"packed_dp", "wlb", "cp", "distca", "distca+perstage", "distca+pingpong"} <= e2e
  assert all(c["role"] == "held-out" for c in s4)
  over_packed = {c["name"].split(": ")[2].split(" over")[0] for c in s4
                 if c["kind"] == "speedup" and "over packed_dp" in c["name"]}
  assert {"wlb", "cp", "distca", "distca+perstage"} <= over_packed
  assert any(c["kind"] == "memory" and "4d_pretrain" in c["name"] for c in s4)
  assert validation["gate_met"] == all(c["within_10pct"] for c in validation["cases"])
  # One dispatch rate for every era, fitted on the profiles (not on a case's timed steps).
  rates = {c["dispatch_bw"] for c in validation["calibrations"].values()}
  km, _ = validate.kernel_model()
  base = validate.fit_memory([r for s, b in validate.MEMORY_RUNS
                              for r in validate.load_runs(s, b)],
                             validate.exchange_calibration(validate.collective_calibration()))
  (rate,) = rates
  assert rate == pytest.approx(validate.dispatch_fit(base, km))


def test_a_step_whose_plans_move_nothing_is_priced_as_packed_dp_when_local_steps_are_on(seed):
  """Without a pipeline, a distca step whose plans all move nothing (gated, or balanced as it
  lies) runs the train step's local branch: packed_dp's step, no exchange, no dispatch. With
  local steps off (the code before that branch), or under a pipeline, the same plans pay both;
  one plan of the step that moves rows sends the whole step through the exchange."""
  spec = costs.model_spec("llama3_8b", n_layers=2)
  km, cal, t = _flat_table(), _cal(), 16384
  lay = step.Layout(gpus=2)
  gated = step.sample_batches("prolong", t, lay, 2, seed=seed)  # every plan gated below
  balanced = [[[[4096] * 4, [4096] * 4]]]  # nothing to move, whatever the gate
  for batches, min_gain in ((gated, 1e9), (balanced, 0.0)):
    sim = lambda local, lay=lay, b=batches: step.simulate(
        b if lay.pipe == 1 else [b[0] * lay.micro_batches], spec, lay, t, cal=cal, km=km,
        opts=step.Options(min_gain=min_gain, nano_batches=1, local_steps=local),
        strategies=("packed_dp", "distca"))
    on, off = sim(True), sim(False)
    assert on["distca"]["local_batches"] == len(batches) and off["distca"]["local_batches"] == 0
    assert on["distca"]["step_s"] == pytest.approx(on["packed_dp"]["step_s"], rel=1e-12)
    for part in ("exchange", "exchange_exposed", "dispatch"):
      assert max(on["distca"]["per_rank_s"][part]) == 0.0, (part, seed)
      assert min(off["distca"]["per_rank_s"][part]) > 0.0, (part, seed)
    assert off["distca"]["step_s"] > on["distca"]["step_s"]
    # Memory is the exchange branch's either way (XLA plans the larger branch).
    assert on["distca"]["memory_gb"] == off["distca"]["memory_gb"]
    # Under a pipeline every tick runs the exchange.
    piped = sim(True, step.Layout(gpus=4, pipe=2, micro_batches=2))["distca"]
    assert piped["local_batches"] == 0 and min(piped["per_rank_s"]["dispatch"]) > 0.0
  # A step of two micro-batches, one of which moves rows: the whole step pays the exchange.
  skewed = [[8192] * 2, [1024] * 16]
  two = step.Layout(gpus=2, micro_batches=2)
  opts = step.Options(min_gain=0.0, local_gain=0.0, nano_batches=1)
  mixed = [[balanced[0][0], skewed]]
  res = [[step.run_distca(rows, t, spec, km, opts) for rows in b] for b in mixed]
  assert [mr.plan.crosses for mr in res[0]] == [False, True]
  assert not step.step_is_local(res[0], two, opts)
  out = step.simulate(mixed, spec, two, t, cal=cal, km=km, opts=opts, strategies=("distca",))
  assert out["distca"]["local_batches"] == 0 and min(out["distca"]["per_rank_s"]["dispatch"]) > 0
  # Plan.crosses is what the backend's routing tables send, on its own plans.
  from distca_jax import backends
  for min_gain in (0.0, 1e9):
    b = backends.get("distca", q_heads=32, kv_heads=8, head_dim=128, min_gain=min_gain)
    for rows in (gated[0][0], skewed, balanced[0][0]):
      for hp in b.host_plans(rows, t):
        assert hp.plan.crosses == bool(hp.meta.q_send_len.any() or hp.meta.kv_send_len.any())
  with pytest.raises(ValueError, match="local_steps='yes' must be True or False"):
    step.Options(local_steps="yes")
  with pytest.raises(ValueError, match="min_gain=-0.1 must be a finite number >= 0"):
    step.Options(min_gain=-0.1)


def test_runs_are_priced_with_the_local_branch_of_their_code(validation):
  """The runs before bcacbbe sent every batch through the exchange; the 2 x H100 runs of
  results/skip are held out, the old tree's priced without the local branch, the new tree's with
  it at the gate each ran (0.02, or its min_gain override): the simulator's local steps are the
  ones each run counted."""
  assert not any(validate.ERA_LOCAL_STEPS[e] for e in ("current", "v5", "h100"))
  assert validate.ERA_LOCAL_STEPS["h100-local"]
  # Priced with the 4 x H100 packed_dp calibration (fitted on runs made before these).
  assert validation["calibrations"]["h100-local"] == validation["calibrations"]["h100"]
  skip = [c for c in validation["cases"] if "skip/raw/step_cond/" in c["name"]]
  assert {c["kind"] for c in skip} == {"e2e", "memory", "speedup"}
  assert all(c["role"] == "held-out" and c["devices"] == 2 for c in skip)
  km, _ = validate.kernel_model()
  cal = costs.Calibration(**validation["calibrations"]["h100"])
  for era, (stem, _) in [("h100", s) for s in validate.HELD_OUT_RUNS["h100"][-2:]] + [
      ("h100-local", s) for s in validate.HELD_OUT_RUNS["h100-local"]]:
    recorded = {r["backend"]: r for r in validate._json(stem)["results"]}
    for run in validate.load_runs(stem):
      if run.strategy != "distca":
        continue
      opts = validate._options(run, era)
      assert opts.local_steps == (era == "h100-local")
      assert opts.min_gain == (0.06 if run.backend.endswith("+gate06") else 0.02)
      res = validate.predict_run(run, cal, km, era)
      share = recorded[run.backend].get("local_steps", 0.0)
      assert res["local_batches"] == round(share * len(run.steps)), (stem, run.backend)


def _assert_h200_distca_priced_as_it_ran(validation, era):
  """Each held-out distca run of ``era`` priced as it ran ('remote', 'keep', the local branch at
  local_gain 0.05, gate 0.02), with the local steps the run counted (ping-pong's too: its
  nano-batches planned apart, as the backend plans them)."""
  km, _ = validate.kernel_model()
  cal = costs.Calibration(**validation["calibrations"][era])
  for stem, backend in validate.HELD_OUT_RUNS[era]:
    recorded = {(r["workload"], r["backend"]): r for r in validate._json(stem)["results"]}
    for run in validate.load_runs(stem, backend):
      if run.strategy != "distca":
        continue
      opts = validate._options(run, era)
      assert (opts.collective, opts.memory_mode, opts.local_steps, opts.local_gain,
              opts.min_gain) == ("remote", "keep", True, 0.05, 0.02), stem
      res = validate.predict_run(run, cal, km, era)
      share = recorded[run.workload, run.backend]["local_steps"]
      assert res["local_batches"] == round(share * len(run.steps)), (stem, run.backend)


def test_h200_era_is_its_own_calibration_on_packed_dp_and_holds_out_the_rest(validation):
  """4 x H200 of 63a9720 (results/four/raw/s6): a current-code era of its own, calibrated on
  its single-stream packed_dp runs without a pipeline; every other case of it is held out, its
  distca runs priced as they ran ('remote', 'keep', the local branch at local_gain 0.05, gate
  0.02): the simulator's local steps are the ones each single-stream run counted."""
  assert "h200" in validate.CURRENT_ERAS and "h200" not in validate.CALIBRATED_AS
  assert validation["calibrations"]["h200"] != validation["calibrations"]["h100"]
  cases = [c for c in validation["cases"] if c.get("era") == "h200"]
  fit = [c for c in cases if c["role"] == "fit"]
  assert fit and all(c["kind"] == "e2e" and c["backend"] == "packed_dp" for c in fit)
  assert {c["stem"] for c in fit} == {s for s, _ in validate.CALIBRATION_RUNS["h200"]}
  e2e = {c["backend"] for c in cases if c["kind"] == "e2e" and c["role"] == "held-out"}
  assert {"wlb", "cp", "distca", "distca+perstage", "distca+pingpong",
          "packed_dp+pingpong"} <= e2e
  assert {c["kind"] for c in cases if c["role"] == "held-out"} == {"e2e", "memory", "speedup",
                                                                   "exchange"}
  # issue35's command left --steps / --warmup at e2e_bench's defaults.
  run = validate.load_runs("four/raw/s6/e2e_4gpu_128k_issue35", "packed_dp")[0]
  assert run.steps == tuple(range(2, 22))
  _assert_h200_distca_priced_as_it_ran(validation, "h200")


def test_h200_s7_era_is_another_machine_priced_with_h200s_calibration(validation):
  """4 x H200 of 231bdf7 on another machine (results/four/raw/s7): priced with the 'h200'
  calibration, every case held out (packed_dp too); distca as it ran ('remote', 'keep', the
  local branch at local_gain 0.05, gate 0.02), each single-stream run's local steps as counted."""
  assert "h200-s7" in validate.CURRENT_ERAS and validate.CALIBRATED_AS["h200-s7"] == "h200"
  assert validation["calibrations"]["h200-s7"] == validation["calibrations"]["h200"]
  cases = [c for c in validation["cases"] if c.get("era") == "h200-s7"]
  assert cases and all(c["role"] == "held-out" for c in cases)
  assert all(c["name"].startswith("four/raw/s7/") for c in cases)
  assert {c["backend"] for c in cases if c["kind"] == "e2e"} >= {
      "packed_dp", "wlb", "cp", "distca", "distca+perstage", "packed_dp+pingpong",
      "distca+pingpong"}
  _assert_h200_distca_priced_as_it_ran(validation, "h200-s7")


def test_h200_s8_era_prices_keep_and_resend_as_they_ran(validation):
  """4 x H200 of 8ec3962 (results/four/raw/s8, host A): the 'h200' calibration, every
  case held out; distca's 'keep' and 'resend' runs priced with the memory mode each ran, ping-pong's
  nano-batches planned apart, so 'heavy_first' rows price faster than 'given' (as they ran),
  'resend' alone paired with its call's packed_dp for the speedup."""
  assert "h200-s8" in validate.CURRENT_ERAS and validate.CALIBRATED_AS["h200-s8"] == "h200"
  assert validation["calibrations"]["h200-s8"] == validation["calibrations"]["h200"]
  cases = [c for c in validation["cases"] if c.get("era") == "h200-s8"]
  assert cases and all(c["role"] == "held-out" and c["name"].startswith("four/raw/s8/")
                       for c in cases)
  modes = {}
  for stem, backend in validate.HELD_OUT_RUNS["h200-s8"]:
    for run in validate.load_runs(stem, backend):
      opts = validate._options(run, "h200-s8")
      if run.strategy == "distca":
        modes[stem.split("/")[-1], run.backend] = (opts.collective, opts.memory_mode)
  assert modes["e2e_4gpu_keep_resend", "distca"] == ("remote", "keep")
  assert modes["e2e_4gpu_keep_resend", "distca+resend"] == ("remote", "resend")
  assert modes["e2e_4gpu_resend_alone", "distca"] == ("remote", "resend")
  e2e = {(c["stem"].split("/")[-1], c["backend"]): c["predicted_s"]
         for c in cases if c["kind"] == "e2e"}
  for stem in ("e2e_4gpu_pingpong_heavy_first", "e2e_4gpu_pingpong_heavy_first_prolong"):
    assert e2e[stem, "distca+hf+pingpong"] < e2e[stem, "distca+pingpong"], stem
  assert e2e["e2e_4gpu_keep_resend", "distca+resend"] > e2e["e2e_4gpu_keep_resend", "distca"]
  assert any(c["kind"] == "speedup" and c["name"].startswith("four/raw/s8/e2e_4gpu_resend_alone:")
             and "distca over packed_dp" in c["name"] for c in cases)


def test_a_ping_pong_runs_nano_batches_are_the_rows_the_backend_plans():
  """``validate.run_batches(nano=True)`` of a distca ping-pong run: nano-batch ``i`` holds rows
  ``[i R/n, (i+1) R/n)`` of every rank's block (``plan.spec.nano_batch_rows``), after the run's
  row order ('heavy_first': ``data.order.heavy_first``); other runs keep one micro-batch."""
  from distca_jax.data import order
  from distca_jax.data.synthetic import SyntheticSource
  from distca_jax.plan.spec import nano_batch_rows
  base = dict(stem="x", workload="prolong", tokens=8192, layers=2, rows_per_rank=4, devices=2,
              steps=(3, 7), mean_step_s=1.0, median_step_s=1.0)
  given = validate.E2eRun(backend="distca+pingpong", overrides=(), **base)
  hf = validate.E2eRun(backend="distca+hf+pingpong",
                       overrides=("attention.distca.nano_rows=heavy_first",), **base)
  src = SyntheticSource("prolong", rows=8, tokens_per_row=8192, vocab_size=2, seed=0)
  for run in (given, hf):
    assert validate.nano_split(run)
    got = validate.run_batches(run, nano=True)
    for s, batch in zip(run.steps, got):
      rows = src.doclens(s)
      if run is hf:
        rows = [rows[i] for i in order.heavy_first(rows, 4)]
      want = [[[x for j in nano_batch_rows(2, 4, 2, i)[k * 2:(k + 1) * 2] for x in rows[j]]
               for k in range(2)] for i in range(2)]
      assert batch == want, (run.backend, s)
  one = validate.run_batches(given)  # one micro-batch: each rank's rows concatenated
  rows = src.doclens(3)
  assert one[0] == [[[x for j in range(k * 4, (k + 1) * 4) for x in rows[j]] for k in range(2)]]
  assert not validate.nano_split(validate.E2eRun(backend="packed_dp+pingpong", overrides=(),
                                                 **base))


def test_local_gain_plans_a_step_that_cannot_win_enough_to_move_nothing():
  """Options.local_gain (attention.distca.local_gain): a step whose predicted gain is below it
  is planned to move nothing and priced on the local branch; just above it, CAD balances."""
  spec = costs.model_spec("llama3_8b", n_layers=2)
  km, cal, lay, t = _flat_table(), _cal(), step.Layout(gpus=2), 8192
  skewed = [[[[8192], [1024] * 8]]]
  gain = plan_lib.predicted_step_gain([8192 * 8193 // 2, 8 * (1024 * 1025 // 2)], t,
                                      costs.linear_pairs_per_token(spec.dims))
  run = lambda lg: step.simulate(skewed, spec, lay, t, cal=cal, km=km,
                                 opts=step.Options(min_gain=0.0, local_gain=lg, nano_batches=1),
                                 strategies=("distca",))["distca"]
  above, below = run(gain * 1.01), run(gain * 0.99)
  assert gain > 0.01 and above["local_batches"] == 1 and above["gated_plans"] == 1, above
  assert below["local_batches"] == 0 and below["gated_plans"] == 0, below
  with pytest.raises(ValueError, match=r"local_gain=-1.0 must be a finite number >= 0"):
    step.Options(local_gain=-1.0)


def test_auto_collective_is_two_level_across_nodes_beside_the_host_blind_dense_exchange():
  """Across nodes 'auto' runs the two-level exchange on host-aware plans (the launcher's one
  process per node drives its servers); beside it the same batches as the system ran them before
  (host-blind plans, 'dense') and the plans priced with 'remote'."""
  cal = _cal()
  assert step.resolve_collective("auto", step.Layout(gpus=cal.gpus_per_node), cal) == "remote"
  assert (step.resolve_collective("auto", step.Layout(gpus=2 * cal.gpus_per_node), cal)
          == "two_level")
  assert step.resolve_collective("ragged", step.Layout(gpus=4), cal) == "ragged"
  with pytest.raises(ValueError, match="collective='ring'"):
    step.resolve_collective("ring", step.Layout(gpus=4), cal)
  res, *_ = _four_gpu_distca(gpus_per_node=2)  # 4 servers: 2 hosts x 2
  assert res["collective"] == "two_level" and res["servers_per_host"] == 2 and res["host_aware"]
  old = res["host_blind_dense"]
  assert res["step_s"] < old["step_s"]
  assert res["plan_inter_host_mb"] <= old["plan_inter_host_mb"]
  assert res["leg_a_bytes_per_layer_mb"] > 0 and res["memory_gb"]["relay_buffers"] > 0
  assert "priced_as_remote" in res


def test_two_level_rounds_are_priced_by_hand(seed):
  """With one bucket every round carries its full block: leg A's ``H - 1`` rounds of
  ``min(send, relay)`` rows at the inter-node rate, leg B's ``L - 1`` rounds of ``min(send +
  relay, recv)`` rows at the in-node rate, each round one latency."""
  spec = costs.model_spec("llama3_8b", n_layers=2)
  d, t = spec.dims, 16384
  lay = step.Layout(gpus=8)
  batches = step.sample_batches("pretrain", t, lay, 1, seed=seed % 1000)
  opts = step.Options(collective="two_level", nano_batches=1, min_gain=0.0, local_gain=0.0,
                      servers_per_host=2, exchange_buckets=1)
  plan = step.run_distca(batches[0][0], t, spec, _flat_table(), opts).plan
  assert plan.servers_per_host == 2
  caps = step.distca_caps([plan], t, 1.1)
  relay = step.relay_rows([plan], 2, 1.1)
  cal = _cal()
  sec, rows = step.two_level_seconds(plan, caps, relay, d, cal, 1, 2, 1)
  bq = d.q_heads * d.head_dim * d.dtype_bytes
  want = 0.0
  for n, w, send, recv, rel in ((4, bq, caps.q_send, caps.q_recv, relay[0]),
                                (2, d.kv_row_bytes, caps.kv_send, caps.kv_recv, relay[1])):
    ra, rb = 3 * min(send, rel), 1 * min(send + rel, recv)  # H - 1 = 3, L - 1 = 1 rounds
    want += n * (4 * cal.a2a_latency_s + ra * w / cal.inter_node_bw + rb * w / cal.intra_node_bw)
  np.testing.assert_allclose(sec, want, rtol=1e-12, err_msg=f"seed={seed} rows={rows}")
  with pytest.raises(ValueError, match="servers_per_host=3 must divide the 8 servers"):
    step.servers_per_host(lay, cal, 8, asked=3)
