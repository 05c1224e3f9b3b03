"""Multi-process training on one machine: feeding, plans, checkpoints and failures.

The subprocess tests (marked ``slow``) launch `python -m distca_jax.train` as 2 processes x 4 CPU
devices (``JAX_NUM_CPU_DEVICES=4``, a coordinator on 127.0.0.1, gloo collectives) and compare them
with 1 process x 8 devices on the tiny config (float32). The other tests check the pieces in this
process (8 fake devices).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import checkpoint as ckpt_lib
from distca_jax import config as config_lib
from distca_jax import launch
from distca_jax import trainer
from distca_jax.data import make_source
from child_env import cpu_xla_flags
from test_train import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small enough that a step takes seconds on a shared 2-core CPU: 8 rows (1 per device) x 256.
TINY = ["--config", os.path.join(ROOT, "configs", "tiny_cpu.py"), "--config.mesh.data=8",
        "--config.rows_per_rank=1", "--config.model.n_layers=2", "--config.model.dtype=float32",
        "--config.optim.warmup_steps=1", "--config.log_every=1", "--config.tensorboard=False"]


def _tiny_config(backend: str, seed: int):
  from configs import tiny_cpu
  c = tiny_cpu.get_config()
  c.attention.backend = backend
  c.mesh.data, c.rows_per_rank, c.model.n_layers, c.seed = 8, 1, 2, seed
  return c


# ------------------------------------------------------------------------------------------------
# In-process pieces
# ------------------------------------------------------------------------------------------------
def test_rows_of_a_batch_equal_the_whole_batch_rows():
  seed = int(np.random.default_rng().integers(1 << 30))
  rng = np.random.default_rng(seed)
  src = make_source(_tiny_config("local", seed).data, rows=16, tokens_per_row=256,
                    vocab_size=256, seed=seed)
  for step in rng.integers(0, 1000, size=3):
    whole = src.batch(int(step))
    a = int(rng.integers(0, 15))
    b = int(rng.integers(a + 1, 17))
    part = src.batch(int(step), rows=(a, b))
    for k, v in whole.items():
      np.testing.assert_array_equal(part[k], v[a:b], err_msg=f"{seed=} {step=} rows {a}:{b} {k}")


def test_local_batch_blocks_build_the_same_global_arrays_and_digest():
  """A batch fed as row blocks (as several processes would) equals the whole batch on device,
  the distca plan rows included, and its plan digest is the whole plan's."""
  seed = int(np.random.default_rng().integers(1 << 30))
  c = _tiny_config("distca", seed)
  mesh = jax.make_mesh((1, 8, 1), ("pipe", "data", "tensor"))
  backend = trainer.make_backend(c)
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank, vocab_size=256, seed=seed)
  step = int(np.random.default_rng(seed).integers(1000))
  doclens = src.doclens(step)
  blocks, digest = trainer.local_batch(src, step, [(0, 3), (3, 8)], backend, doclens)
  whole = trainer.add_host_plan(src.batch(step), backend, doclens, c.tokens_per_rank)
  plan = {k[len(trainer.EXTRA_PREFIX):]: v for k, v in whole.items()
          if k.startswith(trainer.EXTRA_PREFIX)}
  assert plan and digest == trainer.plan_digest(doclens, {trainer.EXTRA_PREFIX + k: v
                                                          for k, v in plan.items()})
  got = trainer.device_batch(blocks, mesh, 8)
  want = trainer.device_batch(whole, mesh)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{seed=} {k}")
  assert trainer.local_row_ranges(mesh, 8) == [(0, 8)]
  # Other document lengths (the first row's first document split in two) give another digest.
  first = list(doclens[0])
  split = [[1, first[0] - 1] + first[1:] if first[0] > 1 else [first[0] + first[1]] + first[2:]]
  other = trainer.plan_digest(split + [list(r) for r in doclens[1:]], {})
  assert other != trainer.plan_digest(doclens, {}), f"{seed=} {doclens[0]}"


