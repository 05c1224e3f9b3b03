"""Data: packed batches of documents for training (see data/README.md for formats and rules).

``make_source(config.data, rows=..., tokens_per_row=..., vocab_size=..., seed=...)`` returns a
``Source``; ``source.batch(step)`` is a dict of [B, T] NumPy arrays (``BATCH_KEYS``) and
``source.doclens(step)`` the per-row piece lengths, both pure functions of (config, seed, step).
``run_source(c, data_ranks)`` is the one a run config trains on.

The text tokenizer is a command-line tool, ``python -m distca_jax.data.tokenize`` (not imported
here, so running it with ``-m`` does not import it twice).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from distca_jax.data.batch import (BATCH_DTYPES, BATCH_KEYS, DataError, Source, layout_arrays,
                                   pack_documents, validate_batch)
from distca_jax.data.files import FileSource, open_dataset
from distca_jax.data.order import HeavyFirst
from distca_jax.data.synthetic import SyntheticSource
from distca_jax.data.workloads import WORKLOADS, WorkloadSampler

SOURCES = ("synthetic", "files")

__all__ = [
    "BATCH_DTYPES", "BATCH_KEYS", "DataError", "FileSource", "HeavyFirst", "SOURCES", "Source",
    "SyntheticSource", "WORKLOADS", "WorkloadSampler", "layout_arrays", "make_source", "run_source",
    "open_dataset", "pack_documents", "validate_batch",
]

_MISSING = object()


def _get(data_config: Any, key: str, default: Any = _MISSING) -> Any:
  if isinstance(data_config, Mapping):
    value = data_config.get(key, default)
  else:
    value = getattr(data_config, key, default)
  if value is _MISSING:
    raise DataError(f"the data config lacks the key {key!r} (config.data.{key})")
  return value


def make_source(data_config: Any, *, rows: int, tokens_per_row: int, vocab_size: int,
                seed: int) -> Source:
  """Build the data source a config names.

  Args:
    data_config: ml_collections ConfigDict (or any attribute object or mapping) with keys
      ``source`` ('synthetic' | 'files'); for 'synthetic': ``workload`` ('pretrain' | 'prolong')
      and ``context_length`` (optional, default 0 = tokens_per_row); for 'files': ``path`` (the
      dataset prefix) and ``shuffle`` (optional, default True). Keys of the other source are
      ignored.
    rows: B = data-parallel ranks x rows per rank.
    tokens_per_row: T, the per-rank token budget.
    vocab_size: V, the model's vocabulary.
    seed: the data seed (layouts, shuffles, synthetic content).

  Returns:
    A ``Source``.
  """
  source = _get(data_config, "source")
  if source == "synthetic":
    workload = _get(data_config, "workload")
    if workload not in WORKLOADS:
      raise DataError(f"unknown config.data.{workload=}; choose one of {sorted(WORKLOADS)}")
    context_length = _get(data_config, "context_length", 0)
    if (isinstance(context_length, bool) or not isinstance(context_length, int)
        or context_length < 0):
      raise DataError(f"config.data.{context_length=} must be an integer >= 0 "
                      "(0 = tokens_per_row)")
    return SyntheticSource(workload, rows=rows, tokens_per_row=tokens_per_row,
                           vocab_size=vocab_size, seed=seed, context_length=context_length)
  if source == "files":
    path = _get(data_config, "path")
    if not isinstance(path, str) or not path:
      raise DataError(f"config.data.{path=} must name a dataset prefix (PREFIX.tokens.npy + "
                      "PREFIX.offsets.npy); write one with python -m distca_jax.data.tokenize")
    shuffle = _get(data_config, "shuffle", True)
    return FileSource(path, rows=rows, tokens_per_row=tokens_per_row, vocab_size=vocab_size,
                      seed=seed, shuffle=shuffle)
  raise DataError(f"unknown config.data.{source=}; choose one of {list(SOURCES)}")


def run_source(c: Any, data_ranks: int) -> Source:
  """The data source of run config ``c`` over ``data_ranks`` data ranks: ``make_source`` of
  ``c.data`` with ``data_ranks x c.rows_per_rank`` rows of ``c.tokens_per_rank`` tokens, the
  model's vocabulary and ``c.seed`` (the trainer's batches: a pure function of config, seed and
  step). distca with ping-pong and ``attention.distca.nano_rows='heavy_first'``: each rank's
  rows heaviest first (``order.HeavyFirst``), for the trainer and the caps' sampled plans alike."""
  source = make_source(c.data, rows=int(data_ranks) * int(c.rows_per_rank),
                       tokens_per_row=int(c.tokens_per_rank), vocab_size=int(c.model.vocab_size),
                       seed=c.seed)
  if (c.attention.backend == "distca" and c.attention.nano_batches > 1
      and c.attention.distca.nano_rows == "heavy_first"):
    return HeavyFirst(source, int(c.rows_per_rank))
  return source
