"""Tokenized documents from local files: ``PREFIX.tokens.npy`` + ``PREFIX.offsets.npy``.

* ``PREFIX.tokens.npy``: 1-D int32 token ids of all documents back to back (memory-mapped).
* ``PREFIX.offsets.npy``: 1-D int64, D + 1 offsets; document d is
  ``tokens[offsets[d]:offsets[d+1]]``; ``offsets[0] == 0``, strictly increasing (no empty
  documents), ``offsets[-1] == len(tokens)``.
* ``PREFIX.meta.json`` (optional; the tokenizer writes it, ``describe_dataset`` for other
  datasets): documents, tokens and the smallest and largest token id. Where it is present and
  matches the two files, the vocabulary check reads the ids from it; without it, opening the
  dataset reads every token once. Either way a process reads only the tokens of the rows it
  builds afterwards (memory-mapped; ``batch(step, rows=(a, b))``).

``python -m distca_jax.data.tokenize`` writes this format from text files. The documents form an
endless stream, epoch after epoch (a seeded permutation per epoch, or file order with
``shuffle=False``); step s takes stream tokens [s * B * T, (s + 1) * B * T) cut into rows by the
split rule of ``distca_jax.data.batch``. Everything is validated when the dataset is opened; each
problem raises ``DataError`` naming the file, the problem and the fix.
"""

from __future__ import annotations

import json
import os

import numpy as np

from distca_jax.data.batch import (DataError, DocumentStream, Pieces, batch_from_pieces, check_step,
                                   cut_rows, select_rows)

TOKENS_SUFFIX = ".tokens.npy"
OFFSETS_SUFFIX = ".offsets.npy"
META_SUFFIX = ".meta.json"
_MAKE_ONE = "write one with: python -m distca_jax.data.tokenize --output PREFIX FILE..."
_SCAN_CHUNK = 1 << 24  # tokens per chunk when checking ids, so the check never loads the whole file


def dataset_paths(prefix: str) -> tuple[str, str]:
  """(tokens path, offsets path) of a dataset prefix."""
  return prefix + TOKENS_SUFFIX, prefix + OFFSETS_SUFFIX


def meta_path(prefix: str) -> str:
  return os.fspath(prefix) + META_SUFFIX


def write_meta(prefix: str, *, documents: int, tokens: int, max_id: int, min_id: int = 0,
               **extra) -> dict:
  """Writes ``PREFIX.meta.json`` (atomically) and returns it."""
  meta = {"documents": int(documents), "tokens": int(tokens), "min_id": int(min_id),
          "max_id": int(max_id), **extra}
  tmp = meta_path(prefix) + ".partial"
  with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(tmp, meta_path(prefix))
  return meta


def describe_dataset(prefix: str) -> dict:
  """Validates dataset ``prefix`` (one pass over its tokens) and writes its ``PREFIX.meta.json``
  (``python -m distca_jax.data.tokenize --describe PREFIX``): processes that open it afterwards
  check token ids against it instead of reading every token."""
  tokens, offsets = open_dataset(prefix, use_meta=False)
  lo, hi = None, None
  for start in range(0, tokens.size, _SCAN_CHUNK):
    chunk = np.asarray(tokens[start:start + _SCAN_CHUNK])
    lo = int(chunk.min()) if lo is None else min(lo, int(chunk.min()))
    hi = int(chunk.max()) if hi is None else max(hi, int(chunk.max()))
  return write_meta(prefix, documents=offsets.size - 1, tokens=tokens.size, max_id=hi, min_id=lo)


def _check_ids_by_meta(prefix: str, tokens: np.ndarray, offsets: np.ndarray,
                       vocab_size: int) -> bool:
  """Checks the id range from ``PREFIX.meta.json``; False when there is none. A meta file that
  does not describe the two files raises."""
  path = meta_path(prefix)
  if not os.path.exists(path):
    return False
  try:
    with open(path) as f:
      meta = json.load(f)
    documents, count = int(meta["documents"]), int(meta["tokens"])
    lo, hi = int(meta.get("min_id", 0)), int(meta["max_id"])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise DataError(f"{path}: not a dataset description ({e}); rewrite it with python -m "
                    f"distca_jax.data.tokenize --describe {prefix}") from e
  if (documents, count) != (offsets.size - 1, tokens.size):
    raise DataError(f"{path} describes {documents} documents and {count} tokens but the files hold "
                    f"{offsets.size - 1} and {tokens.size}; it belongs to other files: rewrite it "
                    f"with python -m distca_jax.data.tokenize --describe {prefix}")
  if lo < 0 or hi >= vocab_size:
    raise DataError(f"{prefix}: token ids span [{lo}, {hi}] ({path}), outside [0, "
                    f"{vocab_size=}); token ids must be in [0, vocab_size): tokenize with a "
                    "tokenizer whose vocabulary fits the model, or raise the model's vocab_size "
                    f"above the largest id ({hi})")
  return True


