"""Core attention over a fused batch of CA-tasks, blockwise in plain jnp: the CPU kernel.

Same contract as ``custom_ops/varlen_attention.py`` (task ``i`` owns query rows ``[cu_q[i],
cu_q[i+1])`` and key rows ``[cu_k[i], cu_k[i+1])``; causal mask aligned bottom-right inside each
task; GQA; O in the input dtype with 0 on rows that see no key, LSE f32 natural-log with -inf
there; differentiable in q, k, v and through the LSE), written with ``lax`` loops, so that
XLA:CPU compiles it natively. The dense ``varlen_attention_reference`` materialises [H, T, U]
logits, all of them masked but the tasks' own (query, key) pairs; this kernel visits only tiles
that hold some of those pairs, so its work follows the task table, not the buffer sizes.

How (one query block = rows of one task):
* Every task's query rows are cut into blocks of ``block_q`` rows starting at the task's first
  row; the table of blocks (task, first row, valid rows, key range, causal offset) is computed
  with jnp inside jit, in row order, live blocks first. Its length is static (``ceil(T /
  block_q) + N``: each task adds at most one partial block); the loop over it runs only the live
  blocks (a ``fori_loop`` with a traced trip count).
* A query block visits its own task's key rows in blocks of ``block_k`` starting at the task's
  first key, up to the causal limit of its last row: key blocks of other tasks and above the
  diagonal are never touched; with a sliding window (``window=w``) the loop starts at the key
  block holding the block's first row's window start, so key blocks wholly before every row's
  window are never touched either. Tiles are ``lax.dynamic_slice`` windows of the buffers (padded by
  one block, so windows never clip); a tile mask drops rows and keys of other tasks.
* Forward: online softmax over the key blocks. Backward (own ``custom_vjp``, FlashAttention-2
  style on one core): the same loops recompute P from the saved LSE, accumulate dQ of the block
  and add dK / dV into the key window (sequential loops need no atomics).
* The forward's O and LSE are named ``KERNEL_OUTPUTS_NAME``: remat policies that keep attention
  ('save_attention', CAD's 'resend') save them instead of rerunning the forward. Each pass is one
  ``while`` loop over the query blocks holding one over the key blocks, so a program's jaxpr
  counts its passes in ``while`` loops.

Letters: T query rows, U key rows, H query heads, K kv heads, G = H // K, D head dim, N tasks,
Q / S rows of a query / key tile.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from custom_ops import KERNEL_OUTPUTS_NAME
from custom_ops import varlen_attention as va

_NEG = -1e30  # finite "minus infinity" for masked logits (exp underflows to 0, no NaN)


def _einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  """einsum with full f32 products for f32 operands (GPUs default to TF32 for f32 matmuls)."""
  f32 = jnp.float32 in (a.dtype, b.dtype)
  return jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST if f32 else None)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the blockwise kernel (forward and backward use the same tiles).

  Attributes:
    block_q: query rows per tile (a task shorter than this wastes the rest of its tile).
    block_k: key rows per tile.
  """
  # Forward + backward of one server's tasks at the tiny config's shapes (T = 3072, U = 3456, 4
  # query / 2 kv heads, D = 32, 24 tasks of tens to hundreds of rows) took 23-29 ms of CPU time
  # with tiles of 32 or 64 x 64 or 128 on a shared 2-core machine, 34-44 ms with 128 x 128 and
  # x 256 tiles; 64 x 64 is in the fastest group.
  block_q: int = 64
  block_k: int = 64

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"BlockSizes.{name}={value!r} must be a positive int")


