"""Pipeline parallelism (distca_jax.pipeline) on 8 fake CPU devices: the schedule, and a pipelined
model equal to pipe=1 in loss, gradients and training curve, compiled once. The fast tier keeps
the host tables, the tick packing, the config errors and one small loss/gradient case."""

import chex
import jax
import numpy as np
import pytest

from distca_jax import backends
from distca_jax import config as config_lib
from distca_jax import pipeline
from distca_jax.plan import ticks as ticks_lib
from distca_jax import sharding as shard_lib
from distca_jax import trainer
from distca_jax.data import make_source
from distca_jax.errors import UserError
from test_train import _with_heads, tiny_config


@pytest.mark.parametrize("stages,microbatches", [(1, 1), (2, 4), (4, 8), (8, 8), (4, 3)])
def test_schedule_table(stages, microbatches):
  table = ticks_lib.schedule_table(stages, microbatches)
  assert table.shape == (microbatches + stages - 1, stages)
  for mb in range(microbatches):  # each microbatch visits stage s at tick mb + s, once
    ticks, where = np.nonzero(table == mb)
    np.testing.assert_array_equal(where, np.arange(stages))
    np.testing.assert_array_equal(ticks, mb + np.arange(stages))
  assert ticks_lib.bubble_fraction(table) == pytest.approx(
      (stages - 1) / (microbatches + stages - 1))


# CAD options of the tests: balance every batch (no gate), a tolerance tiny batches can meet;
# the baselines' CP groups of 2 data ranks (wlb: rows of 1.25 x tokens_per_rank).
DISTCA = {"attention.distca.tolerance": 0.05, "attention.distca.min_gain": 0.0,
          "attention.distca.local_gain": 0.0,
          "attention.baselines.cp_size": 2, "attention.baselines.wlb_alpha": 1.25}


def loss_and_grads(c, batch_np, doclens):
  backend = trainer.make_backend(c)
  batch_np = trainer.add_host_plan(batch_np, backend, doclens, c.tokens_per_rank)
  mesh = shard_lib.make_mesh(data=c.mesh.data, tensor=c.mesh.tensor, pipe=c.mesh.pipe,
                             devices=jax.devices()[:c.mesh.pipe * c.mesh.data * c.mesh.tensor])
  model, tx = trainer.make_model(c, backend), trainer.make_optimizer(c)
  state = trainer.create_train_state(c, model, tx, mesh)

  def f(params, batch):
    total, count = model.apply({"params": params}, batch["inputs"], batch["targets"],
                               batch["loss_mask"], trainer.layout_of(batch), method=model.loss)
    return total / count

  with trainer.mesh_context(mesh):
    loss, grads = jax.jit(jax.value_and_grad(f))(state.params, trainer.device_batch(batch_np, mesh))
  return float(loss), jax.tree.map(np.asarray, jax.device_get(grads))


@pytest.mark.parametrize("pipe,data,tensor,microbatches,remat,backend", [
    (2, 2, 2, 2, "none", "local"),
    pytest.param(2, 4, 1, 4, "full", "local", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 4, "save_attention", "packed_dp", marks=pytest.mark.slow),
    pytest.param(4, 2, 1, 0, "save_attention", "local", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 4, "full", "distca", marks=pytest.mark.slow),
    pytest.param(2, 4, 1, 2, "none", "wlb", marks=pytest.mark.slow),
    pytest.param(2, 4, 1, 2, "none", "cp", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 4, "save_attention", "cp", marks=pytest.mark.slow),
    pytest.param(2, 2, 2, 2, "full", "wlb", marks=pytest.mark.slow),
])
def test_pipelined_loss_and_grads_equal_pipe_1(pipe, data, tensor, microbatches, remat, backend):
  """One step's loss and every gradient (layers, embedding, LM head) of the pipelined model
  equal those of the unpipelined `local` model on the same batch and parameters."""
  seed = int(np.random.default_rng().integers(1 << 30))
  print(f"seed={seed}")
  rows_per_rank = ticks_lib.resolve_microbatches(microbatches, pipe)
  over = {"seed": seed, "model.n_layers": 4, "model.remat": remat, "rows_per_rank": rows_per_rank,
          "mesh.data": data, "mesh.tensor": tensor}
  flat = _with_heads(tiny_config(**over))
  piped = _with_heads(tiny_config(**over, **DISTCA, **{"mesh.pipe": pipe,
                                                       "attention.backend": backend,
                                                       "pipeline.microbatches": microbatches}))
  config_lib.validate(piped)
  src = make_source(flat.data, rows=data * rows_per_rank, tokens_per_row=flat.tokens_per_rank,
                    vocab_size=flat.model.vocab_size, seed=seed)
  step = int(np.random.default_rng(seed).integers(1000))
  batch, doclens = src.batch(step), src.doclens(step)
  loss_1, g_1 = loss_and_grads(flat, batch, doclens)
  loss_p, g_p = loss_and_grads(piped, batch, doclens)
  assert np.isfinite(loss_1) and loss_1 > 1.0
  np.testing.assert_allclose(loss_p, loss_1, rtol=1e-5)
  paths_1 = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g_1)]
  assert paths_1 == [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g_p)]
  for path, a, b in zip(paths_1, jax.tree.leaves(g_1), jax.tree.leaves(g_p)):
    assert np.abs(a).max() > 0, path
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6, err_msg=path)


