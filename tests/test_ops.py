"""Core attention over fused CA-task batches: 'blockwise' (several tile sizes) and 'reference'
(and on a GPU 'flash3') against an independent per-task float64 NumPy oracle (outputs,
log-sum-exp and analytic gradients), padding behaviour, 'blockwise' memory (no [T, U]
intermediate) and remat (its outputs saved by name), 'auto', input validation, kernel errors
and the exact FLOP count.

Run: cd /work/main && .venv/bin/python -m pytest -q tests/test_ops.py
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import zlib

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import custom_ops
from custom_ops import blockwise_attention as bw
from custom_ops import flash3_attention as fa3
from custom_ops import mosaic_worklists
from custom_ops import varlen_attention as va
from distca_jax import config as config_lib
from distca_jax import dataplane, ops
from distca_jax.dataplane import count_primitives
from distca_jax.plan import cost as plan_cost


# ------------------------------------------------------------------------------------------------
# Oracle: per task, per head, dense float64, gradients written out by hand (no JAX autodiff).
# ------------------------------------------------------------------------------------------------


def oracle(q, k, v, cu_q, cu_k, scale, do, dlse, window=0):
  """Returns o, lse, dq, dk, dv (float64) for loss = sum(o * do) + sum(lse * dlse); ``window`` >
  0: a sliding window, row r also sees only keys j > r + (lk - lq) - window."""
  q, k, v, do, dlse = (np.asarray(x, np.float64) for x in (q, k, v, do, dlse))
  num_q_rows, num_heads, _ = q.shape
  group = num_heads // k.shape[1]
  o = np.zeros_like(q)
  lse = np.full((num_q_rows, num_heads), -np.inf)
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  for i in range(len(cu_q) - 1):
    qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
    lq, lk = qe - qs, ke - ks
    if lq == 0:
      continue
    r = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    mask = j <= r + (lk - lq)  # bottom-right causal
    if window:
      mask &= j > r + (lk - lq) - window
    seen = mask.any(axis=1)
    for h in range(num_heads):
      hk = h // group
      qh, kh, vh = q[qs:qe, h], k[ks:ke, hk], v[ks:ke, hk]
      s = qh @ kh.T * scale
      m = np.where(seen, np.max(np.where(mask, s, -np.inf), axis=1, initial=-np.inf), 0.0)
      p = np.where(mask, np.exp(np.where(mask, s - m[:, None], 0.0)), 0.0)
      l = p.sum(axis=1)
      p = p / np.where(seen, l, 1.0)[:, None]
      oh = p @ vh
      o[qs:qe, h] = oh
      lse[qs:qe, h] = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
      doh = do[qs:qe, h]
      dlh = np.where(seen, dlse[qs:qe, h], 0.0)
      dp = doh @ vh.T
      delta = (oh * doh).sum(axis=1)
      ds = p * (dp - delta[:, None] + dlh[:, None])
      dq[qs:qe, h] = scale * ds @ kh
      dk[ks:ke, hk] += scale * ds.T @ qh
      dv[ks:ke, hk] += p.T @ doh
  return o, lse, dq, dk, dv


# ------------------------------------------------------------------------------------------------
# Random task tables and inputs
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
  num_q_rows: int  # T (capacity; rows past the last task are padding)
  num_k_rows: int  # U
  num_tasks: int  # N
  num_heads: int  # H
  num_kv_heads: int  # K
  head_dim: int  # D
  dtype: str


def random_table(rng: np.random.Generator, case: Case):
  """Random tasks with q_len <= kv_len (some equal, some 1 token, some longer than a block),
  random empty trailing tasks and random padding after the last task in both buffers."""
  n_empty = int(rng.integers(1, 3))
  n_live = case.num_tasks - n_empty
  while True:
    lk = rng.integers(1, 41, size=n_live)
    lq = np.array([int(rng.integers(1, x + 1)) for x in lk])
    eq = rng.random(n_live) < 0.3
    lq[eq] = lk[eq]
    lq[rng.random(n_live) < 0.15] = 1
    if lq.sum() < case.num_q_rows and lk.sum() < case.num_k_rows:
      break
  lq = np.concatenate([lq, np.zeros(n_empty, np.int64)])
  lk = np.concatenate([lk, np.zeros(n_empty, np.int64)])
  cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
  return cu_q, cu_k


def random_inputs(rng: np.random.Generator, case: Case, pad_value: float | None = None,
                  cu_q=None, cu_k=None):
  """q, k, v (case dtype) and f32 cotangents; padding rows hold pad_value if given."""
  dt = jnp.dtype(case.dtype)
  q = rng.standard_normal((case.num_q_rows, case.num_heads, case.head_dim)).astype(np.float32)
  k = rng.standard_normal((case.num_k_rows, case.num_kv_heads, case.head_dim)).astype(np.float32)
  v = rng.standard_normal((case.num_k_rows, case.num_kv_heads, case.head_dim)).astype(np.float32)
  if pad_value is not None:
    q[: cu_q[0]] = pad_value
    q[cu_q[-1]:] = pad_value
    k[: cu_k[0]] = pad_value
    k[cu_k[-1]:] = pad_value
    v[: cu_k[0]] = pad_value
    v[cu_k[-1]:] = pad_value
  do = rng.standard_normal(q.shape).astype(np.float32)
  dlse = rng.standard_normal((case.num_q_rows, case.num_heads)).astype(np.float32)
  return jnp.asarray(q, dt), jnp.asarray(k, dt), jnp.asarray(v, dt), do, dlse


ON_GPU = jax.default_backend() == "gpu"
HAS_FLASH3 = importlib.util.find_spec("flash_attn3_jax") is not None
# 'blockwise' runs 16-row tiles here (tasks of up to 40 rows span several tiles); other tiles:
# test_blockwise_tile_sizes_match_oracle. On a GPU FlashAttention-3 ('flash3', when installed) is
# checked as well (the Mosaic GPU kernel: tests/test_mosaic_attention.py).
KERNELS = ["reference", "blockwise"] + (["flash3"] if ON_GPU and HAS_FLASH3 else [])


def _kernel_kwargs(kernel: str) -> dict:
  if kernel == "blockwise":
    return dict(kernel="blockwise", block_sizes=bw.BlockSizes(16, 16))
  return dict(kernel=kernel)


# One jitted function per kernel; task tables are traced, so every table of one Case reuses it.
def _make_fn(kernel: str, kwargs: dict | None = None):
  kwargs = kwargs or _kernel_kwargs(kernel)
  # FA3's backward takes no dLSE, so its loss leaves the log-sum-exp out.
  use_lse = kernel != "flash3"

  def loss(q, k, v, cu_q, cu_k, do, dlse):
    o, lse = ops.core_attention(q, k, v, cu_q, cu_k, return_lse=True, **kwargs)
    total = jnp.sum(o.astype(jnp.float32) * do)
    if use_lse:
      total = total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * dlse)
    return total, (o, lse)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


FNS = {b: _make_fn(b) for b in KERNELS}


def skip_unsupported(kernel: str, case) -> None:
  if kernel == "flash3" and (case.dtype == "float32" or case.head_dim != 128):
    pytest.skip("the flash-attn3-jax wheel takes bf16/fp16 with head dim 128 only")


def rel_err(x, ref) -> float:
  x = np.asarray(x, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check_against_oracle(kernel, case, q, k, v, cu_q, cu_k, do, dlse, fn=None):
  """``fn``: the jitted loss-and-grad to check (default ``FNS[kernel]``)."""
  if kernel == "flash3":
    dlse = np.zeros_like(dlse)
  (_, (o, lse)), (dq, dk, dv) = (fn or FNS[kernel])(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k),
                                             jnp.asarray(do), jnp.asarray(dlse))
  scale = 1.0 / np.sqrt(case.head_dim)
  o_ref, lse_ref, dq_ref, dk_ref, dv_ref = oracle(
      np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), cu_q,
      cu_k, scale, do, dlse)
  tol = 1e-4 if case.dtype == "float32" else 2e-2
  for name, got in (("o", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert not np.isnan(np.asarray(got, np.float32)).any(), f"{kernel}: NaN in {name}"
  lse_np = np.asarray(lse)
  assert (np.isneginf(lse_np) == np.isneginf(lse_ref)).all(), f"{kernel}: -inf pattern of lse"
  finite = np.isfinite(lse_ref)
  errs = {"o": rel_err(o, o_ref), "lse": rel_err(lse_np[finite], lse_ref[finite]),
          "dq": rel_err(dq, dq_ref), "dk": rel_err(dk, dk_ref), "dv": rel_err(dv, dv_ref)}
  bad = {n: e for n, e in errs.items() if not e < tol}
  assert not bad, f"{kernel} {case}: relative errors {errs} exceed {tol}"
  # Rows outside every task: exactly zero outputs and gradients, lse = -inf.
  for name, got, cu in (("o", o, cu_q), ("dq", dq, cu_q), ("dk", dk, cu_k), ("dv", dv, cu_k)):
    got = np.asarray(got, np.float32)
    assert (got[: cu[0]] == 0).all() and (got[cu[-1]:] == 0).all(), f"{kernel}: padding {name}"
  assert np.isneginf(lse_np[cu_q[-1]:]).all()


CASES = [
    Case(96, 160, 6, 2, 2, 64, "float32"),  # MHA, f32, D=64
    Case(96, 160, 6, 4, 2, 128, "bfloat16"),  # GQA 2:1, bf16, D=128
    Case(80, 144, 5, 4, 1, 128, "float32"),  # MQA 4:1, f32, D=128
    Case(80, 144, 5, 2, 2, 64, "bfloat16"),  # MHA, bf16, D=64
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c.num_heads}K{c.num_kv_heads}D"
                         f"{c.head_dim}-{c.dtype}")
@pytest.mark.parametrize("kernel", KERNELS)
def test_random_tables_match_oracle(kernel, case):
  skip_unsupported(kernel, case)
  rng = np.random.default_rng(zlib.crc32(repr((kernel, case)).encode()))
  for _ in range(2):
    cu_q, cu_k = random_table(rng, case)
    q, k, v, do, dlse = random_inputs(rng, case)
    check_against_oracle(kernel, case, q, k, v, cu_q, cu_k, do, dlse)


@pytest.mark.parametrize("kernel", KERNELS)
def test_edge_case_table(kernel):
  """Head padding, 1-token tasks, a task with keys but no queries, one with more queries than
  keys (its first rows see nothing), an empty task in the middle, equal and unequal lengths and
  tasks spanning several blocks; shapes of CASES[1] (no recompile)."""
  case = CASES[1]
  lq = [1, 1, 0, 7, 0, 33, 16, 17, 6, 0]
  lk = [1, 5, 9, 4, 0, 33, 40, 17, 6, 0]
  cu_q = np.concatenate([[3], 3 + np.cumsum(lq)]).astype(np.int32)[: case.num_tasks + 1]
  cu_k = np.concatenate([[2], 2 + np.cumsum(lk)]).astype(np.int32)[: case.num_tasks + 1]
  rng = np.random.default_rng(7)
  q, k, v, do, dlse = random_inputs(rng, case)
  check_against_oracle(kernel, case, q, k, v, cu_q, cu_k, do, dlse)
  cu_q = np.concatenate([[0], np.cumsum(lq[-6:])]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk[-6:])]).astype(np.int32)
  check_against_oracle(kernel, case, q, k, v, cu_q, cu_k, do, dlse)


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_padding_does_not_leak(kernel):
  """Padding rows full of NaN (and of huge values) give finite, exact results everywhere."""
  case = CASES[1]
  rng = np.random.default_rng(11)
  cu_q, cu_k = random_table(rng, case)
  # FlashAttention-3 reads whole key tiles past a task's end and multiplies P = 0 by whatever V
  # holds there, so NaN in padding keys leaks into its outputs (seen on an H200); our kernels
  # zero padding rows first. flash3 is therefore only promised finite padding.
  pads = (3e4,) if kernel == "flash3" else (np.nan, 3e4)
  for pad in pads:
    q, k, v, do, dlse = random_inputs(rng, case, pad_value=pad, cu_q=cu_q, cu_k=cu_k)
    check_against_oracle(kernel, case, q, k, v, cu_q, cu_k, do, dlse)


BLOCKWISE_TILES = [(8, 8), (16, 32), (24, 8), (64, 128)]  # (block_q, block_k); 24: not a power of 2


# The fast tier keeps the non-power-of-2 and the large tiles; the others are slow.
@pytest.mark.parametrize("tiles", [
    pytest.param(t, id=f"{t[0]}x{t[1]}", marks=() if t in ((24, 8), (64, 128)) else
                 pytest.mark.slow) for t in BLOCKWISE_TILES])
def test_blockwise_tile_sizes_match_oracle(tiles):
  """'blockwise' with tiles smaller and larger than the tasks, on random tables (empty tasks,
  1-token tasks, tasks ending at their key end) and the edge table, f32 GQA and bf16 MHA."""
  fn = _make_fn("blockwise", dict(kernel="blockwise", block_sizes=bw.BlockSizes(*tiles)))
  rng = np.random.default_rng(zlib.crc32(repr(tiles).encode()))
  for case in (CASES[2], CASES[3]):
    cu_q, cu_k = random_table(rng, case)
    q, k, v, do, dlse = random_inputs(rng, case)
    check_against_oracle("blockwise", case, q, k, v, cu_q, cu_k, do, dlse, fn=fn)
  lq = [1, 1, 0, 7, 0, 33]  # 1-token, keys without queries, lq > lk, empty, lq == lk
  lk = [1, 5, 9, 4, 0, 33]
  case = CASES[1]
  cu_q = np.concatenate([[3], 3 + np.cumsum(lq)]).astype(np.int32)
  cu_k = np.concatenate([[2], 2 + np.cumsum(lk)]).astype(np.int32)
  q, k, v, do, dlse = random_inputs(rng, case)
  check_against_oracle("blockwise", case, q, k, v, cu_q, cu_k, do, dlse, fn=fn)


def _largest_intermediate(jaxpr) -> int:
  """Elements of the largest value any equation of ``jaxpr`` (sub-jaxprs included) makes."""
  biggest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
        if hasattr(sub, "eqns"):
          biggest = max(biggest, _largest_intermediate(sub))
  return biggest


@pytest.mark.parametrize("kernel", ["blockwise", "reference"])
def test_blockwise_never_builds_the_dense_logits(kernel):
  """Forward and backward of 'blockwise' hold tiles, never a [T, U] array (whose size the dense
  'reference' reaches: the check can fail)."""
  num_q_rows, num_k_rows, heads, kv_heads, head_dim = 2048, 2048, 2, 1, 16
  q = jnp.zeros((num_q_rows, heads, head_dim), jnp.float32)
  k = jnp.zeros((num_k_rows, kv_heads, head_dim), jnp.float32)
  cu = jnp.array([0, 1000, 2048], jnp.int32)

  def loss(q, k, v):
    return jnp.sum(ops.core_attention(q, k, v, cu, cu, kernel=kernel))

  biggest = _largest_intermediate(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k).jaxpr)
  dense = num_q_rows * num_k_rows
  assert (biggest < dense) == (kernel == "blockwise"), (kernel, biggest, dense)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_auto_runs_blockwise_on_cpu():
  from distca_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  c = config_lib.base_config()
  assert c.attention.kernel == "auto"
  assert ops.default_kernel() == "blockwise"
  case = CASES[1]
  rng = np.random.default_rng(13)
  cu_q, cu_k = (jnp.asarray(x) for x in random_table(rng, case))
  q, k, v, _, _ = random_inputs(rng, case)
  run = lambda kernel: jax.jit(functools.partial(ops.core_attention, kernel=kernel,
                                                 return_lse=True))(q, k, v, cu_q, cu_k)
  o_auto, lse_auto = run("auto")
  o, lse = run("blockwise")
  np.testing.assert_array_equal(np.asarray(o_auto, np.float32), np.asarray(o, np.float32))
  np.testing.assert_array_equal(np.asarray(lse_auto), np.asarray(lse))


def test_non_power_of_two_head_dim():
  """D = 80 (not a multiple of any tile width): 'blockwise' forward and gradients."""
  case = Case(48, 64, 3, 2, 1, 80, "float32")
  rng = np.random.default_rng(5)
  cu_q = np.array([0, 20, 21, 40], np.int32)
  cu_k = np.array([0, 30, 31, 60], np.int32)
  q, k, v, do, dlse = random_inputs(rng, case)
  check_against_oracle("blockwise", case, q, k, v, cu_q, cu_k, do, dlse)


def test_blockwise_forward_outputs_are_saved_by_name():
  """The blockwise kernel names its O and LSE (``KERNEL_OUTPUTS_NAME``), so the remat policy that
  keeps kernel outputs saves them (the backward does not rerun the forward); gradients unchanged."""
  t, h, kh, d = 48, 4, 2, 16
  q = jnp.asarray(np.random.default_rng(4).standard_normal((t, h, d)), jnp.float32)
  k = q[:, ::h // kh]
  cu = jnp.array([0, 20, 41], jnp.int32)

  def loss(q, k, v):
    return jnp.sum(ops.core_attention(q, k, v, cu, cu, kernel="blockwise") ** 2)

  remat = jax.checkpoint(loss, policy=ops.saves_kernel_outputs)
  saved = saved_residuals(remat, q, k, k)
  named = sorted(shape for _, shape, why in saved if ops.KERNEL_OUTPUTS_NAME in why)
  assert named == sorted([(t, h, d), (t, kh, h // kh)]), saved  # O, and LSE as [T, K, G]
  for g, w in zip(jax.jit(jax.grad(remat, argnums=(0, 1, 2)))(q, k, k),
                  jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, k)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="GPU-sized task table")
@pytest.mark.parametrize("kernel", [b for b in KERNELS if b != "reference"])
def test_gpu_ca_batch_matches_reference(kernel):
  """A CA batch at production head shapes (32 q heads, 8 KV heads, D=128, bf16): tail shards
  [b - s, b) with their own key prefix, tasks much longer than a tile, against 'reference'."""
  rng = np.random.default_rng(17)
  lq, lk = [], []
  while sum(lq) < 2048 - 700:
    b = int(rng.integers(200, 3000))
    s = int(rng.integers(1, min(b, 700) + 1))
    lq.append(s)
    lk.append(b)
  cu_q = np.concatenate([[0], np.cumsum(lq), [sum(lq)] * 2]).astype(np.int32)
  cu_k = np.concatenate([[0], np.cumsum(lk), [sum(lk)] * 2]).astype(np.int32)
  case = Case(2048, int(cu_k[-1]) + 64, len(cu_q) - 1, 32, 8, 128, "bfloat16")
  q, k, v, do, _ = random_inputs(rng, case)
  dlse = np.zeros((case.num_q_rows, case.num_heads), np.float32)
  args = (q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), jnp.asarray(do), jnp.asarray(dlse))
  (_, (o, lse)), grads = FNS[kernel](*args)
  (_, (o_ref, lse_ref)), grads_ref = FNS["reference"](*args)
  finite = np.isfinite(np.asarray(lse_ref))
  errs = {"o": rel_err(o, o_ref),
          "lse": rel_err(np.asarray(lse)[finite], np.asarray(lse_ref)[finite])}
  errs.update({n: rel_err(g, g_ref) for n, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref)})
  assert all(e < 2e-2 for e in errs.values()), f"{kernel}: {errs}"
  for x in (o, *grads):
    assert not np.isnan(np.asarray(x, np.float32)).any()


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------


def _good():
  q = jnp.zeros((32, 4, 64), jnp.bfloat16)
  k = jnp.zeros((48, 2, 64), jnp.bfloat16)
  cu = jnp.array([0, 16, 32], jnp.int32)
  return q, k, k, cu, cu


@pytest.mark.parametrize("mutate, message", [
    (lambda a: (a[0][0], *a[1:]), "tokens, heads, head_dim"),
    (lambda a: (a[0], a[1], a[2][:40], *a[3:]), "k and v must have the same shape"),
    (lambda a: (jnp.zeros((32, 3, 64), jnp.bfloat16), *a[1:]), "multiple of kv heads"),
    (lambda a: (jnp.zeros((32, 4, 32), jnp.bfloat16), *a[1:]), "share head_dim"),
    (lambda a: (jnp.zeros((32, 4, 512), jnp.bfloat16), jnp.zeros((48, 2, 512), jnp.bfloat16),
                jnp.zeros((48, 2, 512), jnp.bfloat16), *a[3:]), "head_dim=512"),
    (lambda a: (a[0].astype(jnp.float32), *a[1:]), "share a dtype"),
    (lambda a: (a[0].astype(jnp.int8), a[1].astype(jnp.int8), a[2].astype(jnp.int8), *a[3:]),
     "not supported"),
    (lambda a: (*a[:3], a[3].astype(jnp.float32), a[4]), "must be int32"),
    (lambda a: (*a[:3], a[3][None], a[4]), "1-D"),
    (lambda a: (*a[:3], jnp.array([0, 16], jnp.int32), a[4]), "one entry per task boundary"),
    (lambda a: (*a[:3], jnp.array([0, 20, 16], jnp.int32), a[4]), "non-decreasing"),
    (lambda a: (*a[:3], jnp.array([0, 16, 33], jnp.int32), a[4]), "within [0, 32]"),
])
@pytest.mark.parametrize("kernel", ["reference", "blockwise", "mosaic"])
def test_bad_inputs_raise_clear_errors(kernel, mutate, message):
  """Every kernel's inputs are checked before it runs (also where it cannot run: 'mosaic' on
  CPU)."""
  with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
    ops.core_attention(*mutate(_good()), kernel=kernel)


def test_unknown_kernel():
  with pytest.raises(ValueError, match="unknown attention kernel='cudnn'"):
    ops.core_attention(*_good(), kernel="cudnn")


def test_pallas_kernel_names_its_replacement():
  """'pallas' (the removed Triton kernel) is rejected with one line naming what to run instead,
  wherever a kernel name is given: the op, CAD's options, the baselines and the config."""
  fix = (r"\(the Triton kernel\) was removed; use 'mosaic' \(GPU\) or 'blockwise' / 'reference' "
         r"\(CPU\)")
  with pytest.raises(ValueError, match=r"^kernel='pallas' " + fix + "$"):
    ops.core_attention(*_good(), kernel="pallas")
  with pytest.raises(ValueError, match=r"^kernel='pallas' " + fix + "$"):
    dataplane.DispatchOptions(kernel="pallas")
  with pytest.raises(ValueError, match=r"^kernel='pallas' " + fix + "$"):
    ops.check_kernel("pallas")
  c = config_lib.base_config()
  c.attention.kernel = "pallas"
  with pytest.raises(ValueError, match=r"^attention.kernel='pallas' " + fix + "$"):
    config_lib.validate(c)
  assert "pallas" not in ops.KERNELS


