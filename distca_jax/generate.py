"""Greedy decoding with a trained model, for small models (notebooks, smoke tests).

No KV cache: every new token is the argmax of the model's logits on the whole prefix, so
decoding Tn tokens runs Tn forward passes over one fixed-length buffer (one compile). The buffer's
tokens past the prefix are placeholders; causal attention keeps them from reaching the prefix.
The model's core attention must need no host plan (``local`` or ``reference``): parameters are
the same under every backend, so a model trained with ``distca`` decodes with
``trainer.make_model(config, backends.get('local'))``.

Letters (docs/design.md, "Words and letters"): B prompts, Tp prompt tokens, Tn new tokens,
L buffer length (Tp + Tn rounded up), V vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from distca_jax import attention as attn_lib

BUFFER_MULTIPLE = 64  # the buffer length is rounded up to this (the `local` backend tiles rows)


def buffer_length(prompt_len: int, num_tokens: int) -> int:
  """L: ``prompt_len + num_tokens`` rounded up to a multiple of ``BUFFER_MULTIPLE``."""
  n = prompt_len + num_tokens
  return -(-n // BUFFER_MULTIPLE) * BUFFER_MULTIPLE


def greedy_generate(model, params, prompt_BxTp, num_tokens: int) -> jax.Array:
  """Extends each prompt by ``num_tokens`` greedy tokens.

  Args:
    model: a ``model.Transformer`` whose core attention needs no host plan (``local``,
      ``reference``).
    params: its parameters (the ``params`` collection, e.g. ``TrainState.params``).
    prompt_BxTp: int array [B, Tp] of token ids, Tp >= 1; each row is one document.
    num_tokens: Tn >= 0 tokens to append.

  Returns:
    int32 [B, Tp + Tn]: the prompts followed by the generated tokens.
  """
  prompt_BxTp = jnp.asarray(prompt_BxTp)
  if prompt_BxTp.ndim != 2 or prompt_BxTp.shape[1] < 1:
    raise ValueError(f"prompt_BxTp must be [B, Tp] token ids with Tp >= 1; got "
                     f"{prompt_BxTp.shape=}")
  if not jnp.issubdtype(prompt_BxTp.dtype, jnp.integer):
    raise ValueError(f"prompt_BxTp must hold integer token ids; got {prompt_BxTp.dtype=}")
  if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
    raise ValueError(f"{num_tokens=} must be an int >= 0")
  vocab = model.cfg.vocab_size
  if not isinstance(prompt_BxTp, jax.core.Tracer):
    lo, hi = int(prompt_BxTp.min()), int(prompt_BxTp.max())
    if lo < 0 or hi >= vocab:
      raise ValueError(f"prompt token ids span [{lo}, {hi}]; they must lie in [0, {vocab}) "
                       "(model.vocab_size)")
  return _generate(model, params, prompt_BxTp.astype(jnp.int32), num_tokens)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _generate(model, params, prompt_BxTp, num_tokens: int):
  b, p = prompt_BxTp.shape
  length = buffer_length(p, num_tokens)
  tokens_BxL = jnp.zeros((b, length), jnp.int32).at[:, :p].set(prompt_BxTp)
  layout = attn_lib.Layout(jnp.ones((b, length), jnp.int32),
                           jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length)))

  def step(i, tokens_BxL):
    logits_BxLxV = model.apply({"params": params}, tokens_BxL, layout, method=model.logits)
    next_B = jnp.argmax(logits_BxLxV[:, i - 1], axis=-1).astype(jnp.int32)
    return tokens_BxL.at[:, i].set(next_B)

  tokens_BxL = jax.lax.fori_loop(p, p + num_tokens, step, tokens_BxL)
  return tokens_BxL[:, :p + num_tokens]
