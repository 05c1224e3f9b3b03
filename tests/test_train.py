"""The training system: sharded == single device, exact resume, configs, AOT compile."""

import collections
import dataclasses
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import aot, configs_io, trainer
from distca_jax import attention as attn_lib
from distca_jax import sharding as shard_lib
from distca_jax.data import make_source
from child_env import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def tiny_config(**over):
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  c.model.n_layers = 2
  c.tokens_per_rank = 64
  c.attention.block_q = 16
  c.attention.block_k = 32
  c.model.loss_chunk = 32
  for k, v in over.items():
    node = c
    *parents, leaf = k.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = v
  return c


def fresh_params(c, devices):
  """Config c's initial parameters on its mesh over ``devices``."""
  mesh = shard_lib.make_mesh(data=c.mesh.data, tensor=c.mesh.tensor, devices=devices)
  return trainer.create_train_state(c, trainer.make_model(c), trainer.make_optimizer(c),
                                    mesh).params


def loss_and_grads(c, devices, batch_np, params=None):
  """Loss and gradients of config c on ``batch_np`` at ``params`` (default: c's initial ones).
  Configs that differ only in how the model runs (remat, nano-batches) init the same parameters
  (`trainer` inits under the default execution plan): their comparisons pass one set."""
  mesh = shard_lib.make_mesh(data=c.mesh.data, tensor=c.mesh.tensor, devices=devices)
  model = trainer.make_model(c)
  if params is None:
    params = fresh_params(c, devices)

  def f(params, batch):
    total, count = model.apply({"params": params}, batch["inputs"], batch["targets"],
                               batch["loss_mask"], trainer.layout_of(batch),
                               method=model.loss)
    return total / count

  with trainer.mesh_context(mesh):
    loss, grads = jax.jit(jax.value_and_grad(f))(params, trainer.device_batch(batch_np, mesh))
  return float(loss), jax.tree.map(np.asarray, jax.device_get(grads))


@pytest.mark.parametrize("data,tensor", [
    (8, 1), pytest.param(4, 2, marks=pytest.mark.slow), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_sharded_loss_and_grads_equal_single_device(seed, data, tensor):
  # 8 query / 4 kv heads: divisible by every tensor size tested.
  c = _with_heads(tiny_config(**{"mesh.data": data, "mesh.tensor": tensor, "seed": seed}))
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=seed)
  batch = src.batch(int(np.random.default_rng(seed).integers(1000)))
  single = _with_heads(tiny_config(**{"mesh.data": 1, "mesh.tensor": 1, "seed": seed}))
  loss_1, g_1 = loss_and_grads(single, jax.devices()[:1], batch)
  loss_n, g_n = loss_and_grads(c, jax.devices()[:data * tensor], batch)
  assert np.isfinite(loss_1) and loss_1 > 1.0
  np.testing.assert_allclose(loss_n, loss_1, rtol=1e-5)
  flat_1, flat_n = jax.tree.leaves(g_1), jax.tree.leaves(g_n)
  assert len(flat_1) == len(flat_n)
  for a, b in zip(flat_1, flat_n):
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6)


def _with_heads(c):
  c.model.n_kv_heads = 4
  c.model.n_heads = 8
  c.model.head_dim = 16
  return c


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_every_config_loads_and_validates(path):
  from distca_jax import config as config_lib
  c = configs_io.load_config(path)
  config_lib.validate(c)
  cfg = config_lib.model_config(c)
  assert cfg.num_params() > 0
  with open(path) as f:
    doc = f.read()
  assert "python -m distca_jax.train" in doc or "aot_memory" in doc, "docstring must give the run command"


def test_config_override_errors():
  path = os.path.join(ROOT, "configs", "tiny_cpu.py")
  with pytest.raises(Exception, match="no_such_key"):
    configs_io.load_config(path, ["model.no_such_key=1"])
  with pytest.raises(ValueError, match="key=value"):
    configs_io.load_config(path, ["model.dim"])
  c = configs_io.load_config(path, ["model.dim=96", "optim.lr=1"])
  assert c.model.dim == 96 and c.optim.lr == 1.0