def test_kernel_only_options_rejected_elsewhere():
  tiles = bw.BlockSizes(16, 16)
  with pytest.raises(ValueError, match="applies to kernel='blockwise' only"):
    ops.core_attention(*_good(), kernel="reference", block_sizes=tiles)
  with pytest.raises(ValueError, match="custom_ops.blockwise_attention.BlockSizes; got BlockSizes"):
    ops.core_attention(*_good(), kernel="blockwise", block_sizes=mosaic_worklists.BlockSizes())


@pytest.mark.skipif(importlib.util.find_spec("flash_attn3_jax") is not None,
                    reason="flash-attn3-jax is installed here")
def test_flash3_unavailable_says_how_to_install():
  with pytest.raises(ops.KernelUnavailableError, match=r"pip install 'flash-attn3-jax==0\.2\.3'"):
    ops.core_attention(*_good(), kernel="flash3")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
def test_mosaic_on_cpu_names_the_cpu_kernels():
  with pytest.raises(ops.KernelUnavailableError, match="Use kernel='blockwise' or 'reference'"):
    ops.core_attention(*_good(), kernel="mosaic")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU-only error")
@pytest.mark.parametrize("kernel, why", [("flash3", "flash3"), ("mosaic", "Hopper GPUs")])
@pytest.mark.parametrize("backend", ["packed_dp", "distca", "cp"])
def test_a_kernel_this_host_cannot_run_is_a_user_error_when_the_run_is_set_up(
    backend, kernel, why):
  """A GPU kernel named in a config run on a CPU host stops in ``trainer.setup_run`` (before the
  workdir is made or the step traced), as a UserError naming the setting and the CPU kernel.
  Host-only uses (``make_backend``: plans of a GPU config) and `local`, which has no kernel
  option, still build."""
  from distca_jax import backends, configs_io, trainer
  from distca_jax.errors import UserError
  over = [f"attention.backend={backend}", f"attention.kernel={kernel}", "mesh.data=1"]
  c = configs_io.load_config("configs/tiny_cpu.py", over)
  with pytest.raises(UserError, match=rf"^attention.kernel='{kernel}' cannot run here: .*{why}"
                                      r".*; on a CPU set attention.kernel='blockwise'"):
    trainer.setup_run(c, devices=jax.devices()[:1])
  assert backends.kernel_of(c) == kernel
  assert trainer.make_backend(c).fn is not None
  assert ops.check_kernel_runs("blockwise") == "blockwise" and ops.check_kernel_runs("auto")
  c = configs_io.load_config("configs/tiny_cpu.py", [f"attention.kernel={kernel}", "mesh.data=1"])
  assert backends.kernel_of(c) is None
  assert trainer.setup_run(c, devices=jax.devices()[:1]).backend.fn is not None


