"""Greedy decoding (distca_jax.generate): every new token is the argmax of a dense-attention
model's logits on its prefix (checked in one teacher-forced pass: the model is causal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import backends, generate, trainer
from distca_jax import sharding as shard_lib
from test_train import tiny_config


@pytest.fixture(scope="module")
def config_and_params():
  c = tiny_config(**{"mesh.data": 1})
  mesh = shard_lib.make_mesh(data=1, devices=jax.devices()[:1])
  state = trainer.create_train_state(c, trainer.make_model(c), trainer.make_optimizer(c), mesh)
  # Spread the logits of the fresh model so that no argmax is a near-tie.
  params = jax.tree.map(lambda x: 4.0 * x, jax.device_get(state.params))
  return c, params


def test_greedy_generate_takes_the_argmax_on_each_prefix(config_and_params, seed):
  c, params = config_and_params
  model = trainer.make_model(c, backends.get("local", block_q=16, block_k=32))
  oracle = trainer.make_model(c, backends.get("reference"))
  p, n = 5, 6
  prompt = np.random.default_rng(seed).integers(0, c.model.vocab_size, size=(3, p))
  got = np.asarray(generate.greedy_generate(model, params, prompt, n))
  assert got.shape == (3, p + n) and got.dtype == np.int32
  np.testing.assert_array_equal(got[:, :p], prompt)
  # Dense attention at the exact length (no buffer, no padding): the logits at position t see
  # tokens [0, t] only, so one pass over the output checks every step of the decoding.
  b, t = got.shape[0], got.shape[1] - 1
  layout = trainer.layout_of({"segment_ids": jnp.ones((b, t), jnp.int32),
                              "positions": jnp.broadcast_to(jnp.arange(t), (b, t))})
  logits = np.asarray(oracle.apply({"params": params}, jnp.asarray(got[:, :-1]), layout,
                                   method=oracle.logits))[:, p - 1:]
  top2 = np.sort(logits, axis=-1)[..., -2:]
  assert (top2[..., 1] - top2[..., 0]).min() > 1e-4, "near-tie: the comparison would be fragile"
  np.testing.assert_array_equal(got[:, p:], logits.argmax(-1))
  assert len(np.unique(got[:, p:])) > 1  # not a constant output


def test_greedy_generate_errors(config_and_params):
  c, params = config_and_params
  model = trainer.make_model(c, backends.get("local"))
  assert generate.greedy_generate(model, params, np.zeros((2, 3), np.int32), 0).shape == (2, 3)
  with pytest.raises(ValueError, match="Tp >= 1"):
    generate.greedy_generate(model, params, np.zeros((2, 0), np.int32), 4)
  with pytest.raises(ValueError, match="num_tokens=-1"):
    generate.greedy_generate(model, params, np.zeros((2, 3), np.int32), -1)
  with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
    generate.greedy_generate(model, params, np.full((1, 3), 256), 2)
  with pytest.raises(ValueError, match="integer token ids"):
    generate.greedy_generate(model, params, np.zeros((1, 3), np.float32), 2)
  assert generate.buffer_length(5, 7) == 64 and generate.buffer_length(60, 5) == 128