def test_bad_mesh_is_a_clear_error():
  with pytest.raises(ValueError, match="devices are visible"):
    shard_lib.make_mesh(data=3, tensor=1)
  with pytest.raises(ValueError, match="mesh.pipe=3 must divide the 8 devices: lower them, or "
                                       "run on more devices; on a CPU, JAX_NUM_CPU_DEVICES=N"):
    shard_lib.make_mesh(pipe=3)


def test_data_ranks_reads_mesh_data_minus_one_once():
  """config.data_ranks: mesh.data as given, or -1 = every device over tensor x pipe, as the
  trainer's mesh lays it out; a non-positive tensor or pipe size names itself."""
  from distca_jax import config as config_lib
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"),
                             ["mesh.data=-1", "mesh.tensor=2", "mesh.pipe=2"])
  assert config_lib.data_ranks(c, 8) == 2 and config_lib.data_ranks(c, 16) == 4
  assert config_lib.data_ranks(c) == jax.device_count() // 4
  c.mesh.data = 3
  assert config_lib.data_ranks(c, 8) == 3
  c.mesh.data, c.mesh.pipe = -1, 0
  with pytest.raises(ValueError, match=r"^mesh.tensor=2 and mesh.pipe=0 must be >= 1$"):
    config_lib.data_ranks(c, 8)
  c.mesh.data, c.mesh.pipe, c.mesh.tensor = -1, 1, 2
  assert trainer.setup_run(c).mesh.shape["data"] == jax.device_count() // 2


def _run_train(workdir, overrides, env_devices, kill_after_ckpt=None):
  cmd = [sys.executable, "-m", "distca_jax.train", "--config", os.path.join(ROOT, "configs", "tiny_cpu.py"),
         "--workdir", workdir] + [f"--config.{o}" for o in overrides]
  env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(env_devices),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  if kill_after_ckpt is not None:
    ckpt = os.path.join(workdir, "checkpoints", str(kill_after_ckpt))
    deadline = time.time() + 300
    while not os.path.isdir(ckpt) and proc.poll() is None and time.time() < deadline:
      time.sleep(0.05)
    assert proc.poll() is None, "run finished before it could be killed:\n" + proc.stdout.read()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return None
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out
  return out


def _losses(workdir):
  by_step = {}
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      by_step[r["step"]] = r["loss"]  # a resumed run rewrites steps after its checkpoint
  return by_step


@pytest.mark.slow
def test_killed_and_resumed_run_reproduces_losses_exactly(tmp_path):
  over = ["num_steps=24", "log_every=1", "checkpoint_every=4", "tokens_per_rank=64",
          "rows_per_rank=2", "model.n_layers=2", "attention.block_q=32", "attention.block_k=32",
          "model.loss_chunk=64", "tensorboard=False", "optim.warmup_steps=2", "optim.lr=0.003"]
  full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
  out = _run_train(full, over, 2)
  assert "step 24/24" in out
  _run_train(killed, over, 2, kill_after_ckpt=8)
  partial = _losses(killed)
  assert 8 <= max(partial) < 24, f"the kill should land mid-run, got steps {sorted(partial)}"
  out = _run_train(killed, over, 2)
  assert "resumed from checkpoint" in out
  a, b = _losses(full), _losses(killed)
  assert sorted(a) == sorted(b) == list(range(1, 25))
  for s in a:
    assert a[s] == b[s], f"step {s}: uninterrupted {a[s]!r} vs resumed {b[s]!r}"
  # The loss must have fallen: the run really trained.
  assert min(a.values()) < a[1] - 1.0
  out = _run_train(killed, over, 2)
  assert "nothing to do" in out


@pytest.mark.slow
def test_8b_128k_compiles_ahead_of_time_on_8_devices():
  c = configs_io.load_config(os.path.join(ROOT, "configs", "llama3_8b_128k.py"))
  with aot.flash3_stand_in(c):
    _, info = aot.compile_train_step(c, devices=jax.devices()[:8])
  assert info["mesh"] == {"pipe": 1, "data": 2, "tensor": 4}
  assert 7.9e9 < info["params"] < 8.1e9
  # f32 params + Adam moments of 8B over tensor=4 x FSDP data=2: about 12 GB of arguments.
  assert 10 * 2**30 < info["argument_size_in_bytes"] < 13 * 2**30
  assert info["total_per_device_bytes"] > info["argument_size_in_bytes"]


