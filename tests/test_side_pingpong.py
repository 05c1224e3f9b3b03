"""The side-stream exchange in the data plane (``dataplane/side.py``) and the ping-pong whose
exchanges span the other nano-batch's linear work (``distca_jax/side_pingpong.py``), on CPU
through the copy's CPU handler (the g++ library, built here if missing).

Checked: one server's exchange with ``side_blocks`` equals the exchange without it, outputs and
gradients, on random routes; ``span`` equals its reference (copies and work), outputs and
gradients, in both orders; the residency rule and the other refusals name the fix; the
side-stream ping-pong of a real model (distca backend, its plans) equals
``model.ping_pong_layers``, loss and gradients, and in its compiled, scheduled program every
nano-batch's exchanges start before and are done after matrix products of the OTHER
nano-batch's post-/pre-CA, in the forward and in the backward, while the serialized variant has
none between; a few training steps with ``side_stream_blocks`` equal those without within 1e-5.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_side_pingpong.py
"""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from custom_ops import side_stream as ss
from distca_jax import backends
from distca_jax.dataplane import ExchangeOptions, ragged_exchange, side
from tests.test_side_stream import _library  # noqa: F401  (autouse: the CPU library)
from child_env import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mesh(n=1):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


def _self_case(rng):
  x_rows, recv = int(rng.integers(24, 200)), int(rng.integers(24, 200))
  x = jnp.asarray(rng.standard_normal((x_rows, 4, 8)), jnp.bfloat16)
  routes = ss.random_routes(rng, x_rows, recv, 1, fill=float(rng.uniform(0.3, 1.0)))
  # Self routes (plan.ROUTE_ROWS) at any offsets: the send offset is also the peer's send
  # offset, the receive offset also the peer's receive offset.
  routes[0, 0] = routes[5, 0] = int(rng.integers(0, x_rows - routes[3, 0] + 1))
  routes[2, 0] = routes[4, 0] = int(rng.integers(0, recv - routes[3, 0] + 1))
  return x, jnp.asarray(routes), recv


def test_side_exchange_equals_the_exchange_outputs_and_gradients(seed):
  rng = np.random.default_rng(seed)
  mesh = _mesh()
  for trial in range(3):
    x, routes, recv = _self_case(rng)
    ct = jnp.asarray(rng.standard_normal((recv, 4, 8)), jnp.bfloat16)

    def run(blocks):
      def f(x, routes):
        y, vjp = jax.vjp(lambda x: ragged_exchange(x, routes, recv, "data", "ring",
                                                   side_blocks=blocks), x)
        return y, vjp(ct)[0]
      return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()),
                                   check_vma=False))(x, routes)

    (y0, g0), (y1, g1) = run(0), run(int(rng.integers(1, 133)))
    np.testing.assert_array_equal(np.asarray(y1, np.float32), np.asarray(y0, np.float32),
                                  err_msg=f"{seed=} {trial=}")
    np.testing.assert_array_equal(np.asarray(g1, np.float32), np.asarray(g0, np.float32))
    assert np.asarray(y1, np.float32).any()  # rows did move


@pytest.mark.parametrize("order", ["overlap", "serial"])
def test_span_equals_its_reference_outputs_and_gradients(seed, order):
  rng = np.random.default_rng(seed)
  mesh = _mesh()
  where = side.Where(mesh, ("data",))
  (x1, r1, n1), (x2, r2, n2) = _self_case(rng), _self_case(rng)
  x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
  a = jnp.asarray(rng.standard_normal((16, 16)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  w1, w2, wo = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                for s in ((n1, 4, 8), (n2, 4, 8), (16, 8)))

  def work(a, b):
    return jnp.tanh(jnp.dot(a, b, precision="highest"))

  def loss(ys, out):
    return jnp.sum(ys[0] * w1) + jnp.sum(ys[1] * w2) + jnp.sum(out * wo)

  def got(x1, x2, a, b):
    return loss(*side.span(where, [(x1, r1[None], n1), (x2, r2[None], n2)], 8, work, (a, b),
                           order))

  def ref(x1, x2, a, b):
    return loss((ss.side_copy_reference(x1, r1, n1), ss.side_copy_reference(x2, r2, n2)),
                work(a, b))

  with jax.set_mesh(mesh):
    lg, gg = jax.jit(jax.value_and_grad(got, argnums=(0, 1, 2, 3)))(x1, x2, a, b)
  lr, gr = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2, 3)))(x1, x2, a, b)
  np.testing.assert_allclose(float(lg), float(lr), rtol=1e-6)
  for u, v in zip(gg, gr):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)