@pytest.mark.parametrize("backend", ["cp", "wlb"])
def test_host_arrange_backends_keep_their_rows_of_the_arranged_batch(backend):
  """cp / wlb rearrange tokens across rows: a process's blocks are its rows of the whole
  arranged batch, and the digest (the same for every process's rows) covers the arrangement."""
  seed = int(np.random.default_rng().integers(1 << 30))
  c = _tiny_config(backend, seed)
  c.attention.baselines.cp_size = 2
  c.attention.baselines.wlb_alpha = 1.25
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank, vocab_size=256, seed=seed)
  be = trainer.make_backend(c)
  step = int(np.random.default_rng(seed).integers(1000))
  doclens = src.doclens(step)
  whole, digest = trainer.local_batch(src, step, [(0, 8)], be, doclens)
  (_, _, arranged), = whole
  assert not np.array_equal(arranged["segment_ids"], src.batch(step)["segment_ids"]), seed
  for ranges in ([(0, 4)], [(4, 8)], [(1, 3), (5, 8)]):
    blocks, d = trainer.local_batch(src, step, ranges, be, doclens)
    assert d == digest, (seed, ranges)
    assert [(a, b) for a, b, _ in blocks] == ranges
    for a, b, block in blocks:
      assert sorted(block) == sorted(arranged)
      for k, v in block.items():
        np.testing.assert_array_equal(v, arranged[k][a:b], err_msg=f"{seed=} {ranges} {k}")
  unarranged = trainer.plan_digest(doclens, {})
  assert digest != unarranged, seed


# Layouts of the 8 fake devices a checkpoint moves between: (data, tensor, pipe, rows_per_rank),
# every one with 8 rows per batch (mesh.data x rows_per_rank).
LAYOUTS = [(8, 1, 1, 1), (4, 2, 1, 2), (4, 1, 2, 2), (2, 2, 2, 4)]


def _layout_config(layout, **over):
  data, tensor, pipe, rows = layout
  return tiny_config(**{"mesh.data": data, "mesh.tensor": tensor, "mesh.pipe": pipe,
                        "rows_per_rank": rows, "pipeline.microbatches": 2, "log_every": 1,
                        "tensorboard": False, "optim.warmup_steps": 1,
                        "async_checkpoint": False, **over})


def _state_leaves(state) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(x)
          for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(state))}


def _restore(workdir, c):
  """(restored state, its abstract state) of the newest checkpoint in ``workdir`` in c's layout."""
  run = trainer.setup_run(c)
  manager = ckpt_lib.CheckpointManager(str(workdir), c)
  try:
    return manager.restore(run.abstract_state), run.abstract_state
  finally:
    manager.close()


def _layout_id(layout) -> str:
  return "data%d_tensor%d_pipe%d" % layout[:3]


@pytest.fixture(scope="module")
def data8():
  """(config, state) of the data=8 layout the checkpoints here are saved from: every leaf of the
  run's abstract state as zeros placed with its sharding (put from the host, nothing compiled;
  the tests that need values draw them), made once for the tests, which only read it."""
  c = _layout_config(LAYOUTS[0])
  run = trainer.setup_run(c)
  return c, jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding),
                         run.abstract_state)


# The fast tier moves every axis at once (data2_tensor2_pipe2); the single-axis moves are slow.
@pytest.mark.parametrize("target", [pytest.param(l, id=_layout_id(l), marks=(
    () if l == LAYOUTS[-1] else pytest.mark.slow)) for l in LAYOUTS[1:]])
def test_checkpoint_restores_into_another_layout_bit_for_bit(tmp_path, seed, target, data8):
  """A state saved on data=8 (random parameters and optimizer moments) restores on another
  (data, tensor, pipe) layout with every array identical and placed as that layout shards it."""
  c, state = data8
  # Noise drawn and added on the host, then placed as the leaf was: no device op to compile.
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
      lambda x: (jax.device_put(np.asarray(x) + rng.standard_normal(x.shape).astype(x.dtype),
                                x.sharding)
                 if jnp.issubdtype(x.dtype, jnp.floating) else x), state)
  state = state.replace(step=state.step + 7)
  manager = ckpt_lib.CheckpointManager(str(tmp_path), c)
  manager.save(7, state)
  manager.close()
  want = _state_leaves(state)
  got_state, abstract = _restore(tmp_path, _layout_config(target))
  got = _state_leaves(got_state)
  assert sorted(got) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=f"{seed=} {name}")
  for (path, x), a in zip(jax.tree_util.tree_leaves_with_path(got_state),
                          jax.tree.leaves(abstract)):
    assert x.sharding.is_equivalent_to(a.sharding, x.ndim), jax.tree_util.keystr(path)
  assert any(a.sharding.spec != jax.sharding.PartitionSpec() for a in jax.tree.leaves(abstract))