def test_tiny_compiles_ahead_of_time_with_its_state_as_arguments():
  """The AOT path on the tiny model (the 8B compile is in the slow tier): the mesh asked for, the
  model's parameter count, and per-device arguments between the f32 params + two Adam moments
  spread over all 4 devices and all of them on each, plus the batch."""
  from distca_jax import config as config_lib
  c = _with_heads(tiny_config(**{"mesh.data": 2, "mesh.tensor": 2}))
  _, info = aot.compile_train_step(c, devices=jax.devices()[:4])
  assert info["mesh"] == {"pipe": 1, "data": 2, "tensor": 2}
  assert info["params"] == config_lib.model_config(c).num_params() > 0
  state_bytes = 3 * 4 * info["params"]
  assert state_bytes / 4 <= info["argument_size_in_bytes"] <= state_bytes + (1 << 20)
  assert info["total_per_device_bytes"] >= info["argument_size_in_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("data,tensor", [(4, 2)])
def test_ping_pong_equals_single_stream(seed, data, tensor):
  over = {"mesh.data": data, "mesh.tensor": tensor, "seed": seed, "rows_per_rank": 2}
  single = _with_heads(tiny_config(**over))
  pingpong = _with_heads(tiny_config(**over, **{"attention.nano_batches": 2}))
  src = make_source(single.data, rows=data * 2, tokens_per_row=single.tokens_per_rank,
                    vocab_size=single.model.vocab_size, seed=seed)
  batch = src.batch(int(np.random.default_rng(seed).integers(1000)))
  devices = jax.devices()[:data * tensor]
  params = fresh_params(single, devices)
  loss_1, g_1 = loss_and_grads(single, devices, batch, params)
  loss_2, g_2 = loss_and_grads(pingpong, devices, batch, params)
  np.testing.assert_allclose(loss_2, loss_1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_1), jax.tree.leaves(g_2)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("scan_layers,n_layers,remat", [
    pytest.param(True, 3, "full", marks=pytest.mark.slow),
    pytest.param(False, 3, "none", marks=pytest.mark.slow),
    pytest.param(False, 2, "full", marks=pytest.mark.slow), (True, 1, "save_attention")])
def test_ping_pong_schedule_variants_equal_single_stream(seed, scan_layers, n_layers, remat):
  """The cross-layer schedule (prologue, L - 1 units, epilogue) on scanned and unrolled stacks,
  one layer (no unit) and the remat policies: the single stream's loss and gradients."""
  over = {"mesh.data": 2, "mesh.tensor": 1, "seed": seed, "rows_per_rank": 2,
          "model.scan_layers": scan_layers, "model.n_layers": n_layers, "model.remat": remat}
  single = tiny_config(**over)
  pingpong = tiny_config(**over, **{"attention.nano_batches": 2})
  src = make_source(single.data, rows=4, tokens_per_row=single.tokens_per_rank,
                    vocab_size=single.model.vocab_size, seed=seed)
  batch = src.batch(int(np.random.default_rng(seed).integers(1000)))
  devices = jax.devices()[:2]
  params = fresh_params(single, devices)
  loss_1, g_1 = loss_and_grads(single, devices, batch, params)
  loss_2, g_2 = loss_and_grads(pingpong, devices, batch, params)
  np.testing.assert_allclose(loss_2, loss_1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_1), jax.tree.leaves(g_2)):
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remat", [
    pytest.param("full", marks=pytest.mark.slow), "save_attention",
    pytest.param("offload_mlp", marks=pytest.mark.slow)])
def test_remat_policies_keep_loss_and_gradients(seed, remat):
  """Every remat policy (what the backward keeps, reruns or fetches from host memory) gives the
  loss and gradients of no remat."""
  over = {"mesh.data": 2, "mesh.tensor": 1, "seed": seed, "model.n_layers": 2}
  assert_same_loss_and_grads(tiny_config(**over, **{"model.remat": "none"}),
                             tiny_config(**over, **{"model.remat": remat}), seed)