@pytest.mark.parametrize("field, value", [("block_q", 0), ("block_k", 2.0)])
def test_blockwise_block_sizes_validated(field, value):
  with pytest.raises(ValueError, match=f"BlockSizes.{field}={value}"):
    bw.BlockSizes(**{field: value})


# ------------------------------------------------------------------------------------------------
# Exact FLOPs
# ------------------------------------------------------------------------------------------------


def test_flops_count_pairs_exactly():
  rng = np.random.default_rng(2)
  for _ in range(20):
    n = int(rng.integers(1, 6))
    lk = rng.integers(0, 50, size=n)
    lq = rng.integers(0, 60, size=n)  # includes lq > lk and empty tasks
    cu_q = np.concatenate([[0], np.cumsum(lq)])
    cu_k = np.concatenate([[0], np.cumsum(lk)])
    brute = sum(int((np.arange(b)[None, :] <= np.arange(a)[:, None] + (b - a)).sum())
                for a, b in zip(lq, lk))
    assert plan_cost.attention_pairs(cu_q, cu_k) == brute
  # Tail shard [a, b) of a document: P(a, b) = (b - a)(a + b + 1) / 2 (docs/design.md Sec. 10).
  a, b = 1000, 4096
  assert plan_cost.attention_pairs([0, b - a], [0, b]) == (b - a) * (a + b + 1) // 2
  fwd = plan_cost.core_attention_flops([0, b - a], [0, b], num_q_heads=32, head_dim=128)
  assert fwd == 4 * 32 * 128 * (b - a) * (a + b + 1) // 2
  both = plan_cost.core_attention_flops([0, b - a], [0, b], num_q_heads=32, head_dim=128,
                                  include_backward=True)
  assert both == round(3.5 * fwd)


