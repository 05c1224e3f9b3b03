"""One dispatch point for core attention over a fused batch of CA-tasks (its exact pair and FLOP
count is host arithmetic: ``plan.cost.attention_pairs`` / ``core_attention_flops``).

Task i of a batch owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of the packed query buffer
and key/value rows [cu_seqlens_k[i], cu_seqlens_k[i+1]) of the packed key/value buffers; the
causal mask is aligned bottom-right inside each task (see ``custom_ops/varlen_attention.py``).

Kernels (``KERNELS``; a *kernel* computes one fused call, a *backend* is a strategy of the
trainer, ``distca_jax.backends``; docs/design.md, "Words and letters"):
  'reference'  plain jnp, dense [H, T, U] logits: tests and small buffers only.
  'blockwise'  plain jnp, tile by tile over the task table with its own VJP
               (``custom_ops/blockwise_attention.py``): work follows the tasks' (query, key)
               pairs, not the buffer sizes. The CPU kernel.
  'mosaic'     our Pallas Mosaic GPU kernels (``custom_ops/mosaic_attention.py``; Hopper GPUs,
               bf16/fp16, head dim 64/128).
  'flash3'     FlashAttention-3 through the ``flash-attn3-jax`` package (Hopper GPUs, bf16/fp16,
               head dim 128 in the published wheel). Each call runs the cheapest of several
               compiled launch shapes that holds its task table (``flash3_grid_buckets``);
               rows outside the tasks are masked, not computed.

'auto' picks ``default_kernel()`` when traced: 'blockwise' on CPU, 'reference' elsewhere (GPU
configs name 'flash3' or 'mosaic'). It is the configs' default; an explicit name is always run
as named. An unavailable kernel raises ``KernelUnavailableError`` saying how to get it;
nothing falls back. ``check_kernel`` names a bad kernel and the fix.
"""

from __future__ import annotations

import functools
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import custom_ops
from custom_ops import blockwise_attention as bw
from custom_ops import varlen_attention as va
from distca_jax.checks import check_int
from distca_jax.errors import UserError

KERNELS = ("reference", "blockwise", "mosaic", "flash3", "auto")
# Names that are not kernels any more, each with what to use instead (``check_kernel``).
REMOVED_KERNELS = {"pallas": "(the Triton kernel) was removed; use 'mosaic' (GPU) or "
                              "'blockwise' / 'reference' (CPU)"}
FLASH3_PIP_SPEC = "flash-attn3-jax==0.2.3"
FLASH3_HEAD_DIMS = (128,)  # the head dims the published wheel was built for
# flash3 launch shapes per dimension (``flash3_grid_buckets``): 4 -> slots N, N/2, N/4, N/8 times
# bounds L, L/2, L/4, L/8 (16 compiled FA3 variants, one runs per call).
FLASH3_GRID_LEVELS = 4


# ``checkpoint_name`` of a kernel's forward outputs as its backward takes them (O, LSE): remat
# policies that keep attention ('save_attention' in model.py, the 'resend' memory mode in
# dataplane/body.py) save them instead of rerunning the kernel. Every kernel but 'reference'
# names them. By name, not by primitive: FlashAttention-3's FFI call returns its LSE in a
# [slots, H, max_seqlen_q] buffer (8.7 GB for 260 slots of a 64K row, 32 heads) of which only
# the first H x T entries are written; saving that call's outputs kept the whole buffer per layer
# and copied it into the layer scan's stacked residuals (MemcpyD2D, 117-188 ms of a 1.8 s step on
# an H200). The flash3 path names O and the
# [H, T] LSE it cuts out of the buffer.
KERNEL_OUTPUTS_NAME = custom_ops.KERNEL_OUTPUTS_NAME
# ``checkpoint_name`` of the kernel's query/key/value inputs (the backward's residuals).
KERNEL_INPUTS_NAME = "ca_in"


def saves_kernel_outputs(prim, *_, **params) -> bool:
  """Remat policy: save a kernel's forward outputs (the values named ``KERNEL_OUTPUTS_NAME``)."""
  return prim.name == "name" and params.get("name") == KERNEL_OUTPUTS_NAME


class KernelUnavailableError(RuntimeError):
  """The requested attention kernel cannot run here; the message says how to get it."""


def check_kernel(kernel: str, name: str = "kernel") -> str:
  """``kernel`` if it is a ``core_attention`` kernel, else a ``UserError`` (a ValueError) naming
  it and the fix; ``name`` is the setting in the message (e.g. 'attention.kernel')."""
  if kernel in REMOVED_KERNELS:
    raise UserError(f"{name}={kernel!r} {REMOVED_KERNELS[kernel]}")
  if kernel not in KERNELS:
    raise UserError(f"unknown attention {name}={kernel!r}; choose one of {KERNELS}")
  return kernel