def assert_same_loss_and_grads(base, other, seed):
  """Both configs' loss and gradients on one seeded batch: equal trees, dtypes and values."""
  src = make_source(base.data, rows=2, tokens_per_row=base.tokens_per_rank,
                    vocab_size=base.model.vocab_size, seed=seed)
  batch = src.batch(int(np.random.default_rng(seed).integers(1000)))
  params = fresh_params(base, jax.devices()[:2])
  loss_1, g_1 = loss_and_grads(base, jax.devices()[:2], batch, params)
  loss_2, g_2 = loss_and_grads(other, jax.devices()[:2], batch, params)
  assert jax.tree.structure(g_1) == jax.tree.structure(g_2)
  np.testing.assert_allclose(loss_2, loss_1, rtol=1e-6, err_msg=f"seed {seed}")
  for a, b in zip(jax.tree.leaves(g_1), jax.tree.leaves(g_2)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=f"seed {seed}")


@pytest.mark.slow
@pytest.mark.parametrize("kept", [1, 3])
def test_remat_mlp_layers_keep_loss_and_gradients(seed, kept):
  """Keeping the MLP activations of the first layers (two scans over the stacked parameters, the
  weights cast to bf16 before them) gives save_attention's loss and gradients."""
  over = {"mesh.data": 2, "mesh.tensor": 1, "seed": seed, "model.n_layers": 3,
          "model.remat": "save_attention"}
  assert_same_loss_and_grads(tiny_config(**over),
                             tiny_config(**over, **{"model.remat_mlp_layers": kept}), seed)


def test_remat_mlp_layers_saves_the_mlp_of_those_layers_only():
  """What the backward keeps: the gate/up projections ([rows, T, F] values) of exactly the first
  N layers, and of the weights one bf16 copy of the stack (the two scans' inputs; none when
  N = 0, where the one scan slices the float32 stack inside each layer)."""
  from test_ops import saved_residuals
  from distca_jax import model as model_lib
  t, rows, f_dim = 16, 2, 96
  layout = attn_lib.Layout(jnp.ones((rows, t), jnp.int32),
                           jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (rows, 1)))
  tokens = jnp.zeros((rows, t), jnp.int32)
  attend = lambda q, k, v, lay, *, softmax_scale: q * softmax_scale
  base = model_lib.ModelConfig(n_layers=4, remat="save_attention", dim=64, mlp_dim=f_dim)
  params = jax.eval_shape(  # shapes only: saved_residuals traces, it runs nothing
      lambda: model_lib.Transformer(base, attend).init(jax.random.key(0), tokens, layout)["params"])
  for kept in (0, 1, 3):
    cfg = dataclasses.replace(base, remat_mlp_layers=kept)
    m = model_lib.Transformer(cfg, attend)
    saved = saved_residuals(lambda p: m.apply({"params": p}, tokens, layout).sum(), params)
    computed = [(dt, s) for dt, s, why in saved if "from the argument" not in why]
    # Each kept layer: gate and up, [rows, t, F] (a scan stacks them: [kept, rows, t, F]).
    acts = [s for _, s in computed if s[-3:] == (rows, t, f_dim)]
    assert sum(int(np.prod(s)) for s in acts) == kept * 2 * rows * t * f_dim, (kept, acts)
    # With two scans, their weights (bf16 slices of the stack) are kept once: gate and up of
    # every layer, [layers, E, F]; one scan reads the float32 stack itself.
    weights = [(dt, s) for dt, s in computed if s[-2:] == (64, f_dim)]
    assert sum(int(np.prod(s)) for _, s in weights) == (4 * 2 * 64 * f_dim if kept else 0)
    assert all(dt == "bf16" for dt, _ in weights), weights


@pytest.mark.parametrize("over,match", [
    ({"model.remat_mlp_layers": 1, "model.remat": "full"}, "needs remat='save_attention'"),
    ({"model.remat_mlp_layers": 3, "model.remat": "save_attention"}, r"must lie in \[0, n_layers=2\]"),
    ({"model.remat_mlp_layers": 1, "model.remat": "save_attention",
      "attention.nano_batches": 2, "rows_per_rank": 2}, "applies to the single stream")])
