"""Sliding-window core attention on one Hopper GPU: FlashAttention-3 ('flash3', FA3's
``window_size``) and the Mosaic GPU kernels (fused and two-kernel backward) against the
float64 NumPy oracle of the windowed mask (``test_ops.oracle``): outputs, LSE (Mosaic) and
dQ / dK / dV on random CA-task tables whose tasks carry only their windows' keys (key start > 0),
windows smaller and larger than the tasks and the kernels' tiles; plus the distca data plane
with a window plan on the GPU (one server). Skipped off a Hopper GPU; the CPU checks of the same
paths are tests/test_window_attention.py.

Run (on an H100/H200):
  JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/test_window_gpu.py
"""

from __future__ import annotations

import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import ops
from test_ops import oracle

ON_HOPPER = jax.default_backend() == "gpu" and any(
    name in jax.devices()[0].device_kind for name in ("H100", "H200", "H800", "H20"))
HAS_FLASH3 = importlib.util.find_spec("flash_attn3_jax") is not None
DATA_PLANE_KERNELS = ["mosaic"] + (["flash3"] if HAS_FLASH3 else [])
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (H100/H200); default "
                                f"backend here is {jax.default_backend()!r}")


def _window_tasks(rng, num_tasks: int, max_q: int, max_doc: int, window: int):
  """A window layer's task table: task i is the query shard [a, b) of a document, with its keys
  [max(0, a - window + 1), b) (lq queries, lq + min(a, window - 1) keys)."""
  lq = rng.integers(1, max_q + 1, size=num_tasks)
  a = rng.integers(0, max_doc, size=num_tasks)
  lk = lq + np.minimum(a, window - 1)
  lq[rng.random(num_tasks) < 0.1] = 0  # empty tasks (keys and no queries: dK = dV = 0)
  cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
  return cu_q, cu_k


def _rel(x, ref):
  """Relative error, against at least 1e-3 per element (window 1: each row sees only itself, so
  P = 1 and dQ, dK are zero up to rounding)."""
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-3 * np.sqrt(ref.size)))


