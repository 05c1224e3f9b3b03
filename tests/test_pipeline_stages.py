"""Per-stage CAD (`attention.distca.pool_stages=False`) on fake CPU devices: each pipeline stage's
data ranks are their own server group. The data plane with rows over (pipe, data) and the
exchange over 'data' equals per-document attention (outputs and gradients, 'ring' and 'dense');
the host plans keep every stage's CA-tasks on that stage's servers while the pooled plans move
work across stages; the pipelined model's loss and gradients under per-stage CAD equal pooled CAD
and local attention."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from distca_jax import config as config_lib
from distca_jax import dataplane, pipeline, trainer
from distca_jax import plan as plan_lib
from distca_jax.data import make_source
from distca_jax.data.workloads import WorkloadSampler
from distca_jax.plan import ticks as ticks_lib
from distca_jax.plan.buckets import bucket_specs
from test_dispatch import D, H, KH, T, _check, _inputs, _reference, _segments
from test_pipeline import DISTCA, loss_and_grads
from test_train import _with_heads, tiny_config

STAGES, DATA = 2, 4
CAP = plan_lib.Capacity(q_send=T, kv_send=DATA * T, q_recv=2 * T, kv_recv=DATA * T,
                        q_tokens=3 * T // 2, kv_tokens=2 * DATA * T, tasks=48)
SPEC = plan_lib.PlanSpec(num_servers=DATA, tokens_per_row=T, rows_per_device=1, capacity=CAP)


def _pipe_mesh():
  devs = np.asarray(jax.devices()[:STAGES * DATA]).reshape(STAGES, DATA)
  return jax.sharding.Mesh(devs, ("pipe", "data"), axis_types=(AxisType.Auto,) * 2)


def _group_layouts(rng):
  """Per stage: DATA rows of documents; stage 0 has one rank holding one whole-row document (its
  plan must move rows), stage 1 a random Pretrain layout."""
  heavy = [[int(x) for x in rng.integers(1, 24, size=int(rng.integers(1, 5)))]
           for _ in range(DATA)]
  heavy[int(rng.integers(DATA))] = [T]
  ws = WorkloadSampler("pretrain", T, seed=int(rng.integers(1 << 20)))
  return [heavy, ws.step_doclens(int(rng.integers(100)), DATA)]


@pytest.mark.parametrize("collective", ["ring", pytest.param("dense", marks=pytest.mark.slow)])
def test_exchange_over_data_within_each_stage_equals_per_document_attention(seed, collective):
  """Rows sharded over (pipe, data), every collective over 'data': each pipe index runs its own
  plan on its own DATA servers; outputs and gradients equal each document's attention alone."""
  rng = np.random.default_rng(seed)
  groups = _group_layouts(rng)
  opts = plan_lib.PlanOptions(tolerance=0.0, q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4,
                              min_shard=None)
  plans = [plan_lib.host_plan(g, SPEC, options=opts) for g in groups]
  moved = [plan_lib.exchange_bytes(hp.meta, q_heads=H, kv_heads=KH, head_dim=D,
                                   dtype_bytes=4)["dispatch_useful"] for hp in plans]
  assert moved[0] > 0, (moved, f"seed={seed}")
  seg = [_segments(g, DATA, T) for g in groups]
  seg[1] = np.where(seg[1] > 0, seg[1] + seg[0].max(), 0)  # documents of two stages never meet
  q, k, v, ct = _inputs(rng, rows=STAGES * DATA)
  want = _reference(q, k, v, np.concatenate(seg, axis=1), ct)
  mesh = _pipe_mesh()
  options = dataplane.DispatchOptions(
      data_axis=("pipe", "data"), server_axis="data",
      exchange=dataplane.ExchangeOptions(collective=collective))

  def run(q, k, v, plan, ct):
    o, vjp = jax.vjp(lambda q, k, v: dataplane.dispatch_attention(
        q, k, v, plan, SPEC, options, mesh=mesh), q, k, v)
    return (o, *vjp(ct))

  rows = NamedSharding(mesh, P(("pipe", "data")))
  got = jax.jit(run, in_shardings=(rows,) * 5)(q, k, v, np.concatenate(
      [hp.packed for hp in plans]), ct)
  _check(got, want, f"{collective} seed={seed} moved={moved}")