def test_reference_agrees_with_dense_causal_attention():
  """One task with q_len == kv_len is ordinary causal attention (jax.nn.dot_product_attention)."""
  rng = np.random.default_rng(9)
  q = jnp.asarray(rng.standard_normal((40, 4, 64)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((40, 2, 64)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((40, 2, 64)), jnp.float32)
  cu = jnp.array([0, 40], jnp.int32)
  o = ops.core_attention(q, k, v, cu, cu)
  with jax.default_matmul_precision("highest"):  # no tf32 on GPUs
    o_dense = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
  assert rel_err(o, o_dense) < 1e-5


# ------------------------------------------------------------------------------------------------
# experiments/kernel_bench.py: scheduler workloads are the scheduler's per-server task tables
# ------------------------------------------------------------------------------------------------


def _kernel_bench():
  from experiments import kernel_bench  # pylint: disable=import-outside-toplevel
  return kernel_bench


@pytest.mark.parametrize("family", ["pretrain", "prolong"])
def test_kernel_bench_sched_workload_is_the_servers_task_table(family):
  from distca_jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from distca_jax.data.workloads import WorkloadSampler  # pylint: disable=import-outside-toplevel
  kb = _kernel_bench()
  servers, tokens, step, seed, min_shard = 4, 512, 2, 7, 32
  plan = plan_lib.schedule(
      WorkloadSampler(family, tokens_per_row=tokens, seed=seed).step_doclens(step, servers),
      servers, tokens_per_rank=tokens, options=plan_lib.PlanOptions(
          tolerance=0.05, min_shard=min_shard, q_heads=4, kv_heads=2, head_dim=32))
  per_task = lambda t: sorted(zip((t[:, 2] - t[:, 1]).tolist(), t[:, 2].tolist()))
  tables = {}
  for server, buffers in (("max", "used"), ("max", "envelope"), ("1", "used"), ("all", "used")):
    cfg = kb.SchedConfig(tokens_per_rank=tokens, servers=servers, step=step, tolerance=0.05,
                         server=server, buffers=buffers, seed=seed, q_heads=4, kv_heads=2,
                         head_dim=32)
    [wl] = kb.make_workloads([f"sched-{family}-m{min_shard}"], 256, 256, 0, cfg)
    lq, lk = np.diff(wl.cu_q), np.diff(wl.cu_k)
    assert (lq >= 0).all() and (lk >= 0).all() and (lk >= lq).all()
    got = sorted((int(a), int(b)) for a, b in zip(lq, lk) if a > 0)
    if server == "all":
      want, load = per_task(plan.tasks), plan.loads_after.sum()
      assert wl.q_rows == wl.cu_q[-1] and wl.kv_rows == wl.cu_k[-1]
    else:
      s = int(np.argmax(plan.loads_after)) if server == "max" else int(server)
      assert wl.info["server"] == s
      want, load = per_task(plan.tasks[plan.tasks[:, 3] == s]), plan.loads_after[s]
      # Empty trailing slots only, and the buffers hold every task row (padding past them).
      assert all(a > 0 for a in lq[:wl.num_tasks]) and not lq[wl.num_tasks:].any()
      pad = (wl.q_rows - wl.cu_q[-1], wl.kv_rows - wl.cu_k[-1])
      assert pad == (0, 0) if buffers == "used" else min(pad) >= 0
      tables[server, buffers] = (wl.cu_q, wl.cu_k)
    assert got == want
    assert plan_cost.attention_pairs(wl.cu_q, wl.cu_k) == load
  # Padding changes the buffers, not the table.
  assert tables["max", "used"] == tables["max", "envelope"]


def saved_residuals(f, *args) -> list[tuple[str, tuple[int, ...], str]]:
  """(dtype, shape, description) of every residual JAX saves for ``f``'s backward, read from
  ``jax.ad_checkpoint.print_saved_residuals`` (its public view of them)."""
  import contextlib
  import io
  import re
  from jax.ad_checkpoint import print_saved_residuals
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(f, *args)
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
    assert m, line
    out.append((m.group(1), tuple(int(x) for x in m.group(2).split(",") if x), m.group(3)))
  return out


class FA3Emulator:
  """FA3's varlen contract on CPU (the jnp reference for the math), strict about its inputs.

  Rows outside every task are left "unwritten" (NaN), as FA3 leaves them. A task longer than the
  call's max_seqlen bounds, a LSE buffer of the wrong shape, or a LSE handed to the backward that
  is not the forward's, turns the whole result into NaN, so a test using it fails. Records the
  (slots, max_seqlen_q, max_seqlen_k) of every call it traces.
  """

  def __init__(self):
    self.calls = []

  def _check(self, q, cu_q, cu_k, max_seqlen_q, max_seqlen_k):
    lq, lk = jnp.diff(cu_q), jnp.diff(cu_k)
    self.calls.append((cu_q.shape[0] - 1, max_seqlen_q, max_seqlen_k))
    return (jnp.max(lq) <= max_seqlen_q) & (jnp.max(lk) <= max_seqlen_k)

  @staticmethod
  def _unwritten(x, cu):
    _, _, valid = va.rows_to_tasks(cu, x.shape[0])
    return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan)

  def fwd(self, q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, softmax_scale):
    ok = self._check(q, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    o, lse = va.varlen_attention_reference(q, k, v, cu_q, cu_k, softmax_scale=softmax_scale)
    t, h, _ = q.shape
    slots = cu_q.shape[0] - 1
    assert slots * h * max_seqlen_q >= h * t, "the bindings' LSE buffer would be too small"
    raw = jnp.full((slots * h * max_seqlen_q,), jnp.nan, jnp.float32)
    raw = raw.at[:h * t].set(self._unwritten(lse, cu_q).T.reshape(-1))
    o = self._unwritten(o, cu_q).astype(q.dtype)
    return jnp.where(ok, o, jnp.nan), jnp.where(ok, raw, jnp.nan).reshape(slots, h, max_seqlen_q)

  def bwd(self, do, q, k, v, o, lse, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, softmax_scale):
    ok = self._check(q, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    t, h, _ = q.shape
    ok &= lse.shape == (cu_q.shape[0] - 1, h, max_seqlen_q)
    (o_ref, lse_ref), vjp = jax.vjp(lambda q, k, v: va.varlen_attention_reference(
        q, k, v, cu_q, cu_k, softmax_scale=softmax_scale), q, k, v)
    _, _, q_valid = va.rows_to_tasks(cu_q, t)
    given = lse.reshape(-1)[:h * t].reshape(h, t).T
    same = jnp.where(q_valid[:, None], jnp.abs(given - lse_ref) <= 1e-4, True)
    ok &= jnp.all(same | ~jnp.isfinite(lse_ref))
    dq, dk, dv = vjp((do, jnp.zeros_like(lse_ref)))
    dq, dk, dv = (jnp.where(ok, self._unwritten(x, cu), jnp.nan).astype(x.dtype)
                  for x, cu in ((dq, cu_q), (dk, cu_k), (dv, cu_k)))
    return dq, dk, dv


@pytest.mark.parametrize("seed", [11] + [pytest.param(s, marks=pytest.mark.slow)
                                  for s in (12, 13, 14)])
def test_flash3_launch_buckets_mask_padding_and_match_reference(seed):
  """The flash3 path (bucketed launch shapes, padding masked instead of computed) on an emulator
  of FA3's contract: outputs, LSE and dQ/dK/dV equal the reference kernel's on random tables with
  trailing empty slots and padding rows (left NaN by the emulator), and the shape chosen is the
  cheapest of the buckets that holds the table."""
  rng = np.random.default_rng(seed)
  slots = int(rng.integers(4, 13))
  used = int(rng.integers(1, slots + 1))
  if seed % 2:  # the last used slot sits just past a slot-ladder step: cutting it must be wrong
    steps = sorted({b[0] for b in fa3.flash3_grid_buckets(slots, 1, 1, 1, 4)})[:-1]
    used = int(rng.choice(steps)) + 1
  lq = rng.integers(0, 24, size=used)
  lk = lq + rng.integers(0, 40, size=used)
  lk[-1] = max(lk[-1], lq[-1], 1)  # the last used slot is non-empty
  if seed % 2:  # ... and on some seeds holds keys only: its dK/dV must still be computed
    lq[-1] = 0
  q0, k0 = int(rng.integers(0, 9)), int(rng.integers(0, 9))
  cu_q = np.concatenate([[q0], q0 + np.cumsum(lq), np.full(slots - used, q0 + lq.sum())])
  cu_k = np.concatenate([[k0], k0 + np.cumsum(lk), np.full(slots - used, k0 + lk.sum())])
  tq, tk = int(cu_q[-1] + rng.integers(0, 50)), int(cu_k[-1] + rng.integers(0, 50))
  h, kh, d = 4, 2, 16
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (tq, h, d))
  k = jax.random.normal(ks[1], (tk, kh, d))
  v = jax.random.normal(ks[2], (tk, kh, d))
  do = jax.random.normal(ks[3], (tq, h, d))
  msq, msk = 512, 1024  # the caller's static bounds: far above the real tasks
  cu_q, cu_k = jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32)

  def loss(q, k, v, fn):
    o, lse = fn(q, k, v)
    return jnp.sum(o * do), (o, lse)

  emu = FA3Emulator()
  flash = lambda q, k, v: fa3.flash3_masked(
      q, k, v, cu_q, cu_k, softmax_scale=0.3, max_seqlen_q=msq, max_seqlen_k=msk, grid_levels=4,
      impl=(emu.fwd, emu.bwd))
  ref = lambda q, k, v: ops.core_attention(q, k, v, cu_q, cu_k, kernel="reference",
                                           softmax_scale=0.3, return_lse=True)
  traced = jax.jit(jax.grad(lambda *a: loss(*a, flash), argnums=(0, 1, 2),
                            has_aux=True)).trace(q, k, v)  # one trace: run and structure
  got = traced.lower().compile()(q, k, v)
  want = jax.jit(jax.grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2), has_aux=True))(q, k, v)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  # Bounds above the buffers are clamped to them (no task can be longer).
  buckets = fa3.flash3_grid_buckets(slots, tq, min(msq, tq), min(msk, tk), 4)
  # Every bucket was compiled (fwd and bwd), and the last is the caller's full shape.
  assert sorted(set(emu.calls)) == sorted(set(buckets))
  assert buckets[-1][0] == slots and buckets[-1][2] == min(msk, tk)
  # The device's choice is the cheapest bucket holding the table.
  holds = [b for b in buckets if b[0] >= used and b[1] >= lq.max() and b[2] >= lk.max()]
  want_b = min(holds, key=lambda b: b[0] * -(-b[2] // 128))
  chosen = buckets[int(fa3.flash3_bucket(cu_q, cu_k, buckets)[0])]
  assert chosen[0] * -(-chosen[2] // 128) == want_b[0] * -(-want_b[2] // 128)
  assert chosen[0] >= used and chosen[1] >= lq.max() and chosen[2] >= lk.max()
  # The forward ran the full shape once; the backward compiled every shape. No switch in the
  # forward: a remat policy saving the kernel's outputs then keeps one LSE buffer, not one per
  # launch shape ('resend').
  assert emu.calls.count(buckets[-1]) >= 2
  fwd_jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(flash, *a)[0])(q, k, v).jaxpr
  assert count_primitives(fwd_jaxpr, {"cond"})["cond"] == 0
  assert count_primitives(traced.jaxpr.jaxpr, {"cond"})["cond"] >= 1
  # A task longer than the caller's bound: NaN, not a silently shortened task.
  short = lambda q, k, v: fa3.flash3_masked(
      q, k, v, cu_q, cu_k, softmax_scale=0.3, max_seqlen_q=msq, max_seqlen_k=int(lk.max()) - 1,
      grid_levels=4, impl=(emu.fwd, emu.bwd))
  assert np.isnan(np.asarray(jax.jit(short)(q, k, v)[0])).all()


def test_flash3_remat_keeps_o_and_compact_lse_not_the_raw_buffer(seed):
  """Under the remat policies that keep attention ('save_attention', 'resend'), the flash3 path
  saves O and the [H, T] log-sum-exp it cuts out of FA3's [slots, H, max_seqlen_q] buffer; never
  that buffer (8.7 GB per layer for 260 slots of a 64K row); gradients unchanged."""
  from distca_jax import model

  rng = np.random.default_rng(seed)
  t, h, kh, d, slots = 96, 4, 2, 16, 8
  lens = rng.multinomial(t - 8, np.ones(3) / 3)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), np.full(slots - 3, lens.sum())]),
                   jnp.int32)
  ks = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3)
  q = jax.random.normal(ks[0], (t, h, d))
  k, v = (jax.random.normal(x, (t, kh, d)) for x in ks[1:])
  emu = FA3Emulator()
  # The emulator's forward as one primitive named like the bindings' FFI call, so that a policy
  # saving that call's outputs (what the policies did before) would keep the raw buffer.
  from jax.extend.core import Primitive
  from jax.interpreters import mlir
  call = Primitive("ffi_call")
  call.multiple_results = True
  call.def_impl(lambda *a, **kw: emu.fwd(*a, **kw))
  call.def_abstract_eval(lambda *avals, **kw: [
      jax.core.ShapedArray(x.shape, x.dtype) for x in jax.eval_shape(
          functools.partial(emu.fwd, **kw), *avals)])
  mlir.register_lowering(call, mlir.lower_fun(lambda *a, **kw: emu.fwd(*a, **kw),
                                              multiple_results=True))
  fwd = lambda *a, **kw: tuple(call.bind(*a, **kw))

  def loss(q, k, v):
    o, _ = fa3.flash3_masked(q, k, v, cu, cu, softmax_scale=0.3, max_seqlen_q=t,
                              max_seqlen_k=t, grid_levels=2, impl=(fwd, emu.bwd))
    return jnp.sum(o * o)  # the backward still takes the LSE (a residual of the kernel)

  raw = [shape for _, shape, _ in saved_residuals(jax.checkpoint(
      loss, policy=lambda prim, *_, **__: prim.name == "ffi_call"), q, k, v)]
  assert (slots, h, t) in raw  # saving the call's outputs keeps the raw buffer
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for policy in (model.REMAT_POLICIES["save_attention"], ops.saves_kernel_outputs):
    saved = saved_residuals(jax.checkpoint(loss, policy=policy), q, k, v)
    named = sorted(shape for _, shape, why in saved if ops.KERNEL_OUTPUTS_NAME in why)
    assert named == sorted([(t, h, d), (h, t)]), saved
    assert not [shape for _, shape, _ in saved if shape == (slots, h, t)], saved
    grads = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(grads, want):
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def test_flash3_grid_buckets_shapes():
  """Slot ladder N, N/2, ...; bounds in multiples of 128, never above the caller's; the LSE
  buffer [slots, H, max_seqlen_q] always holds [H, T]; grid_levels=1 is the full shape only."""
  b = fa3.flash3_grid_buckets(64, 98304, 65536, 65536, 4)
  assert {x[0] for x in b} == {8, 16, 32, 64}
  assert {x[2] for x in b} == {8192, 16384, 32768, 65536}
  assert all(s * msq >= 98304 for s, msq, _ in b)
  assert fa3.flash3_grid_buckets(64, 98304, 65536, 65536, 1) == ((64, 65536, 65536),)
  # A bound below 128 stays as given; max_seqlen_q grows where slots x bound < T (LSE buffer).
  assert fa3.flash3_grid_buckets(3, 100, 40, 300, 4) == (
      (1, 100, 128), (1, 100, 256), (1, 100, 300), (2, 50, 128), (2, 50, 256), (2, 50, 300),
      (3, 40, 128), (3, 40, 256), (3, 40, 300))
  with pytest.raises(ValueError, match="grid_levels"):
    fa3.flash3_grid_buckets(4, 10, 10, 10, 0)


