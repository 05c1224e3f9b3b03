"""Llama-3 family decoder in Flax Linen, written as pre-CA / core attention / post-CA per layer.

Each layer is three named pieces so that core attention (no weights) can be moved elsewhere:
  * `PreCA`: RMSNorm, Q/K/V projections, RoPE at each token's position inside its own document.
  * core attention: the model field `attend`, a backend's function of (q, k, v, layout)
    (`backends.build(config).fn`).
  * `PostCA`: output projection, residual, RMSNorm, SwiGLU MLP, residual.

Linen declares the parameters (`init` runs the Linen layers under `nn.scan`, or as a list when
`scan_layers=False`, which fixes the parameter tree that checkpoints and Hugging Face import
read); every forward pass, `init`'s included, runs the stack through ONE entry, `run_stack`, on
the unboxed parameters, with an explicit `ExecutionPlan` that the trainer picks from the config
(`execution_plan`): the single stream (one scan with a remat policy, two scans of two policies,
or unrolled), the ping-pong of two nano-batches (`ping_pong_layers`) or a pipeline of stages
(`distca_jax.pipeline`). Every plan is built from the same `layer_pieces`.
Parameters are float32 (master copy), compute runs in `dtype` (bf16 by default).

Shape letters (docs/design.md, "Words and letters"): B rows, T tokens per row, E embed, H query
heads, K kv heads, D head dim, F MLP hidden, V vocab, L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from distca_jax import attention as attn_lib
from distca_jax import layer_types as types_lib
from distca_jax import ops
from distca_jax import pipeline as pipeline_lib
from distca_jax import sharding as shard_lib

Layout = attn_lib.Layout


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model's dimensions and numerics (the glossary of shape letters)."""
  vocab_size: int = 256          # V
  dim: int = 64                  # E, residual width
  n_layers: int = 2              # L
  n_heads: int = 4               # H, query heads
  n_kv_heads: int = 2            # K, key/value heads (GQA when K < H; must divide H)
  head_dim: int = 16             # D
  mlp_dim: int = 128             # F, SwiGLU hidden width
  rope_theta: float = 500_000.0  # RoPE base
  # Llama-3 frequency scaling: factor 0 disables it. Llama-3.1 uses factor 8, low 1, high 4,
  # original context 8192.
  rope_scaling_factor: float = 0.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  norm_eps: float = 1e-5         # RMSNorm epsilon
  tie_embeddings: bool = False   # share the input embedding with the LM head
  dtype: str = "bfloat16"        # compute dtype; params and optimizer state stay float32
  param_dtype: str = "float32"
  # Rematerialization of each layer in the backward: 'none' (keep all activations), 'full'
  # (recompute the whole layer, core attention's forward and CAD's exchanges included),
  # 'save_dots' (keep matmul outputs, recompute the rest), 'save_qkv_out' (keep q/k/v and the
  # core-attention output; the kernel's forward still reruns to rebuild its residuals),
  # 'save_attention' (keep the kernel's inputs, its outputs O and LSE, and the core-attention
  # output: the backward reruns only the linear layers and norms, never the attention kernel's
  # forward nor CAD's exchanges; about 2 x q + 2 x k/v rows per layer more than 'full'),
  # 'offload_mlp' ('save_attention' plus the MLP input and gate/up outputs in pinned host memory:
  # no matmul reruns; GPU only).
  # Measured at 128K tokens per H200, 2 layers: 'none' steps 2% faster than 'save_attention'
  # for 116-121 vs 63-66 GB per GPU: too little speed for the memory at long rows.
  remat: str = "full"
  # With remat='save_attention': the first N layers also keep their MLP input and gate/up
  # projections on the device (names 'mlp_in', 'mlp_gate', 'mlp_up'), so their backward reruns no
  # linear layer; each such layer keeps tokens x (E + 2F) compute-dtype values more (3.75 GiB at
  # 64K tokens of Llama-3-8B layers). The stack then runs as two scans over the same stacked
  # parameters (single stream only: attention.nano_batches=1, mesh.pipe=1).
  remat_mlp_layers: int = 0
  scan_layers: bool = True       # layers stacked, run under one scan (compile time flat in depth)
  init_std: float = 0.02         # normal init of every weight matrix
  loss_chunk: int = 4096         # tokens per chunk of the LM head + loss (bounds logits memory;
                                 # each chunk's gradients are computed in its forward pass)
  # Local and global attention layers (``layer_types``; distca_jax/layer_types.py). Which layers
  # are local: '' (none: every layer full causal), 'local' (every layer), 'K:G' (K local layers
  # then G full ones, repeated from layer 0 and cut at n_layers: Gemma 3 is '5:1', gpt-oss
  # '1:1'), or one letter per layer, 'L' local and 'G' full (e.g. 'LLLLLG').
  layer_pattern: str = ""
  # What a local layer is (exactly one > 0 when layer_pattern is set): a sliding window of
  # `window` tokens (query position p attends keys [max(0, p - window + 1), p] of its
  # document; Mistral's sliding_window), or chunks of `chunk` tokens (keys [(p // chunk) *
  # chunk, p]; Llama 4's chunked attention). RoPE positions stay document positions.
  window: int = 0
  chunk: int = 0

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
    for f in ("dtype", "param_dtype"):
      jnp.dtype(getattr(self, f))  # raises on an unknown dtype name
    if not 0 <= self.remat_mlp_layers <= self.n_layers:
      raise ValueError(f"remat_mlp_layers={self.remat_mlp_layers} must lie in [0, n_layers="
                       f"{self.n_layers}]")
    if self.remat_mlp_layers and (self.remat != "save_attention" or not self.scan_layers):
      raise ValueError(f"remat_mlp_layers={self.remat_mlp_layers} needs remat='save_attention' and "
                       f"scan_layers=True (got remat={self.remat!r}, scan_layers="
                       f"{self.scan_layers}); set remat_mlp_layers=0 otherwise")
    self.layer_types  # raises on a bad layer_pattern / window / chunk

  @property
  def layer_types(self) -> tuple[types_lib.LayerType, ...]:
    """Each layer's attention type (``layer_types.parse_layer_pattern`` of ``layer_pattern``,
    ``window``, ``chunk``)."""
    return types_lib.parse_layer_pattern(self.layer_pattern, self.n_layers, window=self.window,
                                         chunk=self.chunk)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def num_params(self, *, embeddings: bool = True) -> int:
    """Parameter count; `embeddings=False` leaves out the input embedding and LM head."""
    e, h, k, d, f = self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.mlp_dim
    per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * f + 2 * e
    n = self.n_layers * per_layer + e
    if embeddings:
      n += self.vocab_size * e * (1 if self.tie_embeddings else 2)
    return n


