"""Evaluation on held-out data (eval_every / eval_steps): the eval loss is the train step's loss
function on the same batch, with every backend; it is logged (progress line, metrics.jsonl);
held-out splits never share documents with training."""

import json
import math
import os

import numpy as np
import pytest

from distca_jax import config as config_lib
from distca_jax import configs_io, trainer
from distca_jax.data import EVAL_SEED_OFFSET, make_source
from distca_jax.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = ["model.n_layers=2", "tokens_per_rank=64", "attention.block_q=16", "attention.block_k=32",
         "model.loss_chunk=32", "model.n_heads=4", "model.n_kv_heads=2", "mesh.data=4",
         "mesh.tensor=2", "rows_per_rank=2", "checkpoint_every=0", "tensorboard=False",
         "optim.warmup_steps=1", "eval_steps=1"]
BACKENDS = {
    "local": [],
    "packed_dp": [],
    "cp": ["attention.baselines.cp_size=2"],
    "wlb": ["attention.baselines.cp_size=2", "attention.baselines.wlb_alpha=1.25"],
    "distca": ["attention.distca.tolerance=0.05", "attention.distca.min_gain=0.0",
               "attention.distca.local_gain=0.0"],
}


def _config(*over):
  return configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), list(SMALL + list(over)))


def _train_loss_and_eval(c):
  """(the train step's loss on the first held-out batch, the evaluator's loss) at c's initial
  parameters."""
  run = trainer.setup_run(c)
  state = trainer.create_train_state(c, run.model, run.tx, run.mesh)
  rows = run.mesh.shape["data"] * c.rows_per_rank
  evaluator = trainer.Evaluator(c, run, [(0, rows)])
  out = evaluator(state.params, run.model)
  (_, _, batch), = evaluator.batches[0]
  step_fn, _, _ = trainer.compile_train_step(c, run, run.abstract_state, batch)
  with trainer.mesh_context(run.mesh, c.mesh.fsdp):
    _, m = step_fn(state, trainer.device_batch(batch, run.mesh))
  return float(m["loss"]), out


@pytest.mark.slow
def test_eval_loss_is_the_train_loss_on_the_same_batch_for_every_backend():
  """At the same parameters, one held-out batch: each backend's eval loss equals the loss its
  train step reports for that batch (the step's loss is computed before its update), and every
  backend's eval loss equals local's (the backends only move where attention runs)."""
  got = {}
  for name, over in BACKENDS.items():
    train_loss, out = _train_loss_and_eval(_config(f"attention.backend={name}", *over))
    np.testing.assert_allclose(out["eval_loss"], train_loss, rtol=1e-6, err_msg=name)
    assert out["eval_ppl"] == pytest.approx(math.exp(out["eval_loss"]), rel=1e-12)
    got[name] = out["eval_loss"]
  for name, v in got.items():
    np.testing.assert_allclose(v, got["local"], rtol=2e-5, err_msg=name)


@pytest.mark.slow
def test_eval_runs_and_logs(tmp_path, capsys):
  """eval_every=2 over 6 steps logged every 3: steps 2, 4 and 6 are evaluated (and so logged
  too), carrying eval_loss / eval_ppl in metrics.jsonl and the progress line; step 3 does not;
  the held-out loss falls as the model trains."""
  c = _config("num_steps=6", "log_every=3", "eval_every=2", "eval_steps=2", "optim.lr=0.01")
  records = trainer.train_and_evaluate(c, str(tmp_path))
  with open(tmp_path / "metrics.jsonl") as f:
    logged = [json.loads(line) for line in f]
  assert [r["step"] for r in logged] == [2, 3, 4, 6]
  assert [("eval_loss" in r) for r in logged] == [True, False, True, True]
  assert all(np.isfinite(r["loss"]) for r in logged)
  for r in (logged[0], logged[2], logged[3]):
    assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-6)
  assert logged[3]["eval_loss"] < logged[0]["eval_loss"]
  assert records[3]["eval_loss"] == pytest.approx(logged[3]["eval_loss"])
  out = capsys.readouterr().out
  lines = [l for l in out.splitlines() if "step " in l and "loss" in l]
  assert sum("eval loss" in l for l in lines) == 3
  assert "evaluation every 2 steps on 2 held-out batches" in out


