"""Synthetic document-length workloads from the real samples behind the DistCA paper.

The two samples in ``data/doclens`` (see its README) give real training-document lengths. The paper
turns them into batches with a fixed recipe; this module follows it, seeded:

1. split documents at 65,536 tokens into short (< 65,536) and long (>= 65,536);
2. keep a seeded random half (``short_keep``) of the short ones;
3. repeat every long document ``long_upsample`` (4) times;
4. multiply every length by ``context_length / 65,536`` (rounded, at least 1 token);
5. ProLong only: with probability 0.3 replace a long document by one of exactly
   ``65,536 * context_length / 65,536 = context_length`` tokens;
6. shuffle (seeded, a fresh permutation per epoch) and pack greedily into fixed windows, splitting a
   document that straddles a window boundary (the paper's rule: each piece becomes a document of
   its own, positions restarting at 0).

The result is a deterministic function of (workload, context_length, seed, step): step ``s`` takes
the window ``[s * rows * T, (s + 1) * rows * T)`` of the packed stream, so a resumed run sees
exactly the batches an uninterrupted run would have seen. The stream and the split rule themselves
live in ``batch.py`` (``DocumentStream``, ``cut_rows``), shared with the file loader.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

import numpy as np

from distca_jax.data.batch import DataError, DocumentStream, Pieces, cut_rows

WORKLOADS = {"pretrain": "pretrain_wlbllm.json", "prolong": "prolong.json"}
_BASE_CONTEXT = 65_536


def doclens_dir() -> str:
  """Folder holding the length samples (``$DISTCA_DOCLENS_DIR`` overrides)."""
  env = os.environ.get("DISTCA_DOCLENS_DIR")
  if env:
    return env
  here = os.path.dirname(os.path.abspath(__file__))
  return os.path.normpath(os.path.join(here, "..", "..", "data", "doclens"))


def is_user_workload(name: str) -> bool:
  """Whether ``name`` names a user's document-length file rather than a shipped sample."""
  return name not in WORKLOADS


def check_workload(name: str) -> None:
  """Raises a one-line ``DataError`` unless ``name`` is a shipped sample or an existing file."""
  if is_user_workload(name) and not os.path.isfile(name):
    raise DataError(f"unknown workload={name!r}: choose one of {sorted(WORKLOADS)}, or give the "
                    "path of a document-length file (a JSON list, a .npy array, or one length a "
                    "line)")


def _read_lengths(path: str) -> np.ndarray:
  """A document-length file: a JSON list, a .npy array, or text with one length a line."""
  try:
    if path.endswith(".npy"):
      raw = np.load(path, allow_pickle=False)
    elif path.endswith(".json"):
      with open(path) as f:
        raw = json.load(f)
    else:
      raw = np.loadtxt(path, dtype=np.float64, ndmin=1)
    lens = np.asarray(raw)
  except (OSError, ValueError) as e:
    raise DataError(f"{path}: cannot read document lengths ({e}); write a JSON list, a .npy "
                    "array or one length a line") from None
  if (lens.ndim != 1 or lens.size == 0 or not np.issubdtype(lens.dtype, np.number)
      or (lens <= 0).any() or (lens != np.round(lens)).any()):
    raise DataError(f"{path}: expected a non-empty list of positive integers (document lengths "
                    "in tokens)")
  return lens.astype(np.int64)


@functools.lru_cache(maxsize=None)
def load_doclens(name: str) -> np.ndarray:
  """Raw document lengths of a shipped sample ('pretrain' or 'prolong') or of a user's
  document-length file (``name`` its path: a JSON list, a .npy array, or one length a line),
  int64."""
  check_workload(name)
  if is_user_workload(name):
    return _read_lengths(name)
  path = os.path.join(doclens_dir(), WORKLOADS[name])
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"document-length sample {path} is missing; it ships in the repository under data/doclens "
        "(or point $DISTCA_DOCLENS_DIR at a folder holding it)")
  with open(path) as f:
    lens = np.asarray(json.load(f), dtype=np.int64)
  if lens.ndim != 1 or lens.size == 0 or (lens <= 0).any():
    raise DataError(f"{path}: expected a non-empty JSON list of positive integers")
  return lens


