"""``cp``: per-sequence context parallelism (groups of ``cp_size`` consecutive data ranks,
head-tail chunks, K/V all-gathered in the group; ``baselines.group_backend``). A ``cp_size`` of 0
is chosen as ``wlb``'s configuration is: the fastest predicted CP size whose train step fits the
device (``baselines.ideal.cp_choice_from_config``), by ``distca_jax.choose.resolve`` before the
trainer starts, or at startup (``from_first_batches``) where the device reports no memory."""

from __future__ import annotations

import dataclasses

import ml_collections

from distca_jax import attention as attn_lib
from distca_jax import baselines


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: ``cp_size`` (ranks per group, divides mesh.data; 0 or None: chosen by
  ``from_first_batches``), ``kernel``, ``max_docs_per_row``, ``rows_per_rank`` (the trainer's)."""
  cp_size: int | None = None
  kernel: str = "auto"
  max_docs_per_row: int = baselines.DEFAULT_MAX_DOCS_PER_ROW
  rows_per_rank: int = 1

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    """The config's options (no data read: a ``cp_size`` of 0 stays 0 until
    ``from_first_batches``)."""
    b = c.attention.baselines
    return cls(cp_size=b.cp_size, kernel=c.attention.kernel,
               max_docs_per_row=b.max_docs_per_row, rows_per_rank=c.rows_per_rank)


def from_first_batches(c: ml_collections.ConfigDict, options: Options) -> Options:
  """The startup step (``backends.build`` calls this once per run, after ``from_config``): a
  ``cp_size`` of 0 (or None) takes the fastest predicted CP size (``baselines.baseline_choice``,
  memoized per config; a UserError on a device with a memory capacity, where
  ``distca_jax.choose.resolve`` chooses it before the trainer starts); a given one stays."""
  if options.cp_size:
    return options
  return dataclasses.replace(options, cp_size=baselines.baseline_choice(c, "cp").cp_size)


def make(options: Options) -> attn_lib.Backend:
  return baselines.group_backend("cp", **dataclasses.asdict(options))
