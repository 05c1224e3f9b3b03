"""experiments/e2e_bench.py's derived numbers (speedups, fraction of the bound, twin ratios, loss
agreement) and its balance ceiling, on hand-made results."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "experiments"))
import e2e_bench  # noqa: E402  (experiments/ is not a package)

from distca_jax.model import ModelConfig  # noqa: E402


def _run(backend, step_ms, nano=1, losses=(5.0, 4.0), ceiling=1.2, workload="pretrain",
         tokens_per_s=None):
  return dict(workload=workload, tokens=65536, backend=backend, nano_batches=nano,
              step_ms_median=step_ms, losses=list(losses), ceiling=ceiling,
              tokens_per_s=tokens_per_s or 1e8 / step_ms)


def test_derive_ratios_and_twins():
  res = [_run("packed_dp", 1200.0),
         _run("distca", 1000.0, losses=(5.0, 4.01), tokens_per_s=1e8 / 1200.0 * 1.1),
         _run("distca+signal", 980.0, losses=(5.0, 4.5)),
         _run("packed_dp+pingpong", 1150.0, nano=2), _run("distca+pingpong", 900.0, nano=2),
         _run("packed_dp", 800.0, workload="prolong", ceiling=1.0),
         dict(workload="pretrain", tokens=65536, backend="wlb", error="boom")]
  e2e_bench.derive(res)
  dp, ca, sig, _, ca_pp, prolong, _ = res
  assert ca["speedup_vs_packed_dp"] == pytest.approx(1.2)
  assert ca["fraction_of_bound_gain"] == pytest.approx(1.0)  # (1.2 - 1) / (1.2 - 1)
  # The mean-based twin (total time over the batches, like the ceiling): its own numbers.
  assert ca["tokens_per_s_ratio"] == pytest.approx(1.1)
  assert ca["fraction_of_bound_gain_tokens"] == pytest.approx(0.5)
  assert ca["max_loss_diff_vs_packed_dp"] == pytest.approx(0.01)
  assert ca["step_over_signal_only"] == pytest.approx(1000.0 / 980.0)
  assert sig["max_loss_diff_vs_packed_dp"] == pytest.approx(0.5)
  # Ping-pong rows compare with the ping-pong baseline and with their single-stream twin.
  assert ca_pp["speedup_vs_packed_dp"] == pytest.approx(1150.0 / 900.0)
  assert ca_pp["pingpong_speedup"] == pytest.approx(1000.0 / 900.0)
  assert dp["speedup_vs_packed_dp"] == pytest.approx(1.0)
  assert prolong["fraction_of_bound_gain"] is None  # ceiling 1: no gain to take
  assert prolong["fraction_of_bound_gain_tokens"] is None


def test_ceiling_is_max_over_mean_of_step_work():
  cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                    mlp_dim=32)
  # One step, two ranks with the same tokens: the ceiling is set by attention (sum l^2) alone.
  balanced = e2e_bench.ceiling(cfg, [[[[4, 4]], [[4, 4]]]])
  skewed = e2e_bench.ceiling(cfg, [[[[8]], [[1] * 8]]])
  assert balanced == pytest.approx(1.0)
  assert skewed > 1.0
  # Identical work on every rank in every step is never above 1, whatever the lengths.
  assert e2e_bench.ceiling(cfg, [[[[3, 5]], [[5, 3]]], [[[7]], [[7]]]]) == pytest.approx(1.0)
