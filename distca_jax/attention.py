"""Core attention: the pluggable middle piece of every layer (backends: distca_jax.backends).

Core attention is softmax(q k^T) v restricted to each document (causal, never crossing a document
boundary). It has no weights, so it can be moved anywhere: the `local` backend computes each row's
documents where they live; later backends (`distca`, baselines) compute the same function on other
devices. Every backend has the signature of `CoreAttentionFn` and must equal `dense_reference`.

Shapes: B rows (one per data-parallel rank slot), T tokens per row, H query heads, K kv heads,
D head dim, G = H // K query heads per kv head.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from custom_ops.varlen_attention import check_window


_NEG = -1e30  # finite "minus infinity": keeps fully masked rows NaN-free.


@flax.struct.dataclass
class Layout:
  """Where the documents are: travels with the batch into every layer.

  Attributes:
    segment_ids_BxT: int32, 1, 2, ... per document within a row; 0 marks padding.
    positions_BxT: int32, each token's position inside its own document (RoPE uses it).
    extra: backend-specific device arrays (e.g. a CAD plan's metadata); empty for `local`.
  """
  segment_ids_BxT: jax.Array
  positions_BxT: jax.Array
  extra: dict[str, Any] = flax.struct.field(default_factory=dict)


class CoreAttentionFn(Protocol):

  def __call__(self, q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
               layout: Layout, *, softmax_scale: float) -> jax.Array:
    ...


# ----------------------------------------------------------------------------------------------
# Reference: dense, O(T^2) memory. The oracle every backend is tested against.
# ----------------------------------------------------------------------------------------------
def document_mask(segment_ids_BxT: jax.Array, window: int = 0) -> jax.Array:
  """[B, T, T] bool: query t attends key s iff same document, not padding, s <= t (and, with a
  sliding ``window`` > 0, s > t - window: a document's tokens are consecutive in its row)."""
  seg = segment_ids_BxT
  same = seg[:, :, None] == seg[:, None, :]
  t = seg.shape[1]
  causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
  if window:
    causal &= jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window
  return same & causal[None] & (seg[:, :, None] != 0)


def dense_reference(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: Layout, *, softmax_scale: float,
                    window: int = 0):
  """Plain softmax attention under the document mask (sliding ``window`` keys per query when
  > 0), float32; zeros at padding."""
  b, t, h, d = q_BxTxHxD.shape
  kh = k_BxTxKxD.shape[2]
  q = q_BxTxHxD.astype(jnp.float32).reshape(b, t, kh, h // kh, d)
  k = k_BxTxKxD.astype(jnp.float32)
  v = v_BxTxKxD.astype(jnp.float32)
  s_BxKxGxTxS = jnp.einsum("btkgd,bskd->bkgts", q, k) * softmax_scale
  mask_BxTxS = document_mask(layout.segment_ids_BxT, window)
  s_BxKxGxTxS = jnp.where(mask_BxTxS[:, None, None], s_BxKxGxTxS, _NEG)
  p = jax.nn.softmax(s_BxKxGxTxS, axis=-1)
  p = jnp.where(mask_BxTxS[:, None, None], p, 0.0)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, t, h, d)
  return o.astype(q_BxTxHxD.dtype)


# ----------------------------------------------------------------------------------------------
# `local`: blockwise (flash-style) attention in plain jnp with its own VJP, O(T * block) memory.
# ----------------------------------------------------------------------------------------------
def _blocks(x, c):
  """[B, T, ...] -> [T // c, B, c, ...]."""
  b, t = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, t // c, c, *x.shape[2:]), 1, 0)


def _unblocks(x):
  """[n, B, c, ...] -> [B, n * c, ...]."""
  n, b, c = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])


def _block_scores(q_blk, k_blk, seg_q, seg_k, i, j, cq, ck, scale, window=0):
  """Scores and mask of query block i against key block j (row distance < ``window`` when > 0).

  q_blk [B, cq, K, G, D] f32, k_blk [B, ck, K, D] -> s [B, K, G, cq, ck], mask [B, 1, 1, cq, ck].
  """
  s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk) * scale
  qi = i * cq + jnp.arange(cq)
  kj = j * ck + jnp.arange(ck)
  mask = ((seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] != 0)
          & (qi[:, None] >= kj[None, :])[None])
  if window:
    mask &= (qi[:, None] - kj[None, :] < window)[None]
  return s, mask[:, None, None]


def _key_blocks_needed(i, cq, ck):
  """Causal: query block i needs key blocks [0, this)."""
  return ((i + 1) * cq + ck - 1) // ck


def _first_key_block(i, cq, ck, window: int):
  """Query block i needs no key block before this one (0 without a window)."""
  return jnp.maximum(i * cq - window + 1, 0) // ck if window else 0