@pytest.mark.skipif(not (ON_GPU and HAS_FLASH3),
                    reason="needs a Hopper GPU with flash_attn3_jax installed (FlashAttention-3)")
def test_flash3_max_seqlen_hints_with_long_padding():
  """flash3 given max_seqlen = the longest real task (40) while the buffers' padding is longer
  (leading 3/2 rows, trailing 12/43 rows): masking the padding keeps results exact."""
  case = CASES[1]
  lq = [1, 1, 0, 7, 0, 33, 16, 17, 6, 0]
  lk = [1, 5, 9, 4, 0, 33, 40, 17, 6, 0]
  cu_q = np.concatenate([[3], 3 + np.cumsum(lq)]).astype(np.int32)[: case.num_tasks + 1]
  cu_k = np.concatenate([[2], 2 + np.cumsum(lk)]).astype(np.int32)[: case.num_tasks + 1]
  assert case.num_k_rows - cu_k[-1] > 40 and max(lk) == 40
  rng = np.random.default_rng(17)
  q, k, v, do, dlse = random_inputs(rng, case)

  def loss(q, k, v, cu_q, cu_k, do):
    o, lse = ops.core_attention(q, k, v, cu_q, cu_k, return_lse=True, kernel="flash3",
                                max_seqlen_q=40, max_seqlen_k=40)
    return jnp.sum(o.astype(jnp.float32) * do), (o, lse)

  FNS["flash3-hinted"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  try:
    fn = FNS["flash3-hinted"]
    FNS["flash3-hinted"] = lambda q, k, v, cu_q, cu_k, do, dlse: fn(q, k, v, cu_q, cu_k, do)
    check_against_oracle("flash3-hinted", case, q, k, v, cu_q, cu_k, do, np.zeros_like(dlse))
  finally:
    FNS.pop("flash3-hinted")


@pytest.mark.skipif(ON_GPU and HAS_FLASH3, reason="flash3 runs here: no stand-in needed")
def test_flash3_shape_only_stand_in_compiles_off_gpu_and_never_runs(seed):
  """Inside fa3.shape_only, 'flash3' traces and compiles on the CPU (for memory analysis): the
  gradient's outputs have the inputs' shapes, memory.kernel_workspace_bytes finds the backward
  by its name with FA3's accumulators for these shapes, and running the step raises. Outside,
  the kernel still says it cannot run here."""
  from distca_jax import memory
  rng = np.random.default_rng(seed)
  t, u, h, kh, d, slots = 96, 160, 4, 2, 128, 6
  q = jnp.asarray(rng.normal(size=(t, h, d)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.normal(size=(u, kh, d)), jnp.bfloat16) for _ in range(2))
  cu = jnp.asarray(np.linspace(0, t, slots + 1).astype(np.int32))
  cu_k = jnp.asarray(np.linspace(0, u, slots + 1).astype(np.int32))
  loss = lambda q, k, v: jnp.sum(ops.core_attention(q, k, v, cu, cu_k, kernel="flash3",
                                                    softmax_scale=0.1).astype(jnp.float32))
  with pytest.raises(Exception, match="flash3"):
    ops.check_kernel_runs("flash3")
  with fa3.shape_only():
    ops.check_kernel_runs("flash3")
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v)
    compiled = traced.lower().compile()
  assert [g.shape for g in traced.out_info] == [q.shape, k.shape, v.shape]
  assert memory.kernel_workspace_bytes(traced.jaxpr.jaxpr) == (
      memory.flash3_bwd_workspace_bytes(t, u, h, kh, d, slots)), seed
  with pytest.raises(Exception, match="shape_only"):
    jax.block_until_ready(compiled(q, k, v))
  with pytest.raises(Exception, match="flash3"):
    ops.check_kernel_runs("flash3")


