"""Packed batches: the batch contract, the document stream and the split rule.

A batch is a dict of NumPy arrays, all shaped [B, T] (B rows = data-parallel ranks x rows per rank,
T = ``tokens_per_row``, one rank's token budget):

* ``inputs``      int32   token ids;
* ``targets``     int32   the next token of the same document, 0 where ``loss_mask`` is 0;
* ``loss_mask``   float32 1 where the target is a real next token of the same document; 0 at the
  last token of a document and at padding;
* ``segment_ids`` int32   1, 2, 3, ... per document piece within the row, 0 for padding;
* ``positions``   int32   position of the token inside its own piece, 0 at each piece's start.

Every source is an endless *stream* of documents (epoch after epoch, each epoch a seeded order of
all documents). Step ``s`` takes stream tokens ``[s * B * T, (s + 1) * B * T)`` and cuts them into
rows of T tokens. The split rule (the DistCA paper's): a document that straddles a row boundary (or
the step boundary), or that is longer than T, is cut there, and each piece is a document of its own
for attention and RoPE (its own segment id, positions restarting at 0). Only the loss remembers the
cut: the last slot of a piece whose document goes on has the document's next token as its target,
with loss 1 (that token is the first input of the next row, or of the next step); the last slot of
a document's final piece has loss 0.

This module holds the pieces every source shares: ``DocumentStream`` (which document pieces cover
a window of the stream), ``cut_rows`` (the split rule), ``batch_from_pieces`` (the arrays) and
``pack_documents`` (a finite list of documents packed with padding, for evaluation and tests).
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import threading
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from distca_jax.errors import UserError

BATCH_DTYPES = {
    "inputs": np.int32,
    "targets": np.int32,
    "loss_mask": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}
BATCH_KEYS = tuple(BATCH_DTYPES)


class DataError(UserError):
  """Bad data input (file, config value or document); the message names the input and the fix."""


@runtime_checkable
class Source(Protocol):
  """A data source: ``batch(step)`` is a pure function of (config, seed, step).

  Attributes:
    rows: B, rows per step (data-parallel ranks x rows per rank).
    tokens_per_row: T, the token budget of one row.
    vocab_size: V; every token id is in [0, V).
  """

  rows: int
  tokens_per_row: int
  vocab_size: int

  def batch(self, step: int, rows: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The batch of step ``step``: arrays [B, T] keyed by ``BATCH_KEYS``; ``rows=(a, b)`` builds
    only rows [a, b) (arrays [b - a, T], equal to the whole batch's rows a..b-1)."""
    ...

  def doclens(self, step: int) -> list[list[int]]:
    """Piece lengths of step ``step``, one list per row, in row order (sum <= T)."""
    ...

  def describe(self) -> str:
    """One line for logs: what the source is and its sizes."""
    ...


def check_step(step) -> int:
  """Validate a step number (a non-negative integer, also NumPy/JAX integer scalars) as ``int``."""
  try:
    value = operator.index(step)
  except TypeError:
    value = None
  if isinstance(step, bool) or value is None or value < 0:
    raise DataError(f"{step=} must be a non-negative integer (the training step)")
  return value