def test_remat_mlp_layers_rejects_what_it_cannot_do(over, match):
  c = tiny_config(**{"mesh.data": 2, "mesh.tensor": 1, **over})
  src = make_source(c.data, rows=4, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=0)
  with pytest.raises(ValueError, match=match):
    loss_and_grads(c, jax.devices()[:2], src.batch(0))


def test_offload_mlp_policy_offloads_the_mlp_names_and_saves_attention():
  from distca_jax import model as model_lib
  from jax.ad_checkpoint import checkpoint_name

  def f(x):
    return jnp.sum(jnp.sin(checkpoint_name(jnp.sin(x), "mlp_gate")) *
                   jnp.cos(checkpoint_name(jnp.cos(x), "ca_out")))
  policy = model_lib.REMAT_POLICIES["offload_mlp"]
  text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(f, policy=policy)))(jnp.ones(4)))
  assert "MemorySpace.Host" in text, text  # mlp_gate goes to host memory and comes back


def test_every_execution_plan_declares_the_same_parameter_tree():
  """`init` under each execution plan (single stream, ping-pong, a 2-stage pipeline on a
  pipe=2 x data=2 mesh; scanned and unrolled layers, the pipeline scanned only) declares the same
  parameters (paths, shapes and dtypes, abstractly), the paths those of the Linen declaration
  that checkpoints and Hugging Face import read."""
  from flax import linen as nn
  from distca_jax import model as model_lib
  t, rows = 8, 8
  layout = attn_lib.Layout(jnp.ones((rows, t), jnp.int32),
                           jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (rows, 1)))
  tokens = jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (rows, 1))
  attend = lambda q, k, v, lay, *, softmax_scale: q * softmax_scale
  mesh = shard_lib.make_mesh(data=2, tensor=1, pipe=2, devices=jax.devices()[:4])

  def init(cfg, **kw):
    model = model_lib.Transformer(cfg, attend, model_lib.execution_plan(cfg, **kw))
    with trainer.mesh_context(mesh):
      f = lambda: nn.meta.unbox(model.init(jax.random.key(0), tokens, layout)["params"])
      params = jax.eval_shape(f)
    return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(params)}

  for scan in (True, False):
    cfg = model_lib.ModelConfig(n_layers=2, scan_layers=scan)
    single = init(cfg)
    layer0 = "['layers']['layer']" if scan else "['layer_0']['layer']"
    assert f"{layer0}['pre_ca']['wq']" in single, sorted(single)
    assert f"{layer0}['post_ca']['mlp_norm']['scale']" in single, sorted(single)
    for kw in [{"nano_batches": 2}] + ([{"stages": 2}] if scan else []):
      other = init(cfg, **kw)
      assert other.keys() == single.keys(), (scan, kw)
      assert all((other[k].shape, other[k].dtype) == (v.shape, v.dtype)
                 for k, v in single.items()), (scan, kw)


def test_ping_pong_saves_activations_not_weights():
  """Under remat, what the ping-pong stack keeps for the backward is activations only (per
  unit: both residual streams, A's core-attention output, B's q/k/v): no layer's weights,
  whose slices taken outside a unit's checkpoint were once saved for every unit."""
  from test_ops import saved_residuals
  from distca_jax import model as model_lib
  t, rows = 16, 4
  layout = attn_lib.Layout(jnp.ones((rows, t), jnp.int32),
                           jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (rows, 1)))
  tokens = jnp.zeros((rows, t), jnp.int32)
  totals = {}
  for n_layers in (4, 8):
    cfg = model_lib.ModelConfig(n_layers=n_layers, remat="full", dim=128, mlp_dim=512)
    params = jax.eval_shape(  # shapes only: saved_residuals traces, it runs nothing
        lambda: model_lib.Transformer(cfg, lambda q, k, v, lay, *, softmax_scale: q).init(
            jax.random.key(0), tokens, layout)["params"])
    for nano in (1, 2):
      m = model_lib.Transformer(cfg, lambda q, k, v, lay, *, softmax_scale: q * softmax_scale,
                                model_lib.execution_plan(cfg, nano_batches=nano))
      saved = saved_residuals(lambda p: m.apply({"params": p}, tokens, layout).sum(), params)
      computed = [(dt, s) for dt, s, why in saved if "from the argument" not in why
                  and "from a constant" not in why]
      nbytes = {"f32": 4, "bf16": 2, "i32": 4, "f16": 2, "bool": 1}
      totals[n_layers, nano] = sum(int(np.prod(s)) * nbytes[dt] for dt, s in computed)
  per_layer = {n: (totals[8, n] - totals[4, n]) / 4 for n in (1, 2)}
  # Single stream: one residual stream per layer. Ping-pong: about 2.25x that (the streams, O
  # and q/k/v of half the rows); a layer's weights alone are 100x more than either.
  assert 0 < per_layer[2] <= 3 * per_layer[1]