CASES = [  # (kernel, window, tasks, longest shard, H, K, D)
    ("mosaic", 1, 6, 300, 4, 1, 128), ("mosaic", 128, 8, 700, 8, 2, 128),
    ("mosaic", 200, 5, 1500, 4, 4, 64), ("mosaic", 1024, 6, 900, 8, 2, 128),
    ("mosaic", 4096, 3, 3000, 4, 1, 128), ("mosaic:two-kernel", 128, 6, 700, 8, 2, 128),
    ("mosaic:two-kernel", 1000, 5, 1200, 4, 1, 64),
    ("flash3", 1, 6, 300, 4, 1, 128), ("flash3", 128, 8, 700, 8, 2, 128),
    ("flash3", 1024, 6, 900, 8, 2, 128), ("flash3", 4096, 3, 3000, 4, 1, 128),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-w{c[1]}-H{c[4]}K{c[5]}D{c[6]}")
def test_windowed_kernel_matches_float64_oracle(case, seed):
  kernel, window, num_tasks, max_q, num_heads, num_kv_heads, head_dim = case
  if kernel == "flash3" and not HAS_FLASH3:
    pytest.skip("flash_attn3_jax is not installed (the project's 'gpu' extra)")
  rng = np.random.default_rng(seed)
  cu_q, cu_k = _window_tasks(rng, num_tasks, max_q, 4 * max_q, window)
  total_q, total_k = int(cu_q[-1]) + 37, int(cu_k[-1]) + 11
  q = rng.standard_normal((total_q, num_heads, head_dim)).astype(np.float32)
  k = rng.standard_normal((total_k, num_kv_heads, head_dim)).astype(np.float32)
  v = rng.standard_normal((total_k, num_kv_heads, head_dim)).astype(np.float32)
  do = rng.standard_normal((total_q, num_heads, head_dim)).astype(np.float32)
  dt = jnp.bfloat16
  qb, kb, vb, dob = (jnp.asarray(x, dt) for x in (q, k, v, do))
  # The oracle reads the same bf16-rounded values.
  q, k, v, do = (np.asarray(x, np.float32) for x in (qb, kb, vb, dob))
  scale = head_dim ** -0.5
  cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
  if kernel.startswith("mosaic"):
    from custom_ops import mosaic_attention as ma  # pylint: disable=import-outside-toplevel
    preset = dict(fused_bwd=False) if kernel.endswith("two-kernel") else {}
    fn = functools.partial(ma.mosaic_attention, block_sizes=ma.BlockSizes(**preset),
                           window=window, softmax_scale=scale)
  else:
    fn = functools.partial(ops.core_attention, kernel="flash3", return_lse=True, window=window,
                           softmax_scale=scale, max_seqlen_q=int(np.diff(cu_q).max()),
                           max_seqlen_k=int(np.diff(cu_k).max()))

  @jax.jit
  def run(q, k, v, do):
    # The loss reads O only: LSE's cotangent stays a symbolic zero (FA3's backward takes no dLSE).
    o, lse = fn(q, k, v, cq, ck)
    _, vjp_o = jax.vjp(lambda q, k, v: fn(q, k, v, cq, ck)[0], q, k, v)
    return o, lse, vjp_o(do)

  o, lse, (dq, dk, dv) = run(qb, kb, vb, dob)
  want = oracle(q, k, v, cu_q, cu_k, scale, do, np.zeros((total_q, num_heads)), window=window)
  errs = dict(o=_rel(o, want[0]), dq=_rel(dq, want[2]), dk=_rel(dk, want[3]),
              dv=_rel(dv, want[4]))
  print(f"{case=} {seed=} rel errors {errs}")
  for name, x in (("o", o), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.isfinite(np.asarray(x, np.float32)).all(), f"{case=}: {name} not finite"
  rows = np.zeros(total_q, bool)
  rows[cu_q[0]:cu_q[-1]] = True
  lse = np.asarray(lse)
  fin = np.isfinite(want[1]) & rows[:, None]
  np.testing.assert_array_equal(np.isfinite(lse) & rows[:, None], fin, err_msg=f"{case=}")
  np.testing.assert_allclose(lse[fin], want[1][fin], atol=2e-2, rtol=0, err_msg=f"{case=}")
  for name, err in errs.items():
    assert err < 2e-2, f"{case=}: {name} relative error {err:.2e} (bf16 inputs)"


def test_windowed_data_plane_on_one_gpu_equals_windowed_document_attention(seed):
  """One GPU (one server): a window plan's data plane with the GPU kernels (mosaic, and flash3
  when installed) equals each document's windowed attention (float32 dense reference)."""
  from distca_jax import attention as attn_lib  # pylint: disable=import-outside-toplevel
  from distca_jax import dataplane  # pylint: disable=import-outside-toplevel
  from distca_jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  t, h, kh, d, window = 4096, 8, 2, 128, 512
  # Documents cut at random points of the row, a padded tail of 100 rows.
  lens = np.diff(np.unique(np.r_[0, rng.integers(1, t - 100, size=6), t - 100])).tolist()
  hp = plan_lib.fit_host_plan([lens], 1, t, options=plan_lib.PlanOptions(
      q_heads=h, kv_heads=kh, head_dim=d, dtype_bytes=2, min_shard=None, window=window))
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
  q = jnp.asarray(rng.standard_normal((1, t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((1, t, kh, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((1, t, kh, d)), jnp.bfloat16)
  seg = np.zeros((1, t), np.int32)
  g = 0
  for j, n in enumerate(lens):
    seg[0, g:g + n] = j + 1
    g += n
  layout = attn_lib.Layout(jnp.asarray(seg), jnp.zeros((1, t), jnp.int32))
  f32 = lambda x: x.astype(jnp.float32)
  want = attn_lib.dense_reference(f32(q), f32(k), f32(v), layout, softmax_scale=d**-0.5,
                                  window=window)
  for kernel in DATA_PLANE_KERNELS:
    opts = dataplane.DispatchOptions(kernel=kernel, window=window, kernel_options=(
        {"max_seqlen_q": t, "max_seqlen_k": t} if kernel == "flash3" else {}))
    got = dataplane.run_plan(q, k, v, hp, mesh, opts)
    err = _rel(got, want)
    assert err < 2e-2, f"{kernel=}: relative error {err:.2e}"