def test_synthetic_held_out_stream_is_another_seed():
  kw = dict(rows=2, tokens_per_row=64, vocab_size=256, seed=3)
  data = {"source": "synthetic", "workload": "pretrain", "context_length": 0}
  train, held = make_source(data, **kw), make_source(data, split="eval", **kw)
  assert held.seed == train.seed + EVAL_SEED_OFFSET
  assert not np.array_equal(train.batch(0)["inputs"], held.batch(0)["inputs"])


def _dataset(tmp_path, n_docs=10, name="ds"):
  """Document d is 5 + d tokens, all equal to d + 1 (so a batch's tokens name its documents)."""
  lens = np.arange(5, 5 + n_docs)
  tokens = np.concatenate([np.full(l, d + 1, np.int32) for d, l in enumerate(lens)])
  prefix = str(tmp_path / name)
  np.save(prefix + ".tokens.npy", tokens)
  np.save(prefix + ".offsets.npy", np.concatenate([[0], np.cumsum(lens)]).astype(np.int64))
  return prefix


def _docs_seen(source, steps):
  seen = set()
  for s in range(steps):
    b = source.batch(s)
    seen |= set(np.unique(b["inputs"][b["segment_ids"] > 0]).tolist())
  return seen


def test_files_held_out_fraction_is_never_trained_on(tmp_path):
  prefix = _dataset(tmp_path)
  data = {"source": "files", "path": prefix, "shuffle": True, "eval_path": "",
          "eval_fraction": 0.2}
  kw = dict(rows=2, tokens_per_row=16, vocab_size=64, seed=0)
  train, held = make_source(data, **kw), make_source(data, split="eval", **kw)
  assert _docs_seen(train, 20) == set(range(1, 9))  # documents 0..7: every one, many epochs
  assert _docs_seen(held, 5) == {9, 10}             # the last 20%
  whole = make_source({**data, "eval_fraction": 0.0}, **kw)
  assert _docs_seen(whole, 20) == set(range(1, 11))
  other = _dataset(tmp_path, 3, name="other")
  held = make_source({**data, "eval_path": other}, split="eval", **kw)
  assert _docs_seen(held, 3) == {1, 2, 3}
  with pytest.raises(ValueError, match="no held-out data"):
    make_source({**data, "eval_fraction": 0.0}, split="eval", **kw)
  with pytest.raises(ValueError, match="leaving none to train on"):
    make_source({**data, "eval_fraction": 0.99}, **kw)


def test_eval_config_errors_name_the_fix():
  with pytest.raises(UserError, match=r"^eval_every=-1 must be >= 0 \(0: no evaluation\)$"):
    config_lib.validate(_config("eval_every=-1"))
  with pytest.raises(UserError, match="eval_steps=0 must be >= 1"):
    config_lib.validate(_config("eval_steps=0"))
  with pytest.raises(UserError, match=r"data.eval_fraction=1.0 must be in \[0, 1\)"):
    config_lib.validate(_config("data.eval_fraction=1.0"))


def test_files_without_held_out_data_train_and_say_there_is_no_evaluation(tmp_path, capsys):
  prefix = _dataset(tmp_path, 40)
  c = _config("eval_every=1", "num_steps=1", "data.source=files", f"data.path={prefix}",
              "mesh.data=8", "mesh.tensor=1", "rows_per_rank=1", "model.vocab_size=64")
  assert not trainer.has_held_out(c)
  records = trainer.train_and_evaluate(c, str(tmp_path / "run"))
  assert len(records) == 1 and "eval_loss" not in records[0]
  assert ("no evaluation (eval_every=1): data.source='files' has no held-out data; set "
          "data.eval_path=PREFIX or data.eval_fraction=F") in capsys.readouterr().out
  assert trainer.has_held_out(_config("data.source=files", "data.eval_fraction=0.1"))
  assert trainer.has_held_out(_config())


def test_checkpoint_record_keeps_what_changes_training_batches():
  """A checkpoint's data record (a resume with other settings is refused): eval_path and a zero
  eval_fraction are left out (checkpoints written before the held-out keys still resume),
  a non-zero eval_fraction (documents taken out of training) is in."""
  from distca_jax import checkpoint as ckpt_lib
  rec = ckpt_lib._data_record(_config("data.eval_path=/x"))
  assert "eval_path" not in rec["data"] and "eval_fraction" not in rec["data"]
  assert rec["data"]["source"] == "synthetic"
  assert ckpt_lib._data_record(_config("data.eval_fraction=0.1"))["data"]["eval_fraction"] == 0.1