def _query_blocks_needed(j, cq, ck, nq: int, window: int):
  """Query blocks [first, this) see key block j: all after it without a window."""
  return jnp.minimum(((j + 1) * ck - 1 + window - 1) // cq + 1, nq) if window else nq


def _local_fwd_impl(q, k, v, seg, scale, cq, ck, window=0):
  b, t, h, d = q.shape
  kh = k.shape[2]
  g = h // kh
  qb = _blocks(q.reshape(b, t, kh, g, d), cq)  # [nq, B, cq, K, G, D]
  segq = _blocks(seg, cq)
  kb, vb, segk = _blocks(k, ck), _blocks(v, ck), _blocks(seg, ck)

  def one_q_block(args):
    i, q_blk, seg_q = args
    q_blk = q_blk.astype(jnp.float32)

    def body(j, carry):
      acc, m, l = carry
      k_blk = kb[j].astype(jnp.float32)
      s, mask = _block_scores(q_blk, k_blk, seg_q, segk[j], i, j, cq, ck, scale, window)
      s = jnp.where(mask, s, _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("bkgqs,bskd->bkgqd", p, vb[j].astype(jnp.float32))
      return acc, m_new, l

    init = (jnp.zeros((b, kh, g, cq, d), jnp.float32), jnp.full((b, kh, g, cq), _NEG, jnp.float32),
            jnp.zeros((b, kh, g, cq), jnp.float32))
    acc, m, l = jax.lax.fori_loop(_first_key_block(i, cq, ck, window),
                                  _key_blocks_needed(i, cq, ck), body, init)
    safe_l = jnp.where(l > 0, l, 1.0)
    o = jnp.where((l > 0)[..., None], acc / safe_l[..., None], 0.0)
    lse = jnp.where(l > 0, m + jnp.log(safe_l), _NEG)
    # [B, K, G, cq, D] -> [B, cq, K, G, D]
    return jnp.moveaxis(o, 3, 1), jnp.moveaxis(lse, 3, 1)

  nq = t // cq
  o_blocks, lse_blocks = jax.lax.map(one_q_block, (jnp.arange(nq), qb, segq))
  o = _unblocks(o_blocks).reshape(b, t, h, d).astype(q.dtype)
  lse = _unblocks(lse_blocks)  # [B, T, K, G] f32
  return o, lse


def _local_bwd_impl(q, k, v, seg, o, lse, do, scale, cq, ck, window=0):
  b, t, h, d = q.shape
  kh = k.shape[2]
  g = h // kh
  nq, nk = t // cq, t // ck
  q5 = q.reshape(b, t, kh, g, d)
  do5 = do.reshape(b, t, kh, g, d).astype(jnp.float32)
  delta = (do5 * o.reshape(b, t, kh, g, d).astype(jnp.float32)).sum(-1)  # [B, T, K, G]
  qb, dob, deltab, lseb, segq = (_blocks(x, cq) for x in (q5, do5, delta, lse, seg))
  kb, vb, segk = _blocks(k, ck), _blocks(v, ck), _blocks(seg, ck)

  def probs(i, j, q_blk, seg_q, lse_blk, k_blk, seg_k):
    s, mask = _block_scores(q_blk, k_blk, seg_q, seg_k, i, j, cq, ck, scale, window)
    lse_t = jnp.moveaxis(lse_blk, 1, 3)  # [B, K, G, cq]
    return jnp.where(mask, jnp.exp(s - lse_t[..., None]), 0.0)

  def ds_of(p, do_blk, v_blk, delta_blk):
    dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk)
    return p * (dp - jnp.moveaxis(delta_blk, 1, 3)[..., None])

  def dq_block(args):
    i, q_blk, do_blk, delta_blk, lse_blk, seg_q = args
    q_blk = q_blk.astype(jnp.float32)

    def body(j, dq):
      k_blk, v_blk = kb[j].astype(jnp.float32), vb[j].astype(jnp.float32)
      p = probs(i, j, q_blk, seg_q, lse_blk, k_blk, segk[j])
      ds = ds_of(p, do_blk, v_blk, delta_blk)
      return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk) * scale

    return jax.lax.fori_loop(_first_key_block(i, cq, ck, window), _key_blocks_needed(i, cq, ck),
                             body, jnp.zeros((b, cq, kh, g, d), jnp.float32))

  def dkv_block(args):
    j, k_blk, v_blk, seg_k = args
    k_blk, v_blk = k_blk.astype(jnp.float32), v_blk.astype(jnp.float32)

    def body(i, carry):
      dk, dv = carry
      q_blk = qb[i].astype(jnp.float32)
      p = probs(i, j, q_blk, segq[i], lseb[i], k_blk, seg_k)
      ds = ds_of(p, dob[i], v_blk, deltab[i])
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, dob[i])
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk) * scale
      return dk, dv

    first_q = (j * ck) // cq  # earlier query blocks never see key block j (causal)
    zeros = jnp.zeros((b, ck, kh, d), jnp.float32)
    return jax.lax.fori_loop(first_q, _query_blocks_needed(j, cq, ck, nq, window), body,
                             (zeros, zeros))

  dq = _unblocks(jax.lax.map(dq_block, (jnp.arange(nq), qb, dob, deltab, lseb, segq)))
  dk_b, dv_b = jax.lax.map(dkv_block, (jnp.arange(nk), kb, vb, segk))
  return (dq.reshape(b, t, h, d).astype(q.dtype), _unblocks(dk_b).astype(k.dtype),
          _unblocks(dv_b).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _local_attention(q, k, v, seg, scale, cq, ck, window):
  return _local_fwd_impl(q, k, v, seg, scale, cq, ck, window)[0]


def _local_fwd(q, k, v, seg, scale, cq, ck, window):
  o, lse = _local_fwd_impl(q, k, v, seg, scale, cq, ck, window)
  return o, (q, k, v, seg, o, lse)


def _local_bwd(scale, cq, ck, window, res, do):
  q, k, v, seg, o, lse = res
  dq, dk, dv = _local_bwd_impl(q, k, v, seg, o, lse, do, scale, cq, ck, window)
  return dq, dk, dv, None


_local_attention.defvjp(_local_fwd, _local_bwd)


def _pick_block(t: int, want: int) -> int:
  """The block: gcd(T, want). A gcd far below ``want`` (T prime or odd) would mean a loop over
  T / gcd tiny blocks, so it is an error that names the fix instead of a silent slowdown."""
  c = math.gcd(t, want)
  if c < min(8, want, t):
    raise ValueError(f"the 'local' backend tiles rows of T={t} tokens by gcd(T, {want}) = {c}: "
                     f"far too small; use a tokens_per_rank (row length) that is a multiple of 8 "
                     f"(better of attention.block_q / block_k = {want})")
  return c


def local_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: Layout, *, softmax_scale: float,
                    block_q: int = 512, block_k: int = 512, window: int = 0):
  """Each row attends its own documents; blockwise with online softmax, custom VJP.

  Memory is O(T * block) per row instead of O(T^2); key blocks above the causal diagonal are never
  visited. Block sizes are clamped to divisors of T. ``window`` > 0: a sliding window, each query
  sees the ``window`` keys of its document ending at itself, and key blocks wholly before every
  window of a query block are never visited either.
  """
  check_shapes(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout)
  window = check_window(window)
  t = q_BxTxHxD.shape[1]
  cq, ck = _pick_block(t, block_q), _pick_block(t, block_k)
  return _local_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.segment_ids_BxT,
                          float(softmax_scale), cq, ck, window)


