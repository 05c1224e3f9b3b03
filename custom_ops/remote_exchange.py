"""The ragged exchange as device-initiated copies (Pallas Mosaic GPU, Hopper; one process).

``remote_exchange(x, routes, recv_rows, axis)`` implements the contract of
``distca_jax.dataplane.exchange.ragged_exchange`` (collective ``'remote'``): inside
``jax.shard_map`` over the servers' ``axis``, every device copies each group of its send buffer
``x [Cs, ...]`` (rows ``[send_off[p], send_off[p] + send_len[p])`` for server ``p``) straight into
its place in server ``p``'s receive buffer (rows from ``peer_recv_off[p]``), and zeroes the rows
of its own receive buffer from ``keep`` on (default ``sum(recv_len)``: the rows past the last
group; receive groups are packed in sender order from row 0). Each row crosses the wire once; no
buffer depends on the number of servers; the routes are read on the device, so the host never
waits. With ``group=G`` one call exchanges only inside groups of ``G`` consecutive linear peers
(``[0, G)``, ``[G, 2G)``, ...; e.g. the GPUs of one host): a device signals, waits for and copies
to the devices of its own group only, so the routes must be zero for every pair of devices of
different groups (the kernel moves no row between groups, and rows a sender of another group
would fill are neither written nor zeroed; ``check_group_routes`` checks a plan's ``[S, S]``
lengths on the host). The default ``group = S`` is the whole axis.

How (one kernel, ``grid = (blocks,)``, each block one CTA; "peers" are the devices of the
caller's group, itself included):
  1. Entry barrier: each block signals the semaphore ``ready[me]`` on every peer and waits once
     on ``ready[k]`` for every peer ``k``. Every device receives ``blocks`` signals per peer per
     call and its blocks consume exactly that many, so every signal a call sends is consumed by
     that call before its kernel ends.
  2. Copies: the rows are viewed as lines of ``LINE`` elements (one row = ``L`` lines). Group
     ``p`` is cut into chunks of ``chunk`` lines; block ``b`` takes chunks ``b, b + blocks, ...``
     of every group (peers in the order ``me, me + 1, ...`` within the group, so the devices do
     not all write to one peer at once): GMEM -> SMEM (TMA), then SMEM -> the peer's GMEM
     (``plgpu.remote_ref``), through ``slots`` SMEM tiles so that a chunk's load overlaps the
     stores of the chunks before it. A group's last partial chunk goes in power-of-two pieces,
     so no copy writes outside its group.
  Zeroing: rows ``[keep, recv_rows)`` are written from a zeroed SMEM tile the same way, by
  ``zero_blocks`` extra blocks (grid ``blocks + zero_blocks``) that run beside the copies: they
  touch only this device's own receive rows that no sender fills, so they take no part in the
  barriers. With ``zero_blocks = 0`` the copying blocks zero after their copies.
  3. Exit: each block waits for its copies to land, signals ``done[me]`` on every peer and
     waits once on ``done[k]`` for every peer ``k`` (the same counting as step 1); the kernel
     ends when the last block has seen every peer's last block, so the receive buffer is
     complete and no peer writes into this device's memory after the kernel.

Why no signal is lost (jax 0.11.2's Python side; the C++ read at jax commit cec06d1, just
before 0.11.1; custom_ops/MOSAIC_NOTES.md has the details). The
semaphores are NOT persistent: ``pl.get_global`` semaphores are GMEM scratch of one call.
``_emit_mosaic_gpu_custom_call`` (jax/_src/pallas/mosaic_gpu/pallas_call_registration.py)
appends them to the custom call as an operand aliased to an output and computes that operand as
``jnp.zeros`` in the surrounding XLA program, so they are zeroed on each device before every
call, by that device's own stream. A fast peer's signal could only be lost if it reached this
device before that zeroing. It cannot: the kernel uses XLA's collective metadata
(``remote_ref`` sets ``uses_xla_collective_metadata``), and for such a kernel jaxlib's
``MosaicGpuExecute`` (jaxlib/mosaic/gpu/custom_call.cc) launches XLA's multi-GPU barrier
(``LaunchMultiGpuBarrier``, over the devices of the whole mesh, ``xla_replica_ids``) on the
device's stream and then the kernel, unless ``skip_device_barrier`` is set. Stream order puts a
device's zeroing before its barrier arrival, and no peer's kernel starts before every device
has arrived, so every peer's first signal comes after this device's zeroing. The kernel passes
``CompilerParams(skip_device_barrier=False)`` explicitly, and a test checks the lowered custom
call for both attributes. Given that barrier, the entry barrier (step 1) adds no ordering (every
peer has finished its earlier work on its buffers before any kernel starts); it costs one
signal round. The exit barrier (step 3) is what the next call's correctness needs: a device
leaves the kernel only after every signal and row addressed to it has arrived.

Processes: only for one process driving all GPUs of a host (XLA shares peer addresses between
the devices of one process). In jax 0.11.2 a mesh over several processes lowers ``remote_ref``
to NVSHMEM (``nvshmem_ptr``) when the ``nvidia-nvshmem`` wheel is installed and ``XLA_FLAGS``
holds ``--xla_gpu_experimental_enable_nvshmem``, which XLA's custom call refuses ("NVSHMEM is
not supported in XLA"); without them it marks every kernel argument for XLA's symmetric memory
(NCCL windows, peer pointers from NCCL >= 2.29): it could reach GPUs of other processes of the
same host, but it asks for the address of every device of the mesh whatever ``group`` is, so a
mesh over two hosts fails before the first call. Not tried (custom_ops/MOSAIC_NOTES.md,
"Several processes"); multi-process jobs use another collective.

Row widths (elements per row) must be a multiple of ``LINE`` or a line of their own of at most
256 elements and 16-byte multiple.
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from distca_jax.checks import check_int

LINE = 128          # elements per line (a TMA box's inner dimension)
CHUNK_LINES = 128   # lines per copy (32 KB of bf16)
DEFAULT_BLOCKS = 132  # one CTA per SM of an H100 / H200
DEFAULT_SLOTS = 2     # SMEM tiles per CTA: a chunk's load overlaps the previous chunk's store
DEFAULT_ZERO_BLOCKS = 66  # extra CTAs that zero the unfilled receive rows beside the copies
SMEM_BYTES = 227 * 1024   # shared memory one CTA may use on an H100 / H200


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


def check_grid(blocks, chunk, slots, zero_blocks, line_bytes: int) -> tuple[int, int, int, int]:
  """``(blocks, chunk, slots, zero_blocks)`` as ints, or a one-line ``ValueError`` naming the bad
  value and the fix: ``blocks >= 1``, ``chunk`` a power of two (a group's last partial chunk goes
  in pieces ``chunk / 2, ..., 1``), ``slots >= 1``, ``zero_blocks >= 0``, and the ``slots + 1``
  SMEM tiles of ``chunk`` lines of ``line_bytes`` within one CTA's shared memory."""
  blocks = check_int("remote exchange blocks", blocks, 1,
                     f"CTAs that copy; default {DEFAULT_BLOCKS}, one per SM")
  chunk = check_int("remote exchange chunk", chunk, 1, f"lines per copy; default {CHUNK_LINES}")
  if chunk & (chunk - 1):
    raise ValueError(f"remote exchange chunk={chunk} must be a power of two (lines per copy): "
                     f"use {1 << (chunk.bit_length() - 1)} or {1 << chunk.bit_length()}")
  slots = check_int("remote exchange slots", slots, 1,
                    f"SMEM tiles per CTA; default {DEFAULT_SLOTS}")
  zero_blocks = check_int("remote exchange zero_blocks", zero_blocks, 0,
                          "extra CTAs that zero the unfilled rows; 0 = the copying CTAs zero")
  smem = (slots + 1) * chunk * line_bytes
  if smem > SMEM_BYTES:
    raise ValueError(f"remote exchange chunk={chunk} x slots={slots} needs {smem} bytes of shared "
                     f"memory per CTA ({slots} + 1 tiles of {chunk} lines of {line_bytes} bytes), "
                     f"more than {SMEM_BYTES}: use a smaller chunk or fewer slots")
  return blocks, chunk, slots, zero_blocks


