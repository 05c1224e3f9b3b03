"""Windowed and chunked attention (sliding-window and chunked layers): every CPU core-attention
kernel ('reference', 'blockwise', the packed ``local_attention``) against the float64 NumPy
oracle (``test_ops.oracle``) with the windowed mask (outputs, LSE and hand-written gradients) on
fuzzed CA-task tables; the FA3 adapter's windowed path on an emulator of the bindings; chunked
layers as documents cut at chunk boundaries; windowed plans (pairs, K/V rows and bytes against
brute-force counts) and the distca data plane on 8 fake devices with a window against the
reference; the Mosaic and FA3 windowed kernels cross-lowered for CUDA.

Run: .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_window_attention.py
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from custom_ops import blockwise_attention as bw
from custom_ops import flash3_attention as fa3
from custom_ops import varlen_attention as va
from distca_jax import attention as attn_lib
from distca_jax import ops
import test_dispatch as td
from test_attention import random_layout
from test_ops import FA3Emulator, oracle


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


def task_inputs(seed, min_tasks: int, h: int = 4, kh: int = 2, d: int = 16):
  """(cu_q, cu_k, q, k, v, do) of a random task table (``random_tasks``, 1-6 tasks)."""
  rng = np.random.default_rng(seed)
  cu_q, cu_k, tq, tk = random_tasks(rng, int(rng.integers(min_tasks, 7)))
  ks = jax.random.split(jax.random.key(seed), 4)
  q, do = jax.random.normal(ks[0], (tq, h, d)), jax.random.normal(ks[3], (tq, h, d))
  k, v = jax.random.normal(ks[1], (tk, kh, d)), jax.random.normal(ks[2], (tk, kh, d))
  return cu_q, cu_k, q, k, v, do


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
  cu_q, cu_k, q, k, v, do = task_inputs(seed, 1)
  dlse = jax.random.normal(jax.random.key(seed + 1), q.shape[:2])
  fn = KERNELS[kernel]
  cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
  tq = q.shape[0]

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


# ------------------------------------------------------------------------------------------------
# The packed local kernel (packed_dp / local) and chunked layers.
# ------------------------------------------------------------------------------------------------


def _doc_rows(layout):
  """Per row, the document lengths of a layout's segment ids (documents first, then padding)."""
  seg = np.asarray(layout.segment_ids_BxT)
  return [[int((row == i).sum()) for i in range(1, int(row.max()) + 1)] for row in seg]


def _doc_oracle(doc_rows, t, q, k, v, do, window, scale):
  """Every document of every row as one task of the float64 oracle (zeros at padding)."""
  b = q.shape[0]
  flat = lambda x: np.asarray(x).reshape((b * t,) + x.shape[2:])
  # Rows are packed back to back: row r's documents start at r * t.
  starts = [r * t + int(np.sum(lens[:i])) for r, lens in enumerate(doc_rows)
            for i in range(len(lens))]
  lens = [n for row in doc_rows for n in row]
  o = np.zeros(flat(q).shape)
  grads = [np.zeros(flat(x).shape) for x in (q, k, v)]
  for g, n in zip(starts, lens):
    sl = slice(g, g + n)
    cu1 = np.asarray([0, n])
    res = oracle(flat(q)[sl], flat(k)[sl], flat(v)[sl], cu1, cu1, scale, flat(do)[sl],
                 np.zeros((n, q.shape[2])), window=window)
    o[sl] = res[0]
    for acc, gr in zip(grads, res[2:]):
      acc[sl] = gr
  shape = lambda x, like: x.reshape(like.shape)
  return shape(o, q), [shape(g, x) for g, x in zip(grads, (q, k, v))]