_SAVE_ATTENTION = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.save_only_these_names(ops.KERNEL_INPUTS_NAME, "ca_out"),
    ops.saves_kernel_outputs)


@dataclasses.dataclass(frozen=True)
class SaveAttentionOffloadMlp:
  """Remat policy 'offload_mlp': what 'save_attention' keeps on the device, plus the MLP's input
  and its gate/up projections ('mlp_in', 'mlp_gate', 'mlp_up') copied to pinned host memory in
  the forward and back in the backward, so the backward reruns no matmul at all."""
  names: tuple[str, ...] = ("mlp_in", "mlp_gate", "mlp_up")

  def __call__(self, prim, *args, **params):
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=self.names,
        offload_src="device", offload_dst="pinned_host")
    decision = offload(prim, *args, **params)
    if decision != offload(None):  # offload(None) is the "recompute" answer
      return decision
    return _SAVE_ATTENTION(prim, *args, **params)


# 'save_attention' plus the MLP's input and gate/up projections: the layers of
# ``ModelConfig.remat_mlp_layers``, whose backward then reruns no matmul.
SAVE_ATTENTION_AND_MLP = jax.checkpoint_policies.save_from_both_policies(
    _SAVE_ATTENTION, jax.checkpoint_policies.save_only_these_names("mlp_in", "mlp_gate", "mlp_up"))

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "save_qkv_out": jax.checkpoint_policies.save_only_these_names("qkv", "ca_out"),
    "save_attention": _SAVE_ATTENTION,
    "offload_mlp": SaveAttentionOffloadMlp(),
}


def _dense_init(std: float, names: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(std), names)


class RMSNorm(nn.Module):
  eps: float
  dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = shard_lib.gathered(
        self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                   (x.shape[-1],), jnp.float32), ("embed",))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    # Explicit broadcast: tests run with jax_numpy_rank_promotion="raise".
    return (y * scale.reshape((1,) * (y.ndim - 1) + scale.shape)).astype(self.dtype)


