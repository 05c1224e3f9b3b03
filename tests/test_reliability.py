"""Reliability: non-finite steps are skipped, damaged checkpoints are never trained on, a save
interrupted mid-write is ignored, bad input ends in one line, and a step that cannot fit in device
memory stops before it runs. results/reliability.md lists every fault with its command."""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import aot, configs_io, launch, memory, trainer
from distca_jax import checkpoint as ckpt_lib
from distca_jax import sharding as shard_lib
from distca_jax.data import DataError, FileSource
from distca_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny_cpu.py")
SMALL = ["model.n_layers=2", "tokens_per_rank=64", "rows_per_rank=2", "model.loss_chunk=64",
         "attention.block_q=32", "attention.block_k=32", "tensorboard=False"]


def small_config(*extra):
  return configs_io.load_config(TINY, SMALL + list(extra))


def one_device_setup(c):
  mesh = shard_lib.make_mesh(data=1, devices=jax.devices()[:1])
  model, tx = trainer.make_model(c), trainer.make_optimizer(c)
  abstract, state_sh = trainer.state_shardings(c, model, tx, mesh)
  return mesh, model, tx, abstract, state_sh


def leaves_np(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def identical(a, b):
  return all(x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
             for x, y in zip(leaves_np(a), leaves_np(b)))


# ---------------------------------------------------------------------------------------------
# 1. Non-finite guard
# ---------------------------------------------------------------------------------------------
def test_nonfinite_step_is_skipped_inside_the_step():
  c = small_config("optim.warmup_steps=0")  # lr > 0 from the first step
  mesh, model, tx, _, state_sh = one_device_setup(c)
  source = trainer.make_source(c.data, rows=c.rows_per_rank, tokens_per_row=c.tokens_per_rank,
                               vocab_size=c.model.vocab_size, seed=c.seed)
  batch = trainer.device_batch(source.batch(0), mesh)
  put = lambda host: jax.device_put(host, state_sh)
  start = jax.device_get(trainer.create_train_state(c, model, tx, mesh))
  with trainer.mesh_context(mesh):
    step = trainer.jit_train_step(c, model, tx, mesh, state_sh)  # donates the state
    good, m = step(put(start), batch)
    good = jax.device_get(good)
    assert float(m["skipped"]) == 0 and int(good.bad_steps) == 0 and int(good.step) == 1
    assert not identical(good.params, start.params), "a finite step must update the parameters"
    # A NaN weight makes the loss NaN: the step is skipped and the state kept bit for bit.
    bad_in = good.replace(params=jax.tree.map(lambda x: x.copy(), good.params))
    jax.tree.leaves(bad_in.params)[0][...] = np.nan
    out, m = step(put(bad_in), batch)
    out = jax.device_get(out)
    assert not np.isfinite(float(m["loss"]))
    assert float(m["skipped"]) == 1 and int(m["bad_steps"]) == 1 and int(m["skipped_steps"]) == 1
    assert int(out.step) == 2, "the data position still advances"
    assert identical(out.params, bad_in.params) and identical(out.opt_state, bad_in.opt_state)
    out2, m = step(put(out), batch)
    assert int(m["bad_steps"]) == 2 and int(out2.skipped_steps) == 2
    # The streak resets on the next finite step.
    fixed, m = step(put(jax.device_get(out2).replace(params=good.params)), batch)
    assert float(m["skipped"]) == 0 and int(fixed.bad_steps) == 0 and int(fixed.skipped_steps) == 2


def test_bad_step_watch_stops_after_max_consecutive():
  watch = trainer.BadStepWatch(3, lambda: "the last good checkpoint is step 4 at /x/4")
  for step, bad in enumerate([0, 1, 2, 0, 1, 2]):
    watch.add(step, jnp.int32(bad))
  watch.poll(wait=True)  # never 3 in a row
  watch.add(6, jnp.int32(3))
  with pytest.raises(trainer.TrainingDiverged, match=r"steps 5\.\.7 .*step 4 at /x/4"):
    watch.poll(wait=True)


# ---------------------------------------------------------------------------------------------
# 2. Verified checkpoints
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "uint32", "bool", "int8"])
def test_array_hash_sees_every_single_change_and_ignores_sharding(dtype):
  seed = 7
  rng = np.random.default_rng(seed)
  x = rng.integers(0, 2 if dtype == "bool" else 100, size=(16, 24)).astype(dtype)
  h = np.asarray(ckpt_lib._array_hash(jnp.asarray(x)))
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
  np.testing.assert_array_equal(np.asarray(jax.jit(ckpt_lib._array_hash)(sharded)), h,
                                err_msg=f"{seed=}")
  for i in rng.choice(x.size, 20, replace=False):
    y = x.copy().reshape(-1)
    y[i] = (not y[i]) if dtype == "bool" else y[i] + 1
    h2 = np.asarray(ckpt_lib._array_hash(jnp.asarray(y.reshape(x.shape))))
    assert (h2 != h).all(), f"{seed=} element {i}: hash unchanged"
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  if not np.array_equal(swapped, x):
    assert (np.asarray(ckpt_lib._array_hash(jnp.asarray(swapped))) != h).any(), "order-blind hash"