def test_flash3_masking_holds_nothing_of_o_size_across_the_layer_loop():
  """The masking of rows outside every task keeps only the row mask and the fits flag for the
  backward: a predicate broadcast to O's shape is a loop invariant under the layer scan, which
  held it (with full-size zero and NaN fills) while the loop ran."""
  rng = np.random.default_rng(5)
  lq = rng.integers(1, 20, size=3)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lq)]), jnp.int32)
  t, h, kh, d = int(cu[-1]) + 7, 4, 2, 16
  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (t, h, d))
  k, v = (jax.random.normal(x, (t, kh, d)) for x in ks[1:])
  emu = FA3Emulator()
  flash = lambda q: fa3.flash3_masked(q, k, v, cu, cu, softmax_scale=0.3, max_seqlen_q=64,
                                      max_seqlen_k=64, grid_levels=1, impl=(emu.fwd, emu.bwd))[0]
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel
  res = saved_residuals(lambda q: jnp.sum(flash(q)), q)
  full_preds = [a for a, _ in res if a.dtype == jnp.bool_ and a.shape == q.shape]
  assert not full_preds, res
  assert any(a.dtype == jnp.bool_ and a.shape == (t,) for a, _ in res), res
  # Under a differentiated layer scan nothing of O's shape is computed before the loop (a
  # loop-invariant mask or fill would be, and held while the loop runs). The kernel here is an
  # opaque stand-in (the emulator's own NaN padding would be hoisted; FA3's FFI call is not).
  def fwd(q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, softmax_scale):
    return q * softmax_scale, jnp.zeros((cu_q.shape[0] - 1, q.shape[1], max_seqlen_q))
  def bwd(do, q, k, v, o, lse, cu_q, cu_k, **_):
    return do * 2, k * 0, v * 0
  opaque = lambda q: fa3.flash3_masked(q, k, v, cu, cu, softmax_scale=0.3, max_seqlen_q=64,
                                       max_seqlen_k=64, grid_levels=1, impl=(fwd, bwd))[0]
  def layers(ws, q):
    return jnp.sum(lax.scan(lambda x, w: (opaque(x * w), None), q, ws)[0])
  jaxpr = jax.make_jaxpr(jax.grad(layers, argnums=1))(jnp.ones((3,)), q).jaxpr
  first_scan = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan")
  hoisted = [e for e in jaxpr.eqns[:first_scan] if any(
      getattr(v.aval, "shape", None) == q.shape for v in e.outvars)]
  assert not hoisted, hoisted


def test_fills_of_gives_the_values_whatever_the_data_holds():
  """``custom_ops.fills_of``: the fill values in the data's dtype even when the element they are
  computed from is NaN or infinite; bool data gets constants."""
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32):
    for first in (np.nan, np.inf, -3.0) if jnp.issubdtype(dtype, jnp.floating) else (-7,):
      x = jnp.full((3, 2), first, dtype)
      values = (0, np.nan, -np.inf) if jnp.issubdtype(dtype, jnp.floating) else (0, 5)
      got = jax.jit(lambda x, values=values: custom_ops.fills_of(x, *values))(x)
      assert [g.dtype for g in got] == [jnp.dtype(dtype)] * len(values)
      np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(values, np.float64))
  assert custom_ops.fills_of(jnp.ones((2,), jnp.bool_), False)[0].dtype == jnp.bool_