@pytest.mark.parametrize("window", [1, 5, 24, 200])
def test_local_attention_window_equals_oracle(window, seed):
  """``local_attention`` (packed segments, blocks of 8 / 16 rows) with a window: outputs and
  gradients equal the float64 oracle of each document's windowed attention; ``dense_reference``
  with the same window agrees."""
  rng = np.random.default_rng(seed)
  b, t, h, kh, d = 2, 64, 4, 2, 16
  layout = random_layout(rng, b, t)
  doc_rows = _doc_rows(layout)
  ks = jax.random.split(jax.random.key(seed), 4)
  q, do = jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[3], (b, t, h, d))
  k, v = jax.random.normal(ks[1], (b, t, kh, d)), jax.random.normal(ks[2], (b, t, kh, d))
  fn = lambda q, k, v: attn_lib.local_attention(q, k, v, layout, softmax_scale=0.3, block_q=8,
                                                block_k=16, window=window)
  o, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(do)
  wo, wgrads = _doc_oracle(doc_rows, t, q, k, v, do, window, 0.3)
  np.testing.assert_allclose(np.asarray(o), wo, rtol=2e-5, atol=2e-5)
  for g, w in zip(grads, wgrads):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4)
  dense = attn_lib.dense_reference(q, k, v, layout, softmax_scale=0.3, window=window)
  np.testing.assert_allclose(np.asarray(dense), wo, rtol=2e-5, atol=2e-5)


