"""Calls of the Pallas Mosaic GPU kernels of ``custom_ops/mosaic_kernels.py`` (Hopper).

Each call fixes a kernel's grid, shared-memory scratch and outputs: the forward on the packed
query buffer (``forward_in_place``), the dQ kernel on the aligned query buffer, the dK/dV kernel
and the fused backward. The layout and scheduling are described in
``custom_ops/mosaic_attention.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from custom_ops.mosaic_kernels import (LOG2E, bwd_fused_kernel, dkv_kernel, dq_kernel,
                                       fwd_kernel, query_grid, smem_tile)
from custom_ops.mosaic_worklists import NUM_COMPUTE_WGS, BlockSizes


def _kernel(body, *, out_type, scratch_types, grid, name: str,
            grid_names: tuple[str, ...] = ("heads", "tiles")):
  """A warp-specialized kernel over (heads, tiles[, group]): compute warpgroups and one
  producer."""
  return plgpu.kernel(
      body, out_type=out_type, scratch_types=scratch_types, grid=grid,
      grid_names=grid_names, num_threads=NUM_COMPUTE_WGS + 1, thread_name="wg",
      kernel_name=name,  # the name profiles show
      compiler_params=plgpu.CompilerParams(approx_math=True))


def _barriers(slots: int, loads: int, frees: int):
  """A kernel's mbarriers: one per compute warpgroup (its own tile loaded), ``loads`` arrays of
  one per slot (the producer filled it) and ``frees`` arrays of one per slot (both compute
  warpgroups released it)."""
  return [plgpu.Barrier(num_barriers=NUM_COMPUTE_WGS),
          *[plgpu.Barrier(num_barriers=slots)] * loads,
          *[plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS, num_barriers=slots)] * frees]


def forward_in_place(meta, edges, q, q_tail, k, v, k_edge, v_edge, *, bs: BlockSizes,
                     scale: float, num_slots: int, window: int = 0):
  """O [T, H, D] in place (q's rows; a multiple of 8) and the log2-domain LSE [H, num_slots]
  in the tiles' slots (``q_tile_table_in_place``); ``q_tail``: ``q_tail_rows`` of q."""
  _, num_heads, head_dim = q.shape
  group = num_heads // k.shape[1]
  dtype, slots = q.dtype, bs.max_concurrent_steps
  grid, grid_names = query_grid(bs, num_heads, group, meta.shape[1])
  kernel = _kernel(
      functools.partial(fwd_kernel, bs=bs, scale2=scale * LOG2E, group=group, window=window),
      out_type=[jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((num_heads, num_slots), jnp.float32)],
      scratch_types=[
          smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          smem_tile((slots, bs.block_kv, head_dim), dtype),
          smem_tile((slots, bs.block_kv, head_dim), dtype),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          *_barriers(slots, loads=2, frees=2),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
      ],
      grid=grid, grid_names=grid_names,
      name="mosaic_attention_fwd",
  )
  return kernel(meta, edges, q, q_tail, k, v, k_edge, v_edge)


def dq_aligned(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *,
                bs: BlockSizes, scale: float, window: int = 0):
  num_p, num_heads, head_dim = q_p.shape
  group = num_heads // k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  grid, grid_names = query_grid(bs, num_heads, group, meta.shape[1])
  kernel = _kernel(
      functools.partial(dq_kernel, bs=bs, scale=scale, group=group, window=window),
      out_type=jax.ShapeDtypeStruct(q_p.shape, dtype),
      scratch_types=[
          smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          smem_tile((NUM_COMPUTE_WGS, bs.block_q, head_dim), dtype),
          smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          smem_tile((slots, bs.block_kv_dq, head_dim), dtype),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_q), jnp.float32),
          *_barriers(slots, loads=2, frees=2),
      ],
      grid=grid, grid_names=grid_names,
      name="mosaic_attention_dq",
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p)