def default_kernel() -> str:
  """The kernel 'auto' runs: 'blockwise' when JAX's default platform is the CPU, else 'reference'
  (GPU runs name their kernel: 'flash3' or 'mosaic')."""
  return "blockwise" if jax.default_backend() == "cpu" else "reference"


def core_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                   cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                   kernel: str = "reference", softmax_scale: float | None = None,
                   return_lse: bool = False, block_sizes: bw.BlockSizes | None = None,
                   max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                   grid_levels: int = FLASH3_GRID_LEVELS, name_inputs: bool = True):
  """Causal (bottom-right) GQA attention of every CA-task in a fused batch.

  Args:
    q_TxHxD: packed queries [T, H, D] (bf16, fp16 or f32).
    k_UxKxD: packed keys [U, K, D]; H must be a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1], non-decreasing, within [0, T].
    cu_seqlens_k_N1: int32 [N + 1], non-decreasing, within [0, U].
    kernel: 'reference', 'blockwise', 'mosaic', 'flash3' or 'auto' (``default_kernel()``).
    softmax_scale: logit scale; default 1 / sqrt(D).
    return_lse: also return the natural-log log-sum-exp [T, H] (f32; -inf on rows seeing no key).
    block_sizes: 'blockwise' only: its tiles (``custom_ops.blockwise_attention.BlockSizes``).
    max_seqlen_q: 'flash3' only (ignored elsewhere): static upper bound on the query rows of any
      task (padding rows outside the tasks do not count). Default T (always safe). A task
      longer than the bound makes the output NaN.
    max_seqlen_k: 'flash3' only: the same bound for key rows. Default U. FlashAttention-3's
      backward launches ceil(max_seqlen_k / 128) blocks per task and head, so give tight bounds.
    grid_levels: 'flash3' only: launch shapes compiled per dimension (``flash3_grid_buckets``);
      each call runs the cheapest that holds its tasks. 1 = always the full table and bounds.
    name_inputs: tag q, k, v with ``checkpoint_name(KERNEL_INPUTS_NAME)``, so that remat
      policies can keep them for the backward (model.py 'save_attention'). False leaves them
      to be recomputed (CAD's 'resend' memory mode re-sends them).

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key), or (o_TxHxD, lse_TxH) if ``return_lse``.
  """
  if check_kernel(kernel) == "auto":
    kernel = default_kernel()
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  if kernel != "blockwise" and block_sizes is not None:
    raise ValueError(f"block_sizes={block_sizes!r} applies to kernel='blockwise' only; drop it "
                     f"for {kernel=}")
  if name_inputs:  # for remat policies that keep the kernel's residuals ('save_attention')
    q_TxHxD, k_UxKxD, v_UxKxD = (checkpoint_name(x, KERNEL_INPUTS_NAME)
                                 for x in (q_TxHxD, k_UxKxD, v_UxKxD))

  if kernel == "reference":
    o, lse = va.varlen_attention_reference(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1,
                                           cu_seqlens_k_N1, softmax_scale=softmax_scale)
  elif kernel == "blockwise":
    o, lse = bw.blockwise_attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                                    softmax_scale=softmax_scale, block_sizes=block_sizes)
  elif kernel == "mosaic":
    o, lse = _mosaic(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, softmax_scale)
  else:
    o, lse = _flash3(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                     softmax_scale=softmax_scale, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k, grid_levels=grid_levels)
  return (o, lse) if return_lse else o


def _mosaic(q, k, v, cu_q, cu_k, softmax_scale):
  if jax.default_backend() != "gpu":
    raise KernelUnavailableError(
        f"kernel='mosaic' (custom_ops/mosaic_attention.py) runs only on Hopper GPUs; JAX's "
        f"default platform is {jax.default_backend()!r}. Use kernel='blockwise' or 'reference' "
        "there")
  from custom_ops import mosaic_attention  # noqa: PLC0415  (imports Mosaic GPU)
  return mosaic_attention.mosaic_attention(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale)


# ------------------------------------------------------------------------------------------------
# flash3
# ------------------------------------------------------------------------------------------------


def import_flash3():
  """The FlashAttention-3 JAX bindings, or a KernelUnavailableError saying how to install them."""
  try:
    return importlib.import_module("flash_attn3_jax")
  except ImportError as e:  # also a missing CUDA runtime inside the extension
    raise KernelUnavailableError(
        f"kernel='flash3' needs the FlashAttention-3 JAX bindings: pip install "
        f"'{FLASH3_PIP_SPEC}' (Linux x86_64, CUDA >= 12.4, Hopper GPU; the project's optional "
        f"extra 'gpu'). Import failed with: {e!r}") from e


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
  levels = check_int("flash3 grid_levels", levels, 1)

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