def _ping_pong_steps(jaxpr):
  """(scope tag or None, eqn) of every top-level eqn of ``jaxpr``: the ping-pong step it was
  traced under."""
  from distca_jax.model import PING_PONG_SCOPE
  out = []
  for e in jaxpr.eqns:
    tags = [x for x in str(e.source_info.name_stack).split("/") if x.startswith(PING_PONG_SCOPE)]
    out.append((tags[-1][len(PING_PONG_SCOPE) + 1:] if tags else None, e))
  return out


def _runs(steps):
  tags = [t for t, _ in steps if t is not None]
  return [t for i, t in enumerate(tags) if i == 0 or tags[i - 1] != t]


def test_ping_pong_schedule_crosses_layers():
  """While one nano-batch's core attention runs, the other's post-CA of layer i and pre-CA of
  layer i + 1 follow it in program order and depend on nothing it produced (what lets XLA put
  the collectives behind those matmuls); the stack is one scan of L - 1 such units."""
  from distca_jax import model as model_lib
  n_layers, t = 4, 8
  cfg = model_lib.ModelConfig(n_layers=n_layers, remat="none")

  def attend(q, k, v, layout, *, softmax_scale):
    del k, v, layout
    return q * softmax_scale

  layout = attn_lib.Layout(jnp.ones((4, t), jnp.int32),
                           jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (4, 1)))
  tokens = jnp.zeros((4, t), jnp.int32)
  params = jax.eval_shape(  # shapes only: the checks read the traced program
      lambda: model_lib.Transformer(cfg, attend).init(jax.random.key(0), tokens, layout)["params"])
  model = model_lib.Transformer(cfg, attend, model_lib.execution_plan(cfg, nano_batches=2))
  jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens, layout))(params).jaxpr
  scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  assert [e.params["length"] for e in scans] == [n_layers - 1]
  top = _runs(_ping_pong_steps(jaxpr))
  assert top == ["pre_A", "ca_A", "pre_B", "ca_B", "post_A", "post_B"]  # prologue, epilogue
  unit = _ping_pong_steps(scans[0].params["jaxpr"].jaxpr)
  assert _runs(unit) == ["ca_B", "post_A", "pre_A", "ca_A", "post_B", "pre_B"]
  # Which steps each value of the unit was computed from.
  src = collections.defaultdict(set)
  for tag, e in unit:  # every eqn, tagged or not (glue between steps carries dependences too)
    deps = set().union(*[src[v] for v in e.invars if isinstance(v, jax.extend.core.Var)])
    for v in e.outvars:
      src[v] = deps | ({tag} if tag else set())
  reach = collections.defaultdict(set)
  for tag, e in unit:
    for v in e.outvars:
      reach[tag] |= src[v]
  assert "ca_B" not in reach["post_A"] | reach["pre_A"] | reach["ca_A"]
  assert "ca_A" not in reach["post_B"] | reach["pre_B"]
  assert "post_A" in reach["ca_A"] and "ca_B" in reach["post_B"]  # the chains themselves


def test_nano_batches_must_divide_rows():
  from distca_jax import config as config_lib
  c = tiny_config(**{"attention.nano_batches": 2, "rows_per_rank": 3})
  with pytest.raises(ValueError, match="multiple of attention.nano_batches"):
    config_lib.validate(c)


BACKEND_OVERRIDES = {
    "packed_dp": {},
    "cp": {"attention.baselines.cp_size": 2},
    "wlb": {"attention.baselines.cp_size": 2, "attention.baselines.wlb_alpha": 1.25},
    "distca": {"attention.distca.tolerance": 0.05, "attention.distca.min_gain": 0.0,
               "attention.distca.local_gain": 0.0},
    "distca-reference": {"attention.distca.tolerance": 0.05, "attention.distca.min_gain": 0.0,
                         "attention.distca.local_gain": 0.0,
                         "attention.kernel": "reference"},
}


