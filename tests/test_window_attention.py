"""Windowed and chunked attention (sliding-window and chunked layers): every CPU core-attention
kernel ('reference', 'blockwise', the packed ``local_attention``) against the float64 NumPy oracle
(``test_ops.oracle``) with the windowed mask (outputs, LSE and hand-written gradients) on fuzzed CA-task tables; the
FA3 adapter's windowed path on an emulator of the bindings; chunked layers as documents cut at
chunk boundaries; windowed plans (pairs, K/V rows and bytes against brute-force counts) and the
distca data plane on 8 fake devices with a window against the reference; the Mosaic and FA3
windowed kernels cross-lowered for CUDA.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_window_attention.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_ops import blockwise_attention as bw
from custom_ops import varlen_attention as va
from distca_jax import attention as attn_lib
from distca_jax import ops
from test_ops import oracle


def random_tasks(rng, num_tasks: int, max_q: int = 40, max_extra_k: int = 60):
  """A task table with empty tasks, tasks with fewer keys than queries, padding rows before,
  between (none: the contract packs tasks) and after the tasks."""
  lq = rng.integers(0, max_q, size=num_tasks)
  lk = np.maximum(lq + rng.integers(-5, max_extra_k, size=num_tasks), 0)
  lk[rng.random(num_tasks) < 0.1] = 0
  q0, k0 = int(rng.integers(0, 5)), int(rng.integers(0, 5))
  cu_q = np.concatenate([[q0], q0 + np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[k0], k0 + np.cumsum(lk)]).astype(np.int32)
  return cu_q, cu_k, int(cu_q[-1] + rng.integers(0, 9)), int(cu_k[-1] + rng.integers(0, 9))


KERNELS = {
    "reference": lambda q, k, v, cq, ck, w: ops.core_attention(
        q, k, v, cq, ck, kernel="reference", softmax_scale=0.3, return_lse=True, window=w),
    "blockwise": lambda q, k, v, cq, ck, w: ops.core_attention(
        q, k, v, cq, ck, kernel="blockwise", softmax_scale=0.3, return_lse=True, window=w,
        block_sizes=bw.BlockSizes(8, 16)),
    "blockwise_wide": lambda q, k, v, cq, ck, w: ops.core_attention(
        q, k, v, cq, ck, kernel="blockwise", softmax_scale=0.3, return_lse=True, window=w,
        block_sizes=bw.BlockSizes(16, 8)),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [1, 3, 8, 17, 50, 1000])
def test_windowed_kernels_equal_float64_oracle(kernel, window, seed):
  """Outputs, LSE and dQ/dK/dV of windowed CA-task batches (windows shorter and longer than the
  tasks) equal the float64 oracle on fuzzed tables."""
  rng = np.random.default_rng(seed)
  cu_q, cu_k, tq, tk = random_tasks(rng, int(rng.integers(1, 7)))
  h, kh, d = 4, 2, 16
  ks = jax.random.split(jax.random.key(seed), 5)
  q, do = jax.random.normal(ks[0], (tq, h, d)), jax.random.normal(ks[3], (tq, h, d))
  k, v = jax.random.normal(ks[1], (tk, kh, d)), jax.random.normal(ks[2], (tk, kh, d))
  dlse = jax.random.normal(ks[4], (tq, h))
  fn = KERNELS[kernel]
  cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)

  def loss(q, k, v):
    o, lse = fn(q, k, v, cq, ck, window)
    return jnp.sum(o * do) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse), (o, lse)

  (dq, dk, dv), (o, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  _, _, q_valid = va.rows_to_tasks(cq, tq)
  wo, wlse, wdq, wdk, wdv = oracle(q, k, v, cu_q, cu_k, 0.3, do, dlse, window=window)
  np.testing.assert_allclose(np.asarray(o), wo, rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(wlse))
  fin = np.isfinite(wlse)
  np.testing.assert_allclose(np.asarray(lse)[fin], wlse[fin], rtol=2e-5, atol=2e-5)
  for got, w in ((dq, wdq), (dk, wdk), (dv, wdv)):
    np.testing.assert_allclose(np.asarray(got), w, rtol=2e-4, atol=2e-4)
  assert bool(jnp.all(jnp.where(q_valid[:, None, None], True, o == 0)))


def test_window_zero_is_full_causal_bit_for_bit(seed):
  """window=0 (the default) runs exactly today's kernels: same outputs bit for bit."""
  rng = np.random.default_rng(seed)
  cu_q, cu_k, tq, tk = random_tasks(rng, 4)
  ks = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(ks[0], (tq, 4, 16))
  k, v = jax.random.normal(ks[1], (tk, 2, 16)), jax.random.normal(ks[2], (tk, 2, 16))
  for kernel in ("reference", "blockwise"):
    a = ops.core_attention(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), kernel=kernel)
    b = ops.core_attention(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), kernel=kernel,
                           window=0)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("bad", [-1, 2.5, True, "8"])
def test_bad_window_is_a_one_line_error(bad):
  q = jnp.zeros((8, 2, 16))
  cu = jnp.asarray([0, 8], jnp.int32)
  with pytest.raises(ValueError, match="window="):
    ops.core_attention(q, q, q, cu, cu, kernel="reference", window=bad)
