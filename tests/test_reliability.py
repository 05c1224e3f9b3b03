"""Reliability: non-finite steps are skipped, damaged checkpoints are never trained on, a save
interrupted mid-write is ignored, bad input ends in one line, and a step that cannot fit in device
memory stops before it runs. results/reliability.md lists every fault with its command."""

import glob
import json
import os
import re
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
from child_env import cpu_xla_flags

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
  source = trainer.run_source(c, 1)
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


def _step_metrics(bad, loss=1.0, grad_norm=1.0):
  return {"bad_steps": jnp.int32(bad), "loss": jnp.float32(loss),
          "grad_norm": jnp.float32(grad_norm), "loss_limit": jnp.float32(2.0),
          "grad_norm_limit": jnp.float32(jnp.inf)}


def test_bad_step_watch_stops_after_max_consecutive():
  watch = trainer.BadStepWatch(3)
  for step, bad in enumerate([0, 1, 2, 0, 1, 2]):
    watch.add(step, _step_metrics(bad, loss=3.0 if bad else 1.0))
  watch.poll(wait=True)  # never 3 in a row
  assert watch.streak == 2 and watch.streak_start == 4
  watch.add(6, _step_metrics(3, loss=9.0))
  with pytest.raises(trainer.TrainingDiverged, match=r"steps 5\.\.7 .*\(step 5: loss 3 over its spike limit 2\)"):
    watch.poll(wait=True)


def test_spikes_are_measured_against_the_running_statistics(seed):
  """Healthy noisy steps (a falling loss, gradient norms varying 3x) are never spikes; once the
  statistics are warm, a loss 5x the current one (the running mean lags a falling loss) or a
  gradient norm 10x is; a spike's values do
  not enter the statistics (the step keeps the old ones)."""
  rng = np.random.default_rng(seed)
  health = jnp.zeros((len(trainer.HEALTH_FIELDS),), jnp.float32)
  check = jax.jit(lambda h, l, g: trainer.spike_check(h, l, g, 6.0, 5))
  for i in range(60):
    loss = 5.5 * np.exp(-i / 30) * (1 + 0.05 * rng.standard_normal())
    spike, _, health = check(health, jnp.float32(loss), jnp.float32(rng.uniform(0.4, 1.4)))
    assert not any(map(bool, spike)), f"{seed=} healthy step {i} taken for a spike"
  loss_now = float(5.5 * np.exp(-59 / 30))
  for loss, gnorm, which in ((5 * loss_now, 1.0, (True, False)), (loss_now, 10.0, (False, True))):
    spike, limits, _ = check(health, jnp.float32(loss), jnp.float32(gnorm))
    assert tuple(map(bool, spike)) == which, (seed, loss, gnorm, limits)
  spike, _, _ = check(jnp.zeros_like(health), jnp.float32(1e6), jnp.float32(1e6))
  assert not any(map(bool, spike)), "no spike before the warmup (non-finite values apart)"


@pytest.mark.slow  # the same in-step skip as the non-finite test, which stays fast
def test_a_spiking_step_is_skipped_inside_the_step():
  c = small_config("optim.warmup_steps=0", "train.spike_sigmas=6", "train.spike_warmup_steps=1")
  mesh, model, tx, _, state_sh = one_device_setup(c)
  source = trainer.run_source(c, 1)
  batch = trainer.device_batch(source.batch(0), mesh)
  start = jax.device_get(trainer.create_train_state(c, model, tx, mesh))
  with trainer.mesh_context(mesh):
    step = trainer.jit_train_step(c, model, tx, mesh, state_sh)
    good, m = step(jax.device_put(start, state_sh), batch)
    good = jax.device_get(good)
    assert float(m["skipped"]) == 0
    # Statistics that call this step's loss a spike (mean log-loss far below it), with a
    # gradient norm inside its band: a hard batch. Then statistics that call its gradient norm a
    # spike (mean log-norm far below it): a bad update.
    loss_x, grad_g = np.log(float(m["loss"])), np.log(float(m["grad_norm"]))
    hard = good.replace(health=np.asarray([10, loss_x - 3, 0, grad_g, 0], np.float32))
    bad = good.replace(health=np.asarray([10, loss_x, 0, grad_g - 5, 0], np.float32))
    outs = []
    for before in (hard, bad):
      out, m = step(jax.device_put(before, state_sh), batch)
      outs.append((jax.device_get(out), m))
  for before, (out, m) in zip((hard, bad), outs):
    assert float(m["spiked"]) == 1 and float(m["skipped"]) == 1 and int(m["bad_steps"]) == 1
    assert identical(out.params, before.params) and identical(out.opt_state, before.opt_state)
  # The hard batch's loss enters the statistics (the band widens); the bad update's does not.
  (hard_out, _), (bad_out, _) = outs
  assert hard_out.health[1] > hard.health[1] and hard_out.health[2] > 0, hard_out.health
  np.testing.assert_array_equal(bad_out.health, bad.health)


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


