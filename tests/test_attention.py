"""`local` core attention (blockwise, custom VJP) equals the dense reference: outputs and grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distca_jax import attention as attn
from distca_jax import backends
from distca_jax.data.workloads import WorkloadSampler, split_into_rows


def random_layout(rng, rows, t, workload=None):
  """Segment ids / positions of random documents; some rows end in padding."""
  seg = np.zeros((rows, t), np.int32)
  pos = np.zeros((rows, t), np.int32)
  if workload:
    lens = WorkloadSampler(workload, t, seed=int(rng.integers(1 << 30))).step_doclens(
        int(rng.integers(100)), rows)
  else:
    lens = [list(rng.integers(1, t // 2, size=8)) for _ in range(rows)]
    lens = [split_into_rows(r, t, 1)[0] if sum(r) > t else r for r in
            ([_fit(r, t) for r in lens])]
  for b, row in enumerate(lens):
    p = 0
    for i, l in enumerate(row):
      seg[b, p:p + l] = i + 1
      pos[b, p:p + l] = np.arange(l)
      p += l
  return attn.Layout(jnp.asarray(seg), jnp.asarray(pos))


def _fit(row, t):
  out, total = [], 0
  for l in row:
    l = int(min(l, t - total))
    if l <= 0:
      break
    out.append(l)
    total += l
  if total == t and len(out) > 1:
    out[-1] -= 3  # leave padding at the end of some rows
  return out


@pytest.mark.parametrize("heads,kv_heads,workload,blocks", [
    (4, 2, None, (16, 8)), pytest.param(2, 2, "pretrain", (32, 32), marks=pytest.mark.slow),
    pytest.param(4, 1, "prolong", (8, 16), marks=pytest.mark.slow)])
def test_local_equals_reference(seed, heads, kv_heads, workload, blocks):
  rng = np.random.default_rng(seed)
  b, t, d = 3, 64, 16
  layout = random_layout(rng, b, t, workload)
  q = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, t, kv_heads, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
  scale = 1 / np.sqrt(d)
  ref = lambda q, k, v: attn.dense_reference(q, k, v, layout, softmax_scale=scale)
  loc = lambda q, k, v: attn.local_attention(q, k, v, layout, softmax_scale=scale,
                                             block_q=blocks[0], block_k=blocks[1])
  o_ref, o_loc = ref(q, k, v), jax.jit(loc)(q, k, v)
  np.testing.assert_allclose(o_loc, o_ref, atol=2e-5, rtol=1e-5)
  pad = np.asarray(layout.segment_ids_BxT) == 0
  assert np.all(np.asarray(o_loc)[pad] == 0) and np.isfinite(np.asarray(o_loc)).all()
  g_ref = jax.grad(lambda *a: (ref(*a) * w).sum(), argnums=(0, 1, 2))(q, k, v)
  g_loc = jax.jit(jax.grad(lambda *a: (loc(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
  for a, r in zip(g_loc, g_ref):
    np.testing.assert_allclose(a, r, atol=5e-5, rtol=1e-4)


def test_attention_never_crosses_documents(seed):
  rng = np.random.default_rng(seed)
  b, t, h, d = 1, 32, 2, 8
  seg = jnp.asarray(np.repeat([1, 2], 16)[None], jnp.int32)
  layout = attn.Layout(seg, jnp.asarray(np.tile(np.arange(16), 2)[None], jnp.int32))
  q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
  o = attn.local_attention(q, k, v, layout, softmax_scale=0.3, block_q=8, block_k=8)
  k2 = k.at[:, :16].set(jnp.asarray(rng.normal(size=(b, 16, h, d)), jnp.float32))
  o2 = attn.local_attention(q, k2, v, layout, softmax_scale=0.3, block_q=8, block_k=8)
  np.testing.assert_array_equal(o[:, 16:], o2[:, 16:])
  assert not np.allclose(o[:, :16], o2[:, :16])


def test_unknown_backend_names_the_choices():
  with pytest.raises(ValueError, match="available: .*local"):
    backends.get("nope")


def test_shape_errors_are_clear():
  x = jnp.zeros((1, 8, 3, 4))
  lay = attn.Layout(jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="multiple of kv heads"):
    attn.local_attention(x, jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 2, 4)), lay, softmax_scale=1.0)


def test_local_backend_refuses_degenerate_blocks():
  """A row length with no useful divisor (here a prime) is an error naming the fix, not a loop
  over 1-token blocks."""
  t = 37
  x = jnp.ones((1, t, 2, 4))
  lay = attn.Layout(jnp.ones((1, t), jnp.int32), jnp.arange(t)[None])
  with pytest.raises(ValueError, match="T=37.*multiple of 8"):
    attn.local_attention(x, x, x, lay, softmax_scale=1.0, block_q=32, block_k=32)