def test_residency_rule_and_refusals():
  for bad in (0, 133, -1, True, 8.0, "8"):
    with pytest.raises(ValueError, match=r"side_stream_blocks=.*resident at once on 132 SMs"):
      side.check_blocks(bad, 132)
  assert side.check_blocks(132, 132) == 132 and side.check_blocks(np.int64(8), 132) == 8
  with pytest.raises(ValueError, match=r"resident at once on 16 SMs; set 1..16"):
    side.check_blocks(17, 16)
  if jax.default_backend() == "cpu":
    assert side.sm_count() == side.DEFAULT_SMS  # the H100's count
  with pytest.raises(ValueError, match="resident"):
    ExchangeOptions(side_blocks=side.DEFAULT_SMS + 1)
  with pytest.raises(ValueError, match="resident"):
    backends.get("distca", side_stream_blocks=1000)
  with pytest.raises(ValueError, match=r"buckets=4 with side_stream_blocks=8: .* set "
                     r"attention.distca.buckets=1"):
    backends.get("distca", side_stream_blocks=8, buckets=4)
  with pytest.raises(ValueError, match="signal_only=True with side_stream_blocks"):
    ExchangeOptions(side_blocks=8, signal_only=True)
  with pytest.raises(ValueError, match="two_level.*side_stream_blocks=0"):
    ExchangeOptions(side_blocks=8, collective="two_level")
  # Several servers: refused in one line (no peer pointers).
  if jax.device_count() < 2:
    return
  mesh = _mesh(2)
  x = jnp.zeros((16, 4, 8), jnp.float32)
  routes = jnp.zeros((6, 2), jnp.int32)
  f = jax.shard_map(lambda x, r: ragged_exchange(x, r, 16, "data", "ring", side_blocks=8),
                    mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)
  with pytest.raises(ValueError, match=r"one server .* not of 2 servers.*side_stream_blocks=0"):
    jax.jit(f).lower(jnp.zeros((32, 4, 8)), routes)
  del x


# ---------------------------------------------------------------------------------------------
# The side-stream ping-pong of a real model.
# ---------------------------------------------------------------------------------------------
def _stack_case(seed, rows: int, n_layers: int, remat: str | None = None):
  """A real ping-pong stack on one device: the tiny model's layers, the distca backend with the
  side stream (8 CTAs), a batch's plans. Returns ``(stack, layers, x, on_mesh)``:
  ``stack('ref')`` is ``model.ping_pong_layers``, ``stack('overlap' | 'serial')`` the
  side-stream ping-pong, each a function of (layers, x) to the sum of its squared output;
  ``on_mesh()`` the mesh context to run them in."""
  from distca_jax import model as model_lib, sharding as shard_lib, side_pingpong, trainer
  from distca_jax.data import make_source
  from tests.test_dispatch import _tiny_config
  c = _tiny_config("distca", 1, 1, seed, rows_per_rank=rows, nano_batches=2)
  c.model.n_layers = n_layers
  c.model.remat = remat or c.model.remat
  c.attention.distca.side_stream_blocks = 8
  c.attention.distca.buckets = 1
  mesh = shard_lib.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])
  be = trainer.make_backend(c)
  m = trainer.make_model(c, be)
  params = trainer.create_train_state(c, m, trainer.make_optimizer(c), mesh).params
  src = make_source(c.data, rows=rows, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=seed)
  step = int(np.random.default_rng(seed).integers(0, 1000))
  batch = trainer.add_host_plan(src.batch(step), be, src.doclens(step), c.tokens_per_rank)
  plan = model_lib.execution_plan(m.cfg, nano_batches=2)
  layers = jax.tree.map(lambda a: getattr(a, "value", a), params["layers"]["layer"],
                        is_leaf=lambda a: hasattr(a, "value"))
  x = jax.random.normal(jax.random.key(seed), (rows, c.tokens_per_rank, m.cfg.dim), jnp.float32)
  pieces = model_lib.layer_pieces(m.cfg, be.fn)
  with trainer.mesh_context(mesh):
    lay = trainer.layout_of(trainer.device_batch(batch, mesh))

  def stack(variant):
    def run(layers, x):
      if variant == "ref":
        return model_lib.ping_pong_layers(plan, pieces, layers, x, lay)
      return side_pingpong.ping_pong_beside(plan, pieces, be.beside_fn, layers, x, lay,
                                            head_dim=m.cfg.head_dim, order=variant)
    return lambda layers, x: jnp.sum(run(layers, x).astype(jnp.float32) ** 2)
  return stack, layers, x, functools.partial(trainer.mesh_context, mesh)


