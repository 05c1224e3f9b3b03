"""Row order within each data rank's block, for ping-pong's nano-batches.

With ``attention.nano_batches = n`` each nano-batch takes a fixed share of every rank's rows
(``pipeline.split_rows``: rows [i R/n, (i+1) R/n) of the rank's R). Which rows those are
decides how unequal the ranks' attention work is inside each nano-batch, which is what distca
plans and moves per nano-batch. ``HeavyFirst`` reorders each rank's rows by attention work
(the sum of its pieces' squared lengths), heaviest first, so every nano-batch takes rows of
like weight from every rank: heavy with heavy, light with light. No row leaves its rank, so
each device trains on the same tokens; only which nano-batch holds a row changes.
"""

from __future__ import annotations

import numpy as np

from distca_jax.data.batch import DataError


def heavy_first(doclens: list[list[int]], rows_per_rank: int) -> np.ndarray:
  """[B] permutation: position ``i`` of the reordered batch holds original row ``perm[i]``.

  Within each block of ``rows_per_rank`` rows, rows by attention work (sum of squared piece
  lengths) from heaviest to lightest, ties in their original order; blocks keep their place."""
  rows = len(doclens)
  _check_blocks(rows, rows_per_rank)
  work = np.asarray([sum(int(x) * int(x) for x in row) for row in doclens], np.float64)
  perm = np.arange(rows)
  for a in range(0, rows, rows_per_rank):
    block = perm[a:a + rows_per_rank]
    perm[a:a + rows_per_rank] = block[np.argsort(-work[block], kind="stable")]
  return perm


def _check_blocks(rows: int, rows_per_rank: int) -> None:
  if rows_per_rank <= 0 or rows % rows_per_rank:
    raise ValueError(f"{rows} rows do not split into blocks of rows_per_rank={rows_per_rank}")


class HeavyFirst:
  """A ``Source`` whose rows are ``source``'s, reordered within each rank's block by
  ``heavy_first``: ``doclens(step)`` and ``batch(step)`` in that order. ``batch(step, rows=(a,
  b))`` needs whole blocks (``a`` and ``b`` multiples of ``rows_per_rank``, as each process and
  device asks) and builds only those rows. The other attributes (``rows``, ``tokens_per_row``,
  ``vocab_size``, ...) are the wrapped source's. The last step's order is kept, so the input
  thread's ``doclens(step)`` then ``batch(step)`` read the wrapped lengths once."""

  def __init__(self, source, rows_per_rank: int):
    _check_blocks(source.rows, rows_per_rank)
    self.source = source
    self.rows_per_rank = int(rows_per_rank)
    self._last = None  # (step, permutation, reordered document lengths)

  def __getattr__(self, name):  # the wrapped source's attributes
    if name == "source":
      raise AttributeError(name)
    return getattr(self.source, name)

  def _ordered(self, step: int) -> tuple[np.ndarray, list[list[int]]]:
    last = self._last
    if last is None or last[0] != step:
      rows = self.source.doclens(step)
      perm = heavy_first(rows, self.rows_per_rank)
      last = self._last = (step, perm, [rows[i] for i in perm])
    return last[1], last[2]

  def order(self, step: int) -> np.ndarray:
    """Step ``step``'s permutation (``heavy_first`` of the wrapped source's document lengths)."""
    return self._ordered(step)[0].copy()

  def doclens(self, step: int) -> list[list[int]]:
    return [list(row) for row in self._ordered(step)[1]]

  def batch(self, step: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    perm = self._ordered(step)[0]
    if rows is None:
      return {k: v[perm] for k, v in self.source.batch(step).items()}
    a, b = (int(x) for x in rows)
    if not 0 <= a < b <= self.rows:
      raise DataError(f"rows={rows} must be a range [a, b) with 0 <= a < b <= {self.rows}")
    if a % self.rows_per_rank or b % self.rows_per_rank:
      raise ValueError(f"rows={rows}: rows reordered within each rank's block "
                       f"(attention.distca.nano_rows='heavy_first') are built in whole blocks of "
                       f"rows_per_rank={self.rows_per_rank}")
    block = self.source.batch(step, rows=(a, b))
    return {k: v[perm[a:b] - a] for k, v in block.items()}

  def describe(self) -> str:
    return (f"{self.source.describe()}; each rank's rows heaviest first (nano-batches of like "
            "attention work)")
