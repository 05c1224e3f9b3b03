"""Models that mix local (sliding-window, chunked) and global attention layers: the layer
pattern, chunk cuts, and the model against a dense per-layer reference with each layer's mask."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from distca_jax import attention as attn_lib
from distca_jax import layer_types as types_lib
from distca_jax import model as model_lib
from distca_jax.data import batch as batch_lib
from distca_jax.plan import chunk_layout

LT = types_lib.LayerType
W8, C8, FULL = LT("window", 8), LT("chunk", 8), types_lib.FULL_TYPE


# ----------------------------------------------------------------------------------------------
# The pattern
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,kw,want", [
    ("", {}, [FULL] * 6),
    ("local", {"window": 8}, [W8] * 6),
    ("5:1", {"window": 8}, [W8] * 5 + [FULL]),
    ("1:1", {"chunk": 8}, [C8, FULL] * 3),
    ("2:1", {"window": 8}, [W8, W8, FULL, W8, W8, FULL]),
    ("LGLLGL", {"chunk": 8}, [C8, FULL, C8, C8, FULL, C8]),
])
def test_layer_pattern(pattern, kw, want):
  cfg = model_lib.ModelConfig(n_layers=6, layer_pattern=pattern, **kw)
  assert cfg.layer_types == tuple(want)
  assert model_lib.execution_plan(cfg).layer_types == tuple(want)


@pytest.mark.parametrize("kw,match", [
    (dict(layer_pattern="5:1"), r"needs model.window > 0"),
    (dict(window=8), r"model.window=8 / model.chunk=0 with model.layer_pattern='': no layer"),
    (dict(layer_pattern="local", window=8, chunk=8), r"set at most one of them"),
    (dict(layer_pattern="local", window=-1), r"set at most one of them"),
    (dict(layer_pattern="LLG", window=8), r"names 3 layers; model.n_layers=6"),
    (dict(layer_pattern="0:1", window=8), r"'K:G' needs K >= 1"),
    (dict(layer_pattern="sliding", window=8), r"model.layer_pattern='sliding'; use"),
])
def test_layer_pattern_errors(kw, match):
  with pytest.raises(ValueError, match=match):
    model_lib.ModelConfig(n_layers=6, **kw)


def test_mixed_types_need_the_single_stream():
  cfg = model_lib.ModelConfig(n_layers=4, layer_pattern="1:1", window=8)
  with pytest.raises(ValueError, match=r"runs one layer type for all layers; the model mixes "
                                       r"\['window8', 'full'\]"):
    model_lib.execution_plan(cfg, nano_batches=2)
  uniform = model_lib.ModelConfig(n_layers=4, layer_pattern="local", window=8)
  assert model_lib.execution_plan(uniform, nano_batches=2).layer_types == (W8,) * 4


def test_plan_of_other_types_is_refused(seed):
  cfg = model_lib.ModelConfig(n_layers=2, layer_pattern="1:1", window=4, dtype="float32")
  model = model_lib.Transformer(cfg, masked_reference, plan=model_lib.ExecutionPlan())
  tokens, layout = random_batch(np.random.default_rng(seed), 1, 16, cfg.vocab_size)
  with pytest.raises(ValueError, match=r"plan.layer_types=\[\] differ from the model's"):
    model.init(jax.random.key(0), tokens, layout)


# ----------------------------------------------------------------------------------------------
# Chunk cuts
# ----------------------------------------------------------------------------------------------
def test_cut_doclens_and_segment_ids_agree(seed):
  rng = np.random.default_rng(seed)
  t = 64
  for _ in range(20):
    doclens = random_doclens(rng, 3, t)
    chunk = int(rng.integers(1, 20))
    cut = chunk_layout(doclens, chunk)
    assert [sum(r) for r in cut] == [sum(r) for r in doclens]
    assert all(0 < n <= chunk for r in cut for n in r)
    seg, pos = batch_lib.layout_arrays(doclens, t)
    want, _ = batch_lib.layout_arrays(cut, t)
    got = types_lib.cut_segment_ids(jnp.asarray(seg), jnp.asarray(pos), chunk)
    np.testing.assert_array_equal(np.asarray(got), want)


# ----------------------------------------------------------------------------------------------
# The model against a dense reference with each layer's own mask
# ----------------------------------------------------------------------------------------------
def random_doclens(rng, rows, t):
  out = []
  for _ in range(rows):
    row, left = [], int(rng.integers(t * 3 // 4, t + 1))
    while left:
      n = int(min(left, rng.integers(1, t)))
      row.append(n)
      left -= n
    out.append(row)
  return out


def random_batch(rng, rows, t, vocab):
  seg, pos = batch_lib.layout_arrays(random_doclens(rng, rows, t), t)
  tokens = jnp.asarray(rng.integers(0, vocab, (rows, t)), jnp.int32)
  return tokens, attn_lib.Layout(jnp.asarray(seg), jnp.asarray(pos))


def type_mask(seg, pos, layer_type):
  """[B, T, T]: query i attends key j of its own document, j <= i, and per type: the window
  (i - j < w) or the chunk (pos_j >= (pos_i // c) * c). Written from the definitions, not from
  layer_types' helpers."""
  t = seg.shape[1]
  i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
  m = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & (j <= i)[None]
  if layer_type.kind == "window":
    m &= (i - j < layer_type.size)[None]
  if layer_type.kind == "chunk":
    c = layer_type.size
    m &= pos[:, None, :] >= (pos[:, :, None] // c) * c
  return m


def dense_masked(q, k, v, mask, scale):
  b, t, h, d = q.shape
  kh = k.shape[2]
  q = q.astype(jnp.float32).reshape(b, t, kh, h // kh, d)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(jnp.float32)) * scale
  s = jnp.where(mask[:, None, None], s, -1e30)
  p = jnp.where(mask[:, None, None], jax.nn.softmax(s, axis=-1), 0.0)
  return jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(b, t, h, d)


def masked_reference(q, k, v, layout, *, softmax_scale, window: int = 0):
  """A core-attention backend (dense) with the sliding window as a keyword: what the model calls
  for a window layer. Chunk layers arrive with their segment ids already cut."""
  lt = LT("window", window) if window else FULL
  mask = type_mask(layout.segment_ids_BxT, layout.positions_BxT, lt)
  return dense_masked(q, k, v, mask, softmax_scale).astype(q.dtype)


def reference_logits(cfg, params, tokens, layout, types):
  """The decoder written out layer by layer with dense attention under ``types[i]``'s mask."""
  p = params["params"]
  layers = ([jax.tree.map(lambda a: a[i], p["layers"]["layer"]) for i in range(cfg.n_layers)]
            if cfg.scan_layers else [p[f"layer_{i}"]["layer"] for i in range(cfg.n_layers)])
  pre, post = model_lib.PreCA(cfg, parent=None), model_lib.PostCA(cfg, parent=None)
  x = jnp.take(p["embedding"], tokens, axis=0).astype(cfg.compute_dtype)
  for lp, lt in zip(layers, types):
    q, k, v = pre.apply({"params": lp["pre_ca"]}, x, layout.positions_BxT)
    mask = type_mask(layout.segment_ids_BxT, layout.positions_BxT, lt)
    o = dense_masked(q, k, v, mask, 1.0 / math.sqrt(cfg.head_dim)).astype(q.dtype)
    x = post.apply({"params": lp["post_ca"]}, x, o)
  h = model_lib.RMSNorm(cfg.norm_eps, cfg.compute_dtype).apply(
      {"params": p["final_norm"]}, x)
  return model_lib.lm_head_logits(h, p["lm_head"])


def small_cfg(**kw):
  return model_lib.ModelConfig(**dict(dict(n_layers=6, dim=32, n_heads=4, n_kv_heads=2,
                                           head_dim=8, mlp_dim=64, vocab_size=64,
                                           dtype="float32", remat="none", init_std=0.2), **kw))


@pytest.mark.parametrize("kw", [
    dict(layer_pattern="5:1", window=5),
    pytest.param(dict(layer_pattern="5:1", window=5, scan_layers=False), marks=pytest.mark.slow),
    dict(layer_pattern="LGLLGL", chunk=6),
    pytest.param(dict(layer_pattern="local", window=3, remat="full"), marks=pytest.mark.slow),
    pytest.param(dict(layer_pattern="2:1", chunk=4, remat="save_attention", remat_mlp_layers=3),
                 marks=pytest.mark.slow),
])
def test_model_equals_per_layer_reference(seed, kw):
  """Logits and gradients of the model (each run of layers of one type a scan) equal the dense
  per-layer reference; the reference with every layer full differs (the masks matter)."""
  cfg = small_cfg(**kw)
  rng = np.random.default_rng(seed)
  tokens, layout = random_batch(rng, 2, 32, cfg.vocab_size)
  model = model_lib.Transformer(cfg, masked_reference)
  params = nn.meta.unbox(model.init(jax.random.key(seed), tokens, layout))
  ours = lambda p: model.apply(p, tokens, layout, method=model_lib.Transformer.logits)
  ref = lambda p: reference_logits(cfg, p, tokens, layout, cfg.layer_types)
  with jax.default_matmul_precision("highest"):
    got, want = ours(params), ref(params)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    full = reference_logits(cfg, params, tokens, layout, [FULL] * cfg.n_layers)
    assert float(jnp.max(jnp.abs(full - want))) > 100 * 2e-5 * float(jnp.max(jnp.abs(want))), (
        "the local masks change nothing here")
    loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p)))
    g_got, g_want = jax.grad(loss(ours))(params), jax.grad(loss(ref))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-4),
                 g_got, g_want)


def test_uniform_local_model_under_ping_pong(seed):
  """Every layer local: the ping-pong schedule runs the type too (same logits as the single
  stream, which the reference test covers)."""
  cfg = small_cfg(n_layers=3, layer_pattern="local", chunk=5)
  rng = np.random.default_rng(seed)
  tokens, layout = random_batch(rng, 2, 32, cfg.vocab_size)
  single = model_lib.Transformer(cfg, masked_reference)
  params = nn.meta.unbox(single.init(jax.random.key(seed), tokens, layout))
  pp = single.clone(plan=model_lib.execution_plan(cfg, nano_batches=2))
  with jax.default_matmul_precision("highest"):
    want = reference_logits(cfg, params, tokens, layout, cfg.layer_types)
    got = pp.apply(params, tokens, layout, method=model_lib.Transformer.logits)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
