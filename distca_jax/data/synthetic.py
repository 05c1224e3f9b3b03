"""Synthetic batches: the paper's document layouts filled with learnable token content.

Layouts come from ``WorkloadSampler`` (real document lengths, the paper's recipe, seeded). Each
document of the stream is an arithmetic progression modulo the vocabulary,
``token[i] = (start + stride * i) mod V``, with ``start`` in [0, V) and ``stride`` in
[1, min(max_stride, V - 1)] drawn from a hash of (seed, epoch, document). A document keeps its
progression across the pieces the split rule cuts it into, so a piece's last target (the next row's
or next step's first token) is the progression's next term.

Why this content: the first target of a document (its second token) is a guess among the strides,
every later one is determined by the two tokens before it inside the same document. A tiny model
drops from ln(V) towards ln(max_stride) by bigram statistics within a few dozen steps and lower by
attending to the previous token, and only if attention stays inside documents.
"""

from __future__ import annotations

import numpy as np

from distca_jax.data.batch import DataError, Pieces, batch_from_pieces, check_step, select_rows
from distca_jax.data.workloads import WorkloadSampler, check_workload

DEFAULT_MAX_STRIDE = 4


def _mix64(x: np.ndarray) -> np.ndarray:
  """SplitMix64 finalizer on uint64 arrays (wrapping arithmetic): a cheap well-mixed hash."""
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


class SyntheticSource:
  """A ``Source`` of the 'pretrain' or 'prolong' workload with arithmetic-progression documents.

  Args:
    workload: 'pretrain' or 'prolong' (the samples in data/doclens), or the path of a user's
      document-length file (``workloads.load_doclens``).
    rows: B, rows per step.
    tokens_per_row: T, the token budget of one row.
    vocab_size: V (>= 2).
    seed: seeds layouts (the recipe's sample and per-epoch shuffles) and token content.
    context_length: the length the recipe scales document lengths to; 0 means ``tokens_per_row``.
    max_stride: largest progression stride.
  """

  def __init__(self, workload: str, *, rows: int, tokens_per_row: int, vocab_size: int, seed: int,
               context_length: int = 0, max_stride: int = DEFAULT_MAX_STRIDE):
    check_workload(workload)
    for name, value in (("rows", rows), ("tokens_per_row", tokens_per_row)):
      if int(value) <= 0:
        raise DataError(f"{name}={value} must be a positive integer")
    if int(vocab_size) < 2:
      raise DataError(f"{vocab_size=} must be at least 2 for synthetic progressions")
    if int(context_length) < 0:
      raise DataError(f"{context_length=} must be >= 0 (0 means tokens_per_row)")
    if int(max_stride) < 1:
      raise DataError(f"{max_stride=} must be >= 1")
    self.workload = workload
    self.rows = int(rows)
    self.tokens_per_row = int(tokens_per_row)
    self.vocab_size = int(vocab_size)
    self.seed = int(seed)
    self.strides = min(int(max_stride), self.vocab_size - 1)
    self.sampler = WorkloadSampler(workload, self.tokens_per_row, self.seed,
                                   int(context_length) or None)
    self.context_length = self.sampler.context_length
    self._seed_key = _mix64(np.array([self.seed], np.uint64) + np.uint64(0x9E3779B97F4A7C15))

  def _pieces(self, step: int) -> Pieces:
    return self.sampler.step_pieces(check_step(step), self.rows)

  def tokens(self, epoch_M: np.ndarray, doc_M: np.ndarray, offset_M: np.ndarray) -> np.ndarray:
    """Token at ``offset_M`` of pool document ``doc_M`` in epoch ``epoch_M`` (int64 [M])."""
    key = _mix64(epoch_M.astype(np.uint64) ^ self._seed_key)
    key = _mix64(key + doc_M.astype(np.uint64))
    start = (key % np.uint64(self.vocab_size)).astype(np.int64)
    stride = 1 + ((key >> np.uint64(32)) % np.uint64(self.strides)).astype(np.int64)
    return (start + stride * offset_M) % self.vocab_size

  def batch(self, step: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Step ``step``'s batch: arrays [B, T], or rows [a, b) of it for ``rows=(a, b)`` (see
    ``distca_jax.data.batch``)."""
    pieces, n = select_rows(self._pieces(step), self.rows, rows)
    return batch_from_pieces(pieces, n, self.tokens_per_row, self.tokens)

  def doclens(self, step: int) -> list[list[int]]:
    """Step ``step``'s piece lengths per row."""
    return self._pieces(step).row_doclens(self.rows)

  def describe(self) -> str:
    pool = self.sampler.pool
    return (f"synthetic {self.workload}: {self.rows} rows x {self.tokens_per_row} tokens, "
            f"context_length={self.context_length}, pool {pool.size} docs (median "
            f"{int(np.median(pool))}, max {int(pool.max())} tokens, "
            f"{self.sampler.pool_tokens} per epoch), vocab {self.vocab_size}, "
            f"strides 1..{self.strides}, seed {self.seed}")
