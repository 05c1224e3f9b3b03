"""The ragged exchange as device-initiated copies (Pallas Mosaic GPU, Hopper; one process).

``remote_exchange(x, routes, recv_rows, axis)`` implements the contract of
``distca_jax.dataplane.exchange.ragged_exchange`` (collective ``'remote'``): inside
``jax.shard_map`` over the servers' ``axis``, every device copies each group of its send buffer
``x [Cs, ...]`` (rows ``[send_off[p], send_off[p] + send_len[p])`` for server ``p``) straight into
its place in server ``p``'s receive buffer (rows from ``peer_recv_off[p]``), and zeroes the rows
of its own receive buffer that no group fills. Each row crosses the wire once; no buffer depends
on the number of servers; the routes are read on the device, so the host never waits.

How (one kernel, ``grid = (blocks,)``, each block one CTA):
  1. Entry barrier: each block signals the semaphore ``ready[me]`` on every device (itself
     included) and waits once on ``ready[k]`` for every ``k``. Every device receives ``blocks``
     signals per sender per call and its blocks consume exactly that many, so the semaphores
     (global, persistent across calls) return to zero; a block starts writing into a peer's
     buffer only after that peer entered this call (its earlier work on the buffer is done).
  2. Copies: the rows are viewed as lines of ``LINE`` elements (one row = ``L`` lines). Group
     ``p`` is cut into chunks of ``chunk`` lines; block ``b`` takes chunks ``b, b + blocks, ...``
     of every group (peers in the order ``me, me + 1, ...`` so the devices do not all write to
     one peer at once): GMEM -> SMEM (TMA), then SMEM -> the peer's GMEM
     (``plgpu.remote_ref``), through ``slots`` SMEM tiles so that a chunk's load overlaps the
     stores of the chunks before it. A group's last partial chunk goes in power-of-two pieces,
     so no copy writes outside its group.
  Zeroing: the rows past the last filled row are written from a zeroed SMEM tile the same way,
  by ``zero_blocks`` extra blocks (grid ``blocks + zero_blocks``) that run beside the copies:
  they touch only this device's own receive rows that no sender fills, so they take no part in
  the barriers. With ``zero_blocks = 0`` the copying blocks zero after their copies.
  3. Exit: each block waits for its copies to land, signals ``done[me]`` on every device and
     waits once on ``done[k]`` for every ``k`` (the same counting as step 1); the kernel ends
     when the last block has seen every sender's last block, so the receive buffer is complete.

Only for one process driving all GPUs of a host (XLA shares peer addresses between the devices
of one process); multi-process jobs use another collective. Row widths (elements per row) must
be a multiple of ``LINE`` or a line of their own of at most 256 elements and 16-byte multiple.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

LINE = 128          # elements per line (a TMA box's inner dimension)
CHUNK_LINES = 128   # lines per copy (32 KB of bf16)
DEFAULT_BLOCKS = 132  # one CTA per SM of an H100 / H200
DEFAULT_SLOTS = 2     # SMEM tiles per CTA: a chunk's load overlaps the previous chunk's store
DEFAULT_ZERO_BLOCKS = 66  # extra CTAs that zero the unfilled receive rows beside the copies


def line_width(row_shape, dtype) -> int:
  """Elements per line for rows of ``row_shape`` (``ValueError`` naming the shape when no TMA
  line fits)."""
  w = math.prod(row_shape)
  if w % LINE == 0:
    return LINE
  if w <= 256 and (w * jnp.dtype(dtype).itemsize) % 16 == 0:
    return w
  raise ValueError(f"remote exchange: rows of shape {tuple(row_shape)} ({w} x {jnp.dtype(dtype)}) "
                   f"fit no TMA line: use a width that is a multiple of {LINE} elements, or "
                   "another collective (attention.distca.collective='dense')")


def _axes(axis) -> tuple:
  return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _device(axes, sizes, peer):
  """``{axis: index}`` of linear peer ``peer`` over ``axes`` (row-major)."""
  out, rest = {}, peer
  for a, n in reversed(list(zip(axes, sizes))):
    out[a] = lax.rem(rest, jnp.int32(n))
    rest = lax.div(rest, jnp.int32(n))
  return out


def _pieces(copy, src, dst, count, piece: int):
  """``count`` (< 2 * piece) lines from ``src`` to ``dst`` in power-of-two pieces ``piece, ...,
  1``: ``copy(src, dst, n)`` with static ``n``."""
  while piece >= 1:
    def run(src=src, dst=dst, piece=piece):
      copy(src, dst, piece)
    pl.when((count & piece) != 0)(run)
    step = count & piece
    src, dst = src + step, dst + step
    piece //= 2


def _spread(copy, b, blocks: int, chunk: int, src, dst, lines, turn, i):
  """Lines ``[0, lines)`` of one range: full chunks over the blocks (``b``, ``b + blocks``,
  ...), the last partial chunk by block ``(full + turn) % blocks``. ``copy(src, dst, n, i,
  drain)`` moves ``n`` lines as this block's ``i``-th copy; returns the next ``i``."""
  full = lines // chunk

  @pl.loop(b, full, step=blocks, init_carry=i)
  def i(c, i):
    return copy(src + c * chunk, dst + c * chunk, chunk, i, False)

  rest = lines - full * chunk  # < chunk: pieces chunk / 2, ..., 1 cover it exactly

  @pl.when((rest > 0) & (b == lax.rem(full + turn, jnp.int32(blocks))))
  def _():
    _pieces(lambda s_, d_, n: copy(s_, d_, n, i, True), src + full * chunk, dst + full * chunk,
            rest, chunk // 2)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the next copy may reuse any slot

  return i


def _zero_tail(routes_ref, y_ref, zero, b, blocks: int, chunk: int, s: int, ll: int):
  """Blocks ``b`` of ``blocks`` write zeros over this device's receive rows past the last
  filled one (receive groups are packed in sender order from row 0)."""
  zero[...] = jnp.zeros(zero.shape, zero.dtype)
  plgpu.commit_smem()
  filled = jnp.int32(0)
  for k in range(s):
    filled = filled + routes_ref[3, k]
  total = y_ref.shape[0]

  def clear(src, dst, n, i, drain):
    del src, drain  # the zero tile is only read
    plgpu.copy_smem_to_gmem(zero.at[pl.ds(0, n)], y_ref.at[pl.ds(dst, n)])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    return i

  _spread(clear, b, blocks, chunk, jnp.int32(0), filled * ll, total - filled * ll, s,
          jnp.int32(0))


def _kernel(routes_ref, x_ref, y_ref, tiles, zero, bars, *, axes, sizes, lines_per_row: int,
            blocks: int, chunk: int, slots: int, zero_blocks: int):
  s = math.prod(sizes)
  ll = lines_per_row
  b = lax.axis_index("blocks")
  if zero_blocks:
    @pl.when(b >= blocks)
    def _():
      _zero_tail(routes_ref, y_ref, zero, b - blocks, zero_blocks, chunk, s, ll)
      plgpu.wait_smem_to_gmem(0)

  @pl.when(b < blocks)
  def _():
    _copy_blocks(routes_ref, x_ref, y_ref, tiles, zero, bars, b, axes=axes, sizes=sizes, ll=ll,
                 blocks=blocks, chunk=chunk, slots=slots, zero_after=not zero_blocks)


def _copy_blocks(routes_ref, x_ref, y_ref, tiles, zero_tile, bars, b, *, axes, sizes, ll: int,
                 blocks: int, chunk: int, slots: int, zero_after: bool):
  s = math.prod(sizes)
  ready = pl.get_global(plgpu.SemaphoreType.REGULAR((s,)))
  done = pl.get_global(plgpu.SemaphoreType.REGULAR((s,)))
  me = jnp.int32(0)
  for a, n in zip(axes, sizes):
    me = me * n + lax.axis_index(a).astype(jnp.int32)
  # Peers in the order me, me + 1, ...: their routes column and their mesh ids.
  peers = [lax.rem(me + k, jnp.int32(s)) for k in range(s)]
  peer_ids = [_device(axes, sizes, p) for p in peers]

  for pid in peer_ids:  # 1. entry barrier
    pl.semaphore_signal(ready.at[me], device_id=pid)
  for k in range(s):
    pl.semaphore_wait(ready.at[k], 1)

  i = jnp.int32(0)  # copies this block issued: copy i uses slot i % slots
  for k, (p, pid) in enumerate(zip(peers, peer_ids)):  # 2. copies, own group first
    dst_ref = y_ref if k == 0 else plgpu.remote_ref(y_ref, pid)

    def copy(src, dst, n, i, drain, dst_ref=dst_ref):
      slot = lax.rem(i, jnp.int32(slots))
      # The store that last read this slot (``slots`` copies ago) must be done reading it.
      plgpu.wait_smem_to_gmem(0 if drain else slots - 1, wait_read_only=True)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(src, n)], tiles.at[slot, pl.ds(0, n)],
                              bars.at[slot])
      plgpu.barrier_wait(bars.at[slot])
      plgpu.copy_smem_to_gmem(tiles.at[slot, pl.ds(0, n)], dst_ref.at[pl.ds(dst, n)])
      return i + 1

    i = _spread(copy, b, blocks, chunk, routes_ref[0, p] * ll, routes_ref[4, p] * ll,
                routes_ref[1, p] * ll, k, i)

  if zero_after:  # no zeroing blocks: this block zeroes its share after its copies
    _zero_tail(routes_ref, y_ref, zero_tile, b, blocks, chunk, s, ll)

  plgpu.wait_smem_to_gmem(0)  # 3. this block's writes have landed
  for pid in peer_ids:
    pl.semaphore_signal(done.at[me], device_id=pid)
  for k in range(s):
    pl.semaphore_wait(done.at[k], 1)


