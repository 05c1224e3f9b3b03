"""FlashAttention-3 as a core-attention kernel ('flash3' of ``distca_jax.ops.core_attention``):
an adapter from the CA-task contract (``custom_ops.varlen_attention``) to the ``flash-attn3-jax``
bindings (Hopper GPUs, bf16/fp16, head dim 128 in the published wheel).

Each call runs the cheapest of several compiled launch shapes that holds its task table
(``flash3_grid_buckets``, ``flash3_bucket``); rows outside the tasks are masked, not computed
(``flash3_masked``). The bindings are imported only when a call is traced (``import_flash3``), so
this module imports on machines without them (CPUs); the tests run ``flash3_masked`` there on a
CPU emulator of the bindings' contract.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from custom_ops import KERNEL_OUTPUTS_NAME, KernelUnavailableError, fills_of
from custom_ops import varlen_attention as va

FLASH3_PIP_SPEC = "flash-attn3-jax==0.2.3"
FLASH3_HEAD_DIMS = (128,)  # the head dims the published wheel was built for
# flash3 launch shapes per dimension (``flash3_grid_buckets``): 4 -> slots N, N/2, N/4, N/8 times
# bounds L, L/2, L/4, L/8 (16 compiled FA3 variants, one runs per call).
FLASH3_GRID_LEVELS = 4


def import_flash3():
  """The FlashAttention-3 JAX bindings, or a KernelUnavailableError saying how to install them."""
  try:
    return importlib.import_module("flash_attn3_jax")
  except ImportError as e:  # also a missing CUDA runtime inside the extension
    raise KernelUnavailableError(
        f"kernel='flash3' needs the FlashAttention-3 JAX bindings: pip install "
        f"'{FLASH3_PIP_SPEC}' (Linux x86_64, CUDA >= 12.4, Hopper GPU; the project's optional "
        f"extra 'gpu'). Import failed with: {e!r}") from e


def check_available() -> None:
  """A KernelUnavailableError saying why 'flash3' cannot run here: its bindings do not import, or
  JAX's default platform is not a GPU (nothing inside ``shape_only``)."""
  if _SHAPE_ONLY:
    return
  import_flash3()
  if jax.default_backend() != "gpu":
    raise KernelUnavailableError(
        f"kernel='flash3' runs only on CUDA GPUs (Hopper); JAX's default platform is "
        f"{jax.default_backend()!r}. Use kernel='blockwise' or 'reference' there")