def test_resume_with_another_batch_size_is_refused(tmp_path, data8):
  c, state = data8
  manager = ckpt_lib.CheckpointManager(str(tmp_path), c)
  manager.save(1, state)
  manager.close()
  with pytest.raises(ValueError, match=r"'batch_rows': \(8, 4\).*keep the product"):
    _restore(tmp_path, _layout_config((4, 2, 1, 1)))


def test_batch_rows_resolve_every_data_size():
  assert [ckpt_lib.batch_rows(_layout_config(l)) for l in LAYOUTS] == [8] * len(LAYOUTS)
  # mesh.data=-1 takes every device the other axes leave: 8 / (2 x 2) = 2 data ranks here.
  assert ckpt_lib.batch_rows(_layout_config((-1, 2, 2, 3))) == 2 * 3


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "distca"])
def test_training_resumes_in_other_layouts_with_the_same_losses(tmp_path, backend):
  """Steps 1-2 on data=8, then step 3 on each other layout from that checkpoint: the loss of
  step 3 is the uninterrupted data=8 run's (float32)."""
  def config(layout, steps):
    return _layout_config(layout, **{"attention.backend": backend, "num_steps": steps,
                                     "checkpoint_every": 2})
  want = {r["step"]: r["loss"]
          for r in trainer.train_and_evaluate(config(LAYOUTS[0], 3), str(tmp_path / "ref"))}
  trainer.train_and_evaluate(config(LAYOUTS[0], 2), str(tmp_path / "src"))
  layouts = LAYOUTS[1:] if backend == "local" else LAYOUTS[1:2]
  for layout in layouts:
    work = tmp_path / _layout_id(layout)
    shutil.copytree(tmp_path / "src", work)
    got = {r["step"]: r["loss"] for r in trainer.train_and_evaluate(config(layout, 3), str(work))}
    assert sorted(got) == [3], (layout, got)
    assert abs(got[3] - want[3]) <= 1e-4 * abs(want[3]), (layout, got[3], want[3])


@pytest.mark.parametrize("kwargs, match", [
    (dict(coordinator_address="127.0.0.1:1234"), "pass all three"),
    (dict(coordinator_address="localhost", num_processes=2, process_id=0), "must be HOST:PORT"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2), r"--process_id=2 must be"),
    (dict(heartbeat_timeout_s=0), r"--heartbeat_timeout_s=0 must be >= 1"),
])
def test_distributed_flags_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    launch.Distributed(**kwargs).check()


# ------------------------------------------------------------------------------------------------
# Several processes (subprocesses)
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = cpu_xla_flags()  # the device count comes from JAX_NUM_CPU_DEVICES
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices), PYTHONUNBUFFERED="1",
             PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
  return env


def _start(procs: int, devices: int, args: list[str], workdir, logdir, *,
           heartbeat_s: int | None = None, module: list[str] | None = None,
           stderr_apart: bool = False) -> list[subprocess.Popen]:
  """`procs` processes of the trainer (`module` replaces `-m distca_jax.train`); each one's
  output goes to LOGDIR/<workdir name>_<i>.log (stderr to .err with `stderr_apart`)."""
  cmd = [sys.executable] + (module or ["-m", "distca_jax.train"]) + TINY + args + [
      f"--workdir={workdir}"]
  if procs > 1:
    cmd += [f"--coordinator_address=127.0.0.1:{_free_port()}", f"--num_processes={procs}"]
    cmd += [f"--heartbeat_timeout_s={heartbeat_s}"] if heartbeat_s else []
  out = []
  for i in range(procs):
    name = os.path.join(logdir, f"{os.path.basename(str(workdir))}_{i}")
    log = open(name + ".log", "w")
    err = open(name + ".err", "w") if stderr_apart else subprocess.STDOUT
    extra = [f"--process_id={i}"] if procs > 1 else []
    out.append(subprocess.Popen(cmd + extra, cwd=ROOT, env=_env(devices), stdout=log,
                                stderr=err))
  return out


