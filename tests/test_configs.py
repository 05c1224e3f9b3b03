"""Every shipped config fits the hardware its docstring names (CPU AOT of the train step against
that hardware's allocator limit, experiments.config_fit.SHIPPED) and trains 2 steps at tiny model
size with its own mesh, backend and options."""

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from distca_jax import configs_io, trainer
from experiments import config_fit
from child_env import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))

# Tiny dims every shipped mesh can split (tensor 4: heads and kv heads divisible by 4; FSDP over
# 4 data ranks: dim divisible by 4); f32 compute (bf16 is emulated on CPUs); the kernel each
# backend runs on a CPU ('auto').
TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=2", "model.n_heads=4",
        "model.n_kv_heads=4", "model.head_dim=16", "model.mlp_dim=128", "model.loss_chunk=64",
        "model.dtype=float32", "attention.kernel=auto", "tokens_per_rank=256", "rows_per_rank=1",
        "num_steps=2", "log_every=1", "checkpoint_every=0", "tensorboard=False",
        "optim.warmup_steps=1", "data.context_length=0", "attention.distca.caps_from_batches=4",
        "eval_every=2", "eval_steps=1"]


def test_every_shipped_config_names_its_hardware():
  assert sorted(config_fit.SHIPPED) == CONFIGS
  for path, hw in config_fit.SHIPPED.items():
    assert hw.devices <= jax.device_count()


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_config_fits_its_hardware_by_aot(path):
  r = config_fit.fit(path)
  hw = config_fit.SHIPPED[path]
  assert int(np.prod(list(r["mesh"].values()))) == hw.devices
  if hw.limit_bytes is not None:
    assert r["fits"], (f"{path} needs {r['need_per_device_bytes'] / 2**30:.2f} GiB per device, "
                       f"over {hw.limit_bytes / 2**30:.2f} GiB ({hw.name})")
    assert r["need_per_device_bytes"] > r["argument_size_in_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_config_trains_two_steps_at_tiny_size(path, tmp_path):
  """The config's mesh, backend, remat, FSDP and attention options with a tiny model, through
  the entry point a user runs, on as many devices as its hardware has: 2 finite losses and a
  finite held-out loss after step 2 (evaluation with the config's backend)."""
  hw = config_fit.SHIPPED[path]
  c = configs_io.load_config(os.path.join(ROOT, path), TINY)
  real = configs_io.load_config(os.path.join(ROOT, path))
  assert (c.attention.backend, c.mesh.data, c.mesh.tensor, c.mesh.fsdp, c.model.remat) == (
      real.attention.backend, real.mesh.data, real.mesh.tensor, real.mesh.fsdp, real.model.remat)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=cpu_xla_flags(hw.devices))
  out = subprocess.run([sys.executable, "-m", "distca_jax.train", "--config", path, "--workdir",
                        str(tmp_path)] + [f"--config.{o}" for o in TINY],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout + out.stderr
  with open(tmp_path / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  train = [r for r in records if "loss" in r]
  assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)
  assert "eval_loss" not in train[0] and np.isfinite(train[1]["eval_loss"])
  assert f"attention backend '{real.attention.backend}'" in out.stdout + out.stderr
