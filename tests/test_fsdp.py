"""FSDP (`mesh.fsdp`) on 8 fake CPU devices: the parameters and Adam moments really are split over
`data`, the step gathers each layer's weights inside the layer loop, and the math is that of
the replicated layout (one step's loss and gradients, a training curve, checkpoints that cross
between the two layouts and between 8 and 4 devices). The fast tier keeps the placement checks
and one training representative (2 steps of the real loop, `local`, whose second loss follows
the first step's gradients); the gradients of every backend, layout and remat policy, the
40-step curves, the compiled loop's gathers and the checkpoints are in the slow tier."""

import re

import jax
import numpy as np
import pytest

from distca_jax import aot
from distca_jax import checkpoint as ckpt_lib
from distca_jax import config as config_lib
from distca_jax import sharding as shard_lib
from distca_jax import trainer
from distca_jax.data import make_source
from distca_jax.errors import UserError
from test_train import _with_heads, tiny_config

# CAD and baseline options of the tests (as tests/test_pipeline.py): balance every batch, CP
# groups of 2 data ranks.
BACKEND_OPTIONS = {"attention.distca.tolerance": 0.05, "attention.distca.min_gain": 0.0,
                   "attention.distca.local_gain": 0.0,
                   "attention.baselines.cp_size": 2, "attention.baselines.wlb_alpha": 1.25}


def _config(fsdp: bool, **over):
  return _with_heads(tiny_config(**{"mesh.fsdp": fsdp, **BACKEND_OPTIONS, **over}))


def _devices(c):
  return jax.devices()[:c.mesh.pipe * c.mesh.data * c.mesh.tensor]


def loss_and_grads(c, step: int):
  """(loss, gradients as NumPy, params) of batch `step` at the initial state, traced under the
  config's rules table (the train step's own loss)."""
  run = trainer.setup_run(c, devices=_devices(c))
  batch = trainer.add_host_plan(run.source.batch(step), run.backend, run.source.doclens(step),
                                c.tokens_per_rank)
  state = trainer.create_train_state(c, run.model, run.tx, run.mesh)

  def f(params, batch):
    total, count = run.model.apply({"params": params}, batch["inputs"], batch["targets"],
                                   batch["loss_mask"], trainer.layout_of(batch),
                                   method=run.model.loss)
    return total / count

  with trainer.mesh_context(run.mesh, c.mesh.fsdp):
    loss, grads = jax.jit(jax.value_and_grad(f))(state.params,
                                                 trainer.device_batch(batch, run.mesh))
  return float(loss), jax.tree.map(np.asarray, jax.device_get(grads)), state.params


def _assert_trees_close(got, want, rtol, atol):
  flat_w, flat_g = jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got)
  assert len(flat_w) == len(flat_g)
  for (path, w), g in zip(flat_w, flat_g):
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path))


def _shard_fraction(x) -> float:
  return x.addressable_shards[0].data.size / x.size


@pytest.mark.parametrize("over", [
    pytest.param({"mesh.data": 8}, marks=pytest.mark.slow),
    pytest.param({"mesh.data": 8, "attention.backend": "distca", "model.remat": "full"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 4, "mesh.tensor": 2, "attention.backend": "packed_dp",
                  "model.remat": "save_attention"}, marks=pytest.mark.slow),
    pytest.param({"mesh.data": 4, "mesh.tensor": 2, "attention.backend": "cp"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 8, "attention.backend": "wlb", "model.remat": "save_dots"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 8, "rows_per_rank": 2, "attention.nano_batches": 2,
                  "model.remat": "full"}, marks=pytest.mark.slow),
    pytest.param({"mesh.data": 8, "model.remat": "save_attention", "model.remat_mlp_layers": 1},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 4, "mesh.pipe": 2, "rows_per_rank": 4, "model.remat": "full"},
                 marks=pytest.mark.slow),
    pytest.param({"mesh.data": 2, "mesh.pipe": 2, "mesh.tensor": 2, "rows_per_rank": 4,
                  "attention.backend": "distca"}, marks=pytest.mark.slow),
], ids=["local", "distca-full", "packed_dp-tensor2-save_attention", "cp-tensor2", "wlb-save_dots",
        "pingpong", "remat_mlp_layers", "pipe2", "pipe2-tensor2-distca"])
def test_one_step_loss_and_gradients_equal_without_fsdp(seed, over):
  step = int(np.random.default_rng(seed).integers(1000))
  loss_0, g_0, _ = loss_and_grads(_config(False, seed=seed, **over), step)
  loss_1, g_1, params = loss_and_grads(_config(True, seed=seed, **over), step)
  assert np.isfinite(loss_0) and loss_0 > 1.0
  np.testing.assert_allclose(loss_1, loss_0, rtol=1e-6)
  _assert_trees_close(g_1, g_0, rtol=1e-5, atol=1e-7)
  # The FSDP run really split its weights over `data` (on top of `tensor` and `pipe`).
  data = over["mesh.data"]
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    assert "data" in jax.tree.leaves(tuple(x.sharding.spec)), jax.tree_util.keystr(path)
    assert _shard_fraction(x) <= 1 / data, jax.tree_util.keystr(path)