def _run(procs: int, devices: int, args: list[str], workdir, logdir, timeout=600) -> None:
  ps = _start(procs, devices, args, workdir, logdir)
  for i, p in enumerate(ps):
    try:
      rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in ps:
        q.kill()
      rc = "timeout"
    if rc != 0:
      for q in ps:
        q.kill()
      name = os.path.join(logdir, f"{os.path.basename(str(workdir))}_{i}.log")
      raise AssertionError(f"process {i} of {procs} exited with {rc}:\n" + open(name).read()[-4000:])


def _losses(workdir, key: str = "loss") -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def _restore_params(workdir, c):
  from distca_jax import sharding as shard_lib
  mesh = shard_lib.make_mesh(data=8)
  model = trainer.make_model(c, trainer.make_backend(c))
  abstract, _ = trainer.state_shardings(c, model, trainer.make_optimizer(c), mesh)
  manager = ckpt_lib.CheckpointManager(str(workdir), c)
  try:
    return jax.device_get(manager.restore(abstract))
  finally:
    manager.close()


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoint(tmp_path):
  """2 processes x 4 devices reach the per-step losses of 1 process x 8 (local attention); the
  checkpoint the 2 processes write restores in 1 process with the 1-process run's parameters;
  runs resumed with another process count (1, 2, 4 x 2 devices; the last on data=4 x tensor=2)
  keep matching losses."""
  args = ["--config.attention.backend=local", "--config.num_steps=3",
          "--config.checkpoint_every=3", "--config.async_checkpoint=False"]
  two, one = tmp_path / "two", tmp_path / "one"
  _run(2, 4, args, two, tmp_path)
  _run(1, 8, args, one, tmp_path)
  l2, l1 = _losses(two), _losses(one)
  assert sorted(l2) == sorted(l1) == [1, 2, 3]
  for s in l1:
    assert abs(l2[s] - l1[s]) <= 1e-4 * abs(l1[s]), (s, l2[s], l1[s])
  c = _tiny_config("local", 0)
  c.num_steps, c.optim.warmup_steps = 3, 1
  s2, s1 = _restore_params(two, c), _restore_params(one, c)
  assert int(s2.step) == int(s1.step) == 3
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(s2.params),
                          jax.tree.leaves(s1.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # 1 process resumes the 2 processes' checkpoint and 2 processes the 1 process's; then 4
  # processes x 2 devices resume the first on another layout (data=4 x tensor=2, 2 rows per
  # rank: the same 8 rows) and 1 process the second.
  other_layout = ["--config.mesh.data=4", "--config.mesh.tensor=2", "--config.rows_per_rank=2"]
  for steps, (pa, da, layout), (pb, db) in ((4, (1, 8, []), (2, 4)),
                                            (5, (4, 2, other_layout), (1, 8))):
    more = [a for a in args if "num_steps" not in a] + [f"--config.num_steps={steps}"]
    _run(pa, da, more + layout, two, tmp_path)
    _run(pb, db, more, one, tmp_path)
    l2, l1 = _losses(two), _losses(one)
    assert abs(l2[steps] - l1[steps]) <= 1e-4 * abs(l1[steps]), (steps, l2[steps], l1[steps])


@pytest.mark.slow
def test_two_processes_with_distca_match_one(tmp_path):
  """The distca backend (host plans from the global document lengths, each process keeping its
  rows) gives the per-step losses of 1 process x 8 devices."""
  args = ["--config.attention.backend=distca", "--config.num_steps=2",
          "--config.checkpoint_every=0"]
  two, one = tmp_path / "two", tmp_path / "one"
  _run(2, 4, args, two, tmp_path)
  for i, rows in enumerate(["[(0, 4)]", "[(4, 8)]"]):  # each process built its 4 rows only
    assert f"batch rows {rows} of 8" in (tmp_path / f"two_{i}.log").read_text()
  _run(1, 8, args, one, tmp_path)
  l2, l1 = _losses(two), _losses(one)
  assert sorted(l2) == sorted(l1) == [1, 2]
  for s in l1:
    assert abs(l2[s] - l1[s]) <= 1e-4 * abs(l1[s]), (s, l2[s], l1[s])


@pytest.mark.slow
@pytest.mark.parametrize("backend,over", [
    ("cp", ["--config.attention.baselines.cp_size=2"]),
    ("wlb", ["--config.attention.baselines.cp_size=2", "--config.attention.baselines.wlb_alpha=1.25"]),
])
def test_two_processes_with_cp_and_wlb_match_one(tmp_path, backend, over):
  """The baselines that rearrange tokens across rows on the host (every process arranges the
  whole batch and keeps its rows) give the per-step losses and the held-out loss (evaluation
  after step 2, each process feeding its rows of the held-out batch) of 1 process x 8 devices."""
  args = [f"--config.attention.backend={backend}", "--config.num_steps=2",
          "--config.checkpoint_every=0", "--config.eval_every=2", "--config.eval_steps=1"] + over
  two, one = tmp_path / "two", tmp_path / "one"
  _run(2, 4, args, two, tmp_path)
  _run(1, 8, args, one, tmp_path)
  l2, l1 = _losses(two), _losses(one)
  assert sorted(l2) == sorted(l1) == [1, 2]
  for s in l1:
    assert abs(l2[s] - l1[s]) <= 1e-5 * abs(l1[s]), (s, l2[s], l1[s])
  e2, e1 = (_losses(w, "eval_loss") for w in (two, one))
  assert list(e2) == list(e1) == [2] and abs(e2[2] - e1[2]) <= 1e-5 * abs(e1[2]), (e2, e1)


# Process 1 computes another plan digest from step 0 on: the startup check must stop both.
_SKEWED_PLAN = """
import sys, jax
from distca_jax import feed
real = feed.plan_digest
feed.plan_digest = lambda doclens, plan: real(doclens, plan) + jax.process_index()
from absl import app
from distca_jax import train
app.run(train.main, argv=[sys.argv[0]] + sys.argv[1:])
"""


@pytest.mark.slow
def test_different_plans_stop_every_process_naming_the_step(tmp_path):
  script = tmp_path / "skewed.py"
  script.write_text(_SKEWED_PLAN)
  ps = _start(2, 4, ["--config.attention.backend=local", "--config.num_steps=2",
                     "--config.checkpoint_every=0"], tmp_path / "w", tmp_path,
              module=[str(script)])
  rcs = [p.wait(timeout=300) for p in ps]
  assert all(rc != 0 for rc in rcs), rcs
  for i in range(2):
    text = (tmp_path / f"w_{i}.log").read_text()
    assert "step 0: the processes computed different host plans" in text, text[-3000:]


def test_an_abort_names_the_lost_process():
  """What the supervisor reads from the output of a process JAX's runtime aborted."""
  coordinator = ("F1127 client.cc:78] Terminating process because ... UNAVAILABLE: Failed to send "
                 "RPC to coordination service. Either the leader task was preempted/died")
  assert launch.explain_abort(coordinator, 1, 2)[0] == [0]
  heartbeats = "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n2\n"
  assert launch.explain_abort(heartbeats, 0, 4)[0] == [2]
  gloo = "terminate called after throwing an instance of 'gloo::EnforceNotMet'"
  assert launch.explain_abort(gloo, 0, 2)[0] == [1]
  assert launch.explain_abort(gloo, 0, 4)[0] is None  # which of 3 peers: not in the message
  assert launch.explain_abort("ValueError: bug", 0, 2) == (None, "")
  line = launch.lost_line(1, 2, [0], "why", "/nonexistent")
  assert line.startswith("process 1/2: lost the coordinator, process 0 (why)"), line


def test_the_headline_of_a_dump_is_absl_fatal_message_not_faulthandler_noise():
  dump = ["F1127 15:42:52.300102   32608 client.h:86] Terminating process because ... "
          "DEADLINE_EXCEEDED: Deadline Exceeded\n", "RPC: /xla.coordination.CoordinationService/"
          "RegisterTask\n", "Fatal Python error: Aborted\n", "\n",
          "Extension modules: yaml._yaml, jaxlib.cpu_feature_guard (total: 2)\n"]
  assert launch._headline(dump).startswith("Terminating process because")
  assert launch._JOIN_FAILED.search("".join(dump))
  assert launch._headline(["Traceback (most recent call last):\n", '  File "x.py"\n',
                           "ValueError: bug\n", "Extension modules: a (total: 1)\n"]) == (
                               "ValueError: bug")


def _join_alone(tmp_path, process_id: int, extra: list[str]) -> subprocess.Popen:
  """Process `process_id` of a 2-process job whose other process never starts."""
  return subprocess.Popen(
      [sys.executable, "-m", "distca_jax.train"] + TINY + [
          f"--workdir={tmp_path / 'w'}", f"--coordinator_address=127.0.0.1:{_free_port()}",
          "--num_processes=2", f"--process_id={process_id}"] + extra,
      cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("process_id", [0, 1])
def test_a_job_the_process_cannot_join_is_one_line(tmp_path, process_id):
  """The other process never starts: after --initialization_timeout_s the one started says in
  one line that it could not join, naming the address and the fix (before: JAX's abort, and a
  line ending in faulthandler's module list)."""
  start = time.time()
  p = _join_alone(tmp_path, process_id, ["--initialization_timeout_s=3"])
  try:
    _, err = p.communicate(timeout=120)
  finally:
    p.kill()
  assert p.returncode == 2, err
  assert err.count("\n") == 1 and err.startswith(
      f"error: process {process_id}/2 could not join the job: not every process reached the "
      "coordinator at 127.0.0.1:"), err
  assert "--initialization_timeout_s=3 s" in err, err
  print(f"process {process_id}: {time.time() - start:.1f} s to the line")


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_joining_ends_the_process_at_once(tmp_path, sig):
  """SIGTERM / SIGINT while JAX waits for the other processes to join (the default timeout is
  300 s, and the join does not return to Python): one 'interrupted' line within seconds,
  status 128 + the signal."""
  p = _join_alone(tmp_path, 1, [])
  try:
    time.sleep(5)  # inside jax.distributed.initialize by now
    assert p.poll() is None, p.communicate()
    sent = time.time()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
  finally:
    p.kill()  # its child dies with it (PR_SET_PDEATHSIG)
  assert time.time() - sent < 10, err
  assert p.returncode == 128 + sig, err
  assert err.count("\n") == 1 and err.startswith(
      f"interrupted: interrupted by {signal.Signals(sig).name} while process 1/2 was joining "
      "the job"), err


@pytest.mark.slow
def test_multihost_without_a_cluster_is_one_line(tmp_path):
  """`--multihost` outside SLURM / Open MPI / Kubernetes: one line naming the explicit flags,
  exit 2 (before: the supervisor's 'failed (exit status 1): ValueError: coordinator_address
  should be defined.')."""
  env = {k: v for k, v in _env(1).items()
         if not k.startswith(("SLURM_", "OMPI_", "PMI_", "KUBERNETES_", "JOB_COMPLETION_INDEX"))}
  p = subprocess.run([sys.executable, "-m", "distca_jax.train"] + TINY + [
      f"--workdir={tmp_path / 'w'}", "--multihost"], cwd=ROOT, env=env, capture_output=True,
      text=True, timeout=300)
  assert p.returncode == 2, p.stderr
  assert p.stderr.count("\n") == 1 and p.stderr.startswith(
      "error: --multihost found no cluster to join"), p.stderr


def _wait_for_steps(ps, workdir, steps: int, timeout_s: float = 600) -> None:
  """Waits until process 0 has logged ``steps`` steps in ``workdir``; every process must live."""
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + timeout_s
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
    assert time.time() < deadline, f"no {steps} training steps in {timeout_s:g} s"
    assert all(p.poll() is None for p in ps), [p.poll() for p in ps]
    time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])  # 0 hosts the coordinator service