def _load(path: str, what: str, prefix: str) -> np.ndarray:
  if not os.path.exists(path):
    hint = ""
    for suffix in (TOKENS_SUFFIX, OFFSETS_SUFFIX):
      if prefix.endswith(suffix):
        hint = f" (data.path is the prefix: drop {suffix!r}, i.e. {prefix[:-len(suffix)]!r})"
    raise DataError(f"{path}: {what} file not found; a dataset is PREFIX{TOKENS_SUFFIX} + "
                    f"PREFIX{OFFSETS_SUFFIX} and data.path={prefix!r} is the PREFIX{hint}; "
                    f"{_MAKE_ONE}")
  try:
    return np.load(path, mmap_mode="r", allow_pickle=False)
  except (ValueError, OSError, EOFError) as e:
    raise DataError(f"{path}: not a readable NumPy .npy file ({e}); save the {what} with np.save "
                    f"or {_MAKE_ONE}") from e


def open_dataset(prefix: str, *, vocab_size: int | None = None,
                 use_meta: bool = True) -> tuple[np.ndarray, np.ndarray]:
  """Open and validate a dataset.

  Args:
    prefix: the dataset prefix (files ``PREFIX.tokens.npy`` and ``PREFIX.offsets.npy``).
    vocab_size: if given, every token id must lie in [0, vocab_size): checked from
      ``PREFIX.meta.json`` where ``use_meta`` and it exists, else by reading every token.
    use_meta: whether to use ``PREFIX.meta.json``.

  Returns:
    (tokens [total] int32, memory-mapped; offsets [D + 1] int64, in memory).

  Raises:
    DataError: a file is missing or unreadable, has the wrong dtype or shape, the offsets are not
      0 = o_0 < o_1 < ... < o_D = len(tokens), the dataset is empty, or a token id is out of range.
  """
  prefix = os.fspath(prefix)
  tokens_path, offsets_path = dataset_paths(prefix)
  tokens = _load(tokens_path, "tokens", prefix)
  offsets_map = _load(offsets_path, "offsets", prefix)

  if tokens.ndim != 1 or tokens.dtype != np.int32:
    raise DataError(f"{tokens_path}: tokens must be a 1-D int32 array, got {tokens.dtype=} "
                    f"{tokens.shape=}; fix with np.save(path, tokens.reshape(-1).astype(np.int32))")
  if offsets_map.ndim != 1 or offsets_map.dtype != np.int64:
    raise DataError(f"{offsets_path}: offsets must be a 1-D int64 array, got {offsets_map.dtype=} "
                    f"{offsets_map.shape=}; fix with "
                    "np.save(path, offsets.reshape(-1).astype(np.int64))")
  offsets = np.array(offsets_map)  # D + 1 numbers: small next to the tokens, and read at every step
  if tokens.size == 0 or offsets.size < 2:
    raise DataError(f"{tokens_path}: the dataset is empty ({tokens.size} tokens, "
                    f"{max(offsets.size - 1, 0)} documents in {offsets_path}); it needs at least "
                    f"one non-empty document; {_MAKE_ONE}")
  if offsets[0] != 0:
    raise DataError(f"{offsets_path}: offsets must start at 0, got offsets[0]={int(offsets[0])}; "
                    f"offsets are [0, len(doc_0), len(doc_0) + len(doc_1), ..., len(tokens)]")
  lens = np.diff(offsets)
  if (lens < 0).any():
    d = int(np.flatnonzero(lens < 0)[0])
    raise DataError(f"{offsets_path}: offsets must increase, but offsets[{d}]={int(offsets[d])} > "
                    f"offsets[{d + 1}]={int(offsets[d + 1])}; write them as the cumulative sum of "
                    "the document lengths")
  if offsets[-1] != tokens.size:
    raise DataError(f"{offsets_path}: the last offset must equal the number of tokens in "
                    f"{tokens_path}, got offsets[-1]={int(offsets[-1])} and len(tokens)="
                    f"{tokens.size}; the two files do not belong together or one is truncated")
  if (lens == 0).any():
    empty = np.flatnonzero(lens == 0)
    raise DataError(f"{offsets_path}: {empty.size} empty documents (zero length), the first is "
                    f"document {int(empty[0])} (offsets[{int(empty[0])}] == "
                    f"offsets[{int(empty[0]) + 1}] == {int(offsets[empty[0]])}); drop them from "
                    "the offsets (np.unique(offsets)) or re-tokenize without empty inputs")
  if vocab_size is not None and not (
      use_meta and _check_ids_by_meta(prefix, tokens, offsets, int(vocab_size))):
    _check_token_range(tokens, offsets, int(vocab_size), tokens_path)
  return tokens, offsets


