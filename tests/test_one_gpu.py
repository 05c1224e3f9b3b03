"""distca's defaults on ONE GPU: the path a user starts on.

With one GPU there is one attention server, so nothing crosses a wire: 'auto' resolves to
'remote' (a one-process GPU job), and the data plane runs the local copy of the device's own
group instead of the device-initiated kernel (which needs peers). These tests train with every
distca setting at its default and compare the losses with another backend on the same batches.

Run on a one-GPU machine (skipped elsewhere; the output of the last run is committed in
results/one_gpu/defaults_test.log):
  JAX_PLATFORMS=cuda python3 -m pytest -q -s tests/test_one_gpu.py
"""

import os

import jax
import numpy as np
import pytest

from distca_jax import configs_io, trainer
from distca_jax.dataplane import exchange

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ON_ONE_GPU = jax.default_backend() == "gpu" and jax.device_count() == 1
pytestmark = pytest.mark.skipif(not ON_ONE_GPU, reason="needs exactly one GPU "
                                "(CUDA_VISIBLE_DEVICES=0 on a larger host)")


def _losses(config, overrides, workdir):
  c = configs_io.load_config(os.path.join(ROOT, "configs", config), overrides)
  records = trainer.train_and_evaluate(c, str(workdir))
  return [r["loss"] for r in records]


def test_auto_is_remote_on_one_gpu():
  """The default collective on one GPU is the one that failed to compile there before."""
  assert exchange.resolve_collective("auto") == "remote"


# The tiny default config with only the backend switched: every distca key at its default.
TINY = ["num_steps=6", "optim.warmup_steps=2", "log_every=1", "checkpoint_every=0",
        "tensorboard=False"]


def test_tiny_default_trains_with_distca_like_local(tmp_path):
  local = _losses("tiny_cpu.py", TINY + ["attention.backend=local"], tmp_path / "local")
  distca = _losses("tiny_cpu.py", TINY + ["attention.backend=distca"], tmp_path / "d")
  print(f"\ntiny_cpu on {jax.devices()[0].device_kind}: local {local}\n  distca {distca}")
  assert len(distca) == len(local) == 6 and np.isfinite(distca).all()
  np.testing.assert_allclose(distca, local, rtol=1e-3)  # f32 (TF32 matmuls on GPU)


# The shipped GPU config (8B layer shapes, flash3 kernels for every backend), shortened.
BENCH = ["model.n_layers=2", "tokens_per_rank=16384", "num_steps=4",
         "log_every=1", "optim.warmup_steps=1", "tensorboard=False"]


def test_gpu_bench_distca_defaults_train_like_packed_dp(tmp_path):
  packed = _losses("gpu_bench.py", BENCH + ["attention.backend=packed_dp"],
                   tmp_path / "packed")
  distca = _losses("gpu_bench.py", BENCH, tmp_path / "distca")  # the config's own: distca
  print(f"\ngpu_bench 2 layers 16K on {jax.devices()[0].device_kind}: packed_dp {packed}\n"
        f"  distca {distca}")
  assert len(distca) == len(packed) == 4 and np.isfinite(distca).all()
  np.testing.assert_allclose(distca, packed, rtol=2e-3)  # bf16 compute, other kernel calls