def test_killing_one_process_stops_the_other_within_60s(tmp_path, victim):
  """At the default heartbeat timeout the survivor exits with status 2 within 60 s, and its
  stderr is one line naming the lost process (the coordinator for process 0) and the newest
  checkpoint; the job rerun as it was resumes from that checkpoint."""
  args = ["--config.attention.backend=local", "--config.num_steps=100000",
          "--config.checkpoint_every=2", "--config.async_checkpoint=False"]
  ps = _start(2, 4, args, tmp_path / "w", tmp_path, heartbeat_s=None, stderr_apart=True)
  try:
    _wait_for_steps(ps, tmp_path / "w", 4)  # past step 2's synchronous save
    ps[victim].send_signal(signal.SIGKILL)
    t0 = time.time()
    rc = ps[1 - victim].wait(timeout=90)
    took = time.time() - t0
  finally:
    for p in ps:
      if p.poll() is None:
        p.kill()
  err = (tmp_path / f"w_{1 - victim}.err").read_text()
  print(f"victim {victim}: survivor exit {rc} after {took:.1f} s: {err.strip()}")
  assert rc == 2 and took < 60, (rc, took, err)
  lines = [l for l in err.splitlines() if l.strip()]
  who = "the coordinator, process 0" if victim == 0 else "process 1"
  assert len(lines) == 1 and lines[0].startswith(f"error: process {1 - victim}/2: lost {who} ("), err
  named = re.search(r"\(checkpoint step (\d+) at ([^)]+)\)", lines[0])
  assert named, lines[0]
  step = int(named[1])
  assert step >= 2 and named[2] == str(tmp_path / "w" / "checkpoints" / str(step)), lines[0]
  more = [a for a in args if "num_steps" not in a] + [f"--config.num_steps={step + 1}"]
  _run(2, 4, more, tmp_path / "w", tmp_path)
  assert f"resumed from checkpoint at step {step}" in (tmp_path / "w_0.log").read_text()


