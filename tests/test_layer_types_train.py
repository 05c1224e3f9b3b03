"""Training models with local and global layers: every backend that runs them trains like
`local` (the real loop, 8 fake devices); distca plans each layer type on its own, logs each
type's plan statistics and compiles the step once; cp and wlb refuse with one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distca_jax import backends, trainer
from distca_jax.backends import distca as distca_backend
from distca_jax.errors import UserError
from test_train import _with_heads, tiny_config

RUN = {"mesh.data": 8, "num_steps": 3, "log_every": 1, "checkpoint_every": 0,
       "tensorboard": False, "optim.warmup_steps": 1, "eval_every": 0, "rows_per_rank": 2}
DISTCA = {"attention.backend": "distca", "attention.distca.tolerance": 0.05,
          "attention.distca.min_gain": 0.0, "attention.distca.local_gain": 0.0}


def config(layers: dict, **over):
  return _with_heads(tiny_config(**{**RUN, **layers, **over}))


def train(c, workdir, monkeypatch=None):
  """The loop's records; with ``monkeypatch``, also (compiles of the step, core-attention
  traces after the compile, core-attention traces in all)."""
  if monkeypatch is None:
    return trainer.train_and_evaluate(c, str(workdir)), None
  traces, compiles, at_compile = [], [], []
  build, compile_step = backends.build, trainer.compile_train_step

  def counting_build(*args, **kwargs):
    b = build(*args, **kwargs)

    def fn(*a, **k):
      traces.append(k.get("window", 0))
      return b.fn(*a, **k)
    return dataclasses.replace(b, fn=fn)

  def counting_compile(*args, **kwargs):
    out = compile_step(*args, **kwargs)
    compiles.append(1)
    at_compile.append(len(traces))
    return out

  monkeypatch.setattr(backends, "build", counting_build)
  monkeypatch.setattr(trainer, "compile_train_step", counting_compile)
  records = trainer.train_and_evaluate(c, str(workdir))
  return records, (len(compiles), len(traces) - at_compile[-1], traces)


def assert_trains_like_local(layers, steps, tmp_path, monkeypatch, backend_over, rtol):
  over = {"num_steps": steps}
  ref, _ = train(config(layers, **over), tmp_path / "local")
  c = config(layers, **over, **backend_over)
  records, (compiles, late_traces, traces) = train(c, tmp_path / "other", monkeypatch)
  np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in ref], rtol=rtol)
  assert compiles == 1 and late_traces == 0, (compiles, late_traces)
  assert traces, "the backend's core attention was never traced"
  return records, traces


@pytest.mark.slow
def test_five_window_layers_per_global_one_train_with_distca_like_local(tmp_path, monkeypatch):
  """Gemma 3's pattern: 6 layers, 5 sliding-window layers of 16 tokens per full one, 20 steps of
  distca equal `local`'s losses within 1e-5; one compile; the window layers' core attention is
  traced with its window; both types' plan statistics in every record."""
  # Documents of up to 256 tokens (rows of 64): some rows hold many short ones, so the window
  # layers' attention is imbalanced enough to move rows too.
  layers = {"model.n_layers": 6, "model.layer_pattern": "5:1", "model.window": 16,
            "data.context_length": 256}
  records, traces = assert_trains_like_local(layers, 20, tmp_path, monkeypatch, DISTCA, 1e-5)
  assert set(traces) == {0, 16}
  assert len(records) == 20
  for r in records:
    assert {"plan_full_moved_rows", "plan_window16_moved_rows"} <= set(r), r
  mean = lambda k: np.mean([r[k] for r in records])
  # A window layer's attention is nearly as balanced as the linear layers: less to fix.
  assert mean("plan_window16_imbalance_before") < mean("plan_full_imbalance_before")
  # Both types' plans moved rows on some steps: the windowed exchange ran, not only the local
  # attention of the layers whose plans move nothing.
  assert mean("plan_window16_crosses") > 0 and mean("plan_full_crosses") > 0, records[-1]


@pytest.mark.parametrize("layers", [
    {"model.n_layers": 2, "model.layer_pattern": "1:1", "model.chunk": 16},
    pytest.param({"model.n_layers": 2, "model.layer_pattern": "local", "model.chunk": 8},
                 marks=pytest.mark.slow),
])
def test_chunked_model_trains_with_distca_like_local(layers, tmp_path, monkeypatch):
  """Chunk layers plan over the chunk-cut documents; losses equal `local`'s, one compile, and
  every logged step has each type's plan statistics."""
  records, _ = assert_trains_like_local(layers, 3, tmp_path, monkeypatch, DISTCA, 1e-5)
  types = {"full", "chunk16"} if layers["model.layer_pattern"] == "1:1" else {"chunk8"}
  for r in records:
    logged = {k[len("plan_"):-len("_imbalance_before")] for k in r
              if k.startswith("plan_") and k.endswith("_imbalance_before")}
    assert logged == types, r
    for t in types:
      assert r[f"plan_{t}_imbalance_after"] <= r[f"plan_{t}_imbalance_before"] + 1e-9
      assert r[f"plan_{t}_moved_rows"] >= 0 and r[f"plan_{t}_crosses"] in (0.0, 1.0)
  # The full layers' documents are longer than their chunks: more imbalance to fix.
  if len(types) == 2:
    before = lambda t: np.mean([r[f"plan_{t}_imbalance_before"] for r in records])
    assert before("full") > before("chunk16")