def check_group(group, servers: int) -> int:
  """``group`` (``None``: all ``servers``) as an int dividing ``servers``, or a one-line
  ``ValueError`` naming it and the fix."""
  if group is None:
    return servers
  g = check_int("remote exchange group", group, 1, f"peers per group; None = all {servers}")
  if servers % g:
    raise ValueError(f"remote exchange group={g} does not divide the {servers} servers: use a "
                     f"divisor of {servers} (e.g. the GPUs per host), or None for one group")
  return g


def check_group_routes(send_len_SxS, group: int | None):
  """Host check of a plan's ``[S, S]`` group lengths (sender, server) for ``group``: a ValueError
  naming the first pair of devices of different groups with rows between them (``None``: one
  group, nothing to check)."""
  ln = np.asarray(send_len_SxS)
  s = ln.shape[0]
  g = check_group(group, s)
  dev = np.arange(s) // g
  bad = np.argwhere((ln != 0) & (dev[:, None] != dev[None, :]))
  if bad.size:
    p, d = (int(v) for v in bad[0])
    raise ValueError(f"remote exchange group={g}: {int(ln[p, d])} rows from device {p} (group "
                     f"{p // g}) to device {d} (group {d // g}); a group call moves rows only "
                     "inside its group: route them through the exchange between groups")


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