def rope_frequencies(cfg: ModelConfig) -> jnp.ndarray:
  """[D/2] inverse frequencies, with Llama-3 scaling when `rope_scaling_factor` > 0."""
  d = cfg.head_dim
  freqs = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  if cfg.rope_scaling_factor > 0:
    low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = ((cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    scaled = (1 - smooth) * freqs / cfg.rope_scaling_factor + smooth * freqs
    freqs = jnp.where(wavelen < high_wavelen, freqs,
                      jnp.where(wavelen > low_wavelen, freqs / cfg.rope_scaling_factor, scaled))
  return freqs


def apply_rope(x_BxTxNxD, positions_BxT, freqs_D2):
  """Rotary embedding, half-split convention (as Hugging Face Llama checkpoints expect)."""
  ang = positions_BxT.astype(jnp.float32)[..., None] * freqs_D2[None, None]  # [B, T, D/2]
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  x = x_BxTxNxD.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxD.dtype)


class PreCA(nn.Module):
  """Norm, Q/K/V projections and RoPE: x [B,T,E] -> q [B,T,H,D], k, v [B,T,K,D]."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxE, positions_BxT):
    cfg = self.cfg
    dt = cfg.compute_dtype
    h = RMSNorm(cfg.norm_eps, dt, name="attn_norm")(x_BxTxE)

    def proj(name, heads, head_axis):
      names = ("embed", head_axis, "head_dim")
      w = self.param(name, _dense_init(cfg.init_std, names), (cfg.dim, heads, cfg.head_dim),
                     jnp.dtype(cfg.param_dtype))
      return jnp.einsum("bte,ehd->bthd", h, shard_lib.gathered(w, names, dt))

    q = proj("wq", cfg.n_heads, "heads")
    k = proj("wk", cfg.n_kv_heads, "kv_heads")
    v = proj("wv", cfg.n_kv_heads, "kv_heads")
    freqs = rope_frequencies(cfg)
    q, k = apply_rope(q, positions_BxT, freqs), apply_rope(k, positions_BxT, freqs)
    q = nn.with_logical_constraint(q, ("batch", "length", "heads", "head_dim"))
    k = nn.with_logical_constraint(k, ("batch", "length", "kv_heads", "head_dim"))
    v = nn.with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"))
    return q, k, v


class PostCA(nn.Module):
  """Output projection + residual, then RMSNorm + SwiGLU MLP + residual."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxE, o_BxTxHxD):
    cfg = self.cfg
    dt = cfg.compute_dtype
    pdt = jnp.dtype(cfg.param_dtype)

    def weight(name, names, shape):  # the compute-dtype weight, gathered under FSDP
      w = self.param(name, _dense_init(cfg.init_std, names), shape, pdt)
      return shard_lib.gathered(w, names, dt)

    wo = weight("wo", ("heads", "head_dim", "embed"), (cfg.n_heads, cfg.head_dim, cfg.dim))
    x = checkpoint_name(x_BxTxE + jnp.einsum("bthd,hde->bte", o_BxTxHxD.astype(dt), wo), "mlp_in")
    h = RMSNorm(cfg.norm_eps, dt, name="mlp_norm")(x)
    w_gate = weight("w_gate", ("embed", "mlp"), (cfg.dim, cfg.mlp_dim))
    w_up = weight("w_up", ("embed", "mlp"), (cfg.dim, cfg.mlp_dim))
    w_down = weight("w_down", ("mlp", "embed"), (cfg.mlp_dim, cfg.dim))
    gate = checkpoint_name(jnp.einsum("bte,ef->btf", h, w_gate), "mlp_gate")
    up = checkpoint_name(jnp.einsum("bte,ef->btf", h, w_up), "mlp_up")
    act = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    x = x + jnp.einsum("btf,fe->bte", act, w_down)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


def split_rows(tree, n: int):
  """Splits every array of `tree` (leading dim = rows) into n nano-batches, per data rank:
  nano-batch i takes rows [i R/n, (i+1) R/n) of every rank's block (``pipeline.split_rows``)."""
  return pipeline_lib.split_rows(tree, n, key="attention.nano_batches")


merge_rows = pipeline_lib.merge_rows  # the inverse of `split_rows`


def _attend(attend: attn_lib.CoreAttentionFn, qkv, layout: Layout, scale: float,
            layer_type: types_lib.LayerType = types_lib.FULL_TYPE):
  """Core attention of projected (q, k, v), with the names the remat policies look for; a layer
  of a local type gets its type's layout (``layer_types.layout_for``) and, for a sliding window,
  ``window=`` on the backend's call."""
  q, k, v = (checkpoint_name(a, "qkv") for a in qkv)
  kwargs = {"window": layer_type.window} if layer_type.window else {}
  o = attend(q, k, v, types_lib.layout_for(layout, layer_type), softmax_scale=scale, **kwargs)
  return checkpoint_name(o, "ca_out")


class DecoderLayer(nn.Module):
  """pre-CA -> core attention -> post-CA: declares one layer's parameters (``pre_ca``,
  ``post_ca``) at ``init``; every forward pass runs the layer as ``layer_pieces``."""
  cfg: ModelConfig
  attend: attn_lib.CoreAttentionFn

  @nn.compact
  def __call__(self, x_BxTxE, layout: Layout):
    qkv = PreCA(self.cfg, name="pre_ca")(x_BxTxE, layout.positions_BxT)
    o = _attend(self.attend, qkv, layout, 1.0 / math.sqrt(self.cfg.head_dim))
    return PostCA(self.cfg, name="post_ca")(x_BxTxE, o)


class _ScanBody(nn.Module):
  """Adapter: (carry, broadcast layout) -> (carry, None) for nn.scan; its child is named
  ``layer`` (the parameter paths ``layers/layer/...`` or ``layer_{i}/layer/...``)."""
  cfg: ModelConfig
  attend: attn_lib.CoreAttentionFn

  @nn.compact
  def __call__(self, x, layout):
    return DecoderLayer(self.cfg, self.attend, name="layer")(x, layout), None


# Named scopes of the ping-pong steps (tests read them back from the traced program's order).
PING_PONG_SCOPE = "pingpong"


def layer_pieces(cfg: ModelConfig, attend: attn_lib.CoreAttentionFn):
  """A layer's three pieces as functions of explicit parameters, the building blocks of every
  execution plan: ``pre(p, x, layout) -> qkv``, ``ca(qkv, layout) -> o`` and
  ``post(p, x, o) -> x``, ``p`` one layer's ``{'pre_ca', 'post_ca'}`` parameters; ``ca`` takes
  the layer's type as an optional third argument (``layer_types.LayerType``, default full)."""
  scale = 1.0 / math.sqrt(cfg.head_dim)
  # Unbound modules (parent=None): applied to the given parameters, not registered as children.
  pre_mod, post_mod = PreCA(cfg, parent=None), PostCA(cfg, parent=None)

  def pre(p, x, lay):
    return pre_mod.apply({"params": p["pre_ca"]}, x, lay.positions_BxT)

  def ca(qkv, lay, layer_type=types_lib.FULL_TYPE):
    return _attend(attend, qkv, lay, scale, layer_type)

  def post(p, x, o):
    return post_mod.apply({"params": p["post_ca"]}, x, o)

  return pre, ca, post


SINGLE, PING_PONG, PIPELINE = "single", "ping_pong", "pipeline"


@dataclasses.dataclass(frozen=True)
class ExecutionPlan:
  """How the layer stack runs over its parameters (``run_stack``); the parameters are the same
  for every plan.

  schedule: ``'single'`` (one stream of all rows), ``'ping_pong'`` (two nano-batches per rank,
    ``ping_pong_layers``) or ``'pipeline'`` (``stages`` GPipe stages over the mesh's `pipe` axis,
    ``microbatches`` per data rank, 0 = 2 x stages; ``pipeline.pipeline_layers``).
  scan: the layers under one ``lax.scan`` (compile time independent of depth); False: unrolled,
    one call per layer (the parameters are then a list, ``ModelConfig.scan_layers=False``).
  remat: the name of each layer's (or ping-pong unit's) remat policy, ``REMAT_POLICIES``.
  remat_mlp_layers: single stream under 'save_attention' only: the first N layers keep their MLP
    activations too (``ModelConfig.remat_mlp_layers``; two scans).
  layer_types: each layer's attention type (``ModelConfig.layer_types``); empty = every layer
    full. The single stream runs each maximal run of consecutive layers of one type as a scan
    (one scan when all layers share a type); ping-pong and the pipeline need one type for all.
  """
  schedule: str = SINGLE
  scan: bool = True
  remat: str = "full"
  remat_mlp_layers: int = 0
  stages: int = 1
  microbatches: int = 0
  layer_types: tuple[types_lib.LayerType, ...] = ()

  def __post_init__(self):
    if self.schedule not in (SINGLE, PING_PONG, PIPELINE):
      raise ValueError(f"schedule={self.schedule!r}; choose one of {SINGLE!r}, {PING_PONG!r}, "
                       f"{PIPELINE!r}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; choose one of {sorted(REMAT_POLICIES)}")
    if (self.schedule == PIPELINE) != (self.stages > 1):
      raise ValueError(f"schedule={self.schedule!r} with stages={self.stages}: a pipeline has "
                       "stages > 1, the other schedules 1")
    if self.schedule != SINGLE and len(types_lib.distinct(self.layer_types)) > 1:
      raise ValueError(f"schedule={self.schedule!r} runs one layer type for all layers; the model "
                       f"mixes {[t.name for t in types_lib.distinct(self.layer_types)]}: set "
                       "attention.nano_batches=1 and mesh.pipe=1 (the single stream)")


def execution_plan(cfg: ModelConfig, *, nano_batches: int = 1, stages: int = 1,
                   microbatches: int = 0) -> ExecutionPlan:
  """The plan of a config: ``nano_batches`` (``attention.nano_batches``), ``stages``
  (``mesh.pipe``) and ``microbatches`` (``pipeline.microbatches``); scan and remat from
  ``cfg``. The defaults give the single stream."""
  if nano_batches not in (1, 2):
    raise ValueError(f"nano_batches={nano_batches}; use 1 (single stream) or 2 (ping-pong)")
  if cfg.remat_mlp_layers and (stages > 1 or nano_batches == 2):
    raise ValueError(f"model.remat_mlp_layers={cfg.remat_mlp_layers} applies to the single "
                     f"stream; got mesh.pipe={stages}, attention.nano_batches="
                     f"{nano_batches}: set model.remat_mlp_layers=0")
  if stages > 1 and nano_batches != 1:
    raise ValueError(f"attention.nano_batches={nano_batches} with mesh.pipe={stages}: the "
                     "pipeline runs the single stream; set attention.nano_batches=1")
  if stages > 1 and not cfg.scan_layers:
    raise ValueError(f"mesh.pipe={stages} needs model.scan_layers=True (stages are slices of "
                     "the stacked layers)")
  schedule = PIPELINE if stages > 1 else PING_PONG if nano_batches == 2 else SINGLE
  return ExecutionPlan(schedule, scan=cfg.scan_layers, remat=cfg.remat,
                       remat_mlp_layers=cfg.remat_mlp_layers, stages=stages,
                       microbatches=microbatches, layer_types=cfg.layer_types)


def rematerialize(f: Callable, remat, *, prevent_cse: bool) -> Callable:
  """``f`` under ``jax.checkpoint`` with the policy named ``remat`` (a ``REMAT_POLICIES`` name,
  or a policy function); 'none' returns ``f``."""
  if isinstance(remat, str) and remat == "none":
    return f
  policy = REMAT_POLICIES[remat] if isinstance(remat, str) else remat
  return jax.checkpoint(f, policy=policy, prevent_cse=prevent_cse)


def stack_depth(layers) -> int:
  if isinstance(layers, (list, tuple)):
    return len(layers)
  return jax.tree.leaves(layers)[0].shape[0]


def single_stream(plan: ExecutionPlan, pieces, layers, x_BxTxE, layout: Layout):
  """All rows through every layer in order, each layer under the plan's remat policy
  (``prevent_cse=False``, as inside a loop): one scan over the stacked parameters, or a call per
  layer of a list (``plan.scan=False``).

  With ``plan.remat_mlp_layers`` = N > 0 the stack is two scans over the stacked parameters:
  layers [0, N) under ``SAVE_ATTENTION_AND_MLP``, [N, L) under 'save_attention'. Each of them
  takes its layers' weights as its sequence input cast to the compute dtype first (the layers
  cast them anyway; a bf16 slice is half the copy, and their gradients then stack in bf16 before
  the one cast back to the parameter dtype, the same values); the norms' float32 scales stay
  float32. One scan slices the float32 stack inside each layer instead.

  Layers of different attention types (``plan.layer_types``) run as one scan per maximal run of
  consecutive layers of one type and policy, each over its slice of the stack."""
  pre, ca, post = pieces
  n_layers = stack_depth(layers)
  types = plan.layer_types or (types_lib.FULL_TYPE,) * n_layers
  if len(types) != n_layers:
    raise ValueError(f"plan.layer_types names {len(types)} layers; the stack has {n_layers}: "
                     "build the plan with model.execution_plan(cfg, ...)")

  def layer_of(layer_type):
    def layer(p, x):
      return post(p, x, ca(pre(p, x, layout), layout, layer_type))
    return layer

  def scan(x, ps, remat, layer_type):
    body = rematerialize(layer_of(layer_type), remat, prevent_cse=False)
    return lax.scan(lambda x, p: (body(p, x), None), x, ps)[0]

  if not plan.scan:
    for p, layer_type in zip(layers, types):
      x_BxTxE = rematerialize(layer_of(layer_type), plan.remat, prevent_cse=False)(p, x_BxTxE)
    return x_BxTxE
  n = plan.remat_mlp_layers
  policies = [SAVE_ATTENTION_AND_MLP if i < n else "save_attention" if n else plan.remat
              for i in range(n_layers)]
  segments = types_lib.runs(list(zip(types, policies)))
  if len(segments) == 1 and not n:
    return scan(x_BxTxE, layers, plan.remat, types[0])
  weights = layers
  if n:
    dtype = jnp.dtype(jax.tree.leaves(x_BxTxE)[0].dtype)
    weights = jax.tree_util.tree_map_with_path(
        lambda path, a: a if path[-1].key == "scale" else a.astype(dtype), layers)
  x = x_BxTxE
  for start, stop, (layer_type, policy) in segments:
    x = scan(x, jax.tree.map(lambda a: a[start:stop], weights), policy, layer_type)
  return x


def ping_pong_layers(plan: ExecutionPlan, pieces, layers, x_BxTxE, layout: Layout):
  """The decoder stack as a ping-pong of two nano-batches (DistCA Sec. 4.1).

  Each data rank's rows form nano-batches A and B (``split_rows``; no row moves between
  devices). The program runs, for layers i = 0 .. L-1:

      pre_0(A)                 CA_0(A) || pre_0(B)
      CA_i(B)   || post_i(A) + pre_{i+1}(A)
      CA_{i+1}(A) || post_i(B) + pre_{i+1}(B)        (the unit of a scan over i = 0 .. L-2)
      CA_{L-1}(B) || post_{L-1}(A);  post_{L-1}(B)

  so while one nano-batch's core attention (for ``distca``: gathers, all-to-alls, kernel,
  return) runs, the other nano-batch's post-CA of layer i and pre-CA of layer i+1 -- the linear
  work between two core attentions -- has no data dependence on it, and XLA's scheduler may run
  the collectives behind those matmuls, in the forward and in the transposed backward. The math
  is that of the single stream (tests assert equal losses and gradients).

  Args:
    plan: the execution plan (``plan.remat`` wraps each unit like a layer; the carry between
      units holds both nano-batches' residual stream, A's core-attention output and B's q, k, v).
    pieces: ``layer_pieces(cfg, attend)``.
    layers: the per-layer parameters ``{'pre_ca': ..., 'post_ca': ...}``: one tree stacked over
      layers (leading dim L, as ``nn.scan`` stores them) or a list of L trees.
    x_BxTxE: the residual stream entering layer 0.
    layout: the batch layout (split into the two nano-batches here).

  Returns:
    The residual stream after layer L-1, rows in their original order.
  """
  pre, ca, post = pieces
  (x_a, x_b), (lay_a, lay_b) = split_rows(x_BxTxE, 2), split_rows(layout, 2)

  def step(name, fn, *args):
    with jax.named_scope(f"{PING_PONG_SCOPE}_{name}"):
      return fn(*args)

  def prologue(p0, x_a, x_b):
    qkv_a = step("pre_A", pre, p0, x_a, lay_a)
    o_a = step("ca_A", ca, qkv_a, lay_a)
    qkv_b = step("pre_B", pre, p0, x_b, lay_b)
    return x_a, o_a, x_b, qkv_b

  def unit(p_i, p_next, carry):
    x_a, o_a, x_b, qkv_b = carry
    o_b = step("ca_B", ca, qkv_b, lay_b)
    x_a = step("post_A", post, p_i, x_a, o_a)
    qkv_a = step("pre_A", pre, p_next, x_a, lay_a)
    o_a = step("ca_A", ca, qkv_a, lay_a)
    x_b = step("post_B", post, p_i, x_b, o_b)
    qkv_b = step("pre_B", pre, p_next, x_b, lay_b)
    return x_a, o_a, x_b, qkv_b

  def epilogue(p_last, carry):
    x_a, o_a, x_b, qkv_b = carry
    o_b = step("ca_B", ca, qkv_b, lay_b)
    x_a = step("post_A", post, p_last, x_a, o_a)
    x_b = step("post_B", post, p_last, x_b, o_b)
    return x_a, x_b

  return ping_pong_units(plan, layers, x_a, x_b, prologue, unit, epilogue)


def ping_pong_units(plan: ExecutionPlan, layers, x_a, x_b, prologue, unit, epilogue):
  """Runs a ping-pong's pieces over the layers (``ping_pong_layers``' schedule):
  ``prologue(params_0, x_a, x_b) -> carry``, ``unit(params_i, params_{i+1}, carry) -> carry``
  for i = 0 .. L-2 (a scan over stacked parameters, a call per layer for a list), and
  ``epilogue(params_{L-1}, carry) -> (x_a, x_b)``, each under the plan's remat policy; returns
  the two nano-batches' rows merged in their original order."""
  n_layers = stack_depth(layers)
  stacked = not isinstance(layers, (list, tuple))

  def remat(f, in_scan=False):
    # prevent_cse=False only inside the scan (as nn.scan does): there a loop already keeps XLA
    # from merging the backward's recomputation with the forward; outside, CSE would undo it.
    return rematerialize(f, plan.remat, prevent_cse=not in_scan)

  def layer(all_params, i):
    if not stacked:
      return all_params[i]
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), all_params)

  # The layer's parameters are taken out of the stack INSIDE each rematerialized piece: a slice
  # taken outside would be a residual of every unit, one more copy of the layer weights per layer.
  last = n_layers - 1
  carry = remat(lambda ps, x_a, x_b: prologue(layer(ps, 0), x_a, x_b))(layers, x_a, x_b)
  if stacked and n_layers > 1:
    unit_at = remat(lambda ps, i, carry: unit(layer(ps, i), layer(ps, i + 1), carry),
                    in_scan=True)
    carry, _ = lax.scan(lambda carry, i: (unit_at(layers, i, carry), None), carry,
                        jnp.arange(last))
  else:
    for i in range(last):
      carry = remat(unit)(layers[i], layers[i + 1], carry)
  x_a, x_b = remat(lambda ps, carry: epilogue(layer(ps, last), carry))(layers, carry)
  return merge_rows([x_a, x_b])