BACKEND_RUN = {"mesh.data": 4, "mesh.tensor": 2, "num_steps": 3, "log_every": 1,
               "checkpoint_every": 0, "tensorboard": False, "optim.warmup_steps": 1}


@pytest.fixture(scope="module")
def local_losses(tmp_path_factory):
  """`local`'s losses on the backend comparison's run, trained once for every backend."""
  ref = _with_heads(tiny_config(**BACKEND_RUN))
  return [r["loss"] for r in trainer.train_and_evaluate(ref, str(tmp_path_factory.mktemp("local")))]


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKEND_OVERRIDES))
def test_every_backend_trains_like_local(backend, local_losses, tmp_path):
  """The real training loop with each backend: same batches, same init -> same losses as `local`
  (the strategies only move where attention runs), within float32 tolerance. Kernels: the
  configs' default 'auto' ('blockwise' on CPU; 'distca-reference': the dense kernel)."""
  losses_ref = local_losses
  c = _with_heads(tiny_config(**BACKEND_RUN, **{"attention.backend": backend.split("-")[0]},
                              **BACKEND_OVERRIDES[backend]))
  losses = [r["loss"] for r in trainer.train_and_evaluate(c, str(tmp_path / backend))]
  assert len(losses) == len(losses_ref) == 3
  np.testing.assert_allclose(losses, losses_ref, rtol=2e-5)


@pytest.mark.parametrize("t,chunk", [(37, 8), (64, 16), (11, 64)])
def test_chunked_cross_entropy_matches_full_logits(seed, t, chunk):
  """Any row length (a prime like WLB's 78643-token rows included) and chunk: the same sum and
  token count as full logits, and the same gradient, with chunks never smaller than asked."""
  from distca_jax import model as model_lib
  rng = np.random.default_rng([t, chunk, seed])
  b, e, v = 2, 8, 32
  h = jnp.asarray(rng.standard_normal((b, t, e)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((e, v)), jnp.float32)
  y = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
  m = jnp.asarray(rng.random((b, t)) < 0.8)
  scale = float(rng.uniform(0.5, 3.0))  # a cotangent other than 1 reaches the fused backward

  def full(h, w):
    return scale * model_lib.cross_entropy_reference(h, w, y, m)[0]

  def chunked(h, w):
    return scale * model_lib.chunked_cross_entropy(h, w, y, m, chunk)[0]

  got, want = jax.jit(chunked)(h, w), full(h, w)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert float(model_lib.chunked_cross_entropy(h, w, y, m, chunk)[1]) == float(m.sum())
  for g, r in zip(jax.jit(jax.grad(chunked, (0, 1)))(h, w), jax.grad(full, (0, 1))(h, w)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  # The LM head runs once per chunk without differentiation, and 3 matmuls per chunk (logits,
  # dh, dw) with it: the backward never recomputes the logits.
  count_dots = lambda f: str(jax.make_jaxpr(f)(h, w)).count("dot_general")
  assert count_dots(chunked) == 1
  assert count_dots(jax.grad(chunked, (0, 1))) == 3
  # The scan runs ceil(t / chunk) steps of min(chunk, t) tokens (not gcd-sized ones).
  lengths = re.findall(r"\blength=(\d+)", str(jax.make_jaxpr(chunked)(h, w)))
  assert lengths == [str(-(-t // min(chunk, t)))]


def test_launcher_xla_flag_defaults_keep_the_users_word():
  from distca_jax import launch
  name = "xla_gpu_enable_dynamic_slice_fusion"
  assert launch.xla_flags_with_defaults("") == f"--{name}=false"
  assert launch.xla_flags_with_defaults("--xla_force_host_platform_device_count=8") == (
      f"--xla_force_host_platform_device_count=8 --{name}=false")
  for given in (f"--{name}=true", f"--{name}", f"-{name}=true"):  # the user's setting stays
    assert launch.xla_flags_with_defaults(f"--a=1 {given}") == f"--a=1 {given}"