def _save_two(workdir, c, abstract, mesh, model, tx):
  """Checkpoints at steps 1 and 2 (different values); returns the two states on the host."""
  s1 = trainer.create_train_state(c, model, tx, mesh)
  s1 = s1.replace(step=s1.step + 1)
  s2 = s1.replace(step=s1.step + 1, params=jax.tree.map(lambda x: x * 1.5 + 0.25, s1.params))
  m = ckpt_lib.CheckpointManager(workdir, c)
  m.save(1, s1)
  m.save(2, s2)
  m.close()
  return jax.device_get(s1), jax.device_get(s2)


def test_save_refuses_a_nonfinite_state(tmp_path):
  c = small_config()
  mesh, model, tx, abstract, _ = one_device_setup(c)
  state = trainer.create_train_state(c, model, tx, mesh)
  bad = state.replace(opt_state=jax.tree_util.tree_map_with_path(
      lambda p, x: x.at[(0,) * x.ndim].set(jnp.inf) if ".mu" in jax.tree_util.keystr(p) else x,
      state.opt_state))
  m = ckpt_lib.CheckpointManager(str(tmp_path), c)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"not saving step 5: .*mu.* not finite"):
    m.save(5, bad)
  m.close()
  assert m.all_steps() == []


def _damage(path, offset, n=8):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(n)
    f.seek(offset)
    f.write(bytes(x ^ 0xA5 for x in b))


