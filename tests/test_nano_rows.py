"""attention.distca.nano_rows='heavy_first': each rank's rows heaviest first for ping-pong."""

import json
import os

import numpy as np
import pytest

from distca_jax import config as config_lib
from distca_jax import trainer
from distca_jax.data import HeavyFirst, SyntheticSource, run_source
from distca_jax.data.order import heavy_first
from distca_jax.errors import UserError

from tests.test_train import tiny_config


def test_heavy_first_orders_each_block_by_attention_work():
  rng = np.random.default_rng(0)
  for trial in range(20):
    r = int(rng.integers(1, 5))
    doclens = [list(rng.integers(1, 50, size=rng.integers(0, 4))) for _ in range(r * 4)]
    doclens[0] = doclens[1] = [7] if r > 1 else doclens[0]  # a tie keeps its order
    perm = heavy_first(doclens, r)
    work = [sum(x * x for x in row) for row in doclens]
    for a in range(0, len(doclens), r):
      block = list(perm[a:a + r])
      assert sorted(block) == list(range(a, a + r)), (trial, perm)  # no row leaves its block
      w = [work[i] for i in block]
      assert w == sorted(w, reverse=True), (trial, doclens, perm)
      for x, y in zip(block, block[1:]):
        assert work[x] > work[y] or x < y, (trial, perm)  # ties in their original order


def test_heavy_first_source_builds_the_rows_its_doclens_name():
  src = SyntheticSource("pretrain", rows=8, tokens_per_row=256, vocab_size=97, seed=3)
  hf = HeavyFirst(src, rows_per_rank=2)
  for step in range(4):
    perm = hf.order(step)
    assert hf.doclens(step) == [src.doclens(step)[i] for i in perm]
    whole, given = hf.batch(step), src.batch(step)
    for k in given:
      np.testing.assert_array_equal(whole[k], given[k][perm])
    part = hf.batch(step, rows=(2, 6))  # whole blocks, as a process or device asks
    for k in given:
      np.testing.assert_array_equal(part[k], whole[k][2:6])
  with pytest.raises(ValueError, match="whole blocks of rows_per_rank=2"):
    hf.batch(0, rows=(1, 3))
  assert hf.rows == 8 and hf.tokens_per_row == 256 and "heaviest first" in hf.describe()


def test_heavy_first_reads_the_wrapped_lengths_once_per_step():
  """The input thread asks doclens(step) then batch(step): one read of the wrapped lengths."""
  src = SyntheticSource("pretrain", rows=8, tokens_per_row=256, vocab_size=97, seed=3)
  reads = []
  wrapped = src.doclens
  src.doclens = lambda step: reads.append(step) or wrapped(step)
  hf = HeavyFirst(src, rows_per_rank=2)
  for step in range(3):
    lens = hf.doclens(step)
    batch = hf.batch(step)
    lens[0].append(1)  # a caller's change does not reach the kept order
    assert hf.doclens(step) == [wrapped(step)[i] for i in hf.order(step)]
    assert batch["inputs"].shape[0] == 8
  assert reads == [0, 1, 2], reads


def test_run_source_reorders_only_distca_ping_pong_with_heavy_first():
  def source(**over):
    return run_source(tiny_config(**{"rows_per_rank": 2, **over}), 4)
  on = {"attention.backend": "distca", "attention.nano_batches": 2,
        "attention.distca.nano_rows": "heavy_first"}
  assert isinstance(source(**on), HeavyFirst)
  default = {k: v for k, v in on.items() if k != "attention.distca.nano_rows"}
  assert isinstance(source(**default), HeavyFirst)  # the default
  assert not isinstance(source(**{**on, "attention.distca.nano_rows": "given"}), HeavyFirst)
  assert not isinstance(source(**{**on, "attention.nano_batches": 1}), HeavyFirst)
  assert not isinstance(source(**{**on, "attention.backend": "packed_dp"}), HeavyFirst)


def test_nano_rows_must_be_given_or_heavy_first():
  c = tiny_config(**{"attention.distca.nano_rows": "sorted"})
  with pytest.raises(UserError, match="attention.distca.nano_rows='sorted'; use 'given'"):
    config_lib.validate(c)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.slow
def test_heavy_first_trains_the_same_losses_as_given(tmp_path):
  """Reordering rows within each rank moves no token between devices: distca with ping-pong
  reaches the same losses with 'heavy_first' as with 'given' (3 steps, 8 CPU devices)."""
  losses = {}
  for order in ("given", "heavy_first"):
    c = tiny_config(**{"attention.backend": "distca", "attention.nano_batches": 2,
                       "rows_per_rank": 2, "attention.distca.nano_rows": order,
                       "num_steps": 3, "log_every": 1, "checkpoint_every": 0,
                       "tensorboard": False, "optim.warmup_steps": 1})
    if order == "heavy_first":  # the reorder is real on these batches
      src = run_source(c, 8)
      assert any((src.order(s) != np.arange(src.rows)).any() for s in range(3))
    trainer.train_and_evaluate(c, str(tmp_path / order))
    losses[order] = _losses(str(tmp_path / order))
  assert sorted(losses["given"]) == [1, 2, 3]
  for step, loss in losses["given"].items():
    assert losses["heavy_first"][step] == pytest.approx(loss, rel=1e-5), (step, losses)