def test_chunked_attention_is_full_causal_over_chunk_cut_documents(seed):
  """A chunked layer (chunk c: position p sees [(p // c) c, p] of its document) computed as full
  causal attention over ``plan.chunk_layout``'s pieces (the blockwise kernel over one task per
  piece) equals the float64 oracle of the chunked mask; the layout cut keeps every token."""
  from distca_jax import plan as plan_lib
  rng = np.random.default_rng(seed)
  chunk = int(rng.integers(3, 20))
  lens = [int(x) for x in rng.integers(1, 70, size=5)]
  pieces = plan_lib.chunk_layout(lens, chunk)
  assert sum(pieces) == sum(lens) and max(pieces) <= chunk
  n, h, kh, d = sum(lens), 4, 2, 16
  ks = jax.random.split(jax.random.key(seed), 4)
  q, do = jax.random.normal(ks[0], (n, h, d)), jax.random.normal(ks[3], (n, h, d))
  k, v = jax.random.normal(ks[1], (n, kh, d)), jax.random.normal(ks[2], (n, kh, d))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(pieces)]), jnp.int32)
  fn = lambda q, k, v: ops.core_attention(q, k, v, cu, cu, kernel="blockwise", softmax_scale=0.3,
                                          block_sizes=bw.BlockSizes(8, 8))
  o, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(do)
  # The chunked mask written out over whole documents, float64.
  qn, kn, vn, don = (np.asarray(x, np.float64) for x in (q, k, v, do))
  wo, wg = np.zeros_like(qn), [np.zeros_like(qn), np.zeros_like(kn), np.zeros_like(vn)]
  g0 = 0
  for length in lens:
    p = np.arange(length)
    mask = (p[None, :] <= p[:, None]) & (p[None, :] >= (p[:, None] // chunk) * chunk)
    for hh in range(h):
      sl, hk = slice(g0, g0 + length), hh // (h // kh)
      s = np.where(mask, qn[sl, hh] @ kn[sl, hk].T * 0.3, -np.inf)
      pr = np.exp(s - s.max(1, keepdims=True))
      pr /= pr.sum(1, keepdims=True)
      wo[sl, hh] = pr @ vn[sl, hk]
      g = don[sl, hh]
      ds = pr * (g @ vn[sl, hk].T - (g * wo[sl, hh]).sum(1, keepdims=True))
      wg[0][sl, hh] = ds @ kn[sl, hk] * 0.3
      wg[1][sl, hk] += ds.T @ qn[sl, hh] * 0.3
      wg[2][sl, hk] += pr.T @ g
    g0 += length
  np.testing.assert_allclose(np.asarray(o), wo, rtol=2e-5, atol=2e-5)
  for got, want in zip(grads, wg):
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_chunk_layout_forms_and_errors():
  from distca_jax import plan as plan_lib
  assert plan_lib.chunk_layout([5, 8, 3], 4) == [4, 1, 4, 4, 3]
  assert plan_lib.chunk_layout([[9], [2, 4]], 4) == [[4, 4, 1], [2, 4]]
  with pytest.raises(ValueError, match="chunk"):
    plan_lib.chunk_layout([5], 0)


# ------------------------------------------------------------------------------------------------
# Windowed plans: pairs, key/value rows and bytes against brute force; the metadata executed.
# ------------------------------------------------------------------------------------------------


def _random_layout(rng, s: int, t: int):
  """A flat layout over ``s`` ranks of ``t`` tokens: documents may span ranks."""
  lens, total = [], 0
  while total < s * t - 8:
    n = int(min(rng.choice([rng.integers(1, t // 4), rng.integers(t // 2, 3 * t)]),
                s * t - total))
    lens.append(n)
    total += n
  return lens


def _brute_force(plan, window: int):
  """(per-server pairs, [S, S] query rows, [S, S] key/value rows, per-server attention K/V
  rows) from sets of (query position, key position) and of global rows."""
  s, t = plan.num_servers, plan.tokens_per_rank
  loads = np.zeros(s, np.int64)
  kv_attn = np.zeros(s, np.int64)
  q_rows = np.zeros((s, s), np.int64)
  kv_sets: dict[tuple[int, int], set[int]] = {}
  for doc, a, b, srv in plan.tasks.tolist():
    g = int(plan.doc_starts[doc])
    keys = set()
    for p in range(a, b):
      seen = [j for j in range(p + 1) if not window or j > p - window]
      loads[srv] += len(seen)
      keys.update(seen)
      if (g + p) // t != srv:
        q_rows[(g + p) // t, srv] += 1
    kv_attn[srv] += len(keys)
    assert keys == set(range(min(keys), b)) and min(keys) == int(
        max(0, a - window + 1) if window else 0)
    kv_sets.setdefault((doc, srv), set()).update(g + j for j in keys)
  kv_rows = np.zeros((s, s), np.int64)
  for (_, srv), rows in kv_sets.items():
    for r in rows:
      if r // t != srv:
        kv_rows[r // t, srv] += 1
  return loads, q_rows, kv_rows, kv_attn


@pytest.mark.parametrize("window", [1, 7, 40, 300, 0])
def test_window_plan_pairs_and_bytes_equal_brute_force(window, seed):
  """A window plan's loads (before and after), per-pair query and key/value rows, bytes, the
  metadata's send counts and attention key/value rows equal brute-force counts over sets of
  positions and rows; every server is within the tolerance or the plan says why not."""
  from distca_jax import plan as plan_lib
  rng = np.random.default_rng(seed)
  s, t = 4, 256
  lens = _random_layout(rng, s, t)
  opts = plan_lib.PlanOptions(min_shard=8, tolerance=0.05, window=window, q_heads=4, kv_heads=2,
                              head_dim=16)
  plan = plan_lib.schedule(lens, s, tokens_per_rank=t, options=opts)
  assert plan.window == window
  loads, q_rows, kv_rows, kv_attn = _brute_force(plan, window)
  np.testing.assert_array_equal(plan.loads_after, loads)
  np.testing.assert_array_equal(plan.pair_q_rows, q_rows)
  np.testing.assert_array_equal(plan.pair_kv_rows, kv_rows)
  assert plan.bytes_kv == kv_rows.sum() * 2 * 2 * 16 * 2
  q_tr, kv_tr = plan_lib.traffic_rows(plan)
  np.testing.assert_array_equal(kv_tr, kv_rows)
  np.testing.assert_array_equal(q_tr, q_rows)
  start = plan_lib.schedule(lens, s, tokens_per_rank=t,
                            options=dataclasses.replace(opts, max_moves=0))
  np.testing.assert_array_equal(plan.loads_before, _brute_force(start, window)[0])
  meta = plan_lib.plan_to_metadata(plan)
  np.testing.assert_array_equal(meta.kv_send_len, kv_rows)
  np.testing.assert_array_equal(meta.kv_len, kv_attn)
  assert plan_lib.required_capacity(plan).kv_tokens == max(1, kv_attn.max())
  for d in range(s):
    assert plan_lib.attention_pairs(meta.cu_seqlens_q[d], meta.cu_seqlens_k[d], window) == (
        loads[d])
  assert not plan.degraded or plan.degraded_reason
  if window and not plan.degraded:
    assert plan.imbalance_after <= 1.05 + 1e-9



@pytest.mark.parametrize("window", [1, 9, 64])
def test_window_metadata_executes_to_document_attention(window, seed):
  """The NumPy executor running a window plan's metadata (gathers, exchange, windowed tasks,
  return) equals every document's windowed attention computed alone, also on one host with
  servers_per_host (HostBalancer) and in the two-level order."""
  from distca_jax import plan as plan_lib
  rng = np.random.default_rng(seed)
  s, t, h, kh, d = 4, 128, 2, 1, 8
  lens = _random_layout(rng, s, t)
  q = rng.standard_normal((s, t, h, d))
  k, v = rng.standard_normal((s, t, kh, d)), rng.standard_normal((s, t, kh, d))
  want = plan_lib.reference_document_attention(lens, q, k, v, window=window)
  for per_host in (None, 2):
    opts = plan_lib.PlanOptions(min_shard=8, tolerance=0.02, window=window,
                                servers_per_host=per_host)
    plan = plan_lib.schedule(lens, s, tokens_per_rank=t, options=opts)
    meta = plan_lib.plan_to_metadata(plan)
    got = plan_lib.reference_execute(meta, q, k, v, window=window)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-10)



# ------------------------------------------------------------------------------------------------
# The distca data plane on 8 fake devices with a window.
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="window")
def _window_reference(q, k, v, seg, ct, window):
  """Each document alone under the window: dense masked attention over all ranks' tokens as one
  row (documents are consecutive in it), and its VJP."""
  b, t = q.shape[:2]
  flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
  layout = attn_lib.Layout(seg, jnp.zeros_like(seg))
  f = lambda q, k, v: attn_lib.dense_reference(flat(q), flat(k), flat(v), layout,
                                               softmax_scale=td.D**-0.5,
                                               window=window).reshape(q.shape)
  o, vjp = jax.vjp(f, q, k, v)
  return (o, *vjp(ct))


@pytest.mark.slow
@pytest.mark.parametrize("window", [3, 40, 300])
def test_dispatch_with_window_equals_windowed_document_attention(window, seed):
  """``dispatch_attention`` with ``DispatchOptions(window=w)`` over window plans
  (``PlanOptions(window=w)``: tasks with key starts > 0, documents spanning ranks, moved and
  split shards): outputs and dQ/dK/dV equal each document's windowed attention computed alone;
  one trace serves every plan."""
  from distca_jax import plan as plan_lib
  mesh = td._mesh()
  traces = []
  run = td._make_run(mesh, td.SPEC, trace_counter=traces, window=window)
  rng = np.random.default_rng(seed)
  moved = late_keys = 0
  for name, doc_lens, eps in td._layouts(seed)[1::2]:  # flat, huge-rank, span-5-ranks, one-doc
    hp = plan_lib.host_plan(doc_lens, td.SPEC, options=plan_lib.PlanOptions(
        tolerance=float(eps), q_heads=td.H, kv_heads=td.KH, head_dim=td.D, dtype_bytes=4,
        min_shard=None, window=window))
    q, k, v, ct = td._inputs(rng)
    got = run(q, k, v, hp.packed, ct)
    want = _window_reference(q, k, v, td._segments(doc_lens, td.S, td.T), ct, window)
    td._check(got, want, f"{name} {window=} {hp.plan.summary()}")
    moved += hp.plan.num_moves
    late_keys += int((hp.plan.k_starts > 0).sum())
  assert moved > 0 and late_keys > 0, (moved, late_keys)
  assert len(traces) == 1


# ------------------------------------------------------------------------------------------------
# FlashAttention-3's windowed path: on an emulator of the bindings, and lowered for CUDA.
# ------------------------------------------------------------------------------------------------


class WindowFA3Emulator(FA3Emulator):
  """``test_ops.FA3Emulator`` taking FA3's ``window_size`` (it must be ``(window - 1, 0)``); the
  caller patches its reference to the same window."""

  def __init__(self, window: int):
    super().__init__()
    self.window = window

  def fwd(self, *args, window_size, **kw):
    assert window_size == (self.window - 1, 0), window_size
    return super().fwd(*args, **kw)

  def bwd(self, *args, window_size, **kw):
    assert window_size == (self.window - 1, 0), window_size
    return super().bwd(*args, **kw)


@pytest.mark.parametrize("window", [6] + [pytest.param(w, marks=pytest.mark.slow)
                                     for w in (1, 50)])
def test_flash3_window_on_emulator_equals_oracle(window, seed, monkeypatch):
  """``flash3_masked`` with a window (bucketed launch shapes, padding masked) hands FA3
  ``window_size=(window - 1, 0)`` in the forward and every backward branch; on the emulator
  (the reference kernel under the same window) outputs and dQ/dK/dV equal the float64
  oracle."""
  monkeypatch.setattr(va, "varlen_attention_reference", functools.partial(
      va.varlen_attention_reference, window=window))
  cu_q, cu_k, q, k, v, do = task_inputs(seed, 2)
  tq, h = q.shape[:2]
  emu = WindowFA3Emulator(window)
  cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
  fn = lambda q, k, v: fa3.flash3_masked(q, k, v, cq, ck, softmax_scale=0.3, max_seqlen_q=64,
                                          max_seqlen_k=128, grid_levels=2,
                                          impl=(emu.fwd, emu.bwd), window=window)[0]
  o, vjp = jax.vjp(fn, q, k, v)
  grads = vjp(do)
  want = oracle(q, k, v, cu_q, cu_k, 0.3, do, np.zeros((tq, h)), window=window)
  np.testing.assert_allclose(np.asarray(o), want[0], rtol=2e-5, atol=2e-5)
  for g, w in zip(grads, want[2:]):
    np.testing.assert_allclose(np.asarray(g), w, rtol=2e-4, atol=2e-4)
  assert emu.calls, "the emulator was not called"


def test_flash3_window_lowers_for_cuda():
  """The FA3 bindings' forward and backward FFI calls, lowered for CUDA on the CPU, carry the
  window (``window_size_left = w - 1``, ``window_size_right = 0``); window 0 keeps FA3's plain
  causal mask (-1, -1). Needs the bindings importable (the 'gpu' extra)."""
  pytest.importorskip("flash_attn3_jax")
  t, h, kh, d = 256, 4, 2, 128
  q = jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((t, kh, d), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((5,), jnp.int32)

  def lowered(window):
    def grads(q, k, v, cu_q, cu_k):
      loss = lambda q, k, v: jnp.sum(fa3.flash3_masked(
          q, k, v, cu_q, cu_k, softmax_scale=0.1, max_seqlen_q=128, max_seqlen_k=128,
          grid_levels=2, impl=fa3._FA3_IMPL, window=window)[0].astype(jnp.float32))
      return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return jax.jit(grads).trace(q, k, k, cu, cu).lower(lowering_platforms=("cuda",)).as_text()

  text = lowered(128)
  assert "flash_mha_fwd" in text and "flash_mha_bwd" in text
  assert set(re.findall(r"window_size_left = (-?\d+)", text)) == {"127"}
  assert set(re.findall(r"window_size_right = (-?\d+)", text)) == {"0"}
  assert set(re.findall(r"window_size_left = (-?\d+)", lowered(0))) == {"-1"}


# ------------------------------------------------------------------------------------------------
# Mosaic GPU: the windowed work lists (NumPy checks on CPU), and the kernels lowered for CUDA.
# ------------------------------------------------------------------------------------------------


def _window_visible(lq, lk, window):
  r = np.arange(lq)[:, None] + (lk - lq)
  j = np.arange(lk)[None, :]
  return (j <= r) & (j > r - window)


@pytest.mark.parametrize("window", [1, 100, 200, 1000])
def test_mosaic_forward_window_tiles_cover_exactly_the_visible_pairs(window, seed):
  """The forward's in-place work list with a window: every stored row's windowed visible pairs
  visited exactly once, tiles not masked by the window wholly visible, every key tile read
  inside the tasks' keys or from the zero-padded edge copy, and no key tile a CTA streams is
  wholly outside the windows of its stored rows."""
  from custom_ops import mosaic_worklists as mw
  from test_mosaic_attention import _check_edge_read, _compiled, _kv_edge
  rng = np.random.default_rng(seed)
  bs = mw.BlockSizes()
  bq, bkv = bs.block_q, bs.block_kv
  cu_q, cu_k = random_table_long(rng)
  total_q = int(cu_q[-1]) + 8 - int(cu_q[-1]) % 8
  total_k = int(cu_k[-1]) + 5
  table = _compiled(lambda cu_q, cu_k: mw.q_tile_table_in_place(
      cu_q, cu_k, total_q, bs, bkv, window), cu_q, cu_k)
  assert table.shape[0] == mw.QT_FIELDS_IN_PLACE + 2
  (lo, hi, hb8, tb8), edge_rows, edge_block, _ = _kv_edge(cu_k, total_k, bs)
  covered = [np.zeros((b - a, d - c), int) for a, b, c, d in
             zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])]
  for col in table.T:
    err = f"{seed=} {window=} {col=}"
    kb, shift, lk_cut = col[mw.QT_KB8] * 8, col[mw.QT_SHIFT], col[mw.QT_LK]
    useful = np.zeros(col[mw.QT_NMAX], bool)
    for w in range(2):
      row0 = col[mw.QT_Q_ROW8] * 8 + w * bq
      va, vn = col[mw.QT_VA_W + w], col[mw.QT_VN_W + w]
      n_full, n_kv = col[mw.QT_NFULL + w], col[mw.QT_NKV + w]
      if vn == 0 or n_kv == 0:
        continue
      rows = np.arange(row0 + va, row0 + va + vn)
      task = int(np.searchsorted(cu_q, rows[0], side="right") - 1)
      lq, lk = cu_q[task + 1] - cu_q[task], cu_k[task + 1] - cu_k[task]
      cut = kb + shift - cu_k[task]  # keys before the tile's first key tile are cut
      assert cut >= 0 and lk_cut == lk - cut, err
      assert col[mw.QT_DIAG + w] == row0 - cu_q[task] + lk - lq - cut, err
      r = rows - cu_q[task]
      vis = _window_visible(lq, lk, window)
      a = min(max(int(shift > 0), col[-2 + w]), n_kv)
      b = max(a, min(n_full, n_kv))
      for j in range(n_kv):
        _check_edge_read(((lo, hi, hb8, tb8), edge_rows), kb + j * bkv, bkv, edge_block, total_k,
                         err)
        kpos = j * bkv + np.arange(bkv) - shift
        real = kpos[(kpos >= 0) & (kpos < lk_cut)] + cut
        if a <= j < b:
          assert kpos[0] >= 0 and kpos[-1] < lk_cut and vis[np.ix_(r, kpos + cut)].all(), (
              f"{err}: unmasked tile {j}")
        covered[task][np.ix_(r, real)] += vis[np.ix_(r, real)]
        useful[j] |= vis[np.ix_(r, real)].any()
    assert useful.all(), f"{err}: key tiles {np.flatnonzero(~useful)} wholly outside the windows"
  for task, cov in enumerate(covered):
    vis = _window_visible(*cov.shape, window)
    assert (cov[vis] == 1).all() and (cov[~vis] == 0).all(), f"{seed=} {window=} task {task}"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [1, 100, 200, 1000])
def test_mosaic_backward_window_steps_cover_exactly_the_visible_pairs(window, fused, seed):
  """The in-place dK/dV work list with a window, stepped as the fused backward (zero, masked,
  whole, masked, zero steps per warpgroup; a block holding rows outside its task masked on
  every visible step) or the dK/dV kernel (skipped steps instead of zero ones): every pair it
  counts is a windowed visible pair of its own task, each once, and no query tile a CTA streams
  is wholly past the windows of its keys."""
  from custom_ops import mosaic_worklists as mw
  rng = np.random.default_rng(seed)
  bs = mw.BlockSizes(fused_bwd=fused)
  bkd, bqd = bs.block_kv_dkv, bs.block_q_dkv
  cu_q, cu_k = random_table_long(rng)
  total_q, total_k = int(cu_q[-1]) + 2, int(cu_k[-1]) + int(rng.integers(0, 200))
  from test_mosaic_attention import _compiled

  def lists(cu_q, cu_k):
    lay_f = mw.aligned_layout(cu_q, total_q, bs.align_q, front=True)
    return mw.kv_tile_table_in_place(cu_q, cu_k, lay_f, total_k, bs, window), lay_f.start_N

  table, start_f = _compiled(lists, cu_q, cu_k)
  assert table.shape[0] == mw.KT_FIELDS_WINDOW
  n = cu_q.size - 1
  start_q = start_f + cu_q[:-1] % 8
  counts = np.zeros((mw.padded_rows(total_q, n, bs.align_q, front=True), total_k), int)
  for col in table.T:
    err = f"{seed=} {window=} {col=}"
    n_q, qa, q_row = col[mw.KT_NQ], col[mw.KT_QA], col[mw.KT_Q_ROW] * bs.align_q
    useful = np.zeros(max(n_q - qa, 0), bool)
    for w in range(2):
      row0 = col[mw.KT_K_ROW] * 8 + w * bkd
      qa_w, qf_w, moff = col[mw.KT_QA_W + w], col[mw.KT_QF_W + w], col[mw.KT_MOFF_W + w]
      qw_w, qe_w = col[mw.KT_QW_W + w], col[mw.KT_QE_W + w]
      va, vn = col[mw.KT_VA_W + w], col[mw.KT_VN_W + w]
      assert qa <= qa_w <= qf_w <= qw_w <= qe_w <= n_q, err
      inside = va == 0 and vn == bkd
      full = (qf_w, qw_w) if (inside or not fused) else (qe_w, qe_w)
      key = np.arange(bkd)[None, :]
      for qt in range(qa_w, qe_w):
        row = np.arange(bqd)[:, None] + qt * bqd
        if full[0] <= qt < full[1]:
          mask = np.ones((bqd, bkd), bool)
        else:
          mask = (key + moff <= row) & (row < key + moff + window)
          if fused:
            mask &= (key >= va) & (key < va + vn)
        if not fused:  # the dK/dV kernel stores only its segment's rows
          mask = mask & (key >= va) & (key < va + vn)
        np.add.at(counts, (q_row + row[:, 0][:, None], row0 + key), mask.astype(int))
        useful[qt - qa] |= mask.any()
    assert useful.all(), f"{err}: query tiles {qa + np.flatnonzero(~useful)} see none of its keys"
  want = np.zeros_like(counts)
  real_rows = np.zeros(counts.shape[0], bool)
  for i in range(n):
    lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
    want[start_q[i]:start_q[i] + lq, cu_k[i]:cu_k[i + 1]] = _window_visible(lq, lk, window)
    real_rows[start_q[i]:start_q[i] + lq] = True
  np.testing.assert_array_equal(counts[real_rows], want[real_rows], err_msg=f"{seed=} {window=}")


def random_table_long(rng):
  """``test_mosaic_attention.random_table`` of 7 tasks up to 900 rows (windows of 100-1000 rows
  then cut the key ranges)."""
  from test_mosaic_attention import random_table
  return random_table(rng, 7, 900)


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mosaic_window_kernels_lower_for_cuda(fused):
  """The Mosaic forward and backward kernels with a window lower to Mosaic GPU modules without
  a GPU (cross-platform lowering: layout inference, TMA shapes, the window's loops)."""
  from custom_ops import mosaic_attention as ma
  bs = ma.BlockSizes(fused_bwd=fused)
  q = jax.ShapeDtypeStruct((1000, 4, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2045, 2, 128), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((5,), jnp.int32)

  def loss(q, k, v, cu_q, cu_k):
    o, lse = ma.mosaic_attention(q, k, v, cu_q, cu_k, block_sizes=bs, window=256)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
  text = jax.jit(jax.grad(loss, (0, 1, 2))).trace(q, k, k, cu, cu).lower(
      lowering_platforms=("cuda",)).as_text()
  kernels = ["mosaic_attention_bwd"] if fused else ["mosaic_attention_dq", "mosaic_attention_dkv"]
  for name in ["mosaic_attention_fwd"] + kernels:
    assert name in text, name
  with pytest.raises(ValueError, match="dkv_in_place"):
    ma.mosaic_attention(jnp.zeros((8, 2, 64), jnp.bfloat16), jnp.zeros((8, 2, 64), jnp.bfloat16),
                        jnp.zeros((8, 2, 64), jnp.bfloat16), jnp.asarray([0, 8], jnp.int32),
                        jnp.asarray([0, 8], jnp.int32), window=4,
                        block_sizes=ma.BlockSizes(fused_bwd=False, dkv_in_place=False))


@pytest.mark.parametrize("window", [1, 16, 1000])
def test_kernel_bench_windowed_workloads_keep_every_visible_pair(window):
  """experiments/kernel_bench.py's windowed calls (``--windows``) keep each task's queries and
  cut only keys no query's window reads: their windowed pairs equal the uncut call's."""
  from distca_jax.plan import cost as plan_cost
  from experiments import kernel_bench as kb
  sched = kb.SchedConfig(tokens_per_rank=256, servers=4, step=0, tolerance=0.05, server="max",
                         buffers="used", seed=0, q_heads=4, kv_heads=2, head_dim=32)
  full = kb.make_workloads(["dense-128", "ca-s16", "sched-pretrain-m16"], 256, 256, 0, sched)
  cut = kb.make_workloads(["dense-128", "ca-s16", "sched-pretrain-m16"], 256, 256, 0, sched,
                          windows=(window,))
  for f, c in zip(full, cut):
    assert c.name == f"{f.name}-w{window}" and c.cu_q == f.cu_q and c.window == window
    assert plan_cost.attention_pairs(c.cu_q, c.cu_k, window) == plan_cost.attention_pairs(
        f.cu_q, f.cu_k, window)
    assert c.kv_rows >= c.cu_k[-1] and c.cu_k[-1] <= f.cu_k[-1]
    lk = np.diff(c.cu_k)
    assert lk.max(initial=0) <= c.max_k


@pytest.mark.slow
def test_distca_backend_with_window_equals_windowed_reference(seed):
  """The distca backend built with ``Options(window=w)``: its CAD step (window plans, windowed
  kernel) and its local step (``packed_dp`` with the window) both equal each row's documents'
  windowed attention (dense reference), on 8 fake devices, outputs and gradients."""
  from distca_jax.backends import distca as distca_backend
  from jax.sharding import NamedSharding, PartitionSpec as P
  window, t = 24, td.T
  backend = distca_backend.make(distca_backend.Options(
      window=window, kernel="blockwise", q_heads=td.H, kv_heads=td.KH, head_dim=td.D,
      dtype_bytes=4, min_shard=8, tolerance=0.0))
  rng = np.random.default_rng(seed)
  layout = random_layout(rng, td.S, t)
  doclens = _doc_rows(layout)
  doclens[0] = [t]  # one long document: its server's work moves
  seg = np.asarray(layout.segment_ids_BxT).copy()
  seg[0] = 1
  extra = {k: jnp.asarray(v) for k, v in backend.host_prepare(doclens, t).items()}
  mesh = td._mesh(tensor=1)
  q, k, v, ct = td._inputs(rng)
  lay = attn_lib.Layout(jnp.asarray(seg), layout.positions_BxT, extra)
  want = jax.vmap(lambda q, k, v, ct, s: _window_reference(q[None], k[None], v[None], s[None],
                                                           ct[None], window),
                  in_axes=(0, 0, 0, 0, 0))(q, k, v, ct, jnp.asarray(seg))
  want = [w[:, 0] for w in want]
  sh = NamedSharding(mesh, P("data"))
  for name, fn in (("cad", backend.fn), ("local", backend.local_fn)):
    with jax.set_mesh(mesh):
      f = lambda q, k, v: fn(q, k, v, lay, softmax_scale=td.D**-0.5)  # noqa: E731
      args = [jax.device_put(x, sh) for x in (q, k, v)]
      o, vjp = jax.vjp(f, *args)
      got = (o, *vjp(jax.device_put(ct, sh)))
    td._check(got, want, f"{name} {window=}")
  assert int(np.asarray(extra["crosses"]).max()) == 1  # the CAD step's plans moved rows