@functools.lru_cache(maxsize=32)
def document_pool(name: str, context_length: int, seed: int = 0, *, short_keep: float = 0.5,
                  long_upsample: int = 4, prolong_replace: float = 0.3) -> np.ndarray:
  """The recipe's steps 1-5: the pool of scaled document lengths (int64, unshuffled order). A
  user's document-length file is its own pool: its lengths as given, unscaled (documents longer
  than a row are cut at rows, as every workload's)."""
  if context_length <= 0:
    raise DataError(f"{context_length=} must be a positive number of tokens")
  lens = load_doclens(name)
  if is_user_workload(name):
    return lens.copy()
  rng = np.random.default_rng([seed, 0x5EED])
  short = lens[lens < _BASE_CONTEXT]
  long = lens[lens >= _BASE_CONTEXT]
  n_keep = int(round(short_keep * short.size))
  short = np.sort(rng.choice(short.size, size=n_keep, replace=False))
  short = lens[lens < _BASE_CONTEXT][short]
  long = np.repeat(long, long_upsample)
  factor = context_length / _BASE_CONTEXT
  short = np.maximum(1, np.round(short * factor)).astype(np.int64)
  long = np.maximum(1, np.round(long * factor)).astype(np.int64)
  if name == "prolong" and long.size:
    replace = rng.random(long.size) < prolong_replace
    long[replace] = max(1, int(round(_BASE_CONTEXT * factor)))
  return np.concatenate([short, long])


class WorkloadSampler:
  """Per-step document layouts of a workload: ``rows`` windows of ``tokens_per_row`` tokens each.

  Args:
    name: 'pretrain' or 'prolong', or the path of a user's document-length file
      (``load_doclens``), whose lengths are the pool as given.
    tokens_per_row: the token budget of one window (one data-parallel rank's sequence).
    seed: seeds the short-document sample, the ProLong replacement and the per-epoch shuffles.
    context_length: the length the recipe scales to; defaults to ``tokens_per_row`` (the paper
      scales to the context window it packs).
  """

  def __init__(self, name: str, tokens_per_row: int, seed: int = 0,
               context_length: int | None = None):
    if tokens_per_row <= 0:
      raise DataError(f"{tokens_per_row=} must be positive")
    self.name = name
    self.tokens_per_row = int(tokens_per_row)
    self.seed = int(seed)
    self.context_length = int(context_length or tokens_per_row)
    self.pool = document_pool(name, self.context_length, self.seed)
    self.pool_tokens = int(self.pool.sum())
    # Epoch e visits the pool in permutation default_rng([seed, 1, e]); the stream packs them.
    self.stream = DocumentStream(self.pool, self.seed, shuffle=True, salt=1)

  def stream_pieces(self, start: int, length: int) -> Pieces:
    """The document pieces covering stream tokens [start, start + length) (see ``Pieces``)."""
    return self.stream.pieces(start, length)

  def stream_doclens(self, start: int, length: int) -> list[int]:
    """Lengths of the document pieces covering stream tokens [start, start + length)."""
    return self.stream_pieces(start, length).length_N.tolist()

  def flat_doclens(self, step: int, rows: int) -> list[int]:
    """Step ``step``'s window as one flat list packed across rows (documents may span rows)."""
    n = rows * self.tokens_per_row
    return self.stream_doclens(step * n, n)

  def step_pieces(self, step: int, rows: int) -> Pieces:
    """Step ``step``'s pieces cut into rows by the split rule (``Pieces.row_N`` set)."""
    n = rows * self.tokens_per_row
    return cut_rows(self.stream_pieces(step * n, n), self.tokens_per_row, rows)

  def step_doclens(self, step: int, rows: int) -> list[list[int]]:
    """Step ``step``'s layout, one list per row; a document straddling rows is split there."""
    return self.step_pieces(step, rows).row_doclens(rows)


def split_into_rows(flat: Sequence[int], tokens_per_row: int, rows: int) -> list[list[int]]:
  """Cut a flat packed list of lengths into ``rows`` windows, splitting straddling documents.

  Rows are filled in order; a row left short at the end is padding (its list sums to less).
  """
  lens = np.asarray([int(x) for x in flat], np.int64)
  if (lens <= 0).any():
    raise DataError(f"document length {int(lens[lens <= 0][0])} must be positive")
  zeros = np.zeros(lens.size, np.int64)
  pieces = Pieces(zeros, np.arange(lens.size), zeros, lens, lens)
  return cut_rows(pieces, tokens_per_row, rows).row_doclens(rows)