def _check_equal(got, ref, what=""):
  np.testing.assert_allclose(float(got[0]), float(ref[0]), rtol=1e-5, err_msg=what)
  for u, v in zip(jax.tree.leaves(got[1]), jax.tree.leaves(ref[1])):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-4, atol=1e-5, err_msg=what)


@pytest.mark.slow
def test_side_pingpong_equals_ping_pong_and_spans_the_other_nano_batch(seed):
  from distca_jax import side_pingpong
  stack, layers, x, on_mesh = _stack_case(seed, rows=4, n_layers=3)
  runs = {}
  with on_mesh():
    for name in ("ref", "overlap", "serial"):
      compiled = jax.jit(jax.value_and_grad(stack(name), argnums=(0, 1))).lower(
          layers, x).compile()
      runs[name] = (compiled(layers, x), compiled.as_text())
  for name in ("overlap", "serial"):
    _check_equal(runs[name][0], runs["ref"][0], name)
  spans, fwd, bwd = side_pingpong.spans_other(runs["overlap"][1])
  # 12 copies forward (the scan's unit once: B's and A's send, 2 copies each, and return; the
  # prologue's A and the epilogue's B, a send and a return each) and 12 backward; the prologue's
  # and the epilogue's returns have nothing beside them (at most 4 spans without the other's
  # products); a rematerialized forward may add more.
  assert len(spans) >= 24 and len(spans) - fwd - bwd <= 4 and fwd >= 8 and bwd >= 8, (
      fwd, bwd, len(spans))
  # Serialized (each copy done before the work it would span): XLA may still put an unrelated
  # product of the other nano-batch between a start and its done (3 forward spans of 24 here),
  # never the work the span is for.
  spans_s, fwd_s, bwd_s = side_pingpong.spans_other(runs["serial"][1])
  assert len(spans_s) == len(spans) and fwd_s + bwd_s <= 4 and bwd_s == 0, (fwd_s, bwd_s)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["save_attention", "full"])
def test_side_pingpong_under_remat_policies(seed, remat):
  """The layers' remat policy wraps the units (the span's custom VJP inside jax.checkpoint):
  the same loss and gradients as model.ping_pong_layers."""
  stack, layers, x, on_mesh = _stack_case(seed, rows=2, n_layers=2, remat=remat)
  with on_mesh():
    ref, got = (jax.jit(jax.value_and_grad(stack(v), argnums=(0, 1)))(layers, x)
                for v in ("ref", "overlap"))
  _check_equal(got, ref, remat)