@dataclasses.dataclass(frozen=True)
class Pieces:
  """Consecutive document pieces covering a window of a stream, in stream order (N pieces).

  Attributes:
    epoch_N: epoch of each piece's document.
    doc_N: index of the document in the source's pool (file order).
    offset_N: offset of the piece's first token inside its document.
    length_N: tokens in the piece (> 0).
    doc_len_N: full length of the piece's document.
    row_N: row of each piece after ``cut_rows``; None before.
  """

  epoch_N: np.ndarray
  doc_N: np.ndarray
  offset_N: np.ndarray
  length_N: np.ndarray
  doc_len_N: np.ndarray
  row_N: np.ndarray | None = None

  @property
  def num_tokens(self) -> int:
    return int(self.length_N.sum())

  def starts(self) -> np.ndarray:
    """[N] start of each piece inside the window (exclusive cumulative sum of lengths)."""
    return (np.cumsum(self.length_N) - self.length_N).astype(np.int64)

  def row_doclens(self, rows: int) -> list[list[int]]:
    """Piece lengths per row (``rows`` lists; rows without pieces are empty)."""
    if self.row_N is None:
      raise ValueError("row_doclens needs pieces cut into rows (call cut_rows first)")
    bounds = np.searchsorted(self.row_N, np.arange(rows + 1), side="left")
    lens = self.length_N.tolist()
    return [lens[bounds[r]:bounds[r + 1]] for r in range(rows)]

  def token_index(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-token (piece index [M], offset inside the whole document [M]) for the M window tokens."""
    starts = self.starts()
    piece_M = np.repeat(np.arange(self.length_N.size), self.length_N)
    within_M = np.arange(piece_M.size, dtype=np.int64) - starts[piece_M]
    return piece_M, self.offset_N[piece_M] + within_M


def _concat_pieces(parts: Sequence[Pieces]) -> Pieces:
  if not parts:
    empty = np.zeros(0, np.int64)
    return Pieces(empty, empty, empty, empty, empty)
  if len(parts) == 1:
    return parts[0]
  return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                  ("epoch_N", "doc_N", "offset_N", "length_N", "doc_len_N")))


class DocumentStream:
  """An endless stream of documents: epoch ``e`` is every document once, in a seeded order.

  Args:
    lens_D: lengths of the D documents (all > 0), in pool / file order.
    seed: seeds the per-epoch orders.
    shuffle: a fresh seeded permutation per epoch; False keeps pool order every epoch.
    salt: separates the permutations of different users of the same seed.
  """

  _CACHED_EPOCHS = 4

  def __init__(self, lens_D: np.ndarray, seed: int, *, shuffle: bool = True, salt: int = 1):
    lens_D = np.asarray(lens_D, dtype=np.int64)
    if lens_D.ndim != 1 or lens_D.size == 0:
      raise DataError(
          f"a document stream needs a non-empty 1-D list of lengths, got {lens_D.shape=}")
    if (lens_D <= 0).any():
      i = int(np.flatnonzero(lens_D <= 0)[0])
      raise DataError(f"document {i} has length {int(lens_D[i])}; documents must be non-empty")
    self.lens_D = lens_D
    self.lens_D.setflags(write=False)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.salt = int(salt)
    self.num_docs = int(lens_D.size)
    self.num_tokens = int(lens_D.sum())
    self._epochs: collections.OrderedDict[int, tuple[np.ndarray, np.ndarray]] = (
        collections.OrderedDict())
    self._lock = threading.Lock()  # a prefetch thread may share the source with the train loop

  def epoch_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(order_D: document indices in epoch order, starts_D1: their cumulative starts, [D + 1])."""
    with self._lock:
      if epoch in self._epochs:
        self._epochs.move_to_end(epoch)
        return self._epochs[epoch]
    if self.shuffle:
      order = np.random.default_rng([self.seed, self.salt, epoch]).permutation(self.num_docs)
    else:
      order = np.arange(self.num_docs)
    starts = np.zeros(self.num_docs + 1, np.int64)
    np.cumsum(self.lens_D[order], out=starts[1:])
    with self._lock:
      self._epochs[epoch] = (order, starts)
      while len(self._epochs) > self._CACHED_EPOCHS:
        self._epochs.popitem(last=False)
    return order, starts

  def pieces(self, start: int, length: int) -> Pieces:
    """The pieces covering stream tokens [start, start + length), in stream order.

    The first piece may begin inside a document (offset > 0) and the last may end inside one;
    epochs hold whole documents, so no document spans an epoch boundary.
    """
    if start < 0 or length < 0:
      raise ValueError(f"{start=} and {length=} must be non-negative")
    parts = []
    pos, end = int(start), int(start) + int(length)
    while pos < end:
      epoch, off = divmod(pos, self.num_tokens)
      stop = min(off + (end - pos), self.num_tokens)
      order, starts = self.epoch_order(epoch)
      i0 = int(np.searchsorted(starts, off, side="right")) - 1
      i1 = int(np.searchsorted(starts, stop, side="left"))
      doc_start = starts[i0:i1]
      doc = order[i0:i1]
      begin = np.maximum(doc_start, off)
      finish = np.minimum(starts[i0 + 1:i1 + 1], stop)
      parts.append(Pieces(np.full(doc.size, epoch, np.int64), doc.astype(np.int64),
                          begin - doc_start, finish - begin, self.lens_D[doc]))
      pos += stop - off
    return _concat_pieces(parts)


def cut_rows(pieces: Pieces, tokens_per_row: int, rows: int) -> Pieces:
  """The split rule: cut pieces at every row boundary (multiples of T) and tag each with its row.

  Rows fill in order; if the pieces hold fewer than ``rows * T`` tokens the rest is padding.
  """
  total = pieces.num_tokens
  if total > rows * tokens_per_row:
    raise DataError(f"documents hold {total} tokens, more than {rows=} x {tokens_per_row=}")
  starts = pieces.starts()
  cuts = np.union1d(starts, np.arange(tokens_per_row, total, tokens_per_row, dtype=np.int64))
  cuts = cuts[cuts < total]
  which = np.searchsorted(starts, cuts, side="right") - 1
  length = np.diff(np.append(cuts, total))
  return Pieces(pieces.epoch_N[which], pieces.doc_N[which],
                pieces.offset_N[which] + (cuts - starts[which]), length,
                pieces.doc_len_N[which], cuts // tokens_per_row)


def select_rows(pieces: Pieces, rows: int, row_range: tuple[int, int] | None) -> tuple[Pieces, int]:
  """(the pieces of rows [a, b) renumbered from 0, b - a); ``None`` keeps all ``rows``.

  Pieces are in row order, so rows [a, b) hold a contiguous run of them; building a batch from
  that run gives exactly rows a..b-1 of the whole batch (token content depends only on each
  piece's document and offset).
  """
  if row_range is None:
    return pieces, rows
  a, b = (int(x) for x in row_range)
  if not 0 <= a < b <= rows:
    raise DataError(f"rows={row_range} must be a range [a, b) with 0 <= a < b <= {rows}")
  if pieces.row_N is None:
    raise ValueError("select_rows needs pieces cut into rows (call cut_rows first)")
  i0, i1 = np.searchsorted(pieces.row_N, [a, b], side="left")
  sub = Pieces(pieces.epoch_N[i0:i1], pieces.doc_N[i0:i1], pieces.offset_N[i0:i1],
               pieces.length_N[i0:i1], pieces.doc_len_N[i0:i1], pieces.row_N[i0:i1] - a)
  return sub, b - a


TokenFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def batch_from_pieces(pieces: Pieces, rows: int, tokens_per_row: int,
                      token_fn: TokenFn) -> dict[str, np.ndarray]:
  """Build the batch arrays of pieces already cut into rows.

  Args:
    pieces: output of ``cut_rows`` (each row's pieces are contiguous from the row's start).
    rows: B.
    tokens_per_row: T.
    token_fn: ``token_fn(epoch_M, doc_M, offset_M) -> tokens_M``, the token at ``offset_M`` inside
      document ``doc_M`` of epoch ``epoch_M``; called for targets only where the document goes on.

  Returns:
    The batch dict, arrays [B, T].
  """
  if pieces.row_N is None:
    raise ValueError("batch_from_pieces needs pieces cut into rows (call cut_rows first)")
  T = tokens_per_row
  piece_M, offset_M = pieces.token_index()
  n_pieces = pieces.length_N.size
  starts_N = pieces.starts()
  first_N = np.searchsorted(pieces.row_N, pieces.row_N, side="left")  # first piece of each row
  col_N = starts_N - starts_N[first_N]
  seg_N = np.arange(n_pieces) - first_N + 1
  pos_M = np.arange(piece_M.size, dtype=np.int64) - starts_N[piece_M]
  dest_M = pieces.row_N[piece_M] * T + col_N[piece_M] + pos_M

  epoch_M, doc_M = pieces.epoch_N[piece_M], pieces.doc_N[piece_M]
  goes_on_M = offset_M + 1 < pieces.doc_len_N[piece_M]
  inputs_M = token_fn(epoch_M, doc_M, offset_M)
  targets_M = np.zeros(piece_M.size, np.int64)
  targets_M[goes_on_M] = token_fn(epoch_M[goes_on_M], doc_M[goes_on_M], offset_M[goes_on_M] + 1)

  out = {k: np.zeros(rows * T, dt) for k, dt in BATCH_DTYPES.items()}
  out["inputs"][dest_M] = inputs_M
  out["targets"][dest_M] = targets_M
  out["loss_mask"][dest_M] = goes_on_M
  out["segment_ids"][dest_M] = seg_N[piece_M]
  out["positions"][dest_M] = pos_M
  return {k: v.reshape(rows, T) for k, v in out.items()}


def layout_arrays(doclens: Sequence[Sequence[int]],
                  tokens_per_row: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment_ids [B, T], positions [B, T]) of a per-row list of piece lengths; 0 for padding."""
  rows = len(doclens)
  segment_ids = np.zeros((rows, tokens_per_row), np.int32)
  positions = np.zeros((rows, tokens_per_row), np.int32)
  for r, lens in enumerate(doclens):
    lens = np.asarray(lens, np.int64)
    used = int(lens.sum())
    if (lens <= 0).any() or used > tokens_per_row:
      raise DataError(f"row {r}: piece lengths {lens.tolist()} must be positive and sum to at most "
                      f"{tokens_per_row=}")
    piece = np.repeat(np.arange(lens.size), lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    segment_ids[r, :used] = piece + 1
    positions[r, :used] = np.arange(used) - starts[piece]
  return segment_ids, positions


def pack_documents(docs: Sequence[Sequence[int] | np.ndarray], *, rows: int,
                   tokens_per_row: int) -> tuple[dict[str, np.ndarray], list[list[int]]]:
  """Pack a finite list of documents, in order, into one batch with the split rule and padding.

  Args:
    docs: token-id sequences, each one whole document (non-empty).
    rows: B.
    tokens_per_row: T; the documents must hold at most B * T tokens.

  Returns:
    (batch dict of [B, T] arrays, per-row piece lengths).
  """
  arrays = [np.asarray(d).reshape(-1) for d in docs]
  for i, a in enumerate(arrays):
    if a.size == 0:
      raise DataError(f"document {i} is empty; drop it or give it at least one token")
    if not np.issubdtype(a.dtype, np.integer):
      raise DataError(f"document {i} has {a.dtype=}; token ids must be integers")
  if not arrays:
    raise DataError("pack_documents got no documents")
  lens = np.array([a.size for a in arrays], np.int64)
  flat = np.concatenate(arrays).astype(np.int64)
  doc_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
  stream = DocumentStream(lens, seed=0, shuffle=False)
  pieces = cut_rows(stream.pieces(0, int(lens.sum())), tokens_per_row, rows)
  batch = batch_from_pieces(pieces, rows, tokens_per_row,
                            lambda e, d, o: flat[doc_start[d] + o])
  return batch, pieces.row_doclens(rows)


def validate_batch(batch: dict[str, np.ndarray], *, rows: int | None = None,
                   tokens_per_row: int | None = None, vocab_size: int | None = None) -> None:
  """Check the batch contract (keys, dtypes, shapes, ranges, layout, loss/targets); raise DataError.

  Checks everything that one batch alone can show; a piece's last target when its document goes on
  (the next row's or step's first token) is checked by the tests against the stream instead.
  """
  missing = [k for k in BATCH_KEYS if k not in batch]
  if missing:
    raise DataError(f"batch lacks keys {missing}; it must hold {list(BATCH_KEYS)}")
  shape = batch["inputs"].shape
  for k, dt in BATCH_DTYPES.items():
    a = batch[k]
    if a.dtype != dt or a.shape != shape or a.ndim != 2:
      raise DataError(f"batch[{k!r}] has {a.dtype=}, {a.shape=}; expected {np.dtype(dt)} "
                      f"shaped like inputs {shape} (2-D)")
  if ((rows is not None and shape[0] != rows)
      or (tokens_per_row is not None and shape[1] != tokens_per_row)):
    raise DataError(f"batch shape {shape} differs from ({rows=}, {tokens_per_row=})")
  inp, tgt, loss = batch["inputs"], batch["targets"], batch["loss_mask"]
  seg, pos = batch["segment_ids"], batch["positions"]
  if vocab_size is not None:
    for k in ("inputs", "targets"):
      if batch[k].size and (batch[k].min() < 0 or batch[k].max() >= vocab_size):
        raise DataError(f"batch[{k!r}] holds ids outside [0, {vocab_size=})")
  if not np.isin(loss, (0.0, 1.0)).all():
    raise DataError("loss_mask must hold only 0 and 1")
  pad = seg == 0
  if any((batch[k][pad] != 0).any() for k in ("inputs", "targets", "loss_mask", "positions")):
    raise DataError(
        "padding slots (segment_ids == 0) must have inputs, targets, loss_mask and positions 0")
  if (tgt[loss == 0] != 0).any():
    raise DataError("targets must be 0 where loss_mask is 0")
  if (seg < 0).any():
    raise DataError("segment_ids must be >= 0")
  # Segments: start at 1 in slot 0, grow by 0 or 1 per slot, padding only as a suffix.
  real = ~pad
  if (pad[:, :-1] & real[:, 1:]).any():
    raise DataError("padding must come after every document of its row")
  step = np.diff(seg, axis=1)
  if (real[:, 0] & (seg[:, 0] != 1)).any() or ((step != 0) & (step != 1) & real[:, 1:]).any():
    raise DataError("segment_ids must count documents 1, 2, 3, ... from each row's start")
  new = np.ones_like(real)
  new[:, 1:] = step != 0
  expect_pos = np.zeros_like(pos)
  # Position = slots since the segment's start.
  idx = np.broadcast_to(np.arange(shape[1]), shape)
  seg_start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
  expect_pos[real] = (idx - seg_start)[real]
  if (pos != expect_pos).any():
    raise DataError("positions must restart at 0 at each segment's start and count up by 1")
  inner = (step == 0) & real[:, 1:]  # slot i and i + 1 in the same piece
  if (loss[:, :-1][inner] != 1).any() or (tgt[:, :-1][inner] != inp[:, 1:][inner]).any():
    raise DataError("inside a piece every target must be the next input with loss 1")