def _flash3(q, k, v, cu_q, cu_k, *, softmax_scale, max_seqlen_q, max_seqlen_k,
            grid_levels=FLASH3_GRID_LEVELS):
  import_flash3()
  if jax.default_backend() != "gpu":
    raise KernelUnavailableError(
        f"kernel='flash3' runs only on CUDA GPUs (Hopper); JAX's default platform is "
        f"{jax.default_backend()!r}. Use kernel='blockwise' or 'reference' there")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"kernel='flash3' takes bf16 or fp16 inputs; got {q.dtype=}")
  head_dim = q.shape[2]
  if head_dim not in FLASH3_HEAD_DIMS:
    raise ValueError(
        f"kernel='flash3': the published {FLASH3_PIP_SPEC} wheel is built for head dims "
        f"{FLASH3_HEAD_DIMS}; got {head_dim=} (build flash-attn3-jax from source for others)")
  return flash3_masked(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        grid_levels=grid_levels, impl=_FA3_IMPL)


def flash3_masked(q, k, v, cu_q, cu_k, *, softmax_scale, max_seqlen_q, max_seqlen_k,
                   grid_levels, impl):
  """FA3 on the real tasks only; rows outside every task are masked to 0 (-inf LSE).

  FA3 leaves rows outside ``[cu[0], cu[-1])`` unwritten (O, LSE, dQ, dK, dV), so every one of
  them is selected away here (FA3 reads no padding row, so padding inputs need no cleaning). A
  task longer than ``max_seqlen_q`` / ``max_seqlen_k`` makes the whole output NaN (FA3 would
  silently visit only the first ``max_seqlen`` rows). ``impl`` is the pair of FA3 calls (the real
  bindings, or a CPU emulator of their contract in the tests).
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
  o, lse_HxT = _flash3_attention(q, k, v, cu_q, cu_k, bucket, (buckets, scale, impl))
  _, _, q_valid = va.rows_to_tasks(cu_q, num_q_rows)
  o = jnp.where(q_valid[:, None, None], o, jnp.zeros((), o.dtype))
  # A task longer than the caller's bounds would be cut short by FA3 without a word: make it NaN.
  o = jnp.where(fits, o, jnp.asarray(jnp.nan, o.dtype))
  lse_TxH = jnp.where(q_valid[:, None], lse_HxT.T, -jnp.inf)
  return o, lse_TxH


def _fa3_fwd(q, k, v, cu_q, cu_k, **config):
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415  (optional dependency)
  return fa3_varlen.flash_mha_varlen_fwd(q, k, v, cu_q, cu_k, None, is_causal=True, **config)


def _fa3_bwd(do, q, k, v, o, lse, cu_q, cu_k, **config):
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415
  return fa3_varlen.flash_mha_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, is_causal=True,
                                         **config)


_FA3_IMPL = (_fa3_fwd, _fa3_bwd)


def switch_or_call(index, fns, *operands):
  """``lax.switch(index, fns, *operands)``, or the one function called directly (no switch)."""
  return fns[0](*operands) if len(fns) == 1 else jax.lax.switch(index, fns, *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _flash3_attention(q, k, v, cu_q, cu_k, bucket, config):
  """FA3 causal varlen forward in the launch shape ``bucket`` picks: (o [T, H, D], lse [H, T])."""
  return _flash3_attention_fwd(q, k, v, cu_q, cu_k, bucket, config)[0]


def _flash3_attention_fwd(q, k, v, cu_q, cu_k, bucket, config):
  buckets, scale, (fwd, _) = config
  num_q_rows, num_heads, _ = q.shape
  # The forward runs the full shape (see flash3_grid_buckets); the backward switches on bucket.
  _, msq, msk = buckets[-1]
  o, lse_raw = fwd(q, k, v, cu_q, cu_k, max_seqlen_q=msq, max_seqlen_k=msk, softmax_scale=scale)
  lse = lse_raw.reshape(-1)[:num_heads * num_q_rows].reshape(num_heads, num_q_rows)
  # What remat policies keep (saves_kernel_outputs): O and the [H, T] LSE, not the raw buffer.
  o, lse = (checkpoint_name(x, KERNEL_OUTPUTS_NAME) for x in (o, lse))
  return (o, lse), (q, k, v, cu_q, cu_k, bucket, o, lse)


def _flash3_attention_bwd(config, res, cts):
  buckets, scale, (_, bwd) = config
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
                 softmax_scale=scale)
    return run

  dq, dk, dv = switch_or_call(bucket, [branch(*b) for b in buckets], do, q, k, v, o, lse_HxT, cu_q, cu_k)
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
