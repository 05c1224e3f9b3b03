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
from distca_jax.data.files import FileSource, num_documents, open_dataset, split_docs
from distca_jax.data.order import HeavyFirst
from distca_jax.data.synthetic import SyntheticSource
from distca_jax.data.workloads import WORKLOADS, WorkloadSampler, check_workload

SOURCES = ("synthetic", "files")
SPLITS = ("train", "eval")
# The held-out synthetic stream's seed is the run's seed plus this (other layouts, other content).
EVAL_SEED_OFFSET = 0x5EED

__all__ = [
    "BATCH_DTYPES", "BATCH_KEYS", "DataError", "EVAL_SEED_OFFSET", "FileSource", "HeavyFirst", "SOURCES", "Source",
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
                seed: int, split: str = "train") -> Source:
  """Build the data source a config names.

  Args:
    data_config: ml_collections ConfigDict (or any attribute object or mapping) with keys
      ``source`` ('synthetic' | 'files'); for 'synthetic': ``workload`` ('pretrain' | 'prolong' | a document-length file's path)
      and ``context_length`` (optional, default 0 = tokens_per_row); for 'files': ``path`` (the
      dataset prefix), ``shuffle`` (optional, default True), ``eval_path`` and
      ``eval_fraction`` (optional: the held-out split). Keys of the other source are ignored.
    rows: B = data-parallel ranks x rows per rank.
    tokens_per_row: T, the per-rank token budget.
    vocab_size: V, the model's vocabulary.
    seed: the data seed (layouts, shuffles, synthetic content).
    split: 'train', or 'eval' for the held-out data: synthetic, the stream of seed
      ``seed + EVAL_SEED_OFFSET``; files, the dataset ``eval_path``, else the last
      ``eval_fraction`` of ``path``'s documents (which 'train' leaves out).

  Returns:
    A ``Source``.
  """
  if split not in SPLITS:
    raise DataError(f"unknown data {split=}; choose one of {list(SPLITS)}")
  source = _get(data_config, "source")
  if source == "synthetic":
    workload = _get(data_config, "workload")
    try:
      check_workload(workload)
    except DataError as e:
      raise DataError(f"config.data.workload: {e}") from None
    context_length = _get(data_config, "context_length", 0)
    if (isinstance(context_length, bool) or not isinstance(context_length, int)
        or context_length < 0):
      raise DataError(f"config.data.{context_length=} must be an integer >= 0 "
                      "(0 = tokens_per_row)")
    return SyntheticSource(workload, rows=rows, tokens_per_row=tokens_per_row,
                           vocab_size=vocab_size, context_length=context_length,
                           seed=seed + (EVAL_SEED_OFFSET if split == "eval" else 0))
  if source == "files":
    path = _get(data_config, "path")
    if not isinstance(path, str) or not path:
      raise DataError(f"config.data.{path=} must name a dataset prefix (PREFIX.tokens.npy + "
                      "PREFIX.offsets.npy); write one with python -m distca_jax.data.tokenize")
    shuffle = _get(data_config, "shuffle", True)
    eval_path = _get(data_config, "eval_path", "")
    kwargs = dict(rows=rows, tokens_per_row=tokens_per_row, vocab_size=vocab_size, seed=seed,
                  shuffle=shuffle)
    if split == "eval" and eval_path:
      return FileSource(eval_path, **kwargs)
    fraction = float(_get(data_config, "eval_fraction", 0.0))
    if not fraction:
      if split == "eval":
        raise DataError("no held-out data: set config.data.eval_path=PREFIX (a held-out dataset) "
                        "or config.data.eval_fraction=F (that share of data.path's documents)")
      return FileSource(path, **kwargs)
    n = num_documents(path)
    first = split_docs(n, fraction)
    return FileSource(path, docs=(0, first) if split == "train" else (first, n), **kwargs)
  raise DataError(f"unknown config.data.{source=}; choose one of {list(SOURCES)}")


def run_source(c: Any, data_ranks: int, split: str = "train") -> Source:
  """The data source of run config ``c`` over ``data_ranks`` data ranks: ``make_source`` of
  ``c.data`` with ``data_ranks x c.rows_per_rank`` rows of ``c.tokens_per_rank`` tokens, the
  model's vocabulary and ``c.seed`` (the trainer's batches: a pure function of config, seed and
  step). distca with ping-pong and ``attention.distca.nano_rows='heavy_first'``: each rank's
  rows heaviest first (``order.HeavyFirst``), for the trainer and the caps' sampled plans alike.
  ``split='eval'``: the held-out batches evaluation reads (``make_source``)."""
  source = make_source(c.data, rows=int(data_ranks) * int(c.rows_per_rank),
                       tokens_per_row=int(c.tokens_per_rank), vocab_size=int(c.model.vocab_size),
                       seed=c.seed, split=split)
  if (c.attention.backend == "distca" and c.attention.nano_batches > 1
      and c.attention.distca.nano_rows == "heavy_first"):
    return HeavyFirst(source, int(c.rows_per_rank))
  return source
