"""``reference``: dense O(T^2) masked attention in plain jnp (``attention.dense_reference``);
tests only."""

from __future__ import annotations

import dataclasses

import ml_collections

from distca_jax import attention as attn_lib


@dataclasses.dataclass(frozen=True)
class Options:
  """No options."""

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    del c
    return cls()


def make(options: Options) -> attn_lib.Backend:
  del options
  return attn_lib.Backend(attn_lib.dense_reference)
