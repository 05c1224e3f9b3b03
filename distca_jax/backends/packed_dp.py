"""``packed_dp``: no balancing; each rank computes its own rows' documents in one fused varlen
call (``baselines.packed_dp_backend``)."""

from __future__ import annotations

import dataclasses

import ml_collections

from distca_jax import attention as attn_lib
from distca_jax import baselines


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: ``kernel`` (``ops.core_attention`` kernel), ``max_docs_per_row`` (task-table
  slots per row)."""
  kernel: str = "auto"
  max_docs_per_row: int = baselines.DEFAULT_MAX_DOCS_PER_ROW

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    return cls(kernel=c.attention.kernel, max_docs_per_row=c.attention.baselines.max_docs_per_row)


def make(options: Options) -> attn_lib.Backend:
  return baselines.packed_dp_backend(options.kernel, options.max_docs_per_row)