@pytest.mark.slow
def test_damaged_array_bytes_are_never_restored(tmp_path):
  """Every data file of the newest checkpoint, damaged at several offsets: the restored state is
  either bit-identical to what was saved at that step (the bytes were not part of any array) or
  the older checkpoint, with the failure reported by step and path."""
  c = small_config()
  mesh, model, tx, abstract, _ = one_device_setup(c)
  pristine = str(tmp_path / "pristine")
  s1, s2 = _save_two(pristine, c, abstract, mesh, model, tx)
  files = sorted(glob.glob(os.path.join(pristine, "checkpoints", "2", "state", "**", "d", "*"),
                           recursive=True))
  assert files
  fell_back = 0
  for f in files:
    size = os.path.getsize(f)
    for offset in sorted({0, size // 5, size // 3, size // 2, (3 * size) // 4, max(size - 8, 0)}):
      work = str(tmp_path / "work")
      shutil.rmtree(work, ignore_errors=True)
      shutil.copytree(pristine, work)
      _damage(os.path.join(work, os.path.relpath(f, pristine)), offset)
      lines = []
      m = ckpt_lib.CheckpointManager(work, c)
      state = m.restore_verified(abstract, report=lines.append)
      m.close()
      where = f"{os.path.relpath(f, pristine)} offset {offset}"
      if int(state.step) == 2:
        assert identical(state, s2), f"{where}: damaged step 2 restored with other values"
        assert not lines
      else:
        assert int(state.step) == 1 and identical(state, s1), where
        assert lines and "checkpoint step 2 at " in lines[0] and "does not verify" in lines[0]
        assert os.listdir(os.path.join(work, "checkpoints_failed")), "the failed one moves aside"
        fell_back += 1
  assert fell_back >= 4, "damage inside the arrays must be caught"


def test_no_checkpoint_verifies_is_one_clear_error(tmp_path):
  c = small_config()
  mesh, model, tx, abstract, _ = one_device_setup(c)
  _save_two(str(tmp_path), c, abstract, mesh, model, tx)
  for step in (1, 2):
    big = max(glob.glob(str(tmp_path / "checkpoints" / str(step) / "state" / "**" / "d" / "*"),
                        recursive=True), key=os.path.getsize)
    _damage(big, os.path.getsize(big) // 2, n=64)
  m = ckpt_lib.CheckpointManager(str(tmp_path), c)
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"no checkpoint in .* verifies \(2 tried.*step 2 at .*step 1 at "):
    m.restore_verified(abstract, report=lambda line: None)
  m.close()
  assert sorted(m.all_steps()) == [1, 2], "nothing is moved when nothing verifies"


# ---------------------------------------------------------------------------------------------
# Training subprocesses
# ---------------------------------------------------------------------------------------------
RUN = ["num_steps=12", "log_every=1", "checkpoint_every=4", "optim.warmup_steps=2"] + SMALL


def _cmd(workdir, overrides, config=TINY):
  return ([sys.executable, "-m", "distca_jax.train", "--config", config, "--workdir", workdir]
          + [f"--config.{o}" for o in overrides])


def _env(**extra):
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
              JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **extra)


def _run(workdir, overrides, config=TINY, **env):
  p = subprocess.run(_cmd(workdir, overrides, config), cwd=ROOT, env=_env(**env),
                     capture_output=True, text=True, timeout=600)
  return p.returncode, p.stdout, p.stderr


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _every_checkpoint_verifies(workdir, c):
  c.mesh.data = 1  # the runs' one device (`_env`): their batches had 1 x rows_per_rank rows
  _, _, _, abstract, _ = one_device_setup(c)
  m = ckpt_lib.CheckpointManager(workdir, c)
  steps = m.all_steps()
  for step in steps:
    m.restore(abstract, step)  # raises CheckpointError unless it verifies (finite included)
  m.close()
  return steps


@pytest.mark.slow
def test_diverging_run_stops_and_saves_nothing_nonfinite(tmp_path):
  rc, out, err = _run(str(tmp_path), RUN + ["optim.lr=1e6"])
  assert rc == 2, out + err
  assert "Traceback" not in err and "can't create new thread" not in err, err
  lines = [l for l in err.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "train.max_bad_steps=3" in lines[0], err
  assert "the last good checkpoint is step 4 at " in lines[0], err
  assert _every_checkpoint_verifies(str(tmp_path), small_config(*RUN)) == [4]


@pytest.mark.slow
def test_damaged_newest_checkpoint_is_never_trained_on(tmp_path):
  full, damaged = str(tmp_path / "full"), str(tmp_path / "damaged")
  rc, out, err = _run(full, RUN)
  assert rc == 0, out + err
  shutil.copytree(full, damaged)
  os.remove(os.path.join(damaged, "metrics.jsonl"))
  big = max(glob.glob(os.path.join(damaged, "checkpoints", "12", "state", "**", "d", "*"),
                      recursive=True), key=os.path.getsize)
  _damage(big, os.path.getsize(big) // 2, n=4096)
  rc, out, err = _run(damaged, RUN)
  assert rc == 0, out + err
  assert "checkpoint step 12 at " in out and "does not verify" in out, out
  assert "resumed from checkpoint at step 8" in out, out
  a, b = _losses(full), _losses(damaged)
  assert sorted(b) == list(range(9, 13))
  for s in range(9, 13):  # retrained from the verified step 8: the same losses as the first run
    assert a[s] == b[s], f"step {s}: {a[s]} vs {b[s]}"
  assert _every_checkpoint_verifies(damaged, small_config(*RUN)) == [4, 8, 12]
  assert os.listdir(os.path.join(damaged, "checkpoints_failed"))


@pytest.mark.slow
def test_run_killed_inside_a_save_resumes_from_the_previous_checkpoint(tmp_path):
  workdir = str(tmp_path)
  proc = subprocess.Popen(_cmd(workdir, RUN), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env=_env(**{ckpt_lib.SLOW_COMMIT_ENV: "8:120"}))
  ckpts = os.path.join(workdir, "checkpoints")
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    names = os.listdir(ckpts) if os.path.isdir(ckpts) else []
    if "4" in names and any(n.startswith("8.") and "tmp" in n for n in names):
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before the save at step 8:\n" + proc.stdout.read()
  time.sleep(1.0)  # well inside the 120 s the hook holds the commit
  names = os.listdir(ckpts)
  assert "8" not in names and any(n.startswith("8.") for n in names), names
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  rc, out, err = _run(workdir, RUN)
  assert rc == 0, out + err
  assert "resumed from checkpoint at step 4" in out, out
  assert _every_checkpoint_verifies(workdir, small_config(*RUN)) == [4, 8, 12]


# ---------------------------------------------------------------------------------------------
# 3. Clear errors
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, expect", [
    (["foo=1"], "unknown config key 'foo'"),
    (["model.n_layrs=3"], "unknown config key 'model.n_layrs'; nearest valid keys: model.n_layers"),
    (["mesh.data=3"], "mesh data=3"),
    (["attention.backend=nope"], "unknown core-attention backend 'nope'"),
    (["data.source=files", "data.path=/nonexistent/ds"], "tokens file not found"),
    (["train.max_bad_steps=0"], "train.max_bad_steps=0 must be >= 1"),
    (["model.n_heads=5"], "n_heads=5 must be a multiple of n_kv_heads"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, overrides, expect):
  rc, out, err = _run(str(tmp_path), SMALL + overrides)
  assert rc == 2, out + err
  assert err.strip().count("\n") == 0 and err.startswith("error: ") and expect in err, err
  assert "step 1/" not in out


def test_verbose_keeps_the_traceback(tmp_path):
  p = subprocess.run(_cmd(str(tmp_path), SMALL + ["mesh.data=3"]) + ["--verbose"], cwd=ROOT,
                     env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode != 0 and "Traceback" in p.stderr and "mesh data=3" in p.stderr


def test_unknown_key_message_names_the_nearest_keys():
  c = configs_io.load_config(TINY)
  assert "optim.lr" in configs_io.unknown_key_message(c, "optim.lrr")
  assert "model.n_layers" in configs_io.unknown_key_message(c, "n_layers")  # wrong section
  with pytest.raises(UserError, match="nearest valid keys: model.dim"):
    configs_io.load_config(TINY, ["model.dmi=3"])


# ---------------------------------------------------------------------------------------------
# 4. Memory pre-flight
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_memory_preflight_stops_before_the_first_step(tmp_path):
  c = small_config("num_steps=2", "optim.warmup_steps=0", "checkpoint_every=0")
  with pytest.raises(memory.DoesNotFit) as e:
    trainer.train_and_evaluate(c, str(tmp_path), device_memory_bytes=1 << 16)
  err = e.value
  assert err.need > 1 << 16 and err.capacity == 1 << 16
  assert not os.path.exists(tmp_path / "metrics.jsonl") or not open(tmp_path / "metrics.jsonl").read()
  # With the knobs: each compiled ahead of time; the one that halves the tokens needs less.
  c.mesh.data = 1
  explained = aot.explain_does_not_fit(c, err, devices=jax.devices()[:1])
  text = str(explained)
  assert "\n" not in text and "per device" in text and "0.06 MiB (bytes_limit)" in text
  assert "model.remat=full needs" in text and "tokens_per_rank=32 needs" in text, text


def test_out_of_memory_at_run_time_is_reported_like_the_preflight():
  err = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 112.42GiB.")
  with pytest.raises(memory.DoesNotFit, match=r"ran out of device memory \(RESOURCE_EXHAUSTED.*"
                     r"needs 100\.00 GiB per device .* 140\.00 GiB"):
    memory.raise_if_out_of_memory(err, 100 << 30, None, capacity=140 << 30)
  memory.raise_if_out_of_memory(RuntimeError("INTERNAL: something else"), 1, None, capacity=2)


def test_capacity_of_a_cpu_device_is_unknown():
  assert memory.device_capacity_bytes(jax.devices()[0]) is None


@pytest.mark.slow
def test_memory_preflight_one_line_from_the_entry_point(tmp_path):
  rc, out, err = _run(str(tmp_path), SMALL + ["num_steps=2", "optim.warmup_steps=0"],
                      **{launch.DEVICE_MEMORY_ENV: str(1 << 20)})
  assert rc == 2, out + err
  assert err.count("\n") == 1 and "does not fit in device memory" in err, err
  assert "model.remat=full needs" in err and "step 1/" not in out, err


# ---------------------------------------------------------------------------------------------
# 5. Data faults (the validation itself: tests/test_data.py)
# ---------------------------------------------------------------------------------------------
def _dataset(tmp_path, tokens, offsets):
  prefix = str(tmp_path / "ds")
  np.save(prefix + ".tokens.npy", np.asarray(tokens, np.int32))
  np.save(prefix + ".offsets.npy", np.asarray(offsets, np.int64))
  return prefix


def test_truncated_tokens_file_is_a_data_error(tmp_path):
  prefix = _dataset(tmp_path, np.arange(100) % 50, [0, 40, 100])
  with open(prefix + ".tokens.npy", "r+b") as f:
    f.truncate(os.path.getsize(prefix + ".tokens.npy") - 40)
  with pytest.raises(DataError, match=r"ds\.tokens\.npy: not a readable NumPy"):
    FileSource(prefix, rows=1, tokens_per_row=16, vocab_size=64, seed=0)


@pytest.mark.parametrize("tokens, offsets, expect", [
    (np.arange(100) % 50, [0, 40, 90], "last offset must equal"),        # mismatched files
    (np.zeros(0), [0], "dataset is empty"),
    (np.arange(100), [0, 40, 100], "token id 64 at position 64"),       # ids >= vocab_size
    (np.arange(100) % 50, [0, 60, 40, 100], "offsets must increase"),
])
def test_data_faults_stop_the_run_before_the_first_step(tmp_path, tokens, offsets, expect):
  prefix = _dataset(tmp_path, tokens, offsets)
  rc, out, err = _run(str(tmp_path / "w"), SMALL + ["data.source=files", f"data.path={prefix}",
                                                    "model.vocab_size=64"])
  assert rc == 2 and expect in err and err.count("\n") == 1, out + err
  assert "ds." in err and "step 1/" not in out