@pytest.fixture(scope="module")
def fresh():
  """(small_config(), its abstract state, a fresh state): made once for the checkpoint tests,
  which only read it (each change makes new arrays), so its init compiles once."""
  c = small_config()
  mesh, model, tx, abstract, _ = one_device_setup(c)
  return c, abstract, trainer.create_train_state(c, model, tx, mesh)


def _save_two(workdir, c, state):
  """Checkpoints at steps 1 and 2 of ``state`` (different values); returns the two states on
  the host."""
  s1 = state.replace(step=state.step + 1)
  s2 = s1.replace(step=s1.step + 1, params=jax.tree.map(lambda x: x * 1.5 + 0.25, s1.params))
  m = ckpt_lib.CheckpointManager(workdir, c)
  m.save(1, s1)
  m.save(2, s2)
  m.close()
  return jax.device_get(s1), jax.device_get(s2)


def test_save_refuses_a_nonfinite_state(tmp_path, fresh):
  c, _, state = fresh
  bad = state.replace(opt_state=jax.tree_util.tree_map_with_path(
      lambda p, x: x.at[(0,) * x.ndim].set(jnp.inf) if ".mu" in jax.tree_util.keystr(p) else x,
      state.opt_state))
  m = ckpt_lib.CheckpointManager(str(tmp_path), c)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"not saving step 5: .*mu.* not finite"):
    m.save(5, bad)
  m.close()
  assert m.all_steps() == []


def test_diverged_checkpoints_move_aside(tmp_path, fresh):
  c, abstract, state = fresh
  _save_two(str(tmp_path), c, state)
  m = ckpt_lib.CheckpointManager(str(tmp_path), c)
  m.last_good_step = 2
  assert m.set_aside_from(2) == [2] and m.all_steps() == [1] and m.last_good_step == 1
  assert [n.split(".")[0] for n in os.listdir(m.diverged_directory)] == ["2"]
  assert int(m.restore(abstract).step) == 1
  m.close()


def test_restore_failures_drop_bound_method_and_spec_reprs():
  e = ValueError("DATA_LOSS: Error reading <bound method pybind11_detail_function_record_v1."
                 "xyz of TensorStore({'driver': 'zarr'})>")
  assert ckpt_lib._first_words(e) == "DATA_LOSS: Error reading"
  assert ckpt_lib._first_words(RuntimeError("a\n  b")) == "a b"


def _damage(path, offset, n=8):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(n)
    f.seek(offset)
    f.write(bytes(x ^ 0xA5 for x in b))


@pytest.mark.slow
def test_damaged_array_bytes_are_never_restored(tmp_path, fresh):
  """Every data file of the newest checkpoint, damaged at several offsets: the restored state is
  either bit-identical to what was saved at that step (the bytes were not part of any array) or
  the older checkpoint, with the failure reported by step and path."""
  c, abstract, state = fresh
  pristine = str(tmp_path / "pristine")
  s1, s2 = _save_two(pristine, c, state)
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