# ---------------------------------------------------------------------------------------------
# Training: side stream vs not, the same losses.
# ---------------------------------------------------------------------------------------------
_TRAIN = r"""
import json, sys
from distca_jax import configs_io, side_pingpong, trainer
out, traced = {}, []
run = side_pingpong.ping_pong_beside
side_pingpong.ping_pong_beside = lambda *a, **k: (traced.append(blocks), run(*a, **k))[1]
for blocks in (0, 8):
  c = configs_io.load_config("configs/tiny_cpu.py", [
      "num_steps=4", "optim.warmup_steps=1", "log_every=1", "checkpoint_every=0",
      "tensorboard=False", "eval_every=0", "model.n_layers=2", "tokens_per_rank=128",
      "rows_per_rank=4", "attention.backend=distca", "attention.nano_batches=2",
      "attention.distca.local_steps=False", "attention.distca.min_gain=0.0",
      f"attention.distca.side_stream_blocks={blocks}", "attention.distca.buckets=1"])
  out[blocks] = [r["loss"] for r in trainer.train_and_evaluate(c, sys.argv[1] + f"/{blocks}")]
out["traced"] = traced
print("LOSSES", json.dumps(out))
"""


@pytest.mark.slow
def test_training_losses_with_the_side_stream_equal_without(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=cpu_xla_flags(1))
  r = subprocess.run([sys.executable, "-c", _TRAIN, str(tmp_path)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.split("LOSSES", 1)[1])
  assert len(got["0"]) == len(got["8"]) == 4 and np.isfinite(got["0"]).all()
  np.testing.assert_allclose(got["8"], got["0"], rtol=1e-5)
  assert got["traced"] and set(got["traced"]) == {8}, got["traced"]  # the trainer ran it


def test_cuda_program_of_a_span_lowers_forward_and_backward():
  """The CUDA program (cross-lowered on CPU): a start and a done forward and backward, both
  side-effecting (never merged nor dropped), with the SM budget and done's aliasing."""
  mesh = _mesh()
  where = side.Where(mesh, ("data",))
  x = jax.ShapeDtypeStruct((96, 2, 8, 128), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((1, 6, 1), jnp.int32)
  a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)

  def f(x, r, a):
    (y,), out = side.span(where, [(x, r, 128)], 16, lambda a: jnp.tanh(a @ a), (a,))
    return jnp.sum(y.astype(jnp.float32)) + jnp.sum(out.astype(jnp.float32))

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(f, argnums=(0, 2))).trace(x, r, a).lower(
        lowering_platforms=("cuda",)).as_text()
  starts = [l for l in text.splitlines() if f"@{ss.START}(" in l]
  dones = [l for l in text.splitlines() if f"@{ss.DONE}(" in l]
  assert len(starts) == len(dones) == 2, text
  assert all("has_side_effect = true" in l for l in starts + dones), starts + dones
  assert all("blocks = 16 : i64, on_side = 1 : i64" in l for l in starts), starts
  assert all("output_operand_aliases" in l for l in dones), dones
  assert text.count("optimization_barrier") == 4, text


def test_simulator_credits_only_the_measured_overlap():
  from distca_jax.sim import overlap
  m = overlap.measured(8)  # both tables measured 8 CTAs: the lower hidden, the higher slowdown
  rows = [r for t in overlap.TABLES for r in json.load(open(os.path.join(ROOT, t)))["rows"]
          if r["blocks"] == 8]
  assert len(rows) == 2 and len(m["tables"]) == 2
  assert m["hidden"] == min(1.0, min(r["hidden"] for r in rows)) < 1.0
  assert m["slowdown"] == max(1.0, max(r["slowdown"] for r in rows)) > 1.0
  assert overlap.measured(32)["hidden"] <= 1.0  # a table's 140% (noise) is capped at 100%
  with pytest.raises(ValueError, match=r"side_stream_blocks=12: no overlap measured.*\[4, 8, "):
    overlap.measured(12)
  exposed, linear = overlap.credit(np.array([2.0]), np.array([10.0]), 8, servers=1)
  np.testing.assert_allclose(exposed, 2.0 * (1 - m["hidden"]))
  np.testing.assert_allclose(linear, 10.0 * m["slowdown"])
  assert overlap.credit(2.0, 10.0, 0, servers=4) == (2.0, 10.0)
  with pytest.raises(ValueError, match="one server's exchange only, not 4"):
    overlap.credit(2.0, 10.0, 8, servers=4)