def pipeline_stack(plan: ExecutionPlan, pieces, layers, x_BxTxE, layout: Layout):
  """The stack as ``plan.stages`` GPipe stages (``pipeline.pipeline_layers``) over the stacked
  parameters, each layer of each tick under the plan's remat policy."""
  return pipeline_lib.pipeline_layers(
      pieces, layers, x_BxTxE, layout, microbatches=plan.microbatches, stages=plan.stages,
      remat=lambda f: rematerialize(f, plan.remat, prevent_cse=False))


_SCHEDULES = {SINGLE: single_stream, PING_PONG: ping_pong_layers, PIPELINE: pipeline_stack}


def run_stack(plan: ExecutionPlan, pieces, layers, x_BxTxE, layout: Layout):
  """THE layer-stack entry: the residual stream after the last layer, [B, T, E], of ``layers``
  (the unboxed per-layer parameters: stacked over L, or a list) run by ``plan``'s schedule out of
  ``pieces`` (``layer_pieces``)."""
  if plan.schedule == PIPELINE and not plan.scan:
    raise ValueError("a pipeline needs model.scan_layers=True (stages are slices of the stacked "
                     "layers)")
  if plan.schedule != SINGLE and plan.layer_types:  # one type for all layers (ExecutionPlan)
    pre, ca, post = pieces
    pieces = (pre, lambda qkv, lay: ca(qkv, lay, plan.layer_types[0]), post)
  return _SCHEDULES[plan.schedule](plan, pieces, layers, x_BxTxE, layout)


