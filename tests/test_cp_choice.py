"""``cp``'s CP size chosen as ``wlb``'s configuration is (``attention.baselines.cp_size = 0``):
the predicted-fastest candidate whose step fits memory, scored on batches the run never trains or
times, shown by e2e_bench; a given size stays (4 data ranks of the fake CPU devices)."""

import os

import numpy as np
import pytest

from distca_jax import aot, backends, choose, configs_io
from distca_jax import baselines as bl
from distca_jax import config as config_lib
from distca_jax.backends import cp, wlb
from distca_jax.baselines import ideal
from distca_jax.data import make_source, synthetic
from experiments import e2e_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(seed, *over):
  return configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      "attention.backend=cp", "attention.baselines.cp_size=0", "mesh.data=4",
      "tokens_per_rank=4096", "rows_per_rank=2", "num_steps=6", f"seed={seed % 1000}", *over])


def test_cp_size_defaults_to_the_choice(seed):
  """Without a cp_size the run chooses one (the default 0; cp 1 would be packed_dp's split)."""
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      "attention.backend=cp", "mesh.data=4", f"seed={seed % 1000}"])
  assert config_lib.base_config().attention.baselines.cp_size == 0
  assert c.attention.baselines.cp_size == 0
  options = cp.from_first_batches(c, cp.Options.from_config(c))
  assert options.cp_size == bl.baseline_choice(c, "cp").cp_size in (1, 2, 4)


def test_cp_choice_scores_every_size_and_takes_the_fastest_that_fits(seed, monkeypatch):
  c = _config(seed)
  free = ideal.cp_choice_from_config(c)
  assert [x[0] for x in free.candidates] == [1, 2, 4] and free.strategy == "cp"
  # Each candidate's score is the shared layer-time model of cp's placement of the choice
  # batches (rank_metrics: the training logs' path to the same metrics), mean over batches.
  m = config_lib.model_config(c)
  dims = bl.ModelDims.from_model(m)
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank, vocab_size=m.vocab_size,
                    seed=c.seed)
  for size, alpha, secs, fits in free.candidates:
    want = np.mean([bl.estimate_layer_seconds(bl.rank_metrics(
        "cp", src.doclens(s), c.tokens_per_rank, dims=dims, rows_per_rank=2, cp_size=size),
        dims).max() for s in ideal.choice_steps(c)])
    assert secs == pytest.approx(want, rel=1e-12) and alpha == 1.0 and fits, (size, seed)
  order = ideal.ranked(free)
  assert (free.cp_size, free.layer_seconds) == order[0][::2], seed
  assert free.memory == () and free.capacity_bytes is None
  assert free.tasks_per_row == c.attention.baselines.max_docs_per_row
  # Memory excludes the predicted fastest: the choice before the trainer starts (choose), its
  # need estimated by aot.baseline_need_bytes (here a stand-in), takes the next one and records
  # both.
  calls = []

  def need(cfg, backend, size, alpha, tasks, devices=None):
    calls.append((backend, size, alpha, tasks, len(devices)))
    return (3 << 30) if size == order[0][0] else (1 << 30)

  monkeypatch.setattr(aot, "baseline_need_bytes", need)
  monkeypatch.setattr(bl, "_CHOICES", {})
  c.attention.baselines.memory_gib = 2.0
  resolved = choose.resolve(c)
  options = cp.from_first_batches(resolved, cp.Options.from_config(resolved))
  assert options.cp_size == order[1][0], (order, seed)
  assert calls == [("cp", x[0], 1.0, 128, 4) for x in order[:2]]
  got = bl.baseline_choice(c, "cp")
  assert [x[:2] for x in got.excluded_for_memory()] == [(order[0][0], 1.0)]
  assert got.capacity_bytes == 2 << 30 and got.memory[-1][3] == 1 << 30
  # None fits: one line naming the sizes and their needs.
  with pytest.raises(ValueError, match=r"^no cp configuration fits 0\.50 GiB per device \(3 "
                                       r"tried; the least: cp_size=\d needs 1\.00 GiB"):
    ideal.fastest_that_fits(free, lambda size, a: 128, lambda size, a, t: 1 << 30, 1 << 29)


def test_a_given_cp_size_stays_and_reads_no_batch(seed, monkeypatch):
  c = _config(seed, "attention.baselines.cp_size=2")
  sampled = []
  real = synthetic.SyntheticSource.doclens
  monkeypatch.setattr(synthetic.SyntheticSource, "doclens",
                      lambda self, s: sampled.append(s) or real(self, s))
  assert cp.from_first_batches(c, cp.Options.from_config(c)).cp_size == 2
  assert not sampled
  # Its scored configuration is the one given, memory unchecked (the pre-flight checks it).
  given = ideal.cp_choice_from_config(c)
  assert [x[0] for x in given.candidates] == [2] and given.cp_size == 2


def test_e2e_bench_cp_choice_never_sees_the_timed_batches(seed, monkeypatch):
  over = e2e_bench.choice_overrides("cp", ["attention.backend=cp", "mesh.data=4", "num_steps=5",
                                           f"seed={seed % 1000}"])
  assert over[-1] == "attention.baselines.cp_size=0"
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), over)
  steps = []
  real = synthetic.SyntheticSource.doclens
  monkeypatch.setattr(synthetic.SyntheticSource, "doclens",
                      lambda self, s: steps.append(s) or real(self, s))
  monkeypatch.setattr(bl, "_CHOICES", {})
  w = e2e_bench.baseline_config(c, over)
  assert steps and min(steps) >= 5, steps
  assert w["cp_size"] in (1, 2, 4) and w["alpha"] == 1.0 and w["padding_linear_fraction"] == 0
  assert "choose_cp on steps 5-8 (never trained or timed) over CP 1: " in w["how"], w["how"]
  # The table's section shows it next to wlb's.
  fixed = e2e_bench.choice_overrides("cp", over[:-1] + ["attention.baselines.cp_size=2"])
  c2 = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), fixed)
  w2 = e2e_bench.baseline_config(c2, fixed)
  assert w2["cp_size"] == 2 and "cp_size given" in w2["how"]