def _block_table(cu_q_N1, cu_k_N1, num_q_rows: int, block_q: int):
  """Query blocks in row order: (live blocks, [NB] task, first row, valid rows, key start, key
  length, diag); row r of a block sees its task's local keys c <= r + diag."""
  n = cu_q_N1.shape[0] - 1
  lq_N = cu_q_N1[1:] - cu_q_N1[:-1]
  lk_N = cu_k_N1[1:] - cu_k_N1[:-1]
  # A task without keys has no live block: its rows keep O = 0, LSE = -inf.
  blocks_N = jnp.where(lk_N > 0, (lq_N + block_q - 1) // block_q, 0)
  end_N = jnp.cumsum(blocks_N)
  num_blocks = -(-num_q_rows // block_q) + n
  b = jnp.arange(num_blocks, dtype=jnp.int32)
  task = jnp.minimum(jnp.searchsorted(end_N, b, side="right"), n - 1).astype(jnp.int32)
  local = (b - (end_N[task] - blocks_N[task])) * block_q
  lq, lk = lq_N[task], lk_N[task]
  start = cu_q_N1[task] + local
  nrows = jnp.clip(lq - local, 0, block_q)
  diag = local + lk - lq
  return end_N[-1], start, nrows, cu_k_N1[task], lk, diag


def _key_blocks(nrows, lk, diag, block_k: int):
  """Key blocks a query block needs: up to the keys its last valid row sees."""
  return (jnp.clip(jnp.minimum(lk, nrows + diag), 0, None) + block_k - 1) // block_k


def _first_key_block(diag, window: int, block_k: int):
  """First key block a query block needs: 0, or with a window the block holding the first
  key its row 0 sees (``diag - window + 1``; later rows' windows start later)."""
  if not window:
    return 0
  return jnp.clip(diag - window + 1, 0, None) // block_k


def _tile_mask(nrows, lk, diag, j, block_q: int, block_k: int, window: int = 0):
  """[Q, 1, 1, S] bool: row r of the block sees key column c of key block j."""
  r = jnp.arange(block_q, dtype=jnp.int32)[:, None]
  c = j * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]
  mask = (r < nrows) & (c < lk) & (c <= r + diag)
  if window:
    mask &= c > r + diag - window
  return mask[:, None, None, :]


def _prepare(q, k, v, cu_q, cu_k, bs: BlockSizes):
  """f32 buffers [T + Q, K, G, D] and [U + S, K, D] with rows outside every task zeroed (so
  padding, even NaN, never reaches a product) and one block of zero rows appended."""
  num_q_rows, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[1]
  _, _, q_valid = va.rows_to_tasks(cu_q, num_q_rows)
  _, _, k_valid = va.rows_to_tasks(cu_k, k.shape[0])

  def clean(x, valid, pad):
    x = jnp.where(valid[:, None, None], x.astype(jnp.float32), 0.0)
    return jnp.pad(x, ((0, pad), (0, 0), (0, 0)))

  q5 = clean(q, q_valid, bs.block_q).reshape(-1, num_kv_heads, num_heads // num_kv_heads,
                                             head_dim)
  return q5, clean(k, k_valid, bs.block_k), clean(v, k_valid, bs.block_k), q_valid, k_valid


def _forward(q, k, v, cu_q, cu_k, scale: float, bs: BlockSizes, window: int = 0):
  """(o [T, H, D] q dtype, lse [T, K, G] f32 with -inf on rows that see no key)."""
  num_q_rows, num_heads, head_dim = q.shape
  bq, bk = bs.block_q, bs.block_k
  q5, kp, vp, _, _ = _prepare(q, k, v, cu_q, cu_k, bs)
  _, kh, g, d = q5.shape
  live, start, nrows, k_start, lk, diag = _block_table(cu_q, cu_k, num_q_rows, bq)

  def one_block(b, carry):
    o_buf, lse_buf = carry
    q_blk = lax.dynamic_slice_in_dim(q5, start[b], bq) * scale  # [Q, K, G, D]

    def key_step(j, acc_m_l):
      acc, m, l = acc_m_l
      k_blk = lax.dynamic_slice_in_dim(kp, k_start[b] + j * bk, bk)  # [S, K, D]
      v_blk = lax.dynamic_slice_in_dim(vp, k_start[b] + j * bk, bk)
      mask = _tile_mask(nrows[b], lk[b], diag[b], j, bq, bk, window)
      s = jnp.where(mask, _einsum("qkgd,skd->qkgs", q_blk, k_blk), _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + _einsum("qkgs,skd->qkgd", p, v_blk)
      return acc, m_new, l

    init = (jnp.zeros((bq, kh, g, d), jnp.float32), jnp.full((bq, kh, g), _NEG, jnp.float32),
            jnp.zeros((bq, kh, g), jnp.float32))
    acc, m, l = lax.fori_loop(_first_key_block(diag[b], window, bk),
                              _key_blocks(nrows[b], lk[b], diag[b], bk), key_step, init)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    o_blk = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
    lse_blk = jnp.where(seen, m + jnp.log(safe_l), -jnp.inf)
    # Rows past nrows belong to the next block (or padding): keep what the buffer holds there.
    row_ok = (jnp.arange(bq) < nrows[b])[:, None, None]
    old_o = lax.dynamic_slice_in_dim(o_buf, start[b], bq)
    old_lse = lax.dynamic_slice_in_dim(lse_buf, start[b], bq)
    o_buf = lax.dynamic_update_slice_in_dim(o_buf, jnp.where(row_ok[..., None], o_blk, old_o),
                                            start[b], 0)
    lse_buf = lax.dynamic_update_slice_in_dim(lse_buf, jnp.where(row_ok, lse_blk, old_lse),
                                              start[b], 0)
    return o_buf, lse_buf

  init = (jnp.zeros((num_q_rows + bq, kh, g, d), jnp.float32),
          jnp.full((num_q_rows + bq, kh, g), -jnp.inf, jnp.float32))
  o_buf, lse_buf = lax.fori_loop(0, live, one_block, init)
  o = o_buf[:num_q_rows].reshape(num_q_rows, num_heads, head_dim).astype(q.dtype)
  return o, lse_buf[:num_q_rows]


def _backward(q, k, v, cu_q, cu_k, o, lse_TxKxG, do, dlse_TxH, scale: float, bs: BlockSizes,
              window: int = 0):
  """dq, dk, dv (input dtypes) for cotangents do [T, H, D] and dlse [T, H]."""
  num_q_rows, num_heads, head_dim = q.shape
  num_k_rows = k.shape[0]
  bq, bk = bs.block_q, bs.block_k
  q5, kp, vp, q_valid, k_valid = _prepare(q, k, v, cu_q, cu_k, bs)
  _, kh, g, d = q5.shape
  live, start, nrows, k_start, lk, diag = _block_table(cu_q, cu_k, num_q_rows, bq)
  row_valid = q_valid[:, None, None]
  do5 = jnp.where(row_valid[..., None], do.astype(jnp.float32).reshape(-1, kh, g, d), 0.0)
  dlse = jnp.where(row_valid, dlse_TxH.astype(jnp.float32).reshape(-1, kh, g), 0.0)
  # dS = P * (dP - delta): delta = rowsum(dO * O) - dLSE (d LSE / d S = P).
  delta = (do5 * o.astype(jnp.float32).reshape(-1, kh, g, d)).sum(-1) - dlse
  lse = jnp.where(jnp.isfinite(lse_TxKxG), lse_TxKxG, 0.0)
  pad_q = ((0, bq), (0, 0), (0, 0))
  do5 = jnp.pad(do5, pad_q + ((0, 0),))
  delta, lse = jnp.pad(delta, pad_q), jnp.pad(lse, pad_q)

  def one_block(b, carry):
    dq_buf, dk_buf, dv_buf = carry
    q_blk = lax.dynamic_slice_in_dim(q5, start[b], bq)  # [Q, K, G, D]
    do_blk = lax.dynamic_slice_in_dim(do5, start[b], bq)
    lse_blk = lax.dynamic_slice_in_dim(lse, start[b], bq)[..., None]
    delta_blk = lax.dynamic_slice_in_dim(delta, start[b], bq)[..., None]

    def key_step(j, carry):
      dq_blk, dk_buf, dv_buf = carry
      row = k_start[b] + j * bk
      k_blk = lax.dynamic_slice_in_dim(kp, row, bk)  # [S, K, D]
      v_blk = lax.dynamic_slice_in_dim(vp, row, bk)
      mask = _tile_mask(nrows[b], lk[b], diag[b], j, bq, bk, window)
      s = _einsum("qkgd,skd->qkgs", q_blk, k_blk) * scale
      p = jnp.where(mask, jnp.exp(s - lse_blk), 0.0)
      dp = _einsum("qkgd,skd->qkgs", do_blk, v_blk)
      ds = p * (dp - delta_blk)
      dq_blk = dq_blk + _einsum("qkgs,skd->qkgd", ds, k_blk)
      dk_win = lax.dynamic_slice_in_dim(dk_buf, row, bk) + _einsum("qkgs,qkgd->skd", ds, q_blk)
      dv_win = lax.dynamic_slice_in_dim(dv_buf, row, bk) + _einsum("qkgs,qkgd->skd", p, do_blk)
      return (dq_blk, lax.dynamic_update_slice_in_dim(dk_buf, dk_win, row, 0),
              lax.dynamic_update_slice_in_dim(dv_buf, dv_win, row, 0))

    init = (jnp.zeros((bq, kh, g, d), jnp.float32), dk_buf, dv_buf)
    dq_blk, dk_buf, dv_buf = lax.fori_loop(_first_key_block(diag[b], window, bk),
                                           _key_blocks(nrows[b], lk[b], diag[b], bk),
                                           key_step, init)
    row_ok = (jnp.arange(bq) < nrows[b])[:, None, None, None]
    old = lax.dynamic_slice_in_dim(dq_buf, start[b], bq)
    dq_buf = lax.dynamic_update_slice_in_dim(dq_buf, jnp.where(row_ok, dq_blk * scale, old),
                                             start[b], 0)
    return dq_buf, dk_buf, dv_buf

  init = (jnp.zeros((num_q_rows + bq, kh, g, d), jnp.float32),
          jnp.zeros((num_k_rows + bk, kh, d), jnp.float32),
          jnp.zeros((num_k_rows + bk, kh, d), jnp.float32))
  dq_buf, dk_buf, dv_buf = lax.fori_loop(0, live, one_block, init)
  # Key rows outside every task got only zero products; select them to exact zeros anyway.
  kv_ok = k_valid[:, None, None]
  dq = dq_buf[:num_q_rows].reshape(num_q_rows, num_heads, head_dim).astype(q.dtype)
  dk = jnp.where(kv_ok, dk_buf[:num_k_rows] * scale, 0.0).astype(k.dtype)
  dv = jnp.where(kv_ok, dv_buf[:num_k_rows], 0.0).astype(v.dtype)
  return dq, dk, dv


def _lse_TxH(lse_TxKxG):
  return lse_TxKxG.reshape(lse_TxKxG.shape[0], -1)


def _named_forward(q, k, v, cu_q, cu_k, scale, bs, window):
  """The forward's O and LSE, named for the remat policies that keep them."""
  o, lse = _forward(q, k, v, cu_q, cu_k, scale, bs, window)
  return checkpoint_name(o, KERNEL_OUTPUTS_NAME), checkpoint_name(lse, KERNEL_OUTPUTS_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, cu_q, cu_k, scale, bs, window):
  o, lse = _named_forward(q, k, v, cu_q, cu_k, scale, bs, window)
  return o, _lse_TxH(lse)


def _attention_fwd(q, k, v, cu_q, cu_k, scale, bs, window):
  o, lse = _named_forward(q, k, v, cu_q, cu_k, scale, bs, window)
  return (o, _lse_TxH(lse)), (q, k, v, cu_q, cu_k, o, lse)


def _attention_bwd(scale, bs, window, residuals, cotangents):
  q, k, v, cu_q, cu_k, o, lse = residuals
  do, dlse = cotangents
  dq, dk, dv = _backward(q, k, v, cu_q, cu_k, o, lse, do, dlse, scale, bs, window)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                        cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                        softmax_scale: float | None = None,
                        block_sizes: BlockSizes | None = None,
                        window: int = 0) -> tuple[jax.Array, jax.Array]:
  """Causal (bottom-right) GQA attention of every CA-task of a fused batch, blockwise jnp.

  Args:
    q_TxHxD: packed queries [T, H, D], bf16/fp16/f32 (computed in f32).
    k_UxKxD: packed keys [U, K, D], H a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1]; task i owns query rows [cu_q[i], cu_q[i+1]).
    cu_seqlens_k_N1: int32 [N + 1]; task i owns key rows [cu_k[i], cu_k[i+1]).
    softmax_scale: logit scale; default 1 / sqrt(D).
    block_sizes: tiles; default ``BlockSizes()``.
    window: sliding window, keys per query row ending at its diagonal (0 = full causal; the
      mask of ``custom_ops/varlen_attention.py``).

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key) and lse_TxH (f32 natural-log log-sum-exp of the
    scaled logits; -inf on rows that see no key). Differentiable in q, k, v (and through lse).
  """
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  window = va.check_window(window)
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a custom_ops.blockwise_attention.BlockSizes; got "
                     f"{type(block_sizes).__name__}")
  head_dim = q_TxHxD.shape[2]
  scale = float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
  return _attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, scale,
                    block_sizes, window)