@pytest.mark.slow
@pytest.mark.parametrize("pipe,data,tensor,ref_tensor,backend", [
    (2, 4, 1, 2, "local"), (2, 2, 2, 4, "local"), (2, 4, 1, 2, "distca"), (2, 4, 1, 2, "cp"),
    (2, 2, 2, 4, "wlb")])
def test_pipelined_training_matches_pipe_1_and_traces_once(pipe, data, tensor, ref_tensor,
                                                          backend, tmp_path, monkeypatch):
  """The real job on 8 devices: pipe x data x tensor against pipe=1 with the same data ranks
  (so the same global batch), the rest of the devices on tensor: the logged losses agree within
  1e-3 relative, and the pipelined step is traced once over batches of different layouts (with
  `distca`: different plans for every tick; with `cp` and `wlb`: differently arranged rows and
  task tables)."""
  base = {"mesh.data": data, "num_steps": 4, "log_every": 1, "checkpoint_every": 0,
          "tensorboard": False, "optim.warmup_steps": 1, "rows_per_rank": 4,
          "model.n_layers": 4}
  ref = _with_heads(tiny_config(**base, **{"mesh.tensor": ref_tensor}))
  losses_ref = [r["loss"] for r in trainer.train_and_evaluate(ref, str(tmp_path / "flat"))]
  make_step = trainer.make_train_step
  chex.clear_trace_counter()  # the counter is per function across the parametrized cases
  monkeypatch.setattr(trainer, "make_train_step",
                      lambda *a: chex.assert_max_traces(make_step(*a), n=1))
  c = _with_heads(tiny_config(**base, **DISTCA, **{"mesh.tensor": tensor, "mesh.pipe": pipe,
                                                   "pipeline.microbatches": 4,
                                                   "attention.backend": backend}))
  records = trainer.train_and_evaluate(c, str(tmp_path / "piped"))
  losses = [r["loss"] for r in records]
  assert len(losses) == len(losses_ref) == 4
  assert losses_ref[-1] < losses_ref[0]  # it trained
  np.testing.assert_allclose(losses, losses_ref, rtol=1e-3)


def test_pipeline_config_errors():
  c = tiny_config(**{"mesh.pipe": 2, "rows_per_rank": 6})  # default M = 4
  with pytest.raises(UserError, match="multiple of pipeline.microbatches=4"):
    config_lib.validate(c)
  c = tiny_config(**{"mesh.pipe": 4, "model.n_layers": 2, "rows_per_rank": 8})
  with pytest.raises(UserError, match="n_layers=2 must be a multiple of mesh.pipe=4"):
    config_lib.validate(c)
  c = tiny_config(**{"mesh.pipe": 2, "rows_per_rank": 4, "attention.nano_batches": 2})
  with pytest.raises(UserError, match="nano_batches=1"):
    config_lib.validate(c)
  with pytest.raises(UserError, match="pipeline.microbatches=-1"):
    ticks_lib.resolve_microbatches(-1, 2)
  # Building a backend alone (benchmarks, host-only tools) gives the same line: one row per
  # rank cannot form 4 microbatches, for CAD as for the rest (not a CAD capacity error).
  for backend in ("distca", "packed_dp"):
    c = tiny_config(**{"mesh.pipe": 2, "rows_per_rank": 1, "attention.backend": backend})
    with pytest.raises(UserError, match="rows_per_rank=1 must be a multiple of pipeline."
                                        "microbatches=4"):
      backends.build(c)