def test_no_checkpoint_verifies_is_one_clear_error(tmp_path, fresh):
  c, abstract, state = fresh
  _save_two(str(tmp_path), c, state)
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
  return dict(os.environ, XLA_FLAGS=cpu_xla_flags(1),
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


def _with(**over):
  """RUN with the keys of ``over`` (dots as in config keys) set to other values."""
  keys = {k.replace("__", "."): v for k, v in over.items()}
  return [o for o in RUN if o.split("=")[0] not in keys] + [f"{k}={v}" for k, v in keys.items()]


def _one_error_line(err):
  """The stderr of a run that must end with exactly one 'error:' line and nothing else of note."""
  for bad in ("Traceback", "terminate called", "Fatal Python error", "Check failure"):
    assert bad not in err, err[-3000:]
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
  return lines[0]


@pytest.mark.slow
def test_divergence_in_the_default_tiny_config_is_one_line_and_the_advice_trains_on(tmp_path):
  """The README's command with lr 1e6 (300 steps, TensorBoard on): exit 2 with one line that
  names what to resume from and the command; that command (made shorter) trains finite losses."""
  workdir = str(tmp_path / "w")
  p = subprocess.run([sys.executable, "-m", "distca_jax.train", "--config", TINY, "--workdir",
                      workdir, "--config.optim.lr=1e6"], cwd=ROOT, env=_env(),
                     capture_output=True, text=True, timeout=900)
  assert p.returncode == 2, p.stdout + p.stderr
  line = _one_error_line(p.stderr)
  assert "steps 3..5 (3 in a row" in line and "no checkpoint precedes step 3" in line, line
  command = line.split("diverges too): ", 1)[1].split()
  assert command[1:3] == ["-m", "distca_jax.train"] and "--config.optim.lr=0.002" in command
  assert os.path.realpath(os.path.join(ROOT, command[0])) == os.path.realpath(sys.executable)
  assert not os.path.exists(os.path.join(workdir, "checkpoints")) or not os.listdir(
      os.path.join(workdir, "checkpoints"))
  p = subprocess.run(command + ["--config.num_steps=30", "--config.log_every=1"], cwd=ROOT,
                     env=_env(), capture_output=True, text=True, timeout=900)
  assert p.returncode == 0, p.stdout + p.stderr
  losses = [l for s, l in sorted(_losses(workdir).items()) if s > 20]
  assert len(losses) == 30 - 20 and np.isfinite(losses).all(), losses


@pytest.mark.slow
def test_diverging_after_a_checkpoint_resumes_from_the_one_before(tmp_path):
  """Steps 1-8 train (checkpoints 4 and 8), then the learning rate jumps (a resumed run with
  lr 1e6): the checkpoints from the first skipped step on move aside, the error names checkpoint
  8, and the advised command resumes from it with fresh bad-step counts and trains on."""
  workdir = str(tmp_path)
  rc, out, err = _run(workdir, _with(num_steps=8))
  assert rc == 0, out + err
  rc, out, err = _run(workdir, _with(**{"optim.lr": "1e6", "optim.warmup_steps": 0}))
  assert rc == 2, out + err
  line = _one_error_line(err)
  assert re.search(r"steps (9|10)\.\.(11|12) ", line) and "checkpoint step 8 at " in line, line
  assert "checkpoints 12" not in line and "checkpoint 12" not in line, "12 follows skipped steps"
  command = line.split("diverges too): ", 1)[1].split()
  p = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout + p.stderr
  assert "resumed from checkpoint at step 8" in p.stdout, p.stdout
  losses = _losses(workdir)
  assert all(np.isfinite(losses[s]) for s in range(9, 13)), losses
  assert _every_checkpoint_verifies(workdir, small_config(*RUN))[-1] == 12


def _start_and_wait(workdir, steps):
  """A long tiny run started in the background, once it has logged ``steps`` steps."""
  proc = subprocess.Popen(_cmd(workdir, _with(num_steps=400)), cwd=ROOT,
                          env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 300
  while not (os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= steps):
    assert time.time() < deadline and proc.poll() is None, proc.communicate()
    time.sleep(0.1)
  return proc


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_and_verifies_the_current_step(tmp_path, sig):
  workdir = str(tmp_path)
  proc = _start_and_wait(workdir, steps=6)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 128 + sig, out + err
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith(f"interrupted: interrupted by {sig.name} after "
                                                 "step "), err
  step = int(lines[0].split("after step ")[1].split(":")[0])
  assert step >= 6 and "and verified it" in lines[0], lines[0]
  assert step in _every_checkpoint_verifies(workdir, small_config(*RUN))
  rc, out, err = _run(workdir, _with(num_steps=step + 1))
  assert rc == 0 and f"resumed from checkpoint at step {step}" in out, out + err


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_the_rerun_trains(tmp_path):
  workdir = str(tmp_path)
  proc = _start_and_wait(workdir, steps=6)
  proc.send_signal(signal.SIGINT)
  time.sleep(0.05)  # two pending signals of one kind merge into one
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  lines = [l for l in err.splitlines() if l.strip()]
  assert proc.returncode == 130 and len(lines) == 1, out + err
  assert (lines[0].startswith("interrupted: interrupted by SIGINT") and
          "rerun the same command to resume" in lines[0]), lines[0]
  rc, out, err = _run(workdir, _with(num_steps=8))  # a save cut short is never restored
  assert rc == 0, out + err


_STOP_SCRIPT = """
import signal, sys, time
from distca_jax import stop as stop_lib
stop = stop_lib.StopRequest(timeout_s=0.3, workdir=sys.argv[1])
for sig in sys.argv[2].split(","):
  stop(getattr(signal, sig))
if sys.argv[3] == "ack":
  stop.acknowledge()
time.sleep(1.5)
print("went on")
"""


@pytest.mark.parametrize("sigs,ack,rc,says", [
    ("SIGINT", "", 130, "reached no step boundary within train.stop_timeout_s=0.3 s"),
    ("SIGTERM,SIGINT", "", 143, "a second SIGINT: stopping now"),
    ("SIGTERM", "ack", 0, None)])
def test_a_stop_that_reaches_no_step_boundary_ends_in_one_line(tmp_path, sigs, ack, rc, says):
  p = subprocess.run([sys.executable, "-c", _STOP_SCRIPT, str(tmp_path), sigs, ack], cwd=ROOT,
                     env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                     timeout=60)
  assert p.returncode == rc, p.stdout + p.stderr
  if says is None:
    assert p.stdout.strip() == "went on" and not p.stderr.strip(), p.stdout + p.stderr
  else:
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "(no checkpoint yet)" in lines[0], p.stderr


def test_stop_timeout_must_be_positive():
  with pytest.raises(UserError, match=r"train.stop_timeout_s=0.0 must be > 0"):
    from distca_jax import config as config_lib  # pylint: disable=import-outside-toplevel
    config_lib.validate(small_config("train.stop_timeout_s=0.0"))


def _read_only_dir(path):
  """Makes ``path`` read-only (chmod, or chattr +i for root); False when neither works here."""
  os.makedirs(path)
  os.chmod(path, 0o555)
  if os.geteuid() == 0:
    subprocess.run(["chattr", "+i", path], capture_output=True)
  try:
    open(os.path.join(path, "probe"), "w").close()
    return False
  except OSError:
    return True


@pytest.mark.slow
def test_an_unwritable_workdir_is_one_line(tmp_path):
  ro = str(tmp_path / "ro")
  if not _read_only_dir(ro):
    pytest.skip("cannot make a read-only directory here (no chmod or chattr effect)")
  try:
    for workdir in (ro, os.path.join(ro, "sub")):
      rc, out, err = _run(workdir, SMALL)
      assert rc == 2, out + err
      assert "is not writable" in _one_error_line(err) and f"--workdir={workdir}" in err, err
  finally:
    subprocess.run(["chattr", "-i", ro], capture_output=True)
    os.chmod(ro, 0o755)


@pytest.mark.slow
def test_a_bad_mesh_leaves_no_workdir(tmp_path):
  workdir = str(tmp_path / "new")
  rc, out, err = _run(workdir, SMALL + ["mesh.data=3"])
  assert rc == 2 and "mesh data=3" in _one_error_line(err)
  assert not os.path.exists(workdir)


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
    (["attention.backend=packed_dp", "attention.kernel=mosaic"],
     "attention.kernel='mosaic' cannot run here"),
])
def test_user_errors_are_one_line_without_traceback(tmp_path, overrides, expect):
  rc, out, err = _run(str(tmp_path), SMALL + overrides)
  assert rc == 2, out + err
  assert err.strip().count("\n") == 0 and err.startswith("error: ") and expect in err, err
  assert "step 1/" not in out