def test_server_axis_errors_name_the_fix():
  with pytest.raises(ValueError, match="server_axis='pipe' must be the trailing axes"):
    dataplane.DispatchOptions(data_axis=("pipe", "data"), server_axis="pipe")
  with pytest.raises(ValueError, match="server_axis='data' must be the trailing axes"):
    dataplane.DispatchOptions(data_axis="tensor", server_axis="data")
  assert dataplane.DispatchOptions(data_axis=("pipe", "data")).exchange_axis == ("pipe", "data")
  q = np.zeros((STAGES * DATA, T, H, D), np.float32)
  plan = np.zeros((STAGES * DATA, SPEC.width), np.int32)
  pooled = dataplane.DispatchOptions(data_axis=("pipe", "data"))  # 8 servers, a 4-server plan
  with pytest.raises(ValueError, match=r"servers on \('pipe', 'data'\)=8 does not match"):
    dataplane.dispatch_attention(q, q[:, :, :KH], q[:, :, :KH], plan, SPEC, pooled,
                                 mesh=_pipe_mesh())


def _pipe_config(pool: bool, data: int = DATA, **over):
  c = _with_heads(tiny_config(**DISTCA, **{
      "mesh.pipe": STAGES, "mesh.data": data, "rows_per_rank": 4, "pipeline.microbatches": 2,
      "attention.backend": "distca", "tokens_per_rank": 256,
      "attention.distca.pool_stages": pool}, **over))
  config_lib.validate(c)
  return c