@pytest.mark.slow
def test_a_process_lost_before_the_first_step_stops_the_other_within_60s(tmp_path):
  """A peer killed while the survivor compiles and runs its first step ends the survivor with
  status 2 within 60 s and one line naming the lost process."""
  args = ["--config.attention.backend=local", "--config.num_steps=100000",
          "--config.checkpoint_every=0"]
  ps = _start(2, 4, args, tmp_path / "w", tmp_path, heartbeat_s=None, stderr_apart=True)
  log = tmp_path / "w_0.log"
  try:
    deadline = time.time() + 120
    while "compiling the train step" not in (log.read_text() if log.exists() else ""):
      assert time.time() < deadline and all(p.poll() is None for p in ps), (
          [p.poll() for p in ps], log.read_text() if log.exists() else "")
      time.sleep(0.05)
    ps[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    rc = ps[0].wait(timeout=90)
    took = time.time() - t0
  finally:
    for p in ps:
      if p.poll() is None:
        p.kill()
  err = (tmp_path / "w_0.err").read_text()
  print(f"survivor exit {rc} after {took:.1f} s: {err.strip()}")
  lines = [l for l in err.splitlines() if l.strip()]
  assert rc == 2 and took < 60, (rc, took, err)
  assert len(lines) == 1 and lines[0].startswith("error: process 0/2: lost process 1 ("), err


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_verified_step(tmp_path):
  """A signal that reaches one process of two stops both before the same step, each saving and
  verifying that step's checkpoint and printing its one 'interrupted' line; the job rerun as it
  was resumes from that step."""
  args = ["--config.attention.backend=local", "--config.num_steps=100000",
          "--config.checkpoint_every=1000"]
  ps = _start(2, 4, args, tmp_path / "w", tmp_path, stderr_apart=True)
  try:
    _wait_for_steps(ps, tmp_path / "w", 3)
    ps[1].send_signal(signal.SIGTERM)
    rcs = [p.wait(timeout=120) for p in ps]
  finally:
    for p in ps:
      if p.poll() is None:
        p.kill()
  errs = [(tmp_path / f"w_{i}.err").read_text() for i in range(2)]
  assert rcs == [128 + signal.SIGTERM] * 2, (rcs, errs)
  steps = []
  for err in errs:
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted: interrupted by SIGTERM after "
                                                   "step "), err
    assert "and verified it" in lines[0], lines[0]
    steps.append(int(lines[0].split("after step ")[1].split(":")[0]))
  assert steps[0] == steps[1] >= 3, steps
  more = [a for a in args if "num_steps" not in a] + [f"--config.num_steps={steps[0] + 1}"]
  _run(2, 4, more, tmp_path / "w", tmp_path)
  assert f"resumed from checkpoint at step {steps[0]}" in (tmp_path / "w_0.log").read_text()


