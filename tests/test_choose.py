"""A baseline configuration the config leaves to the run (cp_size, wlb_alpha 0), chosen above the
trainer (``distca_jax.choose``) and handed down as config values; the backend chooses by itself
only where no memory capacity must be checked (4 data ranks of the fake CPU devices)."""

import json
import os

import pytest

from distca_jax import aot, backends, choose, configs_io, launch
from distca_jax import baselines as bl
from distca_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(seed, *over):
  return configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      "mesh.data=4", "tokens_per_rank=1024", "rows_per_rank=2", "num_steps=2",
      "optim.warmup_steps=0",
      f"seed={seed % 1000}", *over])


@pytest.mark.parametrize("backend", ["cp", "wlb"])
def test_resolve_sets_the_choice_as_config_values(seed, backend, monkeypatch):
  monkeypatch.setattr(bl, "_CHOICES", {})
  c = _config(seed, f"attention.backend={backend}", "attention.baselines.cp_size=0",
              "attention.baselines.wlb_alpha=0")
  lines = []
  got = choose.resolve(c, log=lines.append)
  choice = bl.baseline_choice(c, backend)  # the same choice (memoized), no capacity on CPU
  b = got.attention.baselines
  assert b.cp_size == choice.cp_size >= 1 and c.attention.baselines.cp_size == 0
  if backend == "wlb":
    assert (b.wlb_alpha, b.wlb_tasks_per_row) == (choice.alpha, choice.tasks_per_row)
    assert b.wlb_tasks_per_row > 0
  assert len(lines) == 1 and f"attention.baselines.cp_size={choice.cp_size}" in lines[0], lines
  # The backend built from the resolved config runs it as given: nothing left to choose.
  assert backends.build(got).chosen == ()
  # A config that gives its configuration comes back as it is, with no line.
  assert choose.resolve(got, log=lines.append) is got and len(lines) == 1


def test_an_open_configuration_on_a_device_with_memory_is_one_line_naming_resolve(seed,
                                                                                   monkeypatch):
  """With a memory capacity (here attention.baselines.memory_gib), choosing compiles each
  candidate's step: the backend does not choose unchecked, it names choose.resolve; resolve
  walks the candidates by their need (aot.baseline_need_bytes, a stand-in here)."""
  monkeypatch.setattr(bl, "_CHOICES", {})
  c = _config(seed, "attention.backend=cp", "attention.baselines.cp_size=0",
              "attention.baselines.memory_gib=1")
  with pytest.raises(UserError, match=r"^attention\.backend='cp' with attention\.baselines\."
                                      r"cp_size 0 on a device with 1\.00 GiB: .*"
                                      r"distca_jax\.choose\.resolve\(config\)"):
    backends.build(c)
  needs = []

  def need(cfg, backend, size, alpha, tasks, devices=None):
    needs.append(size)
    return (2 << 30) if size == 4 else (1 << 29)

  monkeypatch.setattr(aot, "baseline_need_bytes", need)
  got = choose.resolve(c)
  assert needs and got.attention.baselines.cp_size != 4, needs
  assert backends.build(got).chosen == ()


@pytest.mark.slow
def test_the_launcher_chooses_before_training_and_records_the_choice(seed, tmp_path, capsys,
                                                                      monkeypatch):
  """launch.run resolves an open cp configuration before the trainer starts: one line names it,
  the run trains at that size, and the workdir's config.json records it."""
  monkeypatch.setattr(bl, "_CHOICES", {})
  c = _config(seed, "attention.backend=cp", "attention.baselines.cp_size=0", "num_steps=1",
              "mesh.data=-1", "checkpoint_every=0", "tensorboard=False")
  want = bl.baseline_choice(c, "cp").cp_size
  launch.run(c, str(tmp_path / "w"))
  out = capsys.readouterr().out
  assert "configuration chosen before training" in out and (
      f"attention.baselines.cp_size={want}") in out, out
  saved = json.load(open(tmp_path / "w" / "config.json"))
  assert saved["attention"]["baselines"]["cp_size"] == want
