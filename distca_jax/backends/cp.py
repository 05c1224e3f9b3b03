"""``cp``: per-sequence context parallelism (groups of ``cp_size`` consecutive data ranks,
head-tail chunks, K/V all-gathered in the group; ``baselines.group_backend``)."""

from __future__ import annotations

import dataclasses

import ml_collections

from distca_jax import attention as attn_lib
from distca_jax import baselines


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: ``cp_size`` (ranks per group, divides mesh.data; required), ``kernel``,
  ``max_docs_per_row``, ``rows_per_rank`` (the trainer's)."""
  cp_size: int | None = None
  kernel: str = "auto"
  max_docs_per_row: int = baselines.DEFAULT_MAX_DOCS_PER_ROW
  rows_per_rank: int = 1

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    b = c.attention.baselines
    return cls(cp_size=b.cp_size, kernel=c.attention.kernel,
               max_docs_per_row=b.max_docs_per_row, rows_per_rank=c.rows_per_rank)


def make(options: Options) -> attn_lib.Backend:
  return baselines.group_backend("cp", **dataclasses.asdict(options))