def check_shapes(q, k, v, layout: Layout):
  """Raises a ValueError unless q [B,T,H,D], k and v [B,T,K,D] and the layout agree."""
  if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
    raise ValueError(f"expected q [B,T,H,D] and k, v [B,T,K,D]; got {q.shape=} {k.shape=} {v.shape=}")
  if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q and k disagree on rows, tokens or head dim: {q.shape=} {k.shape=}")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"query heads {q.shape[2]} must be a multiple of kv heads {k.shape[2]}")
  if layout.segment_ids_BxT.shape != q.shape[:2]:
    raise ValueError(f"{layout.segment_ids_BxT.shape=} must equal (rows, tokens) = {q.shape[:2]}")


# ----------------------------------------------------------------------------------------------
# What a backend is (the backends themselves: distca_jax.backends).
# ----------------------------------------------------------------------------------------------
EXTRA_PREFIX = "extra/"  # batch keys holding a backend's host-made arrays (`Layout.extra`)
# The `host_prepare` array [B] int32 that picks the step's branch when the backend has a
# `local_fn`: any nonzero, some row of the batch crosses devices (the step runs `fn`); all zero,
# the step runs `local_fn`.
CROSSES_KEY = "crosses"


@dataclasses.dataclass(frozen=True)
class Backend:
  """A core-attention backend.

  Attributes:
    fn: the device function (`CoreAttentionFn`), options bound.
    host_prepare: optional host-side planner, run on the input thread for every batch:
      `host_prepare(doclens, tokens_per_row) -> dict[str, np.ndarray]`, `doclens` one list of
      document lengths per row. Every array has the batch's rows as its leading dimension (it is
      sharded over `data` like the batch) and a shape that never depends on the batch, so the
      step compiles once. The arrays reach `fn` as `layout.extra`.
    host_arrange: optional, instead of `host_prepare`, for strategies that move tokens between
      ranks (`cp`, `wlb`): `host_arrange(np_batch, doclens) -> np_batch'`, the trainer's batch
      (arrays [B, T]) in the strategy's token arrangement [B, T'], with `fn`'s tables under
      `EXTRA_PREFIX` keys. The per-token loss terms are only permuted, so the loss is unchanged.
    chosen: the options the run's startup step chose from sampled batches because the config
      left them at 0, as (name, value) pairs (`backends.build`; empty when the config set them).
    local_fn: optional device function for batches in which no row crosses devices
      (`host_prepare`'s `CROSSES_KEY` all zero): the train step holds a second branch, the
      whole step (forward, backward, update) with `local_fn`, and one `lax.cond` per step picks
      it for such a batch (distca: `packed_dp`'s attention when no plan moves a row).
  """
  fn: Callable[..., jax.Array]
  host_prepare: Callable[..., dict] | None = None
  host_arrange: Callable[..., dict] | None = None
  chosen: tuple[tuple[str, Any], ...] = ()
  local_fn: Callable[..., jax.Array] | None = None
