"""Core attention over a fused batch of CA-tasks: Pallas Mosaic GPU kernels (Hopper) and reference.

Same contract as ``custom_ops/varlen_attention.py`` (task ``i`` owns query rows
``[cu_q[i], cu_q[i+1])`` and key/value rows ``[cu_k[i], cu_k[i+1])``; bottom-right causal mask
inside each task; GQA; rows that see no key get output 0 and log-sum-exp ``-inf``; key rows
outside every task get dK = dV = 0). Inputs bf16 or fp16, head dim 64 or 128, f32 accumulation.
The kernels run only on Hopper GPUs (warpgroup MMA, TMA); ``mosaic_attention_reference`` is the
plain-jnp oracle (the same function as ``varlen_attention_reference``).

Letters in names: T query tokens, U key/value tokens, H query heads, K key/value heads, D head dim,
N tasks (``N1`` = N + 1), P padded rows, F table fields, B tiles.

Layout (why it looks like this):
* Queries are read and O written in place by the forward. A CTA tile (``BlockSizes.align_q``
  rows) of task ``i`` starts at ``cu_q[i]`` rounded down to 8 rows (the granularity at which
  Mosaic GPU issues tiled TMA copies), plus multiples of the tile; rows of the tile outside the
  task are computed but not stored: a warpgroup block wholly inside its task stores O with one
  TMA copy, a block holding another task's rows stores its own rows from an untiled staging
  buffer in power-of-two row pieces. The padding rows before the first task and after the last
  are two key-less segments whose tiles write O = 0, so every row is written once. Blocks
  reaching past the buffer's last row read a zero-padded copy of its tail rows. LSE goes to a
  slot per tile, in the order of the aligned layout below with each task shifted by
  ``cu_q[i] % 8`` rows (``aligned_layout(..., front=True)``), and is gathered back ([H, T] f32,
  small). Query buffers whose row count is not a multiple of 8 are padded first (one copy).
* The backward's key-tile kernels (the default one-kernel backward, the in-place dK/dV kernel)
  read Q and dO in place the same way: a task's query tiles start at ``cu_q[i]`` rounded down
  to 8, tiles reaching outside the tasks' rows ``[cu_q[0], cu_q[-1])`` read zero-padded edge
  copies (``kv_edges`` on ``cu_q``), and LSE / delta come in the forward's slot layout, where
  every row of no task gets LSE +inf (P, hence dS, is exactly 0 there, so those rows add
  nothing to dK, dV or dQ). dQ is accumulated in place in f32 and scaled and cast in one pass.
* The dQ kernel of the two-kernel backward (and the dK/dV kernel on aligned K/V) reads an
  aligned copy of Q and dO: each task's query rows are gathered (inside jit, plain jnp on
  ``cu_seqlens``) into a buffer where every task starts at a multiple of the CTA tile (rows
  between tasks are zeros, LSE +inf), and dQ is gathered back. The padded length is static
  (``padded_rows``: each task adds at most ``align - 1`` rows), so one compiled kernel serves
  every task table of the same shapes.
* Keys and values are read in place. Key tiles start at multiples of ``KV_ROW_MULTIPLE`` (8)
  rows, the granularity at which Mosaic GPU issues tiled TMA copies; a task's first tile may
  start up to 7 rows early and its last runs past its end, both masked. Tiles that would reach
  outside the tasks' rows ``[cu_k[0], cu_k[-1])`` (padding, any value, or past the buffer) read a
  zero-padded copy of those edge rows instead (``kv_edges``), so NaN in padding never meets a
  zero probability. The dK/dV kernel tiles the packed buffer the same way (the two padding
  segments included, which get zeros) and stores each warpgroup's rows of its own segment from
  untiled staging buffers in power-of-two row pieces. K/V buffers whose row count is not a
  multiple of 8 are padded first (one copy; Mosaic GPU tiles the whole buffer).
* Work lists. ``q_tile_table_in_place`` (forward) and ``q_tile_table`` (dQ kernel) list, for
  every CTA query tile (two warpgroups of ``block_q`` rows each), its task's key rows and, per
  warpgroup, how many key tiles it visits and which of them need no causal mask.
  ``kv_tile_table_in_place`` lists, for every CTA key tile of the dK/dV kernel, the query tiles
  of its own task that see it: per warpgroup the first one that sees any of its keys and the
  first that sees all of them. No (query tile, key tile) pair outside a
  task's key range or above its causal diagonal is visited; tiles are ordered by descending work
  (longest-processing-time first).
* Kernels are warp-specialized: two compute warpgroups and one producer warpgroup that streams
  tiles through ``max_concurrent_steps`` shared-memory slots with TMA (``mbarrier`` handshakes
  per slot). Forward: FlashAttention-3 style online softmax, optional ping-pong scheduling of the
  two compute warpgroups (softmax of one overlaps the matrix products of the other). Backward,
  by default one kernel over key tiles (FlashAttention-3 style): each CTA loops over its GQA
  group's heads and its task's visible query tiles, accumulates dK/dV in registers and computes
  dQ of each query step (each warpgroup half of its columns, over both warpgroups' keys), added
  to an f32 buffer with TMA reduce-add stores.
  With ``BlockSizes(fused_bwd=False)``, FlashAttention-2 style without atomics: a dQ kernel over
  query tiles beside the dK/dV kernel (two more matrix products per tile pair).

Modules: this one (input checks, custom_vjp over the packed buffers, public entry point),
``custom_ops/mosaic_worklists.py`` (``BlockSizes``, aligned layout, work lists),
``custom_ops/mosaic_kernels.py`` (the Pallas kernels) and ``custom_ops/mosaic_calls.py`` (their
calls).

Measured against FlashAttention-3 on one H200: custom_ops/MOSAIC_NOTES.md and
results/kernel_bench.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax.ad_checkpoint import checkpoint_name

from custom_ops import KERNEL_OUTPUTS_NAME
from custom_ops import varlen_attention as va
from custom_ops.mosaic_calls import bwd_fused_call, dkv_call, dq_aligned, forward_in_place
from custom_ops.mosaic_kernels import LN2
from custom_ops.mosaic_worklists import (KV_ROW_MULTIPLE, BlockSizes, aligned_layout,
                                         gather_rows, kv_edges, kv_tile_table,
                                         kv_tile_table_in_place, q_tail_rows, q_tile_table,
                                         q_tile_table_in_place)

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SUPPORTED_HEAD_DIMS = (64, 128)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1) -> None:
  """The varlen contract's checks plus this kernel's dtype and head-dim limits."""
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  dtype, head_dim = q_TxHxD.dtype, q_TxHxD.shape[2]
  if dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"mosaic attention takes bf16 or fp16 inputs; got {dtype=} (cast, or use kernel="
        "'blockwise' for f32)")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(
        f"mosaic attention supports head dims {SUPPORTED_HEAD_DIMS}; got {head_dim=} (use "
        "kernel='blockwise' for others)")


# ------------------------------------------------------------------------------------------------
# custom_vjp over packed buffers
# ------------------------------------------------------------------------------------------------


def _key_edges(k, v, cu_k, bs):
  edges, rows = kv_edges(cu_k, k.shape[0], bs.edge_block)
  return edges, gather_rows(k, rows), gather_rows(v, rows)


def _rows_to_multiple(x, multiple: int):
  """x with zero rows appended up to a multiple of ``multiple`` rows (a copy; none if already).

  Tiled TMA reads need the K/V buffers' row count to be a multiple of 8 (Mosaic GPU tiles the
  whole buffer); callers that allocate such buffers pay no copy.
  """
  extra = -x.shape[0] % multiple
  return x if extra == 0 else jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))


def _forward(q, k, v, cu_q, cu_k, scale, bs, window):
  num_q_rows = q.shape[0]
  q8 = _rows_to_multiple(q, KV_ROW_MULTIPLE)
  q_tail = gather_rows(q8, q_tail_rows(num_q_rows, q8.shape[0], bs.block_q))
  edges, k_edge, v_edge = _key_edges(k, v, cu_k, bs)
  k, v = _rows_to_multiple(k, KV_ROW_MULTIPLE), _rows_to_multiple(v, KV_ROW_MULTIPLE)
  meta = q_tile_table_in_place(cu_q, cu_k, q8.shape[0], bs, bs.block_kv, window)
  lay_f = aligned_layout(cu_q, num_q_rows, bs.align_q, front=True)  # the tiles' LSE slots
  o, lse2_f = forward_in_place(meta, edges, q8, q_tail, k, v, k_edge, v_edge, bs=bs,
                               scale=scale, num_slots=lay_f.src_P.shape[0], window=window)
  # The backward's residuals from the kernel: remat policies that keep attention save them by
  # this name, so the backward never reruns it.
  o, lse2_f = (checkpoint_name(x, KERNEL_OUTPUTS_NAME) for x in (o, lse2_f))
  o = o[:num_q_rows]
  lse_TxH = gather_rows(lse2_f, lay_f.dst_T, fill=-jnp.inf, axis=1).T * LN2
  return (o, lse_TxH), (q, k, v, o, lse2_f, cu_q, cu_k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, cu_q, cu_k, scale, bs, window):
  return _forward(q, k, v, cu_q, cu_k, scale, bs, window)[0]


def _attention_fwd(q, k, v, cu_q, cu_k, scale, bs, window):
  out, res = _forward(q, k, v, cu_q, cu_k, scale, bs, window)
  return out, (res, q.shape[0], k.shape[0])


def _attention_bwd(scale, bs, window, residuals, cotangents):
  # k, v: the forward's buffers, rows padded to a multiple of 8; num_k_rows: the caller's rows.
  # lse2_f: the forward's LSE slots (the ``front`` aligned layout).
  (q, k, v, o, lse2_f, cu_q, cu_k), num_q_rows, num_k_rows = residuals
  do, dlse_TxH = cotangents
  # delta_i = sum_d O_id dO_id - dLSE_i: the row term of dS = P * (dP - delta).
  delta_TxH = (jnp.einsum("thd,thd->th", o.astype(jnp.float32), do.astype(jnp.float32))
               - dlse_TxH.astype(jnp.float32))
  edges, k_edge, v_edge = _key_edges(k, v, cu_k, bs)
  # The in-place kernels read Q and dO in the packed buffers (rows outside the tasks from
  # zero-padded edge copies) and LSE / delta in the front layout, where rows of no task (a
  # tile's rows before or after its task) get LSE +inf, as do rows that see no key (LSE -inf):
  # their P, hence dS, is exactly 0.
  lay_f = aligned_layout(cu_q, num_q_rows, bs.align_q, front=True)
  task_row = (lay_f.src_P < num_q_rows)[None, :]
  lse2_fb = jnp.where(task_row & ~jnp.isneginf(lse2_f), lse2_f, jnp.inf)
  delta_f = gather_rows(delta_TxH.T, lay_f.src_P, axis=1)
  q8, do8 = (_rows_to_multiple(x, KV_ROW_MULTIPLE) for x in (q, do))
  q_edges, q_edge_rows = kv_edges(cu_q, num_q_rows, bs.block_q_dkv)
  q_edges = (q_edges, gather_rows(q, q_edge_rows), gather_rows(do, q_edge_rows))
  if bs.fused_bwd:
    meta_k = kv_tile_table_in_place(cu_q, cu_k, lay_f, num_k_rows, bs, window)
    dq, dk, dv = bwd_fused_call(meta_k, edges, q8, k, v, k_edge, v_edge, do8, lse2_fb, delta_f,
                                q_edges, bs=bs, scale=scale, num_k_rows=num_k_rows,
                                window=window)
    return (dq[:num_q_rows] * scale).astype(q.dtype), dk, dv, None, None
  # The dQ kernel (and the dK/dV kernel on aligned K/V) read the aligned query buffer.
  lay_q = aligned_layout(cu_q, num_q_rows, bs.align_q)
  q_p, do_p = gather_rows(q, lay_q.src_P), gather_rows(do, lay_q.src_P)
  delta_p = gather_rows(delta_TxH.T, lay_q.src_P, axis=1)
  slot_p = gather_rows(lay_f.dst_T, lay_q.src_P, fill=lse2_f.shape[1])
  lse2_b = gather_rows(lse2_fb, slot_p, fill=jnp.inf, axis=1)
  meta_q = q_tile_table(cu_q, cu_k, lay_q, num_q_rows, bs, bs.block_kv_dq, window)
  dq_p = dq_aligned(meta_q, edges, q_p, k, v, k_edge, v_edge, do_p, lse2_b, delta_p, bs=bs,
                    scale=scale, window=window)
  if bs.dkv_in_place:
    # dK/dV are stored untiled, so they take the caller's row count.
    meta_k = kv_tile_table_in_place(cu_q, cu_k, lay_f, num_k_rows, bs, window)
    dk, dv = dkv_call(meta_k, edges, q8, k, v, k_edge, v_edge, do8, lse2_fb, delta_f, q_edges,
                      bs=bs, scale=scale, num_k_rows=num_k_rows, window=window)
  else:
    k, v = k[:num_k_rows], v[:num_k_rows]
    lay_k = aligned_layout(cu_k, num_k_rows, bs.align_k)
    k_p, v_p = gather_rows(k, lay_k.src_P), gather_rows(v, lay_k.src_P)
    meta_k = kv_tile_table(cu_q, cu_k, lay_q, lay_k, k.shape[0], bs)
    dk_p, dv_p = dkv_call(meta_k, edges, q_p, k_p, v_p, k_p, v_p, do_p, lse2_b, delta_p,
                          q_edges, bs=bs, scale=scale, num_k_rows=k_p.shape[0])
    dk, dv = gather_rows(dk_p, lay_k.dst_T), gather_rows(dv_p, lay_k.dst_T)
  dq = gather_rows(dq_p, lay_q.dst_T)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                     cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                     softmax_scale: float | None = None,
                     block_sizes: BlockSizes | None = None,
                     window: int = 0) -> tuple[jax.Array, jax.Array]:
  """Causal (bottom-right) GQA attention of every CA-task of a fused batch; Mosaic GPU kernels.

  Args:
    q_TxHxD: packed queries [T, H, D], bf16/fp16, D in ``SUPPORTED_HEAD_DIMS``.
    k_UxKxD: packed keys [U, K, D], H a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1]; task i owns query rows [cu_q[i], cu_q[i+1]).
    cu_seqlens_k_N1: int32 [N + 1]; task i owns key rows [cu_k[i], cu_k[i+1]).
    softmax_scale: logit scale; default 1 / sqrt(D).
    block_sizes: kernel tiles; default ``BlockSizes()``.
    window: sliding window (keys per query row ending at its diagonal; 0 = full causal). The
      work lists then visit no key tile wholly before a query tile's windows (forward) and no
      query tile wholly past a key tile's windows (backward); tiles on the window's edge are
      masked.

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key) and lse_TxH (f32 natural-log log-sum-exp of the
    scaled logits; -inf on rows that see no key). Differentiable in q, k, v (and through lse).
  """
  validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  if not isinstance(block_sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a mosaic_attention.BlockSizes; got {block_sizes=}")
  window = va.check_window(window)
  if window and not block_sizes.dkv_in_place:
    raise ValueError(f"mosaic attention with window={window} needs "
                     "BlockSizes(dkv_in_place=True) (the in-place dK/dV work list carries the "
                     "window); drop dkv_in_place=False")
  head_dim = q_TxHxD.shape[2]
  scale = float(1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale)
  return _attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, scale,
                    block_sizes, window)



# The oracle: the plain-jnp dense masked attention of the shared contract.
mosaic_attention_reference = va.varlen_attention_reference
