"""The pipeline's schedule on the host (NumPy): which microbatch each stage holds at each tick,
and the rows each tick's core-attention call sees (``tick_rows``, what a planner plans per tick).

``distca_jax.pipeline`` runs this schedule on devices (one scan over the ticks); the arithmetic
here is what the host needs of it without JAX: the distca backend's per-tick planning and its
startup caps, the schedule tables of the experiments. Letters (docs/design.md, "Words and
letters"): P stages, M microbatches, R rows per rank.
"""

from __future__ import annotations

import numpy as np

from distca_jax.errors import UserError


def resolve_microbatches(microbatches: int, stages: int) -> int:
  """The configured microbatch count; 0 takes the default 2 x stages."""
  if microbatches < 0:
    raise UserError(f"pipeline.microbatches={microbatches} must be >= 0 (0 = 2 x mesh.pipe)")
  return microbatches or 2 * stages


def num_ticks(stages: int, microbatches: int) -> int:
  return microbatches + stages - 1


def schedule_table(stages: int, microbatches: int) -> np.ndarray:
  """int32 [M + P - 1, P]: the microbatch stage s holds at tick t, or -1 (a bubble slot)."""
  t = np.arange(num_ticks(stages, microbatches))[:, None]
  m = t - np.arange(stages)[None, :]
  return np.where((m >= 0) & (m < microbatches), m, -1).astype(np.int32)


def bubble_fraction(table: np.ndarray) -> float:
  """Share of (tick, stage) slots of a schedule table that compute nothing anybody reads."""
  return float((table < 0).mean())


def tick_rows(doclens, *, stages: int, rows_per_rank: int, microbatches: int):
  """The rows each tick's core-attention call sees: one list of document-length lists per tick,
  ordered (stage, data rank, row of the microbatch); bubble slots are empty rows.

  `doclens` is the batch's, one list per row, data rank d owning rows [d R, (d+1) R).
  """
  m = resolve_microbatches(microbatches, stages)
  if rows_per_rank % m or len(doclens) % rows_per_rank:
    raise ValueError(f"{len(doclens)} rows of rows_per_rank={rows_per_rank} cannot form "
                     f"pipeline.microbatches={m} microbatches of whole rows")
  r, d = rows_per_rank // m, len(doclens) // rows_per_rank
  return [[list(doclens[rank * rows_per_rank + mb * r + j]) if mb >= 0 else []
           for mb in held for rank in range(d) for j in range(r)]
          for held in schedule_table(stages, m)]