def test_every_weight_and_adam_moment_is_split_over_data():
  """Each parameter leaf and each Adam moment holds 1/8 of its elements per device: the `embed`
  dim over `data=8`."""
  c = _config(True, **{"mesh.data": 8})
  run = trainer.setup_run(c, devices=_devices(c))
  state = trainer.create_train_state(c, run.model, run.tx, run.mesh)
  dim = run.model.cfg.dim
  leaves = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
  big = [(p, x) for p, x in leaves if x.ndim >= 1 and x.size >= dim]
  assert len(big) >= 3 * len(jax.tree.leaves(state.params))  # params, mu, nu
  for path, x in big:
    shard = x.sharding.shard_shape(x.shape)
    axis = [i for i, (a, b) in enumerate(zip(x.shape, shard)) if a != b]
    assert len(axis) == 1 and x.shape[axis[0]] == dim and shard[axis[0]] == dim // 8, (
        jax.tree_util.keystr(path), x.shape, shard)
    assert _shard_fraction(x) == 1 / 8


def _computations(hlo: str) -> dict[str, str]:
  """HLO module text -> {computation name: its body text}."""
  out, name, lines = {}, None, []
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
    if head and name is None:
      name, lines = head.group(1), []
    elif line.startswith("}") and name is not None:
      out[name] = "\n".join(lines)
      name = None
    elif name is not None:
      lines.append(line)
  return out


def _loop_computations(comps: dict[str, str]) -> set[str]:
  """Names of the while-loop bodies and every computation they call, transitively."""
  todo = [m for text in comps.values() for m in re.findall(r"body=%?([\w.\-]+)", text)]
  seen: set[str] = set()
  while todo:
    n = todo.pop()
    if n in seen or n not in comps:
      continue
    seen.add(n)
    todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", comps[n])
    for group in re.findall(r"branch_computations=\{([^}]*)\}", comps[n]):
      todo += [g.strip().lstrip("%") for g in group.split(",")]
  return seen