def dkv_call(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, q_edges, *,
             bs: BlockSizes, scale: float, num_k_rows: int, window: int = 0):
  """dK, dV [num_k_rows, K, D]: in the packed buffers (``bs.dkv_in_place``: q_p, do_p the
  packed Q and dO, ``q_edges`` = (edges, Q edge copy, dO edge copy) as ``kv_edges``) or in the
  aligned copies k, v (q_p, do_p aligned; ``q_edges`` unread)."""
  num_heads, head_dim = q_p.shape[1], q_p.shape[2]
  num_kv_heads = k.shape[1]
  dtype, slots = q_p.dtype, bs.max_concurrent_steps
  stage = [plgpu.SMEM((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype)] * 2
  kernel = _kernel(
      functools.partial(dkv_kernel, bs=bs, scale=scale, group=num_heads // num_kv_heads,
                        window=window),
      out_type=[jax.ShapeDtypeStruct((num_k_rows, *k.shape[1:]), dtype)] * 2,
      scratch_types=[
          smem_tile((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          smem_tile((NUM_COMPUTE_WGS, bs.block_kv_dkv, head_dim), dtype),
          smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          smem_tile((slots, bs.block_q_dkv, head_dim), dtype),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          plgpu.SMEM((slots, bs.block_q_dkv), jnp.float32),
          *(stage if bs.dkv_in_place else []),
          *_barriers(slots, loads=4, frees=1),
      ],
      grid=(num_kv_heads, meta.shape[1]),
      name="mosaic_attention_dkv",
  )
  return kernel(meta, edges, q_p, k, v, k_edge, v_edge, do_p, lse_p, delta_p, *q_edges)


def bwd_fused_call(meta, edges, q, k, v, k_edge, v_edge, do, lse_p, delta_p, q_edges, *,
                   bs: BlockSizes, scale: float, num_k_rows: int, window: int = 0):
  """dQ [T + block_q_dkv, H, D] (f32, unscaled: the caller multiplies by ``scale``; rows past
  T receive zeros) of the packed query buffer (T rows, a multiple of 8) and dK, dV
  [num_k_rows, K, D] in the packed buffers, from one kernel over key tiles
  (``kv_tile_table_in_place``; ``q_edges`` as ``dkv_call``'s)."""
  num_heads, head_dim = q.shape[1], q.shape[2]
  num_kv_heads = k.shape[1]
  dtype, slots = q.dtype, bs.max_concurrent_steps
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  # Each warpgroup's dQ product reads half of K's columns: one swizzle row of half a row's bytes.
  swizzle = min(128, head_dim // NUM_COMPUTE_WGS * jnp.dtype(dtype).itemsize)
  tile = functools.partial(smem_tile, swizzle=swizzle)
  union = plgpu.RefUnion(
      (tile((2, NUM_COMPUTE_WGS, bkd, bqd), dtype),
       smem_tile((NUM_COMPUTE_WGS, bqd, head_dim // NUM_COMPUTE_WGS), jnp.float32)),
      [plgpu.SMEM((NUM_COMPUTE_WGS, bkd, head_dim), dtype)] * 2)
  kernel = _kernel(
      functools.partial(bwd_fused_kernel, bs=bs, scale=scale, group=num_heads // num_kv_heads,
                        window=window),
      out_type=[jax.ShapeDtypeStruct((num_k_rows, *k.shape[1:]), dtype)] * 2,
      scratch_types=[
          tile((NUM_COMPUTE_WGS, bkd, head_dim), dtype),
          tile((NUM_COMPUTE_WGS, bkd, head_dim), dtype),
          tile((slots, bqd, head_dim), dtype),
          tile((slots, bqd, head_dim), dtype),
          plgpu.SMEM((slots, bqd), jnp.float32),
          plgpu.SMEM((slots, bqd), jnp.float32),
          union,
          *_barriers(slots, loads=4, frees=1),
          plgpu.Barrier(num_arrivals=NUM_COMPUTE_WGS),
      ],
      grid=(num_kv_heads, meta.shape[1]),
      name="mosaic_attention_bwd",
  )
  # Query tiles of the last task may run up to block_q_dkv rows past the buffer's end.
  dq_ref = jax.new_ref(jnp.zeros((q.shape[0] + bqd, *q.shape[1:]), jnp.float32))
  dk, dv = kernel(meta, edges, q, k, v, k_edge, v_edge, do, lse_p, delta_p, *q_edges, dq_ref)
  return dq_ref[...], dk, dv