def _check_token_range(tokens: np.ndarray, offsets: np.ndarray, vocab_size: int,
                       tokens_path: str) -> None:
  for lo in range(0, tokens.size, _SCAN_CHUNK):
    chunk = np.asarray(tokens[lo:lo + _SCAN_CHUNK])
    bad = (chunk < 0) | (chunk >= vocab_size)
    if bad.any():
      i = int(np.flatnonzero(bad)[0])
      pos, value = lo + i, int(chunk[i])
      doc = int(np.searchsorted(offsets, pos, side="right")) - 1
      raise DataError(
          f"{tokens_path}: token id {value} at position {pos} (document {doc}) is outside "
          f"[0, {vocab_size=}); token ids must be in [0, vocab_size): tokenize with a tokenizer "
          f"whose vocabulary fits the model, or raise the model's vocab_size above the largest id "
          f"({int(tokens.max())})")


def num_documents(prefix: str) -> int:
  """The number of documents of dataset ``prefix`` (its offsets file's length - 1; nothing else
  is read)."""
  prefix = os.fspath(prefix)
  return max(_load(dataset_paths(prefix)[1], "offsets", prefix).size - 1, 0)


def split_docs(num_docs: int, eval_fraction: float) -> int:
  """The first held-out document when ``eval_fraction`` of ``num_docs`` documents (the last ones,
  at least one) are held out; ``num_docs`` when ``eval_fraction`` is 0."""
  if not eval_fraction:
    return num_docs
  held = max(1, int(round(eval_fraction * num_docs)))
  if held >= num_docs:
    raise DataError(f"data.eval_fraction={eval_fraction} holds out {held} of the {num_docs} "
                    "documents, leaving none to train on; lower it or add documents")
  return num_docs - held


class FileSource:
  """A ``Source`` reading tokenized documents from ``PREFIX.tokens.npy`` + ``PREFIX.offsets.npy``.

  Args:
    path: the dataset prefix.
    rows: B, rows per step.
    tokens_per_row: T, the token budget of one row.
    vocab_size: V; every token id in the file must be in [0, V) (checked at open).
    seed: seeds the per-epoch document permutations.
    shuffle: a fresh seeded permutation of the documents per epoch; False keeps file order.
    docs: (a, b): only documents [a, b) of the dataset (a held-out split: ``split_docs``);
      None: all.
  """

  def __init__(self, path: str, *, rows: int, tokens_per_row: int, vocab_size: int, seed: int,
               shuffle: bool = True, docs: tuple[int, int] | None = None):
    for name, value in (("rows", rows), ("tokens_per_row", tokens_per_row),
                        ("vocab_size", vocab_size)):
      if int(value) <= 0:
        raise DataError(f"{name}={value} must be a positive integer")
    if not isinstance(shuffle, (bool, np.bool_)):
      raise DataError(f"{shuffle=} must be True or False")
    self.path = os.fspath(path)
    self.rows = int(rows)
    self.tokens_per_row = int(tokens_per_row)
    self.vocab_size = int(vocab_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.tokens, self.offsets = open_dataset(self.path, vocab_size=self.vocab_size)
    n = self.offsets.size - 1
    self.docs = (0, n) if docs is None else (int(docs[0]), int(docs[1]))
    if not 0 <= self.docs[0] < self.docs[1] <= n:
      raise DataError(f"{self.path}: documents {list(self.docs)} of its {n}: a split must keep at "
                      "least one document on each side; lower data.eval_fraction or add documents")
    lens = np.diff(self.offsets)[self.docs[0]:self.docs[1]]
    self.stream = DocumentStream(lens, self.seed, shuffle=self.shuffle, salt=2)

  def _pieces(self, step: int) -> Pieces:
    n = self.rows * self.tokens_per_row
    return cut_rows(self.stream.pieces(check_step(step) * n, n), self.tokens_per_row, self.rows)

  def _tokens(self, epoch_M: np.ndarray, doc_M: np.ndarray, offset_M: np.ndarray) -> np.ndarray:
    del epoch_M  # a document's tokens are the same in every epoch
    return self.tokens[self.offsets[doc_M + self.docs[0]] + offset_M]

  def batch(self, step: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Step ``step``'s batch: arrays [B, T], or rows [a, b) of it for ``rows=(a, b)`` (see
    ``distca_jax.data.batch``)."""
    pieces, n = select_rows(self._pieces(step), self.rows, rows)
    return batch_from_pieces(pieces, n, self.tokens_per_row, self._tokens)

  def doclens(self, step: int) -> list[list[int]]:
    """Step ``step``'s piece lengths per row."""
    return self._pieces(step).row_doclens(self.rows)

  def describe(self) -> str:
    lens = self.stream.lens_D
    per_step = self.rows * self.tokens_per_row
    part = "" if self.docs == (0, self.offsets.size - 1) else f" (documents {list(self.docs)})"
    return (f"files {self.path}{part}: {lens.size} docs, {self.stream.num_tokens} tokens (median "
            f"{int(np.median(lens))}, max {int(lens.max())}), {self.rows} rows x "
            f"{self.tokens_per_row} tokens, one epoch = {self.stream.num_tokens / per_step:.2f} "
            f"steps, shuffle={self.shuffle}, seed {self.seed}, vocab {self.vocab_size}")