@pytest.mark.parametrize("args, expect", [
    ([], "flag --config=None: Flag --config must have a value other than None"),
    (["--config", TINY], "flag --workdir=None"),
    (["--config", "configs/no_such.py", "--workdir", "W"], "--config=configs/no_such.py: no such file"),
    (["--config", TINY, "--workdir", "W", "--config.num_steps=abc"],
     "flag --config.num_steps=abc: invalid literal for int()"),
    (["--config", TINY, "--workdir", "W", "--num_step=3"], "Unknown command line flag 'num_step'"),
])
def test_bad_flags_are_one_line(tmp_path, args, expect):
  """Missing, unknown or mistyped flags and a config path without a file: one line, exit 2, and
  no workdir."""
  p = subprocess.run([sys.executable, "-m", "distca_jax.train"] + args, cwd=tmp_path, env=_env(),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 2, p.stdout + p.stderr
  assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and expect in p.stderr, (
      p.stderr)
  assert not os.path.exists(tmp_path / "W")


def test_aot_memory_with_a_kernel_this_host_cannot_run_is_one_line(tmp_path):
  """`experiments.aot_memory` on a config naming a GPU kernel, on a CPU host: one line naming
  the setting and the CPU kernel, exit 2 (the override that fixes it is in README.md)."""
  p = subprocess.run([sys.executable, "-m", "experiments.aot_memory", "--config", TINY,
                      "--devices", "1", "--override", "attention.backend=packed_dp",
                      "--override", "attention.kernel=mosaic"],
                     cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 2, p.stdout + p.stderr
  assert p.stderr.count("\n") == 1 and p.stderr.startswith(
      "error: attention.kernel='mosaic' cannot run here"), p.stderr


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


@pytest.mark.slow
def test_auto_memory_mode_runs_resend_when_keep_does_not_fit(tmp_path):
  """distca's default memory_mode 'auto': with a capacity between the 'resend' and the 'keep'
  step's needs, or one that 'keep' fits without its spare, the pre-flight compiles both and
  trains with 'resend' (same loss and gradient norm as 'keep'); below both it stops with the
  'resend' step's need; 'keep' alone stops."""
  import dataclasses
  c = small_config("attention.backend=distca", "mesh.data=4", "num_steps=2",
                   "optim.warmup_steps=0", "checkpoint_every=0")
  run = trainer.setup_run(c, devices=jax.devices()[:4])
  assert run.backend.memory_mode == "keep" and run.backend.resend_fn is not None
  keep_only = dataclasses.replace(run, backend=dataclasses.replace(run.backend, resend_fn=None))
  state = trainer.create_train_state(c, run.model, run.tx, run.mesh)
  batch = trainer.add_host_plan(run.source.batch(0), run.backend, run.source.doclens(0),
                                c.tokens_per_rank)
  lines = []
  keep_fn, _, keep_need, keep_run = trainer.preflight(c, run, state, batch, log=lines.append)
  assert keep_run is run and len(lines) == 1 and "'keep' (" in lines[0], lines
  lines.clear()
  with pytest.raises(memory.DoesNotFit) as below:
    trainer.preflight(c, run, state, batch, capacity=1 << 10, log=lines.append)
  resend_need = below.value.need
  assert resend_need < keep_need, (resend_need, keep_need)
  between = (resend_need + keep_need) // 2
  with pytest.raises(memory.DoesNotFit):
    trainer.preflight(c, keep_only, state, batch, capacity=between)
  lines.clear()
  auto_fn, _, need, auto_run = trainer.preflight(c, run, state, batch, capacity=between,
                                                 log=lines.append)
  assert need == resend_need and auto_run.model is not run.model
  assert len(lines) == 1 and "running 'resend'" in lines[0], lines
  # 'keep' fits with nothing to spare: 'resend' runs (a step's temporaries are one block).
  lines.clear()
  _, _, need, tight_run = trainer.preflight(c, run, state, batch, capacity=keep_need,
                                            log=lines.append)
  assert need == resend_need and tight_run.model is not run.model, (need, resend_need)
  assert len(lines) == 1 and "less than 4% of" in lines[0] and "running 'resend'" in lines[0]
  device_batch = trainer.device_batch(batch, run.mesh)
  host = jax.device_get(state)  # each step donates the state it is given
  with trainer.mesh_context(run.mesh):
    _, m_keep = keep_fn(jax.device_put(host, run.state_shardings), device_batch)
    _, m_auto = auto_fn(jax.device_put(host, run.state_shardings), device_batch)
  np.testing.assert_allclose(float(m_auto["loss"]), float(m_keep["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(m_auto["grad_norm"]), float(m_keep["grad_norm"]), rtol=1e-5)


def test_out_of_memory_at_run_time_is_reported_like_the_preflight():
  err = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 112.42GiB.")
  with pytest.raises(memory.DoesNotFit, match=r"ran out of device memory \(RESOURCE_EXHAUSTED.*"
                     r"needs 100\.00 GiB per device .* 140\.00 GiB"):
    memory.raise_if_out_of_memory(err, 100 << 30, None, capacity=140 << 30)
  memory.raise_if_out_of_memory(RuntimeError("INTERNAL: something else"), 1, None, capacity=2)


def test_kernel_workspace_counts_flash3_backward_accumulators_and_ffi_failures_map():
  """FlashAttention-3's varlen backward (found by primitive name at any depth: inside scan and
  custom_vjp) counts its f32 dQ / dK / dV accumulators; the largest call counts; its failed
  scratch allocation ("bad optional access") becomes the pre-flight's line."""
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  bwd = Primitive(memory.FLASH3_VARLEN_BWD)
  bwd.multiple_results = True
  bwd.def_abstract_eval(lambda do, q, k, v, o, lse, cq, ck: (q, k, v))
  mlir.register_lowering(bwd, lambda ctx, *a: a[1:4])

  def step(q, k, cq, big_q):
    def body(c, _):
      dq, dk, dv = bwd.bind(q, q, k, k, q, q[..., 0], cq, cq)
      return c + dq.sum() + dk.sum() + dv.sum(), None
    c, _ = jax.lax.scan(body, 0.0, None, length=2)
    dq, _, _ = bwd.bind(big_q, big_q, k, k, big_q, big_q[..., 0], cq, cq)
    return c + dq.sum()

  nq, h, d, nk, kh, b = 1000, 4, 8, 3000, 2, 5
  q = jnp.zeros((nq, h, d), jnp.bfloat16)
  k = jnp.zeros((nk, kh, d), jnp.bfloat16)
  cq = jnp.zeros((b + 1,), jnp.int32)
  big = jnp.zeros((2 * nq, h, d), jnp.bfloat16)
  got = memory.kernel_workspace_bytes(jax.make_jaxpr(step)(q, k, cq, big).jaxpr)
  want = max(4 * d * (h * (n + 128 * b) + 2 * kh * (nk + 128 * b)) for n in (nq, 2 * nq))
  assert got == want == 4 * d * (h * (2 * nq + 128 * b) + 2 * kh * (nk + 128 * b))
  assert memory.kernel_workspace_bytes(jax.make_jaxpr(lambda x: x * 2)(q).jaxpr) == 0
  err = RuntimeError("UNKNOWN: XLA FFI call failed: bad optional access [executable_name=x]")
  with pytest.raises(memory.DoesNotFit, match=r"ran out of device memory \(UNKNOWN: XLA FFI.*"
                     r"needs 73\.00 GiB \(XLA's buffer assignment 65\.50 GiB \+ "
                     r"kernel workspaces 7\.50 GiB\) per device"):
    memory.raise_if_out_of_memory(err, 73 << 30, None, capacity=72 << 30,
                                  workspace=int(7.5 * (1 << 30)))


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
