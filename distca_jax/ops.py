"""One dispatch point for core attention over a fused batch of CA-tasks, and its exact FLOP count.

Task i of a batch owns query rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of the packed query buffer
and key/value rows [cu_seqlens_k[i], cu_seqlens_k[i+1]) of the packed key/value buffers; the
causal mask is aligned bottom-right inside each task (see ``custom_ops/varlen_attention.py``).

Backends:
  'reference'  plain jnp, dense [H, T, U] logits: tests and small buffers only.
  'pallas'     our Pallas kernel (Triton backend); interpret mode on CPU.
  'flash3'     FlashAttention-3 through the ``flash-attn3-jax`` package (Hopper GPUs, bf16/fp16,
               head dim 128 in the published wheel).

An unavailable backend raises ``BackendUnavailableError`` saying how to get it; nothing falls back.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from custom_ops import varlen_attention as va
from distca_jax import scheduler

BACKENDS = ("reference", "pallas", "flash3")
FLASH3_PIP_SPEC = "flash-attn3-jax==0.2.3"
FLASH3_HEAD_DIMS = (128,)  # the head dims the published wheel was built for
# Kernel backward cost over forward cost (the backward recomputes QK^T): fwd+bwd = 3.5x forward.
BACKWARD_FLOPS_RATIO = scheduler.BWD_FWD_RATIO  # one place holds it: the scheduler


class BackendUnavailableError(RuntimeError):
  """The requested attention backend cannot run here; the message says how to get it."""


def core_attention(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                   cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                   backend: str = "reference", softmax_scale: float | None = None,
                   return_lse: bool = False, interpret: bool | None = None,
                   block_sizes: va.BlockSizes | None = None, max_seqlen_q: int | None = None,
                   max_seqlen_k: int | None = None):
  """Causal (bottom-right) GQA attention of every CA-task in a fused batch.

  Args:
    q_TxHxD: packed queries [T, H, D] (bf16, fp16 or f32).
    k_UxKxD: packed keys [U, K, D]; H must be a multiple of K.
    v_UxKxD: packed values [U, K, D].
    cu_seqlens_q_N1: int32 [N + 1], non-decreasing, within [0, T].
    cu_seqlens_k_N1: int32 [N + 1], non-decreasing, within [0, U].
    backend: 'reference', 'pallas' or 'flash3'.
    softmax_scale: logit scale; default 1 / sqrt(D).
    return_lse: also return the natural-log log-sum-exp [T, H] (f32; -inf on rows seeing no key).
    interpret: 'pallas' only; run in the Pallas interpreter. Default: True iff the default
      backend is CPU.
    block_sizes: 'pallas' only; kernel tiles (``custom_ops.BlockSizes``).
    max_seqlen_q: 'flash3' only (ignored elsewhere): static upper bound on the query rows of any
      task and of the padding before the first and after the last task. Default T (always safe).
    max_seqlen_k: 'flash3' only: the same bound for key rows. Default U. FlashAttention-3's
      backward launches ceil(max_seqlen_k / 128) blocks per task and head, so give tight bounds.

  Returns:
    o_TxHxD (q dtype; 0 on rows that see no key), or (o_TxHxD, lse_TxH) if ``return_lse``.
  """
  if backend not in BACKENDS:
    raise ValueError(f"unknown attention {backend=}; choose one of {BACKENDS}")
  va.validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  if backend != "pallas" and (interpret is not None or block_sizes is not None):
    raise ValueError(
        f"interpret={interpret!r} and block_sizes={block_sizes!r} apply to backend='pallas' only; "
        f"drop them for {backend=}")

  if backend == "reference":
    o, lse = va.varlen_attention_reference(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1,
                                           cu_seqlens_k_N1, softmax_scale=softmax_scale)
  elif backend == "pallas":
    if interpret is None:
      interpret = jax.default_backend() == "cpu"
    if not interpret and jax.default_backend() != "gpu":
      raise BackendUnavailableError(
          f"backend='pallas' compiles only for CUDA GPUs (default backend is "
          f"{jax.default_backend()!r}); pass interpret=True to run it in the Pallas interpreter")
    o, lse = va.varlen_attention(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                                 softmax_scale=softmax_scale, block_sizes=block_sizes,
                                 interpret=interpret)
  else:
    o, lse = _flash3(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1,
                     softmax_scale=softmax_scale, max_seqlen_q=max_seqlen_q,
                     max_seqlen_k=max_seqlen_k)
  return (o, lse) if return_lse else o


# ------------------------------------------------------------------------------------------------
# flash3
# ------------------------------------------------------------------------------------------------


def _import_flash3():
  try:
    return importlib.import_module("flash_attn3_jax")
  except ImportError as e:  # also a missing CUDA runtime inside the extension
    raise BackendUnavailableError(
        f"backend='flash3' needs the FlashAttention-3 JAX bindings: pip install "
        f"'{FLASH3_PIP_SPEC}' (Linux x86_64, CUDA >= 12.4, Hopper GPU; the project's optional "
        f"extra 'gpu'). Import failed with: {e!r}") from e


def _flash3(q, k, v, cu_q, cu_k, *, softmax_scale, max_seqlen_q, max_seqlen_k):
  _import_flash3()
  if jax.default_backend() != "gpu":
    raise BackendUnavailableError(
        f"backend='flash3' runs only on CUDA GPUs (Hopper); the default backend is "
        f"{jax.default_backend()!r}. Use backend='pallas' (interpret mode on CPU) or 'reference'")
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"backend='flash3' takes bf16 or fp16 inputs; got {q.dtype=}")
  head_dim = q.shape[2]
  if head_dim not in FLASH3_HEAD_DIMS:
    raise ValueError(
        f"backend='flash3': the published {FLASH3_PIP_SPEC} wheel is built for head dims "
        f"{FLASH3_HEAD_DIMS}; got {head_dim=} (build flash-attn3-jax from source for others)")
  num_q_rows, num_heads, _ = q.shape
  num_k_rows = k.shape[0]
  cu_q = cu_q.astype(jnp.int32)
  cu_k = cu_k.astype(jnp.int32)
  msq = max(int(max_seqlen_q or num_q_rows), 1)
  msk = max(int(max_seqlen_k or num_k_rows), 1)
  cu_q_ext, cu_k_ext = flash3_task_table(cu_q, cu_k, num_q_rows, num_k_rows, msq, msk)
  num_ext = cu_q_ext.shape[0] - 1
  # The bindings size the LSE buffer [tasks, H, max_seqlen_q] while FA3 writes it as [H, T].
  msq = max(msq, -(-num_q_rows // num_ext))
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
  _, _, q_valid = va.rows_to_tasks(cu_q, num_q_rows)
  # Zeroing padding query rows on the way in makes their dQ exactly 0 whatever FA3 leaves there.
  q = jnp.where(q_valid[:, None, None], q, jnp.zeros((), q.dtype))
  o, lse_raw = _flash3_attention(q, k, v, cu_q_ext, cu_k_ext,
                                 (("max_seqlen_q", msq), ("max_seqlen_k", msk),
                                  ("softmax_scale", scale)))
  o = jnp.where(q_valid[:, None, None], o, jnp.zeros((), o.dtype))
  lse_HxT = lse_raw.reshape(-1)[: num_heads * num_q_rows].reshape(num_heads, num_q_rows)
  lse_TxH = jnp.where(q_valid[:, None], lse_HxT.T, -jnp.inf)
  return o, lse_TxH


def _pad_chunks(lo, hi, n: int, width: int):
  """``n + 1`` boundaries cutting rows ``[lo, hi)`` into ``n`` pieces of at most ``width``."""
  return jnp.minimum(lo + width * jnp.arange(n + 1, dtype=jnp.int32), hi)


def flash3_task_table(cu_q_N1, cu_k_N1, num_q_rows: int, num_k_rows: int, max_seqlen_q: int,
                      max_seqlen_k: int):
  """The task table FlashAttention-3 is called with: the tasks plus padding pseudo-tasks.

  Rows outside ``[cu_q[0], cu_q[-1])`` (queries) and ``[cu_k[0], cu_k[-1])`` (keys) become
  pseudo-tasks (queries without keys, keys without queries) so that FA3 writes zeros there (O,
  dQ, dK, dV) instead of leaving them unwritten. FA3 only visits ``max_seqlen`` rows of any task,
  so every pseudo-task is cut to at most ``max_seqlen_q`` query and ``max_seqlen_k`` key rows:
  callers can then pass the bound of the real tasks (e.g. the row length), however much padding
  the buffers hold, and FA3's grid (blocks per task x ceil(max_seqlen / 128)) stays small.

  Args:
    cu_q_N1, cu_k_N1: int32 [N + 1] task boundaries (the caller's).
    num_q_rows, num_k_rows: buffer rows (static).
    max_seqlen_q, max_seqlen_k: static bounds on the real tasks' query / key rows.

  Returns:
    (cu_q_ext, cu_k_ext): int32 [N + 1 + 2 (nq + nk)], nq = ceil(num_q_rows / max_seqlen_q) and
    nk = ceil(num_k_rows / max_seqlen_k): leading pieces, the tasks, trailing query pieces (no
    keys), trailing key pieces (no queries); empty pieces are zero-length tasks.
  """
  nq = -(-int(num_q_rows) // int(max_seqlen_q))
  nk = -(-int(num_k_rows) // int(max_seqlen_k))
  zero = jnp.zeros((), jnp.int32)
  q0, qn, k0, kn = cu_q_N1[0], cu_q_N1[-1], cu_k_N1[0], cu_k_N1[-1]
  tq, tk = jnp.int32(num_q_rows), jnp.int32(num_k_rows)
  # Leading: nq query-only pieces of [0, q0), then nk key-only pieces of [0, k0).
  lead_q = jnp.concatenate([_pad_chunks(zero, q0, nq, max_seqlen_q), jnp.full((nk,), q0)])
  lead_k = jnp.concatenate([jnp.zeros((nq + 1,), jnp.int32), _pad_chunks(zero, k0, nk, max_seqlen_k)[1:]])
  # Trailing: query-only pieces of [qn, T), then key-only pieces of [kn, U).
  tail_q = jnp.concatenate([_pad_chunks(qn, tq, nq, max_seqlen_q)[1:], jnp.full((nk,), tq)])
  tail_k = jnp.concatenate([jnp.full((nq,), kn), _pad_chunks(kn, tk, nk, max_seqlen_k)[1:]])
  cu_q = jnp.concatenate([lead_q, cu_q_N1[1:], tail_q]).astype(jnp.int32)
  cu_k = jnp.concatenate([lead_k, cu_k_N1[1:], tail_k]).astype(jnp.int32)
  return cu_q, cu_k


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash3_attention(q, k, v, cu_q, cu_k, config):
  """FA3 varlen causal forward: (o [T, H, D], raw lse); backward through FA3's kernels."""
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415  (optional dependency)
  return fa3_varlen.flash_mha_varlen_fwd(q, k, v, cu_q, cu_k, None, is_causal=True, **dict(config))


def _flash3_attention_fwd(q, k, v, cu_q, cu_k, config):
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415
  o, lse = fa3_varlen.flash_mha_varlen_fwd(q, k, v, cu_q, cu_k, None, is_causal=True,
                                           **dict(config))
  return (o, lse), (q, k, v, cu_q, cu_k, o, lse)


def _flash3_attention_bwd(config, res, cts):
  from flash_attn3_jax import varlen as fa3_varlen  # noqa: PLC0415
  q, k, v, cu_q, cu_k, o, lse = res
  do, dlse = cts
  if not isinstance(dlse, jax.custom_derivatives.SymbolicZero):
    raise NotImplementedError(
        "backend='flash3' cannot differentiate through the log-sum-exp (FA3's backward takes no "
        "dLSE); use backend='pallas' or 'reference' when the loss depends on lse")
  if isinstance(do, jax.custom_derivatives.SymbolicZero):
    do = jnp.zeros(o.shape, o.dtype)
  dq, dk, dv = fa3_varlen.flash_mha_varlen_bwd(do, q, k, v, o, lse, cu_q, cu_k, is_causal=True,
                                               **dict(config))
  return dq, dk, dv, None, None


def _flash3_attention_fwd_symbolic(q, k, v, cu_q, cu_k, config):
  # symbolic_zeros=True wraps each primal; unwrap them.
  return _flash3_attention_fwd(q.value, k.value, v.value, cu_q.value, cu_k.value, config)


_flash3_attention.defvjp(_flash3_attention_fwd_symbolic, _flash3_attention_bwd,
                         symbolic_zeros=True)


# ------------------------------------------------------------------------------------------------
# Exact cost
# ------------------------------------------------------------------------------------------------


def attention_pairs(cu_seqlens_q_N1: Sequence[int] | np.ndarray,
                    cu_seqlens_k_N1: Sequence[int] | np.ndarray) -> int:
  """Exact count of (query, key) pairs the bottom-right causal mask keeps, summed over tasks.

  A task with lq queries and lk keys: local row r sees clip(r + 1 + lk - lq, 0, lk) keys; for
  lq <= lk this is lq * (lk - lq) + lq * (lq + 1) / 2 (the P(a, b) of DESIGN_NOTES section 1).
  """
  cu_q = np.asarray(cu_seqlens_q_N1, dtype=np.int64)
  cu_k = np.asarray(cu_seqlens_k_N1, dtype=np.int64)
  if cu_q.shape != cu_k.shape or cu_q.ndim != 1:
    raise ValueError(f"cu_seqlens must be 1-D of equal shape; got {cu_q.shape=}, {cu_k.shape=}")
  total = 0
  for lq, lk in zip(np.diff(cu_q).tolist(), np.diff(cu_k).tolist()):
    if lq <= 0 or lk <= 0:
      continue
    off = lk - lq
    # Rows r with r + 1 + off in [1, lk]: they see r + 1 + off keys; rows before see none.
    r_lo = max(0, -off)
    n = lq - r_lo
    first = r_lo + 1 + off
    total += n * first + n * (n - 1) // 2
  return int(total)


def core_attention_flops(cu_seqlens_q_N1: Sequence[int] | np.ndarray,
                         cu_seqlens_k_N1: Sequence[int] | np.ndarray, *, num_q_heads: int,
                         head_dim: int, include_backward: bool = False) -> int:
  """Exact attention FLOPs of a task table: forward 4 * H * D * pairs (QK^T and PV).

  With ``include_backward`` the kernel-throughput convention adds ``BACKWARD_FLOPS_RATIO`` x
  forward (fwd + bwd = 3.5x forward). Query heads count, not KV heads (GQA saves bytes only).
  """
  fwd = 4 * int(num_q_heads) * int(head_dim) * attention_pairs(cu_seqlens_q_N1, cu_seqlens_k_N1)
  if not include_backward:
    return fwd
  return int(round(fwd * (1.0 + BACKWARD_FLOPS_RATIO)))
