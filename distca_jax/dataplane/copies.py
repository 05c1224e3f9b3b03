"""Row copies of the data plane and their custom VJPs.

Every copy moves whole rows (``[rows, ...]``) through an int32 index in which an out-of-range
entry (the metadata's sentinel) gives ``fill``. Rows travel as 32-bit words (``_row_words``), and
the backward avoids XLA's bf16 scatter-add (results/archive/5a62d97/row_copy_bench.md,
results/archive/10d3c84/gather_bench.md):

* ``take_rows``: ``x[idx]``; the sender gathers and the query/output paths.
* ``gather_two``: ``concat(own rows, received rows)[idx]`` without building the concatenation
  (key and value rows, which several tasks may read).
* ``place_unique``: the same for routes that read every source row once (query rows to the
  server, output rows back): own rows first, received rows written in place afterwards.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np


def take_rows(x: jax.Array, idx: jax.Array, fill=0, *, unique: bool = False) -> jax.Array:
  """Rows ``x[idx]``; an out-of-range index (the metadata's sentinel) gives ``fill``.

  The rows are copied as 32-bit words (``_row_words``), which XLA gathers faster than
  ``[rows, heads, dim]`` bf16 rows (results/archive/5a62d97/row_copy_bench.md).

  The backward (``_copy_rows``) avoids XLA's bf16 scatter-add
  (results/archive/10d3c84/gather_bench.md): with
  ``unique=True`` (no row of ``x`` is read twice: the query and output paths) it is a gather
  through the inverse map; otherwise (key/value rows feed several tasks and servers) a
  scatter-add in float32 (the sum of a row's contributions is rounded once).
  """
  return _copy_rows(x, idx, fill, unique)


def _row_words(x: jax.Array) -> jax.Array:
  """``[N, ...]`` -> ``[N, W]`` uint32 view of each row's bytes (rows of whole 4-byte words), or
  ``[N, F]`` flat rows when a row's bytes are not whole words (no copy: a bitcast)."""
  n, item = x.shape[0], jnp.dtype(x.dtype).itemsize
  flat = x.reshape(n, -1)
  if item > 4 or 4 % item or (flat.shape[1] * item) % 4:
    return flat
  return lax.bitcast_convert_type(flat.reshape(n, -1, 4 // item) if item < 4 else flat,
                                  jnp.uint32)


def _from_words(w: jax.Array, like: jax.Array, rows: int) -> jax.Array:
  """Inverse of ``_row_words``: ``rows`` rows shaped and typed like ``like``'s."""
  if w.dtype != like.dtype:
    w = lax.bitcast_convert_type(w, like.dtype)
  return w.reshape((rows,) + like.shape[1:])


def _word_fill(fill, dtype) -> Any:
  """The 32-bit word whose bytes are ``fill`` in ``dtype`` (every element of it)."""
  item = jnp.dtype(dtype).itemsize
  if item > 4 or 4 % item:
    return fill
  return int(np.full(4 // item, fill, dtype=jnp.dtype(dtype)).view(np.uint32)[0])


def _gather_words(x, idx, fill):
  """``jnp.take(x, idx, axis=0, mode='fill')`` on the ``_row_words`` view: rows as words."""
  w = _row_words(x)
  return jnp.take(w, idx, axis=0, mode="fill",
                  fill_value=_word_fill(fill, x.dtype) if w.dtype != x.dtype else fill)


def _take_words(x, idx, fill):
  """``jnp.take(x, idx, axis=0, mode='fill')`` computed on ``_row_words`` views."""
  return _from_words(_gather_words(x, idx, fill), x, idx.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _copy_rows(x, idx, fill, unique):
  return _take_words(x, idx, fill)


def _take_rows_fwd(x, idx, fill, unique):
  # A zero-width stand-in carries x's row count and dtype to the backward.
  return _copy_rows(x, idx, fill, unique), (idx, jnp.zeros((x.shape[0], 0), x.dtype))


def _take_rows_bwd(fill, unique, res, dy):
  idx, like = res
  n = like.shape[0]
  if unique:
    inv = jnp.full((n,), idx.shape[0], jnp.int32).at[idx].set(
        jnp.arange(idx.shape[0], dtype=jnp.int32), mode="drop")
    dx = _take_words(dy, inv, 0)
  else:
    flat = dy.reshape(dy.shape[0], -1).astype(jnp.float32)
    dx = jnp.zeros((n, flat.shape[1]), jnp.float32).at[idx].add(flat, mode="drop").reshape(
        (n,) + dy.shape[1:])
  return dx.astype(like.dtype), None


_copy_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def gather_two(own_TxF: jax.Array, recv_CxF: jax.Array, idx: jax.Array, fill=0) -> jax.Array:
  """``concat(own, received)[idx]`` without building the concatenation.

  ``idx`` addresses the metadata's source order: own rows ``[0, T)``, then the receive buffer
  ``[T, T + C)``; anything at or past ``T + C`` (the sentinel) gives ``fill``. Each output row
  reads one source: one gather from each buffer, joined by a select, which XLA fuses into one
  pass (no concatenated copy of own and received rows).
  """
  r, in_recv = _received(idx, own_TxF.shape[0], recv_CxF.shape[0])
  return _take_two(own_TxF, recv_CxF, idx, r, in_recv, fill)


def _received(idx: jax.Array, t: int, c: int):
  """(row of the receive buffer ``[c]`` that source index ``idx`` addresses, or ``c`` = none;
  whether it addresses one): own rows are ``[0, t)``, received rows ``[t, t + c)``."""
  r = idx - t
  in_recv = (r >= 0) & (r < c)
  return jnp.where(in_recv, r, c), in_recv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _take_two(own, recv, own_idx, recv_idx, in_recv, fill):
  """``where(in_recv, recv[recv_idx], own[own_idx])`` (out-of-range -> ``fill``), copied as
  32-bit words like ``take_rows``.

  The select runs on the words, so XLA fuses both gathers and the select into one pass
  (selecting bf16 rows after two word gathers measured slower). An index of one source is out
  of range wherever the row reads the other (``gather_two``), so each source's cotangent is
  the output's, scattered through its own index.
  """
  got = jnp.where(in_recv[:, None], _gather_words(recv, recv_idx, fill),
                  _gather_words(own, own_idx, fill))
  return _from_words(got, own, own_idx.shape[0])


def _take_two_fwd(own, recv, own_idx, recv_idx, in_recv, fill):
  like = lambda x: jnp.zeros((x.shape[0], 0), x.dtype)
  return (_take_two(own, recv, own_idx, recv_idx, in_recv, fill),
          (own_idx, recv_idx, like(own), like(recv)))


def _take_two_bwd(fill, res, dy):
  own_idx, recv_idx, like_own, like_recv = res
  d_own, _ = _take_rows_bwd(fill, False, (own_idx, like_own), dy)
  d_recv, _ = _take_rows_bwd(fill, False, (recv_idx, like_recv), dy)
  return d_own, d_recv, None, None, None


_take_two.defvjp(_take_two_fwd, _take_two_bwd)


def place_unique(own_TxF: jax.Array, recv_CxF: jax.Array, idx: jax.Array, fill=0) -> jax.Array:
  """``gather_two`` built as own rows first, received rows written in place.

  For routes that read every source row at most once (query rows to the server, output rows
  back to the owner). The gather of the own rows does not depend on the exchange, so XLA may
  run it while the rows are on the wire; after the exchange only the received rows are
  touched: one scatter (unique destinations, no atomics) of the ``C`` received rows.
  ``gather_two`` instead reads both sources for every output row after the exchange.
  Output rows that no source fills are ``fill``.
  """
  t, c = own_TxF.shape[0], recv_CxF.shape[0]
  n = idx.shape[0]
  out = take_rows(own_TxF, idx, fill, unique=True)  # rows routed to received rows: fill, for now
  src, _ = _received(idx, t, c)
  # The inverse map: received row -> its output row (n = not placed, dropped by the scatter).
  dst = jnp.full((c,), n, jnp.int32).at[src].set(jnp.arange(n, dtype=jnp.int32), mode="drop",
                                                 unique_indices=True)
  # Flat rows: XLA's scatter, like its gather, is faster over [rows, features] than over
  # [rows, heads, dim] (results/archive/5a62d97/row_copy_bench.md).
  return out.reshape(n, -1).at[dst].set(recv_CxF.reshape(c, -1), mode="drop",
                                        unique_indices=True).reshape(out.shape)
