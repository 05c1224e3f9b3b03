"""The CA-task attention contract every kernel implements: input checks and the plain-jnp reference.

Contract (the same as FlashAttention's varlen call with separate ``cu_seqlens_q``/``cu_seqlens_k``):
task ``i`` owns query rows ``[cu_q[i], cu_q[i+1])`` of the packed query buffer and key/value rows
``[cu_k[i], cu_k[i+1])`` of the packed key/value buffers. Inside a task the causal mask is aligned
bottom-right: local query row ``r`` of a task with ``lq`` queries and ``lk`` keys sees local keys
``j <= r + (lk - lq)`` (for ``lq == lk`` this is ordinary causal attention; the last query row
always sees every key). With a sliding window of ``w`` keys (``window=w``; 0 = full causal),
row ``r`` also sees only keys ``j >= r + (lk - lq) - w + 1``: the ``w`` keys ending at its
diagonal (a window layer's task reads only its keys ``[max(0, a - w + 1), b)``, so the
bottom-right alignment keeps document positions). Query heads are a multiple of key/value
heads (GQA: query head ``h`` reads KV head ``h // (H // K)``). Inputs are bf16, fp16 or f32;
all accumulation is f32.

Rows that see no key (padding rows outside every task, rows of empty tasks, and the first rows of
a task with ``lq > lk``) get output 0 and log-sum-exp ``-inf``; their gradients are 0. Key rows outside
every task get dK = dV = 0. Nothing is NaN.

Preconditions that cannot be checked on traced values (checked when the tables are concrete):
``cu_seqlens`` are non-decreasing, start at >= 0 and end at <= the buffer length.

Letters in names: T query tokens, U key/value tokens, H query heads, K key/value heads, D head dim,
N tasks (``N1`` = N + 1).

This module holds what the kernels share: ``validate_inputs`` (the contract's checks, raising
ValueError naming the bad value and the fix), ``rows_to_tasks`` (each buffer row's task) and
``varlen_attention_reference`` (dense masked attention in plain jnp: the oracle of the kernels'
tests and the 'reference' kernel of ``distca_jax.ops.core_attention``). The kernels:
``custom_ops/blockwise_attention.py`` (jnp tiles, the CPU kernel) and
``custom_ops/mosaic_attention.py`` (Pallas Mosaic GPU, Hopper).
"""

from __future__ import annotations

import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------