class Transformer(nn.Module):
  """Decoder stack: tokens [B,T] + layout -> final hidden states [B,T,E] (before the LM head)."""
  cfg: ModelConfig
  attend: attn_lib.CoreAttentionFn  # core attention: a backend's function of (q, k, v, layout)
  plan: ExecutionPlan | None = None  # how the stack runs; None: ``execution_plan(cfg)``

  def setup(self):
    cfg = self.cfg
    self.embedding = self.param(
        "embedding", _dense_init(1.0, ("vocab", "embed")), (cfg.vocab_size, cfg.dim),
        jnp.dtype(cfg.param_dtype))
    if not cfg.tie_embeddings:
      self.lm_head = self.param("lm_head", _dense_init(cfg.init_std, ("embed", "vocab")),
                                (cfg.dim, cfg.vocab_size), jnp.dtype(cfg.param_dtype))
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.compute_dtype)
    # The layers' parameters are declared by these Linen modules (run once by `init`).
    if cfg.scan_layers:
      self.layers = nn.scan(
          _ScanBody, variable_axes={"params": 0}, split_rngs={"params": True},
          in_axes=(nn.broadcast,), length=cfg.n_layers,
          metadata_params={nn.PARTITION_NAME: "layers"})(cfg, self.attend)
    else:
      self.layer_list = [_ScanBody(cfg, self.attend, name=f"layer_{i}")
                         for i in range(cfg.n_layers)]

  def _plan(self) -> ExecutionPlan:
    return self.plan if self.plan is not None else execution_plan(self.cfg)

  def _layer_params(self):
    """The unboxed per-layer parameters: stacked over layers (scan) or a list."""
    params = nn.meta.unbox(self.variables["params"])
    if self.cfg.scan_layers:
      return params["layers"]["layer"]
    return [params[f"layer_{i}"]["layer"] for i in range(self.cfg.n_layers)]

  def __call__(self, tokens_BxT, layout: Layout):
    """Final normalized hidden states [B, T, E] in the compute dtype."""
    plan = self._plan()
    if plan.scan != self.cfg.scan_layers:
      raise ValueError(f"plan.scan={plan.scan} with model.scan_layers={self.cfg.scan_layers}: "
                       "build the plan with model.execution_plan(cfg, ...)")
    if (plan.layer_types or (types_lib.FULL_TYPE,) * self.cfg.n_layers) != self.cfg.layer_types:
      raise ValueError(f"plan.layer_types={[t.name for t in plan.layer_types]} differ from the "
                       f"model's {[t.name for t in self.cfg.layer_types]}: build the plan with "
                       "model.execution_plan(cfg, ...)")
    table = shard_lib.gathered(self.embedding, ("vocab", "embed"))  # f32: its gradient too
    x = jnp.take(table, tokens_BxT, axis=0).astype(self.cfg.compute_dtype)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    if self.is_initializing():  # declare the layers' parameters (their output is not used)
      if self.cfg.scan_layers:
        self.layers(x, layout)
      else:
        for layer in self.layer_list:
          layer(x, layout)
    pieces = layer_pieces(self.cfg, self.attend)
    own = getattr(self.attend, "ping_pong", None) if plan.schedule == PING_PONG else None
    if own is not None:  # the backend's ping-pong (its exchanges on a side stream)
      x = own(plan, pieces, self._layer_params(), x, layout, head_dim=self.cfg.head_dim)
    else:
      x = run_stack(plan, pieces, self._layer_params(), x, layout)
    if plan.schedule == PIPELINE:
      with pipeline_lib.head_rules(x.shape[0]):  # the head splits rows over (pipe, data)
        return self.final_norm(nn.with_logical_constraint(x, ("batch", "length", "embed")))
    return self.final_norm(x)

  def head_weights(self):
    """[E, V] LM-head matrix (the embedding's transpose when tied)."""
    return self.embedding.T if self.cfg.tie_embeddings else self.lm_head

  def logits(self, tokens_BxT, layout: Layout):
    """Full logits [B, T, V] in float32 (tests and small models; training uses `loss`)."""
    return lm_head_logits(self(tokens_BxT, layout), self.head_weights())

  def loss(self, tokens_BxT, targets_BxT, loss_mask_BxT, layout: Layout):
    """(sum of masked token cross-entropies, number of loss tokens), LM head chunked over T."""
    h = self(tokens_BxT, layout)
    w = self.head_weights()
    head_rules = (pipeline_lib.head_rules(h.shape[0]) if self._plan().schedule == PIPELINE
                  else contextlib.nullcontext())
    with head_rules, jax.named_scope(LM_HEAD_SCOPE):
      return chunked_cross_entropy(h, w, targets_BxT, loss_mask_BxT, self.cfg.loss_chunk)