def test_e2e_bench_table_shows_cp_and_wlb_configurations(tmp_path):
  run = dict(workload="pretrain", tokens=1024, step_ms_median=1.0, step_ms_p10=1.0,
             step_ms_p90=1.0, tokens_per_s=1.0, layers=1, ceiling=1.1, host_plan_ms_median=0.0,
             input_wait_ms_median=0.0, input_wait_ms_max=0.0)
  conf = lambda size, alpha, how: dict(cp_size=size, alpha=alpha, how=how, tasks_per_row=16,
                                       padding_linear_fraction=alpha - 1.0)
  results = [dict(run, backend="cp", cp_config=conf(4, 1.0, "choose_cp HOW")),
             dict(run, backend="wlb", wlb_config=conf(2, 1.2, "choose_wlb HOW"))]

  class Args:
    out, steps, warmup = str(tmp_path / "t"), 1, 0

  e2e_bench.write(Args, results, quiet=True)
  text = open(Args.out + ".md").read()
  section = text.split("## Baselines' configuration (wlb, cp)")[1]
  assert "| pretrain | 1024 | cp | 4 | 1 | 16 | choose_cp HOW | 0% of T per rank |" in section
  assert "| pretrain | 1024 | wlb | 2 | 1.2 | 16 | choose_wlb HOW | 20% of T per rank |" in section


def test_cp_size_zero_outside_the_startup_step_is_one_clear_line():
  with pytest.raises(ValueError, match=r"^backend 'cp': cp_size=0 must be an int >= 1 .*"
                                       r"set attention\.baselines\.cp_size"):
    backends.get("cp", cp_size=0)


@pytest.mark.slow
def test_e2e_bench_tiny_cp_shows_its_chosen_configuration(tmp_path):
  """The CPU smoke run: `--tiny --backends cp` trains at the chosen CP size and its table names
  the size and how it was chosen."""
  import json
  out = str(tmp_path / "cp")
  e2e_bench.main(["--tiny", "--backends", "cp", "--workloads", "pretrain", "--tokens", "256",
                  "--layers", "1", "--steps", "1", "--warmup", "0", "--out", out])
  res = json.load(open(out + ".json"))["results"]
  assert len(res) == 1 and "error" not in res[0], res
  w = res[0]["cp_config"]
  assert "attention.baselines.cp_size=0" in res[0]["overrides"]
  assert w["cp_size"] == min(w["candidates"], key=lambda x: (x[2], x[0]))[0]
  text = open(out + ".md").read()
  assert f"| pretrain | 256 | cp | {w['cp_size']} | 1 | 128 | choose_cp on steps 1-4" in text


@pytest.mark.slow
def test_cp_need_is_the_compiled_step_and_the_walk_skips_what_does_not_fit():
  """aot.baseline_need_bytes compiles a flash3 cp step on the CPU (the kernel's shape-only
  stand-in) at each CP size: a larger group gathers more keys, so it needs more; ranked largest
  CP first with a capacity just under CP 4's need, the walk takes the next size that fits and
  reports CP 4 as excluded."""
  import jax
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      "attention.backend=cp", "attention.kernel=flash3", "model.head_dim=128", "model.dim=256",
      "model.n_heads=2", "model.n_kv_heads=1", "model.dtype=bfloat16", "model.n_layers=2",
      "mesh.data=4", "rows_per_rank=1", "attention.baselines.cp_size=0"])
  devices = jax.devices()[:4]
  need_fn = lambda size, alpha, tasks: aot.baseline_need_bytes(c, "cp", size, alpha, tasks,
                                                               devices=devices)
  need = {size: need_fn(size, 1.0, 128) for size in (1, 2, 4)}
  assert need[4] > need[1] > 0, need
  choice = ideal.WlbChoice(0, 1.0, 0.0, tuple((size, 1.0, 1.0 / size, True) for size in need),
                           strategy="cp")
  got = ideal.fastest_that_fits(choice, lambda size, alpha: 128, need_fn, need[4] - 1)
  assert got.memory[0] == (4, 1.0, 128, need[4]) and got.capacity_bytes == need[4] - 1
  assert got.cp_size == 2 if need[2] < need[4] else got.cp_size == 1
  assert [m[0] for m in got.excluded_for_memory()] == [4] + ([2] if need[2] >= need[4] else [])


def test_build_reports_the_options_its_startup_step_chose():
  """``backends.build`` records what ``from_first_batches`` set (the trainer logs it); a
  configuration given in full records nothing."""
  from distca_jax import backends, configs_io
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      "attention.backend=cp", "mesh.data=4", "attention.baselines.cp_size=0"])
  chosen = dict(backends.build(c).chosen)
  assert set(chosen) == {"cp_size"} and 4 % chosen["cp_size"] == 0, chosen
  c.attention.baselines.cp_size = 2
  assert backends.build(c).chosen == ()