def _gathered_shapes(text: str) -> list[tuple[int, ...]]:
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather\(", text)]


@pytest.mark.slow
def test_step_gathers_each_layer_s_weights_inside_the_layer_loop():
  """The compiled step all-gathers every per-layer weight inside a while loop (the layer scan,
  forward and backward), and no array of the program holds a weight matrix gathered for all
  layers (remat 'full' keeps none for the backward): the weights are gathered one layer at a
  time, not all at once up front. Its per-device arguments are the replicated layout's with the
  state (f32 params, two Adam moments) cut to 1/8."""
  over = {"mesh.data": 8, "model.n_layers": 3, "model.remat": "full"}
  c = _config(True, **over)
  compiled, info = aot.compile_train_step(c, devices=_devices(c))
  _, info_rep = aot.compile_train_step(_config(False, **over), devices=_devices(c))
  state_bytes = 3 * 4 * info_rep["params"]
  batch_bytes = info_rep["argument_size_in_bytes"] - state_bytes
  assert 0 <= batch_bytes < state_bytes / 8
  assert info["argument_size_in_bytes"] <= state_bytes / 8 + batch_bytes + (4 << 10)
  comps = _computations(compiled.as_text())
  loops = _loop_computations(comps)
  assert loops, "the step has no while loop (layer scan)"
  in_loops = [s for n in loops for s in _gathered_shapes(comps[n])]
  every_shape = {tuple(int(d) for d in dims.split(",") if d)
                 for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", compiled.as_text())}
  m = config_lib.model_config(c)
  e, h, k, d, f = m.dim, m.n_heads, m.n_kv_heads, m.head_dim, m.mlp_dim
  layer_weights = {"wq": (e, h, d), "wk/wv": (e, k, d), "wo": (h, d, e), "w_gate/w_up": (e, f),
                   "w_down": (f, e), "norm scale": (e,)}
  squeeze = lambda s: tuple(x for x in s if x != 1)  # a [1, ...] slice of the stack counts
  for name, shape in layer_weights.items():
    assert any(squeeze(s) == shape for s in in_loops), (name, shape, in_loops)
    if len(shape) > 1:  # matrices (a [L, E] shape may be another array's)
      assert (m.n_layers,) + shape not in every_shape, (name, shape)


def test_fsdp_needs_dim_divisible_by_data():
  c = _config(True, **{"mesh.data": 8, "model.dim": 60})
  with pytest.raises(UserError, match=r"model.dim=60 over mesh.data=8.*mesh.fsdp=False"):
    trainer.setup_run(c, devices=_devices(c))


def _train_losses(c, workdir):
  return [r["loss"] for r in trainer.train_and_evaluate(c, str(workdir))]


RUN = {"log_every": 1, "checkpoint_every": 0, "tensorboard": False, "optim.warmup_steps": 2,
       "mesh.data": 8, "rows_per_rank": 1}


@pytest.mark.parametrize("backend,steps", [
    # Two compiled training runs even at 2 steps (~30 s on 2 cores): the fast tier keeps the
    # placement and gather checks instead.
    pytest.param("local", 40, marks=pytest.mark.slow),
    pytest.param("distca", 40, marks=pytest.mark.slow),
])
def test_training_curve_equals_without_fsdp(backend, steps, tmp_path):
  """The real training loop, FSDP against the replicated layout: every step's loss within 1e-5
  relative (the run trains: the loss falls)."""
  over = {**RUN, "num_steps": steps, "attention.backend": backend}
  ref = _train_losses(_config(False, **over), tmp_path / "replicated")
  got = _train_losses(_config(True, **over), tmp_path / "fsdp")
  assert len(got) == len(ref) == steps
  np.testing.assert_allclose(got, ref, rtol=1e-5)
  if steps >= 40:
    assert min(ref) < ref[0] - 1.0


def _continue(c, state, start: int, n: int):
  """(state, losses) after steps start .. start + n - 1 on the config's devices (local backend)."""
  run = trainer.setup_run(c, devices=_devices(c))
  losses = []
  with trainer.mesh_context(run.mesh, c.mesh.fsdp):
    fn = trainer.jit_train_step(c, run.model, run.tx, run.mesh, run.state_shardings)
    for s in range(start, start + n):
      state, m = fn(state, trainer.device_batch(run.source.batch(s), run.mesh))
      losses.append(float(m["loss"]))
  return state, losses


def _restore(c, workdir, step):
  run = trainer.setup_run(c, devices=_devices(c))
  manager = ckpt_lib.CheckpointManager(str(workdir), c)
  try:
    return manager.restore(run.abstract_state, step), run.state_shardings
  finally:
    manager.close()


@pytest.mark.slow
def test_checkpoint_crosses_fsdp_and_device_count(tmp_path):
  """FSDP on 8 devices saves step 2; the replicated layout on 4 devices (2 rows per rank, the
  same batches) restores it, its shardings are its own, and it continues with the losses of the
  uninterrupted FSDP run. Its step-4 state, saved, restores into FSDP on 8 devices bit for bit."""
  common = {**RUN, "num_steps": 4, "checkpoint_every": 2, "async_checkpoint": False}
  fsdp8 = _config(True, **common)
  rep4 = _config(False, **{**common, "mesh.data": 4, "rows_per_rank": 2})
  full = _train_losses(fsdp8, tmp_path / "fsdp8")
  state, shardings = _restore(rep4, tmp_path / "fsdp8", 2)
  assert int(state.step) == 2
  for x, sh in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    assert x.sharding == sh and len(x.sharding.device_set) == 4
    assert _shard_fraction(x) == 1.0  # replicated over data=4 (tensor=1)
  state, losses = _continue(rep4, state, 2, 2)
  np.testing.assert_allclose(losses, full[2:], rtol=1e-5)

  manager = ckpt_lib.CheckpointManager(str(tmp_path / "rep4"), rep4)
  manager.save(4, state)
  manager.wait()
  manager.close()
  back, shardings = _restore(fsdp8, tmp_path / "rep4", 4)
  for (path, a), b, sh in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                              jax.tree.leaves(back), jax.tree.leaves(shardings)):
    assert b.sharding == sh, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))
  assert _shard_fraction(back.params["embedding"]) == 1 / 8


def test_hf_import_places_parameters_as_an_fsdp_run_does():
  """`hf_import.param_shardings(..., fsdp=True)` (what `load_hf_params(mesh=, fsdp=True)` puts
  each tensor on) equals the FSDP train state's parameter shardings."""
  from distca_jax import hf_import
  c = _config(True, **{"mesh.data": 4, "mesh.tensor": 2})
  run = trainer.setup_run(c, devices=_devices(c))
  got = hf_import.param_shardings(config_lib.model_config(c), run.mesh, fsdp=True)["params"]
  want = run.state_shardings.params
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    assert a == b, jax.tree_util.keystr(path)
  assert "data" in jax.tree.leaves(tuple(got["embedding"].spec))


@pytest.mark.parametrize("over,offered", [
    ({"mesh.data": -1}, True), ({"mesh.data": 4, "mesh.tensor": 2}, True),
    ({"mesh.data": -1, "mesh.fsdp": True}, False), ({"mesh.data": 1, "mesh.tensor": 8}, False),
    ({"mesh.data": 8, "model.dim": 60}, False)])
def test_does_not_fit_offers_fsdp_where_it_applies(over, offered):
  """The pre-flight's knobs (`aot.knob_variants`) offer `mesh.fsdp=True` when there are several
  data ranks that divide model.dim and FSDP is off."""
  c = _config(over.pop("mesh.fsdp", False), **over)
  knobs = dict(aot.knob_variants(c, 8))
  assert (knobs.get("mesh.fsdp=True") == {"mesh.fsdp": True}) == offered, knobs