# The name scope of the LM head + loss in `Transformer.loss` (the profiler's step breakdown
# attributes kernels to it through their HLO op metadata).
LM_HEAD_SCOPE = "lm_head_loss"


def lm_head_logits(h_BxTxE, w_ExV):
  """fp32 logits of the LM head, the matmul in h's dtype."""
  return jnp.einsum("bte,ev->btv", h_BxTxE, w_ExV.astype(h_BxTxE.dtype),
                    preferred_element_type=jnp.float32)


def cross_entropy_reference(h_BxTxE, w_ExV, targets_BxT, mask_BxT):
  """Plain-jnp reference: (sum of masked cross-entropies, token count) from full fp32 logits."""
  logits = lm_head_logits(h_BxTxE, w_ExV)
  nll = (jax.nn.logsumexp(logits, -1)
         - jnp.take_along_axis(logits, targets_BxT[..., None], -1)[..., 0])
  m = mask_BxT.astype(jnp.float32)
  return (nll * m).sum(), m.sum()


def chunked_cross_entropy(h_BxTxE, w_ExV, targets_BxT, mask_BxT, chunk: int):
  """Sum of masked cross-entropies without materializing all [B, T, V] logits at once.

  Chunks are ``min(chunk, T)`` tokens; when ``T`` is not a multiple, the tail is padded with
  masked-out tokens (at most ``chunk - 1`` extra rows of logits) rather than shrinking the chunk:
  a gcd-sized chunk degenerates to 1 token for rows like WLB's floor(1.2 x 65536) = 78643 (a
  prime), which turned the loss into a 78643-step scan (a 200 s first step on an H200).

  Under differentiation the forward pass also computes the gradients of ``h`` and ``w`` chunk by
  chunk (d logits = softmax - one-hot is at hand right after the log-sum-exp), so each chunk's
  logits are computed once: three LM-head matmuls per chunk (logits, dh, dw) where rematerialized
  autodiff ran four (logits again in the backward) plus a second pass over [B, c, V] fp32 logits.
  Costs: dh ([B, T, E], h's dtype) and dw ([E, V], fp32) live from the forward to the backward.
  Without differentiation (evaluation) only the loss is computed.
  """
  b, t, e = h_BxTxE.shape
  c = min(max(1, int(chunk)), t)
  pad = (-t) % c
  if pad:  # padded tokens have mask 0: they add nothing to the loss or the token count
    h_BxTxE = jnp.pad(h_BxTxE, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    mask_BxT = jnp.pad(mask_BxT, ((0, 0), (0, pad)))
  n = (t + pad) // c
  split = lambda a: jnp.moveaxis(a.reshape(b, n, c, *a.shape[2:]), 1, 0)
  mask_f = mask_BxT.astype(jnp.float32)
  total = _fused_lm_head_ce(split(h_BxTxE), w_ExV, split(targets_BxT), split(mask_f))
  return total, mask_f.sum()


def _ce_chunk(h_c, w_c, y_c, m_c):
  """One chunk: (fp32 logits [b, c, V], their log-sum-exp [b, c], masked NLL sum)."""
  logits = nn.with_logical_constraint(lm_head_logits(h_c, w_c), ("batch", "length", "vocab"))
  lse = jax.nn.logsumexp(logits, axis=-1)
  tgt = jnp.take_along_axis(logits, y_c[..., None], axis=-1)[..., 0]
  return logits, lse, ((lse - tgt) * m_c).sum()


def _head_in_compute_dtype(w_ExV, dtype):
  """The LM-head matrix cast to the compute dtype, gathered over `data` under FSDP (once for all
  chunks; its gradient, accumulated in float32 over the chunks, is reduce-scattered after)."""
  return shard_lib.gathered(w_ExV, ("embed", "vocab"), dtype)


@jax.custom_vjp
def _fused_lm_head_ce(h_NxBxCxE, w_ExV, y_NxBxC, m_NxBxC):
  w_c = _head_in_compute_dtype(w_ExV, h_NxBxCxE.dtype)

  def body(total, xs):
    return total + _ce_chunk(xs[0], w_c, xs[1], xs[2])[2], None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (h_NxBxCxE, y_NxBxC, m_NxBxC))
  return total