def test_runtime_shutdown_warnings_start_what_the_supervisor_keeps():
  """JAX's GPU client warns when its task watch is cancelled as the job's coordination service
  stops (4 processes x 1 GPU, after every process printed its own line); the supervisor keeps
  such lines in its log instead of printing them, like the coordination agent's."""
  watch = ("W1127 18:16:22.849640   12984 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: "
           "UNAVAILABLE: Cancelling all calls")
  assert launch._DUMP_START.match(watch)
  assert launch._DUMP_START.match("W1127 12:00:00.0 1 coordination_service_agent.cc:1] x")
  assert not launch._DUMP_START.match("W1127 12:00:00.0 1 pjrt_client.cc:9] another warning")
  assert not launch._DUMP_START.match("interrupted: interrupted by SIGINT after step 3")


def test_fault_specs_parse_and_a_bad_one_names_the_fix():
  from experiments import peer_death  # pylint: disable=import-outside-toplevel
  assert peer_death._fault("kill:1", 2) == ("kill", 1)
  assert peer_death._fault("int:all", 4) == ("int", "all")
  assert peer_death._fault("diverge", 2) == ("diverge", None)
  for bad in ("kill:2", "kill:all", "term:x", "diverge:1", "boom"):
    with pytest.raises(ValueError, match=r"not a fault of 2 processes: use kill:I"):
      peer_death._fault(bad, 2)