def remote_exchange(x, routes, recv_rows: int, axis, *, blocks: int = DEFAULT_BLOCKS,
                    chunk: int = CHUNK_LINES, slots: int = DEFAULT_SLOTS,
                    zero_blocks: int = DEFAULT_ZERO_BLOCKS):
  """``x [Cs, ...]`` moved by ``routes`` (int32 ``[6, S]``, ``plan.ROUTE_ROWS``) into
  ``[recv_rows, ...]`` on each device (module docstring). Inside ``jax.shard_map`` over
  ``axis`` (a name or a tuple of names: the servers, row-major)."""
  axes = _axes(axis)
  sizes = tuple(int(lax.axis_size(a)) for a in axes)
  if routes.shape != (6, math.prod(sizes)):
    raise ValueError(f"remote exchange: routes of shape {routes.shape}; expected "
                     f"(6, {math.prod(sizes)}) for the servers of axes {axes}")
  row_shape = x.shape[1:]
  g = line_width(row_shape, x.dtype)
  ll = math.prod(row_shape) // g
  x_lines = x.reshape(x.shape[0] * ll, g)
  kernel = plgpu.kernel(
      functools.partial(_kernel, axes=axes, sizes=sizes, lines_per_row=ll, blocks=blocks,
                        chunk=chunk, slots=slots, zero_blocks=zero_blocks),
      out_type=jax.ShapeDtypeStruct((recv_rows * ll, g), x.dtype),
      scratch_types=[plgpu.SMEM((slots, chunk, g), x.dtype), plgpu.SMEM((chunk, g), x.dtype),
                     plgpu.Barrier(num_barriers=slots)],
      grid=(blocks + zero_blocks,), grid_names=("blocks",), kernel_name="remote_exchange")
  y = kernel(routes.astype(jnp.int32), x_lines)
  return y.reshape((recv_rows,) + row_shape)