def validate_inputs(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                    cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array) -> None:
  """Raises ValueError naming the bad value and the fix; checks values only when concrete."""
  q, k, v = q_TxHxD, k_UxKxD, v_UxKxD
  if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
    raise ValueError(
        f"q, k, v must be [tokens, heads, head_dim]; got {q.shape=}, {k.shape=}, {v.shape=}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got {k.shape=}, {v.shape=}")
  if q.shape[2] != k.shape[2]:
    raise ValueError(f"q and k must share head_dim; got {q.shape=}, {k.shape=}")
  num_q_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
  if num_kv_heads == 0 or num_q_heads % num_kv_heads:
    raise ValueError(
        f"query heads must be a positive multiple of kv heads (GQA); got {num_q_heads=}, "
        f"{num_kv_heads=}")
  if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
    raise ValueError(
        f"{head_dim=} is outside the supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f"q, k, v must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
  if q.dtype not in SUPPORTED_DTYPES:
    raise ValueError(
        f"{q.dtype=} is not supported; use one of {[str(d) for d in SUPPORTED_DTYPES]}")
  for name, cu in (("cu_seqlens_q", cu_seqlens_q_N1), ("cu_seqlens_k", cu_seqlens_k_N1)):
    if cu.ndim != 1 or cu.shape[0] < 2:
      raise ValueError(
          f"{name} must be 1-D [tasks + 1] with tasks >= 1; got {name}.shape={cu.shape}")
    if cu.dtype != jnp.int32:
      raise ValueError(
          f"{name} must be int32; got {name}.dtype={cu.dtype} (cast with .astype(int32))")
  if cu_seqlens_q_N1.shape != cu_seqlens_k_N1.shape:
    raise ValueError(
        f"cu_seqlens_q and cu_seqlens_k must have one entry per task boundary each; got "
        f"{cu_seqlens_q_N1.shape=}, {cu_seqlens_k_N1.shape=}")
  for name, cu, total in (("cu_seqlens_q", cu_seqlens_q_N1, q.shape[0]),
                          ("cu_seqlens_k", cu_seqlens_k_N1, k.shape[0])):
    if isinstance(cu, jax.core.Tracer):
      continue  # values unknown at trace time; the module docstring states the precondition
    cu_np = np.asarray(cu)
    if cu_np[0] < 0 or (np.diff(cu_np) < 0).any() or cu_np[-1] > total:
      raise ValueError(
          f"{name}={cu_np.tolist()} must be non-decreasing within [0, {total}] (the buffer length)")


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------


def check_window(window) -> int:
  """``window`` as an int >= 0 (0 = full causal); raises a one-line ValueError otherwise."""
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
    raise ValueError(f"window={window!r} must be an int >= 0 (keys per query row ending at its "
                     "diagonal; 0 = full causal attention)")
  return int(window)


def rows_to_tasks(cu_N1: jax.Array, total_rows: int):
  """Task id (clamped), local index and validity ([T] each) of every row of a packed buffer."""
  t = jnp.arange(total_rows, dtype=jnp.int32)
  task = jnp.searchsorted(cu_N1[1:], t, side="right").astype(jnp.int32)
  valid = (t >= cu_N1[0]) & (t < cu_N1[-1])
  task = jnp.minimum(task, cu_N1.shape[0] - 2)
  return task, t - cu_N1[task], valid


def varlen_attention_reference(q_TxHxD: jax.Array, k_UxKxD: jax.Array, v_UxKxD: jax.Array,
                               cu_seqlens_q_N1: jax.Array, cu_seqlens_k_N1: jax.Array, *,
                               softmax_scale: float | None = None,
                               window: int = 0) -> tuple[jax.Array, jax.Array]:
  """Plain-jnp dense masked attention with the contract of the module docstring (``window``:
  keys per query row ending at its diagonal, 0 = full causal).

  Materializes [H, T, U] logits in f32: a test oracle and fallback for small buffers only.
  """
  validate_inputs(q_TxHxD, k_UxKxD, v_UxKxD, cu_seqlens_q_N1, cu_seqlens_k_N1)
  window = check_window(window)
  num_q_rows, num_heads, head_dim = q_TxHxD.shape
  num_k_rows, num_kv_heads, _ = k_UxKxD.shape
  group = num_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
  cu_q, cu_k = cu_seqlens_q_N1, cu_seqlens_k_N1
  lq_N = cu_q[1:] - cu_q[:-1]
  lk_N = cu_k[1:] - cu_k[:-1]
  q_task, q_local, q_valid = rows_to_tasks(cu_q, num_q_rows)
  k_task, k_local, k_valid = rows_to_tasks(cu_k, num_k_rows)
  limit_T = q_local + (lk_N - lq_N)[q_task]
  mask_TxU = (q_valid[:, None] & k_valid[None, :] & (q_task[:, None] == k_task[None, :])
              & (k_local[None, :] <= limit_T[:, None]))
  if window:
    mask_TxU &= k_local[None, :] > limit_T[:, None] - window

  # Padding rows are zeroed first so that whatever they hold (even NaN) cannot leak through 0 * x.
  q = jnp.where(q_valid[:, None, None], q_TxHxD.astype(jnp.float32), 0.0)
  q = q.reshape(num_q_rows, num_kv_heads, group, head_dim)
  k = jnp.where(k_valid[:, None, None], k_UxKxD.astype(jnp.float32), 0.0)
  v = jnp.where(k_valid[:, None, None], v_UxKxD.astype(jnp.float32), 0.0)
  hi = lax.Precision.HIGHEST
  s = jnp.einsum("tkgd,ukd->kgtu", q, k, precision=hi) * scale
  mask = mask_TxU[None, None]
  m = lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(mask, jnp.exp(jnp.where(mask, s - m, 0.0)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  seen = l > 0.0
  l_safe = jnp.where(seen, l, 1.0)
  o = jnp.einsum("kgtu,ukd->tkgd", p / l_safe, v, precision=hi)
  lse = jnp.where(seen, m + jnp.log(l_safe), -jnp.inf)[..., 0]  # [K, G, T]
  o_TxHxD = o.reshape(num_q_rows, num_heads, head_dim).astype(q_TxHxD.dtype)
  lse_TxH = lse.reshape(num_heads, num_q_rows).T
  return o_TxHxD, lse_TxH
