"""``local``: each row attends its own documents (blockwise jnp with online softmax, custom VJP;
``attention.local_attention``). The default backend and every other backend's loss oracle."""

from __future__ import annotations

import dataclasses
import functools

import ml_collections

from distca_jax import attention as attn_lib


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: ``block_q`` / ``block_k``: query / key block (clamped to a divisor of T)."""
  block_q: int = 512
  block_k: int = 512

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    return cls(block_q=c.attention.block_q, block_k=c.attention.block_k)


def make(options: Options) -> attn_lib.Backend:
  return attn_lib.Backend(functools.partial(attn_lib.local_attention, block_q=options.block_q,
                                            block_k=options.block_k))