def _fused_lm_head_ce_fwd(h_NxBxCxE, w_ExV, y_NxBxC, m_NxBxC):
  dtype = h_NxBxCxE.dtype
  w_c = _head_in_compute_dtype(w_ExV, dtype)

  def body(carry, xs):
    total, dw = carry
    h_c, y_c, m_c = xs
    logits, lse, nll = _ce_chunk(h_c, w_c, y_c, m_c)
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == y_c[..., None]
    p = jnp.exp(logits - lse[..., None])
    dlogits = ((p - is_target.astype(p.dtype)) * m_c[..., None]).astype(dtype)
    dlogits = nn.with_logical_constraint(dlogits, ("batch", "length", "vocab"))
    dh = jnp.einsum("btv,ev->bte", dlogits, w_c, preferred_element_type=jnp.float32)
    dw = dw + jnp.einsum("bte,btv->ev", h_c, dlogits, preferred_element_type=jnp.float32)
    return (total + nll, dw), dh.astype(dtype)

  init = (jnp.zeros((), jnp.float32), jnp.zeros(w_ExV.shape, jnp.float32))
  (total, dw), dh = jax.lax.scan(body, init, (h_NxBxCxE, y_NxBxC, m_NxBxC))
  return total, (dh, dw.astype(w_ExV.dtype))


def _fused_lm_head_ce_bwd(res, g):
  dh, dw = res
  return (dh * g.astype(dh.dtype), (dw * g).astype(dw.dtype), None, None)


_fused_lm_head_ce.defvjp(_fused_lm_head_ce_fwd, _fused_lm_head_ce_bwd)