def test_tick_arrays_round_trip():
  """per_tick_backend packs each tick's [S D r, W] host array into the batch's row layout, and
  unpack_tick_array gives every tick's array back on the device, rows over (pipe, data)."""
  import dataclasses
  from distca_jax import attention as attn_lib
  stages, data, rows_per_rank, m, w = 2, 4, 4, 2, 3
  seen, made = [], []

  def host_prepare(rows, tokens_per_row):  # each entry encodes (call, row, column)
    del tokens_per_row
    seen.append(rows)
    made.append(np.asarray([[1000 * len(made) + 10 * i + j for j in range(w)]
                            for i in range(len(rows))], np.int32))
    return {"plan": made[-1]}

  backend = pipeline.per_tick_backend(
      attn_lib.Backend(fn=None, host_prepare=host_prepare), stages=stages,
      rows_per_rank=rows_per_rank, microbatches=m)
  doclens = [[i + 1] for i in range(data * rows_per_rank)]
  packed = backend.host_prepare(doclens, 64)[pipeline.TICK_PREFIX + "plan"]
  assert packed.shape[0] == data * rows_per_rank
  # The rows each tick's call saw: stage s holds microbatch t - s, bubbles are empty rows.
  r = rows_per_rank // m
  for t, rows in enumerate(seen):
    for s in range(stages):
      mb = t - s
      for rank in range(data):
        for j in range(r):
          got = rows[(s * data + rank) * r + j]
          assert got == ([rank * rows_per_rank + mb * r + j + 1] if 0 <= mb < m else [])
  mesh = shard_lib.make_mesh(data=data, pipe=stages)
  with trainer.mesh_context(mesh):
    out = jax.jit(lambda a: pipeline.unpack_tick_array(a, stages, m))(
        jax.device_put(packed, trainer.rows_sharding(mesh)))
  assert len(made) == ticks_lib.num_ticks(stages, m)
  np.testing.assert_array_equal(np.asarray(out), np.stack(made))
  assert out.sharding.spec[1] == ("pipe", "data")


def test_distca_plans_pool_ticks_over_every_stage():
  """CAD under the pipeline plans each tick over all pipe x data ranks: rows move between
  stages, and in warm-up ticks the idle stage's ranks serve the busy stage's attention."""
  c = _with_heads(tiny_config(**DISTCA, **{"mesh.pipe": 2, "mesh.data": 4, "rows_per_rank": 4,
                                           "pipeline.microbatches": 2,
                                           "attention.backend": "distca",
                                           "tokens_per_rank": 256}))
  config_lib.validate(c)
  backend = trainer.make_backend(c)
  src = make_source(c.data, rows=16, tokens_per_row=256, vocab_size=c.model.vocab_size,
                    seed=c.seed)
  ticks = [ticks_lib.tick_rows(src.doclens(step), stages=2, rows_per_rank=4, microbatches=2)
           for step in range(6)]
  plans = [backend.host_plans(rows, 256)[0].plan for per_step in ticks for rows in per_step]
  assert all(p.num_servers == 8 for p in plans)
  cross = sum(int(p.pair_q_rows[:4, 4:].sum() + p.pair_q_rows[4:, :4].sum()) for p in plans)
  assert cross > 0
  warmups = [backend.host_plans(per_step[0], 256)[0].plan for per_step in ticks]
  assert all(p.loads_before[4:].sum() == 0 for p in warmups)  # stage 1 holds nothing at tick 0
  assert any(p.loads_after[4:].sum() > 0 for p in warmups)    # ... and serves stage 0


