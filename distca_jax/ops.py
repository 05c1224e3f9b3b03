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
  'flash3'     FlashAttention-3 through the ``flash-attn3-jax`` package, adapted to the
               task contract in ``custom_ops/flash3_attention.py`` (Hopper GPUs, bf16/fp16,
               head dim 128 in the published wheel): each call runs the cheapest of several
               compiled launch shapes that holds its task table; rows outside the tasks are
               masked, not computed. The bindings are imported when a call is traced.

'auto' picks ``default_kernel()`` when traced: 'blockwise' on CPU, 'reference' elsewhere (GPU
configs name 'flash3' or 'mosaic'). It is the configs' default; an explicit name is always run
as named. An unavailable kernel raises ``KernelUnavailableError`` saying how to get it;
nothing falls back. ``check_kernel`` names a bad kernel and the fix.
"""

from __future__ import annotations


import jax
from jax.ad_checkpoint import checkpoint_name

import custom_ops
from custom_ops import blockwise_attention as bw
from custom_ops import flash3_attention as fa3
from custom_ops import varlen_attention as va
from distca_jax.errors import UserError

KERNELS = ("reference", "blockwise", "mosaic", "flash3", "auto")
# Names that are not kernels any more, each with what to use instead (``check_kernel``).
REMOVED_KERNELS = {"pallas": "(the Triton kernel) was removed; use 'mosaic' (GPU) or "
                              "'blockwise' / 'reference' (CPU)"}


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


KernelUnavailableError = custom_ops.KernelUnavailableError  # a kernel that cannot run here


def check_kernel(kernel: str, name: str = "kernel") -> str:
  """``kernel`` if it is a ``core_attention`` kernel, else a ``UserError`` (a ValueError) naming
  it and the fix; ``name`` is the setting in the message (e.g. 'attention.kernel')."""
  if kernel in REMOVED_KERNELS:
    raise UserError(f"{name}={kernel!r} {REMOVED_KERNELS[kernel]}")
  if kernel not in KERNELS:
    raise UserError(f"unknown attention {name}={kernel!r}; choose one of {KERNELS}")
  return kernel


def check_kernel_runs(kernel: str, name: str = "attention.kernel") -> str:
  """``check_kernel``, then a ``UserError`` naming ``kernel`` and the fix when it cannot run on
  JAX's default platform ('mosaic' and 'flash3' off a GPU, 'flash3' without its bindings).
  Called before a run builds its step, so a GPU config started on a CPU host stops with one line
  instead of failing while the step is traced."""
  check_kernel(kernel, name)
  try:
    if kernel == "mosaic":
      _check_mosaic_available()
    elif kernel == "flash3":
      fa3.check_available()
  except KernelUnavailableError as e:
    raise UserError(f"{name}={kernel!r} cannot run here: {e}; on a CPU set {name}='blockwise' "
                    "(the CPU kernel, same shapes) or 'auto'") from e
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
                   grid_levels: int = fa3.FLASH3_GRID_LEVELS, name_inputs: bool = True,
                   window: int = 0):
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
    grid_levels: 'flash3' only: launch shapes compiled per dimension (``fa3.flash3_grid_buckets``);
      each call runs the cheapest that holds its tasks. 1 = always the full table and bounds.
    name_inputs: tag q, k, v with ``checkpoint_name(KERNEL_INPUTS_NAME)``, so that remat
      policies can keep them for the backward (model.py 'save_attention'). False leaves them
      to be recomputed (CAD's 'resend' memory mode re-sends them).
    window: sliding window (static): local query row r of a task with lq queries and lk keys
      sees keys ``r + lk - lq - window < j <= r + lk - lq`` (``custom_ops.varlen_attention``);
      0 = full causal. A window layer's task ``[a, b)`` reads keys ``[max(0, a - window + 1),
      b)`` (``plan.k_starts``).

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key), or (o_TxHxD, lse_TxH) if ``return_lse``.
  """
  if check_kernel(kernel) == "auto":
    kernel = default_kernel()
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  window = va.check_window(window)
  if kernel != "blockwise" and block_sizes is not None:
    raise ValueError(f"block_sizes={block_sizes!r} applies to kernel='blockwise' only; drop it "
                     f"for {kernel=}")
  if name_inputs:  # for remat policies that keep the kernel's residuals ('save_attention')
    q_TxHxD, k_UxKxD, v_UxKxD = (checkpoint_name(x, KERNEL_INPUTS_NAME)
                                 for x in (q_TxHxD, k_UxKxD, v_UxKxD))

  if kernel == "reference":
    o, lse = va.varlen_attention_reference(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1,
                                           cu_seqlens_k_N1, softmax_scale=softmax_scale,
                                           window=window)
  elif kernel == "blockwise":
    o, lse = bw.blockwise_attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                                    softmax_scale=softmax_scale, block_sizes=block_sizes,
                                    window=window)
  elif kernel == "mosaic":
    o, lse = _mosaic(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1, softmax_scale,
                     window)
  else:
    o, lse = fa3.flash3_attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                                    softmax_scale=softmax_scale, max_seqlen_q=max_seqlen_q,
                                    max_seqlen_k=max_seqlen_k, grid_levels=grid_levels,
                                    window=window)
  return (o, lse) if return_lse else o


def _check_mosaic_available() -> None:
  if jax.default_backend() != "gpu":
    raise KernelUnavailableError(
        f"kernel='mosaic' (custom_ops/mosaic_attention.py) runs only on Hopper GPUs; JAX's "
        f"default platform is {jax.default_backend()!r}. Use kernel='blockwise' or 'reference' "
        "there")


def _mosaic(q, k, v, cu_q, cu_k, softmax_scale, window=0):
  _check_mosaic_available()
  from custom_ops import mosaic_attention  # noqa: PLC0415  (imports Mosaic GPU)
  return mosaic_attention.mosaic_attention(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale,
                                           window=window)