KEEP = 6  # the kernel's routes row holding ``keep`` (after the six ``plan.ROUTE_ROWS``)


def _zero_tail(routes_ref, y_ref, zero, b, blocks: int, chunk: int, s: int, ll: int):
  """Blocks ``b`` of ``blocks`` write zeros over this device's receive rows from ``keep`` on."""
  zero[...] = jnp.zeros(zero.shape, zero.dtype)
  plgpu.commit_smem()
  keep = routes_ref[KEEP, 0]
  total = y_ref.shape[0]

  def clear(src, dst, n, i, drain):
    del src, drain  # the zero tile is only read
    plgpu.copy_smem_to_gmem(zero.at[pl.ds(0, n)], y_ref.at[pl.ds(dst, n)])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    return i

  _spread(clear, b, blocks, chunk, jnp.int32(0), keep * ll, total - keep * ll, s, jnp.int32(0))


def _kernel(routes_ref, x_ref, y_ref, tiles, zero, bars, *, axes, sizes, group: int,
            lines_per_row: int, blocks: int, chunk: int, slots: int, zero_blocks: int):
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
    _copy_blocks(routes_ref, x_ref, y_ref, tiles, zero, bars, b, axes=axes, sizes=sizes,
                 group=group, ll=ll, blocks=blocks, chunk=chunk, slots=slots,
                 zero_after=not zero_blocks)


def _copy_blocks(routes_ref, x_ref, y_ref, tiles, zero_tile, bars, b, *, axes, sizes, group: int,
                 ll: int, blocks: int, chunk: int, slots: int, zero_after: bool):
  s = math.prod(sizes)
  ready = pl.get_global(plgpu.SemaphoreType.REGULAR((group,)))
  done = pl.get_global(plgpu.SemaphoreType.REGULAR((group,)))
  me = jnp.int32(0)
  for a, n in zip(axes, sizes):
    me = me * n + lax.axis_index(a).astype(jnp.int32)
  # The peers of this device's group in the order me, me + 1, ... (wrapping inside the group):
  # their routes column (linear peer id) and their mesh ids. ``slot``: this device's semaphore
  # on each peer (its place in the group).
  if group == s:
    slot = me
    peers = [lax.rem(me + k, jnp.int32(s)) for k in range(s)]
  else:
    slot = lax.rem(me, jnp.int32(group))
    base = me - slot
    peers = [base + lax.rem(slot + k, jnp.int32(group)) for k in range(group)]
  peer_ids = [_device(axes, sizes, p) for p in peers]

  for pid in peer_ids:  # 1. entry barrier
    pl.semaphore_signal(ready.at[slot], device_id=pid)
  for k in range(group):
    pl.semaphore_wait(ready.at[k], 1)

  i = jnp.int32(0)  # copies this block issued: copy i uses slot i % slots
  for k, (p, pid) in enumerate(zip(peers, peer_ids)):  # 2. copies, own group first
    dst_ref = y_ref if k == 0 else plgpu.remote_ref(y_ref, pid)

    def copy(src, dst, n, i, drain, dst_ref=dst_ref):
      tile = lax.rem(i, jnp.int32(slots))
      # The store that last read this tile (``slots`` copies ago) must be done reading it.
      plgpu.wait_smem_to_gmem(0 if drain else slots - 1, wait_read_only=True)
      plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(src, n)], tiles.at[tile, pl.ds(0, n)],
                              bars.at[tile])
      plgpu.barrier_wait(bars.at[tile])
      plgpu.copy_smem_to_gmem(tiles.at[tile, pl.ds(0, n)], dst_ref.at[pl.ds(dst, n)])
      return i + 1

    i = _spread(copy, b, blocks, chunk, routes_ref[0, p] * ll, routes_ref[4, p] * ll,
                routes_ref[1, p] * ll, k, i)

  if zero_after:  # no zeroing blocks: this block zeroes its share after its copies
    _zero_tail(routes_ref, y_ref, zero_tile, b, blocks, chunk, s, ll)

  plgpu.wait_smem_to_gmem(0)  # 3. this block's writes have landed
  for pid in peer_ids:
    pl.semaphore_signal(done.at[slot], device_id=pid)
  for k in range(group):
    pl.semaphore_wait(done.at[k], 1)