@pytest.mark.slow
def test_checkpoint_resumes_under_another_pipe_layout(tmp_path):
  """A checkpoint of a pipe=1 run resumes under pipe=2 (same parameter tree, other shardings)
  and continues with the losses of the uninterrupted pipe=1 run."""
  base = {"mesh.data": 4, "log_every": 1, "checkpoint_every": 2, "tensorboard": False,
          "optim.warmup_steps": 1, "rows_per_rank": 4, "model.n_layers": 4,
          "async_checkpoint": False}
  flat = lambda steps: _with_heads(tiny_config(**base, **{"mesh.tensor": 2, "num_steps": steps}))
  want = {r["step"]: r["loss"] for r in trainer.train_and_evaluate(flat(4), str(tmp_path / "a"))}
  trainer.train_and_evaluate(flat(2), str(tmp_path / "b"))
  piped = _with_heads(tiny_config(**base, **{"num_steps": 4, "mesh.pipe": 2,
                                             "pipeline.microbatches": 2}))
  got = {r["step"]: r["loss"] for r in trainer.train_and_evaluate(piped, str(tmp_path / "b"))}
  assert sorted(got) == [3, 4]
  np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-3)


@pytest.mark.parametrize("pool", [True, False])
def test_startup_caps_are_sized_for_the_pooled_ticks(pool):
  """Under the pipeline the startup caps come from the run's first batches planned per tick
  (every stage's rows, R / M per device, on pipe x data servers; per-stage CAD, pool=False: each
  stage's rows on its data servers): at least what those plans need without caps and at most
  that x caps_headroom (rounded to row multiples), so neither a pipe=1 sizing (R rows on data
  servers) nor the fixed fractions pass; later ticks plan within them, with a fixed plan
  width."""
  import dataclasses
  from distca_jax import backends
  from distca_jax.backends import distca as distca_backend
  from distca_jax.plan import capacity as cap_lib
  stages, data, rows_per_rank, m, t, sampled = 2, 4, 4, 2, 256, 6
  c = _with_heads(tiny_config(**DISTCA, **{
      "mesh.pipe": stages, "mesh.data": data, "rows_per_rank": rows_per_rank,
      "pipeline.microbatches": m, "attention.backend": "distca", "tokens_per_rank": t,
      "attention.distca.caps_from_batches": sampled, "attention.distca.pool_stages": pool}))
  config_lib.validate(c)
  got = distca_backend.startup_capacity(c)
  rows = t * rows_per_rank // m  # a device's rows in one tick's call
  assert set(got) == set(cap_lib.EXCHANGE_FIELDS) | {"q_tokens", "kv_tokens"}
  src = make_source(c.data, rows=data * rows_per_rank, tokens_per_row=t,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  # The same ticks planned with caps no tick can reach: what each really needs.
  roomy = trainer.make_backend(c, **{f: 8 * rows for f in got})
  need = [cap_lib.required_capacity(hp.plan)
          for step in range(sampled)
          for ticked in ticks_lib.tick_rows(src.doclens(step), stages=stages,
                                           rows_per_rank=rows_per_rank, microbatches=m)
          for hp in roomy.host_plans(ticked, t)]
  assert len(need) == sampled * ticks_lib.num_ticks(stages, m) * (1 if pool else stages)
  mult = cap_lib.row_multiple(rows)
  for name, v in got.items():
    most = max(getattr(n, name) for n in need)
    enveloped = -(-most // mult) * mult  # the envelope rounds up before the headroom
    floor = mult if name in cap_lib.EXCHANGE_FIELDS else rows
    high = -(-max(floor, enveloped * c.attention.distca.caps_headroom) // mult) * mult
    assert most <= v <= high, (name, v, most, high)
  backend = trainer.make_backend(c)
  assert {k: backend.caps[k] for k in got} == got
  assert backends.module("distca").Options.from_config(c).data_axis == ("pipe", "data")
  widths = set()
  for step in range(sampled, sampled + 10):  # batches the caps never saw
    doclens = src.doclens(step)
    for ticked in ticks_lib.tick_rows(doclens, stages=stages, rows_per_rank=rows_per_rank,
                                     microbatches=m):
      for hp in backend.host_plans(ticked, t):
        used = dataclasses.asdict(cap_lib.required_capacity(hp.plan))
        assert all(used[k] <= v for k, v in got.items()), (step, used, got)
    packed = backend.host_prepare(doclens, t)
    widths.add(tuple(a.shape for a in packed.values()))
  assert len(widths) == 1