def flash3_grid_buckets(num_tasks: int, num_q_rows: int, max_seqlen_q: int, max_seqlen_k: int,
                       levels: int = FLASH3_GRID_LEVELS) -> tuple[tuple[int, int, int], ...]:
  """The launch shapes ``(task slots, max_seqlen_q, max_seqlen_k)`` a flash3 call compiles.

  FA3's varlen kernels launch ``slots x ceil(max_seqlen / 128) x heads`` thread blocks whatever
  the tasks' real lengths (its backward over ``max_seqlen_k``), and a block past its task's end
  still costs a launch. So the backward is compiled for ``levels`` slot counts (``N, N/2, N/4,
  ...``) times ``levels`` bounds (``L, L/2, ...``, multiples of 128), and each call runs the
  cheapest shape that holds its table (``flash3_bucket``): trailing empty slots are cut off and
  the bounds drop to the smallest ladder step above the longest task. Measured on an H200
  (results/micro/flash3_grid_bench.md): the backward of a ProLong server's 24 tasks in 64 slots with
  bound 64K took 32.7 ms, 23.4 ms with 24 slots and bound 10K. The forward always runs the last
  (full) shape: FA3's forward skips empty tiles (its time did not move with the shape), and one
  forward shape keeps a single LSE buffer shape, so remat policies that save the kernel's
  outputs ('resend') keep one buffer, not one per branch.

  The LSE buffer the bindings allocate is ``[slots, H, max_seqlen_q]`` while FA3 writes it as
  ``[H, T]``, so a shape's ``max_seqlen_q`` is raised to at least ``ceil(T / slots)``.
  """
  if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) or levels < 1:
    raise ValueError(f"flash3 grid_levels={levels!r} must be an int >= 1")
  levels = int(levels)

  def level(n: int, i: int, multiple: int) -> int:
    return min(n, max(multiple, -(-n // 2**i // multiple) * multiple))

  msq, msk = max(int(max_seqlen_q), 1), max(int(max_seqlen_k), 1)
  slot_ladder = sorted({level(max(int(num_tasks), 1), i, 1) for i in range(levels)})
  bounds = [(level(msq, i, 128), level(msk, i, 128)) for i in reversed(range(levels))]
  out = [(slots, max(bq, -(-int(num_q_rows) // slots)), bk)
         for slots in slot_ladder for bq, bk in bounds]
  return tuple(dict.fromkeys(out))


def flash3_bucket(cu_q, cu_k, buckets) -> tuple[jax.Array, jax.Array]:
  """Device choice among ``buckets``: (the index of the fewest launched blocks that hold every
  task, whether the last bucket, the caller's full shape, holds them: else FA3 would cut a task
  short)."""
  lq, lk = jnp.diff(cu_q), jnp.diff(cu_k)
  slot = jnp.arange(1, lq.shape[0] + 1, dtype=jnp.int32)
  used = jnp.max(jnp.where((lq > 0) | (lk > 0), slot, 0), initial=0)
  mq, mk = jnp.max(lq, initial=0), jnp.max(lk, initial=0)
  b = np.asarray(buckets, np.int64)
  holds = (used <= b[:, 0]) & (mq <= b[:, 1]) & (mk <= b[:, 2])
  cost = (b[:, 0] * (-(-b[:, 2] // 128))).astype(np.float32)  # backward blocks per head
  # The last bucket holds whatever any bucket holds (the ladders only go up).
  best = jnp.argmin(jnp.where(holds, jnp.asarray(cost), jnp.inf))
  return jnp.where(holds[-1], best, len(buckets) - 1).astype(jnp.int32), holds[-1]


def flash3_attention(q, k, v, cu_q, cu_k, *, softmax_scale, max_seqlen_q, max_seqlen_k,
                     grid_levels=FLASH3_GRID_LEVELS, window: int = 0):
  """(o [T, H, D], lse [T, H]) of kernel 'flash3' (``distca_jax.ops.core_attention``): checks
  the platform, dtype and head dim, then ``flash3_masked`` on the real FA3 bindings
  (``window`` > 0: FA3's local attention, ``flash3_window_size``)."""
  check_available()
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"kernel='flash3' takes bf16 or fp16 inputs; got {q.dtype=}")
  head_dim = q.shape[2]
  if head_dim not in FLASH3_HEAD_DIMS:
    raise ValueError(
        f"kernel='flash3': the published {FLASH3_PIP_SPEC} wheel is built for head dims "
        f"{FLASH3_HEAD_DIMS}; got {head_dim=} (build flash-attn3-jax from source for others)")
  return flash3_masked(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        grid_levels=grid_levels,
                        impl=SHAPE_ONLY_IMPL if _SHAPE_ONLY else _FA3_IMPL, window=window)


def flash3_window_size(window: int) -> tuple[int, int]:
  """FA3's ``window_size=(left, right)`` of the contract's sliding ``window`` (0 = full causal:
  ``(-1, -1)``). FA3 aligns windows bottom-right per task as the contract does: query row ``r``
  sees keys ``[r + lk - lq - left, r + lk - lq + right]``, so ``left = window - 1``, ``right =
  0``; its varlen forward and backward both take it (``flash_attn3_jax.varlen_fwd`` /
  ``varlen_bwd`` 0.2.3)."""
  window = va.check_window(window)
  return (window - 1, 0) if window else (-1, -1)


def flash3_masked(q, k, v, cu_q, cu_k, *, softmax_scale, max_seqlen_q, max_seqlen_k,
                   grid_levels, impl, window: int = 0):
  """FA3 on the real tasks only; rows outside every task are masked to 0 (-inf LSE).

  FA3 leaves rows outside ``[cu[0], cu[-1])`` unwritten (O, LSE, dQ, dK, dV), so every one of
  them is selected away here (FA3 reads no padding row, so padding inputs need no cleaning). A
  task longer than ``max_seqlen_q`` / ``max_seqlen_k`` makes the whole output NaN (FA3 would
  silently visit only the first ``max_seqlen`` rows). ``impl`` is the pair of FA3 calls (the real
  bindings, or a CPU emulator of their contract in the tests); with ``window`` > 0 both are
  called with ``window_size=flash3_window_size(window)``.
  """
  num_q_rows, num_heads, head_dim = q.shape
  cu_q = cu_q.astype(jnp.int32)
  cu_k = cu_k.astype(jnp.int32)
  # No task is longer than its buffer, so bounds above the buffer sizes only cost launches.
  msq = min(max_seqlen_q or num_q_rows, num_q_rows)
  msk = min(max_seqlen_k or k.shape[0], k.shape[0])
  buckets = flash3_grid_buckets(cu_q.shape[0] - 1, num_q_rows, msq, msk, grid_levels)
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
  bucket, fits = flash3_bucket(cu_q, cu_k, buckets)
  windowed = {"window_size": flash3_window_size(window)} if window else {}
  config = (buckets, scale, impl, tuple(windowed.items()))
  o, lse_HxT = _flash3_attention(q, k, v, cu_q, cu_k, bucket, config)
  _, _, q_valid = va.rows_to_tasks(cu_q, num_q_rows)
  o = mask_output(o, q_valid, fits)
  lse_TxH = jnp.where(q_valid[:, None], lse_HxT.T, fills_of(lse_HxT, -jnp.inf)[0])
  return o, lse_TxH


@jax.custom_vjp
def mask_output(o, valid, fits):
  """``o`` with rows outside every task 0 and all of it NaN unless ``fits`` (a task longer than
  the caller's bounds, which FA3 would cut short without a word).

  The values of two ``jnp.where``; the backward keeps only ``valid`` [rows] and ``fits``.
  ``jnp.where``'s own transpose keeps its predicate broadcast to ``o``'s shape: under the layer
  scan that predicate (the plan's, the same in every layer) is a loop invariant, which the scan
  computes once before the loop and holds, at ``o``'s size, while the loop runs; the fills are
  kept in the loop the same way (``fills_of``)."""
  zero, nan = fills_of(o, 0, jnp.nan)
  return jnp.where(fits, jnp.where(valid[:, None, None], o, zero), nan)


def _mask_output_fwd(o, valid, fits):
  return mask_output(o, valid, fits), (valid, fits)


def _mask_output_bwd(res, g):
  valid, fits = res
  return (jnp.where(valid[:, None, None] & fits, g, jnp.zeros((), g.dtype)),
          np.zeros(valid.shape, jax.dtypes.float0), np.zeros(fits.shape, jax.dtypes.float0))


mask_output.defvjp(_mask_output_fwd, _mask_output_bwd)


def _fa3_fwd(q, k, v, cu_q, cu_k, **config):  # config: max_seqlen_*, softmax_scale, window_size
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415  (optional dependency)
  return fa3_varlen.flash_mha_varlen_fwd(q, k, v, cu_q, cu_k, None, is_causal=True, **config)


def _fa3_bwd(do, q, k, v, o, lse, cu_q, cu_k, **config):
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415
  return fa3_varlen.flash_mha_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, is_causal=True,
                                         **config)


_FA3_IMPL = (_fa3_fwd, _fa3_bwd)


# ----------------------------------------------------------------------------------------------
# A shape-only stand-in of the bindings, for memory analysis off a Hopper GPU.
# ----------------------------------------------------------------------------------------------
_SHAPE_ONLY: list[bool] = []  # non-empty inside ``shape_only``


@contextlib.contextmanager
def shape_only():
  """Inside: 'flash3' traces and compiles on any platform with ``SHAPE_ONLY_IMPL`` in place of
  the bindings, so XLA's buffer assignment of a flash3 step (the kernel's outputs, no scratch)
  and ``distca_jax.memory.kernel_workspace_bytes`` (the backward's FFI scratch, found by the
  primitive's name) can be read on a CPU. A step compiled this way must never run."""
  _SHAPE_ONLY.append(True)
  try:
    yield
  finally:
    _SHAPE_ONLY.pop()


def _never_run(*_):
  raise RuntimeError("a flash3 step compiled under flash3_attention.shape_only ran; it is for "
                     "memory analysis only")


def _shape_only_primitive(name: str, out_avals):
  """A primitive named like the bindings' FFI call whose outputs have the bindings' shapes; it
  lowers to a host callback that raises (the outputs are buffers of the plan, as the real
  call's are; nothing else is allocated inside XLA's plan)."""
  from jax.extend.core import Primitive  # noqa: PLC0415
  from jax.interpreters import mlir  # noqa: PLC0415
  prim = Primitive(name)
  prim.multiple_results = True
  prim.def_abstract_eval(lambda *avals, **kw: out_avals(*avals, **kw))
  shapes = lambda *avals, **kw: [jax.ShapeDtypeStruct(a.shape, a.dtype)
                                 for a in out_avals(*avals, **kw)]
  mlir.register_lowering(prim, mlir.lower_fun(
      lambda *args, **kw: jax.pure_callback(_never_run, shapes(*args, **kw), *args),
      multiple_results=True))
  return prim


def _fwd_avals(q, k, v, cu_q, cu_k, *, max_seqlen_q, **_):
  del k, v, cu_k
  return [jax.core.ShapedArray(q.shape, q.dtype),
          jax.core.ShapedArray((cu_q.shape[0] - 1, q.shape[1], max_seqlen_q), jnp.float32)]


def _bwd_avals(do, q, k, v, o, lse, cu_q, cu_k, **_):
  del do, o, lse, cu_q, cu_k
  return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]


@functools.cache
def _shape_only_prims():
  return (_shape_only_primitive("flash_mha_varlen_fwd", _fwd_avals),
          _shape_only_primitive("flash_mha_varlen_bwd", _bwd_avals))


def _shape_only_fwd(q, k, v, cu_q, cu_k, **config):
  return tuple(_shape_only_prims()[0].bind(q, k, v, cu_q, cu_k, **config))


def _shape_only_bwd(do, q, k, v, o, lse, cu_q, cu_k, **config):
  return tuple(_shape_only_prims()[1].bind(do, q, k, v, o, lse, cu_q, cu_k, **config))


SHAPE_ONLY_IMPL = (_shape_only_fwd, _shape_only_bwd)


def switch_or_call(index, fns, *operands):
  """``lax.switch(index, fns, *operands)``, or the one function called directly (no switch)."""
  return fns[0](*operands) if len(fns) == 1 else jax.lax.switch(index, fns, *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash3_attention(q, k, v, cu_q, cu_k, bucket, config):
  """FA3 causal varlen forward in the launch shape ``bucket`` picks: (o [T, H, D], lse [H, T])."""
  return _flash3_attention_fwd(q, k, v, cu_q, cu_k, bucket, config)[0]


def _flash3_attention_fwd(q, k, v, cu_q, cu_k, bucket, config):
  buckets, scale, (fwd, _), windowed = config
  num_q_rows, num_heads, _ = q.shape
  # The forward runs the full shape (see flash3_grid_buckets); the backward switches on bucket.
  _, msq, msk = buckets[-1]
  o, lse_raw = fwd(q, k, v, cu_q, cu_k, max_seqlen_q=msq, max_seqlen_k=msk, softmax_scale=scale,
                   **dict(windowed))
  lse = lse_raw.reshape(-1)[:num_heads * num_q_rows].reshape(num_heads, num_q_rows)
  # What remat policies keep (saves_kernel_outputs): O and the [H, T] LSE, not the raw buffer.
  o, lse = (checkpoint_name(x, KERNEL_OUTPUTS_NAME) for x in (o, lse))
  return (o, lse), (q, k, v, cu_q, cu_k, bucket, o, lse)


def _flash3_attention_bwd(config, res, cts):
  buckets, scale, (_, bwd), windowed = config
  q, k, v, cu_q, cu_k, bucket, o, lse_HxT = res
  do, dlse = cts
  if not isinstance(dlse, jax.custom_derivatives.SymbolicZero):
    raise NotImplementedError(
        "kernel='flash3' cannot differentiate through the log-sum-exp (FA3's backward takes no "
        "dLSE); use kernel='mosaic' (or 'blockwise' / 'reference') when the loss depends on lse")
  if isinstance(do, jax.custom_derivatives.SymbolicZero):
    do = jnp.zeros(o.shape, o.dtype)

  def branch(slots, msq, msk):
    def run(do, q, k, v, o, lse_HxT, cu_q, cu_k):
      flat = lse_HxT.reshape(-1)
      lse_raw = jnp.pad(flat, (0, slots * lse_HxT.shape[0] * msq - flat.shape[0]))
      return bwd(do, q, k, v, o, lse_raw.reshape(slots, lse_HxT.shape[0], msq),
                 cu_q[:slots + 1], cu_k[:slots + 1], max_seqlen_q=msq, max_seqlen_k=msk,
                 softmax_scale=scale, **dict(windowed))
    return run

  dq, dk, dv = switch_or_call(bucket, [branch(*b) for b in buckets], do, q, k, v, o, lse_HxT,
                              cu_q, cu_k)
  _, _, q_valid = va.rows_to_tasks(cu_q, q.shape[0])
  _, _, k_valid = va.rows_to_tasks(cu_k, k.shape[0])
  zero = jnp.zeros((), dq.dtype)
  return (jnp.where(q_valid[:, None, None], dq, zero), jnp.where(k_valid[:, None, None], dk, zero),
          jnp.where(k_valid[:, None, None], dv, zero), None, None, None)


def _flash3_attention_fwd_symbolic(q, k, v, cu_q, cu_k, bucket, config):
  # symbolic_zeros=True wraps each primal; unwrap them.
  return _flash3_attention_fwd(q.value, k.value, v.value, cu_q.value, cu_k.value, bucket.value,
                               config)


_flash3_attention.defvjp(_flash3_attention_fwd_symbolic, _flash3_attention_bwd,
                         symbolic_zeros=True)