def test_each_type_is_gated_on_its_own_gain():
  """local_gain per layer type: on rows of one long document against rows of short ones, the
  full layers' plan pays and moves rows while the 4-token window layers' could gain little and
  moves nothing (those layers run packed_dp's attention); the step crosses."""
  c = config({"model.n_layers": 2, "model.layer_pattern": "1:1", "model.window": 4},
             **{**DISTCA, "attention.distca.local_gain": 0.01, "tokens_per_rank": 256,
                "attention.distca.caps_from_batches": 0})  # caps not sized on other batches
  backend = backends.build(c)
  rows = 8 * 2
  doclens = [[256] if r % 4 == 0 else [32] * 8 for r in range(rows)]
  extra = backend.host_prepare(doclens, 256)
  crosses = lambda t: int(extra[f"crosses@{t}"].max())
  assert (crosses("full"), crosses("window4"), int(extra["crosses"].max())) == (1, 0, 1)
  stats = {t: extra[f"plan_stats@{t}"][0] for t in ("full", "window4")}
  assert stats["window4"][2] == 0 < stats["full"][2]  # moved rows
  assert stats["window4"][0] < stats["full"][0]  # imbalance before


@pytest.mark.slow
def test_layers_whose_plans_move_nothing_run_locally_in_a_crossing_step(tmp_path, monkeypatch):
  """local_gain 0.01: every step's full plan moves rows, its 4-token window plan does not, so
  each step runs the exchange for the full layers and packed_dp's windowed attention for the
  window layers (the per-layer branch); losses equal `local`'s."""
  layers = {"model.n_layers": 2, "model.layer_pattern": "1:1", "model.window": 4,
            "data.context_length": 256}
  over = {**DISTCA, "attention.distca.local_gain": 0.01}
  records, traces = assert_trains_like_local(layers, 4, tmp_path, monkeypatch, over, 1e-5)
  assert set(traces) == {0, 4}
  assert [(r["plan_full_crosses"], r["plan_window4_crosses"]) for r in records] == [(1, 0)] * 4


@pytest.mark.parametrize("local", [{"model.chunk": 8},
                                   pytest.param({"model.window": 8}, marks=pytest.mark.slow)])
def test_packed_dp_runs_local_layers(local, tmp_path):
  layers = {"model.n_layers": 2, "model.layer_pattern": "1:1", **local}
  ref, _ = train(config(layers), tmp_path / "local")
  got, _ = train(config(layers, **{"attention.backend": "packed_dp"}), tmp_path / "packed_dp")
  np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-5)


@pytest.mark.parametrize("backend,why", [("cp", "head-tail chunks"), ("wlb", "per-document")])
def test_cp_and_wlb_refuse_local_layers(backend, why):
  c = config({"model.n_layers": 2, "model.layer_pattern": "1:1", "model.window": 8},
             **{"attention.backend": backend, "attention.baselines.cp_size": 2})
  with pytest.raises(UserError, match=rf"attention.backend='{backend}' cannot run local layers "
                                      rf"\['window8', 'full'\].*{why}.*use 'distca', 'packed_dp'"):
    backends.build(c)


def test_price_branch_refuses_several_layer_types():
  c = config({"model.n_layers": 2, "model.layer_pattern": "1:1", "model.chunk": 8},
             **DISTCA, **{"attention.distca.branch": "price"})
  with pytest.raises(UserError, match=r"branch='price' prices the plans of one layer type"):
    backends.build(c)


def test_plan_stats_record_averages_each_type():
  a = {"full": np.array([2.0, 1.0, 10.0, 1.0]), "window8": np.array([1.2, 1.1, 0.0, 0.0])}
  b = {"full": np.array([4.0, 1.2, 30.0, 1.0])}
  rec = distca_backend.plan_stats_record([a, b])
  assert rec["plan_full_imbalance_before"] == 3.0 and rec["plan_full_moved_rows"] == 20.0
  assert rec["plan_window8_imbalance_after"] == pytest.approx(1.1)
  assert distca_backend.plan_stats_record([{}]) == {}