def remote_exchange(x, routes, recv_rows: int, axis, *, keep=None, group: int | None = None,
                    blocks: int = DEFAULT_BLOCKS, chunk: int = CHUNK_LINES,
                    slots: int = DEFAULT_SLOTS, zero_blocks: int = DEFAULT_ZERO_BLOCKS):
  """``x [Cs, ...]`` moved by ``routes`` (int32 ``[6, S]``, ``plan.ROUTE_ROWS``) into
  ``[recv_rows, ...]`` on each device (module docstring). Inside ``jax.shard_map`` over
  ``axis`` (a name or a tuple of names: the servers, row-major).

  ``keep``: int32 scalar (may vary per device): rows ``[keep, recv_rows)`` are zeroed, the rows
  before are left to the senders; default ``sum(recv_len)`` (every row past the groups). The
  signal-only exchange passes the sum of the unclipped lengths with clipped routes, so its
  zeroing is the real exchange's and never meets a row a sender writes. ``group``: peers per
  group (module docstring); ``None`` = all ``S``. ``blocks``, ``chunk``, ``slots``,
  ``zero_blocks``: the grid (``check_grid``)."""
  axes = _axes(axis)
  sizes = tuple(int(lax.axis_size(a)) for a in axes)
  s = math.prod(sizes)
  if routes.shape != (6, s):
    raise ValueError(f"remote exchange: routes of shape {routes.shape}; expected "
                     f"(6, {s}) for the servers of axes {axes}")
  group = check_group(group, s)
  row_shape = x.shape[1:]
  g = line_width(row_shape, x.dtype)
  blocks, chunk, slots, zero_blocks = check_grid(blocks, chunk, slots, zero_blocks,
                                                 g * jnp.dtype(x.dtype).itemsize)
  ll = math.prod(row_shape) // g
  x_lines = x.reshape(x.shape[0] * ll, g)
  routes = routes.astype(jnp.int32)
  keep = jnp.sum(routes[3]) if keep is None else jnp.asarray(keep, jnp.int32)
  keep = jnp.clip(keep, 0, recv_rows)
  routes = jnp.concatenate([routes, jnp.broadcast_to(keep, (1, s))])  # row KEEP
  kernel = plgpu.kernel(
      functools.partial(_kernel, axes=axes, sizes=sizes, group=group, lines_per_row=ll,
                        blocks=blocks, chunk=chunk, slots=slots, zero_blocks=zero_blocks),
      out_type=jax.ShapeDtypeStruct((recv_rows * ll, g), x.dtype),
      scratch_types=[plgpu.SMEM((slots, chunk, g), x.dtype), plgpu.SMEM((chunk, g), x.dtype),
                     plgpu.Barrier(num_barriers=slots)],
      # The barrier XLA launches before the kernel orders every device's zeroing of the
      # semaphores before any peer's first signal (module docstring): never skip it.
      compiler_params=plgpu.CompilerParams(skip_device_barrier=False),
      grid=(blocks + zero_blocks,), grid_names=("blocks",), kernel_name="remote_exchange")
  y = kernel(routes, x_lines)
  return y.reshape((recv_rows,) + row_shape)