def test_per_stage_plans_keep_each_stage_on_its_servers_pooled_plans_cross(seed):
  """Each tick: per-stage CAD plans the P stages' rows separately on DATA servers each (every
  task's server is in its document owner's stage, and the stage's work stays there) and packs
  them in (stage, rank, row) order; pooled CAD plans the tick on P x DATA servers and, in the
  warm-up tick (stage 1 holds nothing), moves stage 0's work onto stage 1's ranks."""
  from distca_jax.backends import distca as distca_backend
  per_stage, pooled = _pipe_config(False, seed=seed), _pipe_config(True, seed=seed)
  # The backends of one tick's call (what pipeline.per_tick_backend calls per tick).
  b_stage, b_pool = (distca_backend.make(distca_backend.from_first_batches(
      c, distca_backend.Options.from_config(c))) for c in (per_stage, pooled))
  src = make_source(per_stage.data, rows=DATA * 4, tokens_per_row=256,
                    vocab_size=per_stage.model.vocab_size, seed=seed)
  r = 4 // 2  # rows per device and tick
  crossed = 0
  for step in range(3):
    for t, rows in enumerate(ticks_lib.tick_rows(src.doclens(step), stages=STAGES,
                                                 rows_per_rank=4, microbatches=2)):
      plans = b_stage.host_plans(rows, 256)
      assert len(plans) == STAGES, f"seed={seed} step={step} tick={t}"
      for s, hp in enumerate(plans):
        p = hp.plan
        stage_rows = rows[s * DATA * r:(s + 1) * DATA * r]
        assert p.num_servers == DATA
        np.testing.assert_array_equal(p.doc_lens, [x for row in stage_rows for x in row if x])
        owner = s * DATA + p.doc_starts[p.tasks[:, 0]] // (r * 256)
        server = s * DATA + p.tasks[:, 3]
        np.testing.assert_array_equal(owner // DATA, server // DATA)
        pairs = [sum(x * (x + 1) // 2 for row in stage_rows[d * r:(d + 1) * r] for x in row)
                 for d in range(DATA)]
        np.testing.assert_array_equal(p.loads_before, pairs)
        assert p.loads_after.sum() == sum(pairs)
      packed = b_stage.host_prepare(rows, 256)["distca_plan"]
      # Every stage's plan in the smallest capacity bucket all of them fit (plan.buckets).
      buckets = bucket_specs(plans[0].spec, per_stage.attention.distca.buckets)
      k = buckets.choose(*[hp.plan for hp in plans])
      np.testing.assert_array_equal(packed, np.concatenate([
          buckets.pack(buckets.in_bucket(rows[s * DATA * r:(s + 1) * DATA * r], hp, k).packed, k)
          for s, hp in enumerate(plans)]))
      (pool,) = b_pool.host_plans(rows, 256)
      assert pool.plan.num_servers == STAGES * DATA
      crossed += int(pool.plan.pair_q_rows[:DATA, DATA:].sum()
                     + pool.plan.pair_q_rows[DATA:, :DATA].sum())
      if t == 0:  # warm-up: stage 1's slots are bubbles
        assert plans[1].plan.loads_after.sum() == 0
        assert pool.plan.loads_after[DATA:].sum() > 0, f"seed={seed} step={step}"
  assert crossed > 0


def test_per_stage_options_from_config():
  """pool_stages=False under a pipeline: rows over (pipe, data), the exchange over 'data', P
  server groups; pooled and pipe=1 keep one group on the rows' axis. (The startup caps of both:
  tests/test_pipeline.py::test_startup_caps_are_sized_for_the_pooled_ticks.)"""
  from distca_jax import backends
  options = backends.module("distca").Options.from_config
  o = options(_pipe_config(False))
  assert (o.data_axis, o.server_axis, o.server_groups) == (("pipe", "data"), "data", STAGES)
  pooled = options(_pipe_config(True))
  assert (pooled.data_axis, pooled.server_axis, pooled.server_groups) == (("pipe", "data"), None,
                                                                          1)
  flat = options(tiny_config(**{"attention.backend": "distca",
                                "attention.distca.pool_stages": False}))
  assert (flat.data_axis, flat.server_axis, flat.server_groups) == ("data", None, 1)


@pytest.mark.slow  # three compiled pipelined steps: ~50 s on 2 shared CPU cores
@pytest.mark.parametrize("data,collective", [(2, "ring"), (2, "dense"), (4, "ring")])
def test_per_stage_loss_and_grads_equal_pooled_and_local(seed, data, collective):
  """One step of the pipelined model (pipe 2): per-stage CAD, pooled CAD and local attention
  (pipe 1) give the same loss and gradients on the same random batch and parameters; the batch
  is the first of the seed's steps whose per-stage plans move rows (so the exchange within each
  stage is exercised)."""
  over = {"seed": seed, "model.n_layers": 2, "model.remat": "none", "rows_per_rank": 2,
          "mesh.data": data, "mesh.tensor": 1, "tokens_per_rank": 128}
  flat = _with_heads(tiny_config(**over))
  piped = {pool: _with_heads(tiny_config(**over, **DISTCA, **{
      "mesh.pipe": 2, "attention.backend": "distca", "pipeline.microbatches": 2,
      "attention.distca.collective": collective, "attention.distca.pool_stages": pool}))
      for pool in (True, False)}
  src = make_source(flat.data, rows=data * 2, tokens_per_row=flat.tokens_per_rank,
                    vocab_size=flat.model.vocab_size, seed=seed)
  per_stage = trainer.make_backend(piped[False])
  moved = lambda doclens: sum(
      int(hp.plan.pair_q_rows.sum())
      for rows in ticks_lib.tick_rows(doclens, stages=2, rows_per_rank=2, microbatches=2)
      for hp in per_stage.host_plans(rows, flat.tokens_per_rank))
  step = next((i for i in range(20) if moved(src.doclens(i)) > 0), None)
  assert step is not None, f"no batch of 20 moved rows within a stage (seed={seed})"
  batch, doclens = src.batch(step), src.doclens(step)
  loss_1, g_1 = loss_and_grads(flat, batch, doclens)
  assert np.isfinite(loss_1) and loss_1 > 1.0
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(g_1)]
  for pool, c in piped.items():
    loss_p, g_p = loss_and_grads(c, batch, doclens)
    np.testing.assert_allclose(loss_p, loss_1, rtol=1e-5, err_msg=f"pool_stages={pool}")
    for path, a, b in zip(paths, jax.tree.leaves(g_1), jax.tree.leaves(g_p)):
      assert np.abs(a).max() > 0, path
      np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6,
                                 err_msg=f"pool_stages={pool} {path} seed={seed}")