def test_the_supervisor_prints_only_the_line_when_the_gpu_client_warns_after_it(tmp_path):
  """A process that ends with its own line and then JAX's task-watch warning (as 4 processes x
  1 GPU did at every end) shows one stderr line; the supervisor keeps the rest."""
  child = tmp_path / "child.py"
  child.write_text(
      "import sys\n"
      f"print({launch.JOINED_MARK!r} + '1/4', file=sys.stderr, flush=True)\n"
      "print('error: the run diverged: rerun with a lower learning rate', file=sys.stderr)\n"
      "print('W1127 18:16:17.848929   13069 pjrt_client.cc:1605] WatchTasksAsync failed for task "
      "1: CANCELLED: CANCELLED', file=sys.stderr)\n"
      "print('Additional GRPC error information from remote target coordination_service while "
      "calling /xla.coordination.CoordinationService/WatchTasks:', file=sys.stderr)\n"
      "print(\":CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']\", "
      "file=sys.stderr)\n"
      "sys.exit(2)\n")
  # In a fresh interpreter: the supervisor forks, which this JAX-threaded process should not.
  p = subprocess.run([sys.executable, "-c", "import sys; from distca_jax import launch; "
                      f"sys.exit(launch.supervise([{str(child)!r}], {str(tmp_path / 'w')!r}, "
                      "verbose=False))"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                     capture_output=True, text=True, timeout=60)
  assert p.returncode == 2 and p.stderr.strip().splitlines() == [
      "error: the run diverged: rerun with a lower learning rate"], p.stderr


def test_the_supervisor_keeps_an_aborted_childs_dump_in_the_workdir(tmp_path):
  """A child that aborts (as a process with heap corruption does) leaves its Python stacks in
  the run's workdir, named in the supervisor's one line; a workdir that cannot take it falls
  back to a temporary file."""
  child = tmp_path / "child.py"
  child.write_text(
      "import faulthandler, os, sys\n"
      f"print({launch.JOINED_MARK!r} + '1/2', file=sys.stderr, flush=True)\n"
      "print('free(): unaligned chunk detected in tcache 2', file=sys.stderr, flush=True)\n"
      "faulthandler.enable()\n"
      "os.abort()\n")
  workdir = tmp_path / "w"
  blocked = tmp_path / "file"
  blocked.write_text("")  # a workdir under a file: its crash/ folder cannot be made
  for wd in (workdir, blocked / "w"):
    p = subprocess.run([sys.executable, "-c", "import sys; from distca_jax import launch; "
                        f"sys.exit(launch.supervise([{str(child)!r}], {str(wd)!r}, "
                        "verbose=False))"], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                       capture_output=True, text=True, timeout=60)
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("error: process 1/2 failed (killed by SIGABRT)"), (
        p.stderr)
    path = last.split("its output: ")[1].split(";")[0]
    assert "Fatal Python error: Aborted" in open(path).read(), path
    assert os.path.dirname(path) == (str(workdir / "crash") if wd == workdir else
                                     tempfile.gettempdir()), path
