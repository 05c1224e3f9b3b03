"""SPMD pipeline parallelism over the mesh's `pipe` axis: a GPipe schedule under one `jit`.

The decoder stack's L layers form P = mesh.pipe stages of L / P consecutive layers. The
parameters keep the shape they have without a pipeline (one tree stacked over layers, leading
dim L, as `nn.scan` stores it); `sharding.RULES` puts that `layers` dim on `pipe`, so stage s
holds layers [s L/P, (s+1) L/P) and checkpoints, Hugging Face import and optimizer state are the
same for every (pipe, data, tensor). Inside the step the stack is viewed as [P, L/P, ...] (a
local reshape of the pipe-sharded dim).

Each data rank's rows form M microbatches (`pipeline.microbatches`; `to_microbatches`: rows
[i R/M, (i+1) R/M) of every rank's block, so no row moves; `split_rows`). The schedule is a `lax.scan` over
M + P - 1 ticks; the carry holds one activation slot per stage, `[P, Bm, T, E]`, with its stage
dim sharded on `pipe`. At tick t:

  1. stage 0's slot takes microbatch t's embeddings (t < M);
  2. every stage applies its L/P layers to its slot (stage s holds microbatch t - s; in the
     warm-up and drain ticks, where 0 <= t - s < M fails, it computes on a slot nobody reads:
     the bubble). Pre-CA and post-CA are `vmap`ped over the stage dim (`spmd_axis_name='pipe'`,
     so every stage runs its own weights on its own device); core attention sees the slots of
     ALL stages as one batch of P x Bm rows, sharded over (pipe, data), with the layout of the
     microbatch each stage holds;
  3. the last stage's slot is written to the output buffer (microbatch t - P + 1);
  4. the slots shift one stage (`jnp.roll` on the pipe-sharded dim: a collective permute).

The backward is autodiff of the scan: all forward ticks, then all backward ticks (GPipe), with
the layer remat policy (`ModelConfig.remat`) applied to each layer of each tick. The bubble is
(P - 1) / (M + P - 1) of every stage's ticks (`plan.ticks.schedule_table`, `bubble_fraction`).

Embedding and LM head are replicated over `pipe` (simplest; they cost every stage their weights
and Adam moments, 1.05B parameters for Llama-3-8B): the batch is embedded before the scan on
every pipe rank (a row gather; stage 0 reads microbatch t at tick t), the output buffer is
replicated over `pipe` (the last stage's slot is broadcast each tick), and after the scan the
final hidden states are split over (data, pipe) rows (when the rows divide), so the final norm,
the LM head and the loss run once per row over all pipe x data ranks. Their gradients are summed
over `pipe` by the partitioner like any replicated weight's over `data`.

Core attention across stages. A tick's core-attention call sees the rows of every stage, so a
backend that plans on the host plans per tick (`per_tick_backend`): `distca` balances the
documents of all microbatches the stages hold in that tick over ALL pipe x data ranks as
attention servers (`data_axis=('pipe', 'data')`), and ranks of a bubble slot, which hold no
documents, serve the others; with `attention.distca.pool_stages=False` it plans each stage's
rows of the tick on that stage's data ranks alone (per-stage CAD: the exchange runs over `data`
within each pipe index). Every tick is one phase (the forward ticks, then the backward's
transposed ticks), the plans of a whole step are made on the host ahead of it, and their shapes
are fixed (the caps; one compiled step). `packed_dp` computes each rank's own rows. `cp` and
`wlb` arrange the step's whole batch on the host as without a pipeline (`Backend.host_arrange`;
WLB-LLM's packing deals the documents over every lane, so it balances the microbatches against
each other too); their task tables are per row and go with their microbatch, and each stage's CP
groups (data ranks of that stage) gather the K/V of the microbatch the stage holds. The
arrangement only moves tokens between rows, so the losses are those of pipe = 1.

Microbatches vs nano-batches: microbatches (this module) split a rank's rows over pipeline
ticks; nano-batches (`attention.nano_batches`, ping-pong) split them inside one layer to overlap
one half's core attention with the other's linear work. The pipeline runs the single stream
(`nano_batches = 1`).

Letters (docs/design.md, "Words and letters"): P stages (= mesh.pipe), Nd data ranks,
M microbatches, Bm rows of one microbatch (all data ranks), T tokens per row, E embed, L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax import lax

from distca_jax.plan.ticks import num_ticks, resolve_microbatches, tick_rows

PIPE_AXIS = "pipe"
TICK_PREFIX = "tick/"  # layout.extra keys holding per-tick arrays (`per_tick_backend`)
TICKS_SCOPE = "pipeline_ticks"  # named scope of the tick scan (benchmarks find it in the jaxpr)


# ----------------------------------------------------------------------------------------------
# Host: per-tick planning of a backend (the tick arithmetic is `plan.ticks`).
# ----------------------------------------------------------------------------------------------
def per_tick_backend(backend, *, stages: int, rows_per_rank: int, microbatches: int):
  """The backend with its host planning done per pipeline tick (for `mesh.pipe > 1`).

  A backend's `host_prepare(doclens, tokens_per_row)` plans one core-attention call from the
  rows that call sees. Under the pipeline a call sees, at tick t, the slots of every stage: stage
  s's rows of microbatch t - s (empty rows in bubble slots), ordered (stage, data rank, row) as
  the rows of `pipeline_layers`' attention call (on P x Nd servers, or per stage on Nd: the
  backend's own split, `backends.distca.Options.server_groups`). This wrapper plans each of the
  M + P - 1 ticks that way and packs each returned array `[P Nd r, W]` (r = rows_per_rank / M
  rows per device and call) for the whole step into the batch's row layout: key
  `TICK_PREFIX + name`, shape `[Nd R, X]`, data rank d's block holding its devices' plans of every
  tick `[ticks, P, r, W]`, flattened and zero-padded to R rows. `pipeline_layers` unpacks them
  (`unpack_tick_array`) and scans them over the ticks, so the plans of a whole step are made on
  the host ahead of it, with fixed shapes (one compiled step).
  """
  if backend.host_prepare is None:
    return backend
  m = resolve_microbatches(microbatches, stages)
  r = rows_per_rank // m
  inner = backend.host_prepare

  def host_prepare(doclens, tokens_per_row: int) -> dict[str, np.ndarray]:
    d = len(doclens) // rows_per_rank
    per_tick = [inner(rows, tokens_per_row) for rows in tick_rows(
        doclens, stages=stages, rows_per_rank=rows_per_rank, microbatches=m)]
    out = {}
    for name in per_tick[0]:
      a = np.stack([p[name] for p in per_tick])
      if a.ndim != 3 or a.shape[1] != stages * d * r:
        raise ValueError(f"host_prepare's {name!r} is {a.shape[1:]} per tick; the pipeline packs "
                         f"[rows = {stages * d * r}, W] arrays only")
      a = a.reshape(len(per_tick), stages, d, r, a.shape[2]).transpose(2, 0, 1, 3, 4).reshape(d, -1)
      a = np.pad(a, ((0, 0), (0, (-a.shape[1]) % rows_per_rank)))
      out[TICK_PREFIX + name] = a.reshape(d * rows_per_rank, -1)
    return out

  return dataclasses.replace(backend, host_prepare=host_prepare)


# ----------------------------------------------------------------------------------------------
# Device.
# ----------------------------------------------------------------------------------------------
def mesh_stages() -> int:
  """Size of the `pipe` axis of the mesh being traced under (1 without one)."""
  mesh = jax.sharding.get_abstract_mesh()
  return dict(mesh.shape).get(PIPE_AXIS, 1) if mesh is not None and mesh.shape else 1


def _data_size() -> int:
  mesh = jax.sharding.get_abstract_mesh()
  return dict(mesh.shape).get("data", 1) if mesh is not None and mesh.shape else 1


def split_rows(tree, n: int, *, key: str = "pipeline.microbatches"):
  """Every array of `tree` (leading dim = rows, sharded over `data`) -> n parts, per data rank.

  Rank r holds a contiguous block of R rows; part i takes rows [i R/n, (i+1) R/n) of every
  rank's block, so no row moves between devices. Pipeline microbatches and ping-pong
  nano-batches (`model.split_rows`) split rows this way; `key` names the config key of n in
  the error.
  """
  d = _data_size()

  def one(i):
    def take(a):
      rows = a.shape[0]
      if rows % (d * n):
        raise ValueError(f"{rows} rows on {d} data ranks cannot be split {n} ways: set "
                         f"rows_per_rank to a multiple of {key}={n}")
      r = rows // d
      blk = a.reshape(d, r, *a.shape[1:])[:, i * (r // n):(i + 1) * (r // n)]
      return blk.reshape(d * (r // n), *a.shape[1:])
    return jax.tree.map(take, tree)

  return [one(i) for i in range(n)]


def merge_rows(parts):
  """Inverse of `split_rows` for a list of arrays."""
  d = _data_size()
  blocks = [p.reshape(d, p.shape[0] // d, *p.shape[1:]) for p in parts]
  out = jnp.concatenate(blocks, axis=1)
  return out.reshape(-1, *out.shape[2:])


def to_microbatches(tree, microbatches: int):
  """Every array [rows, ...] -> [M, rows / M, ...], microbatch i = `split_rows`' part i."""
  return jax.tree.map(lambda *parts: jnp.stack(parts), *split_rows(tree, microbatches))


def from_microbatches(a_MxBmx):
  """Inverse of `to_microbatches` for one array."""
  return merge_rows([a_MxBmx[i] for i in range(a_MxBmx.shape[0])])


def unpack_tick_array(a_BxX, stages: int, microbatches: int):
  """A `per_tick_backend` array [Nd R, X] -> [ticks, P Nd r, W], rows over (pipe, data)."""
  d = _data_size()
  rows, x = a_BxX.shape
  per_rank = rows // d
  r = per_rank // microbatches
  ticks = num_ticks(stages, microbatches)
  w = per_rank * x // (ticks * stages * r)  # the padding is under R entries: less than one W
  a = a_BxX.reshape(d, per_rank * x)[:, :ticks * stages * r * w]
  a = jnp.moveaxis(a.reshape(d, ticks, stages, r, w), 0, 2).reshape(ticks, stages * d * r, w)
  return jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec(
      None, (PIPE_AXIS, "data"), None))


def _flat(a_PxBmx):
  """[P, Bm, ...] -> [P Bm, ...]: stage-major rows, sharded over (pipe, data)."""
  return a_PxBmx.reshape(-1, *a_PxBmx.shape[2:])


def _unflat(a, stages: int):
  return a.reshape(stages, -1, *a.shape[1:])


def pipeline_layers(pieces, layers, x_BxTxE, layout, *, microbatches: int,
                    stages: int | None = None, remat=None):
  """The decoder stack as a P-stage GPipe pipeline over the mesh's `pipe` axis.

  Args:
    pieces: `(pre, attend, post)`, a layer's pieces (`model.layer_pieces`):
      `pre(p, x_BxTxE, layout) -> (q, k, v)` and `post(p, x_BxTxE, o) -> x_BxTxE` on one layer's
      parameters `p`; `attend((q, k, v), layout) -> o`, core attention, called once per layer and
      tick on the P x Bm rows of every stage's slot (rows sharded over (pipe, data)).
    layers: per-layer parameters `{'pre_ca': ..., 'post_ca': ...}` stacked over layers (leading
      dim L, `nn.scan`'s layout); L must divide by the stage count.
    x_BxTxE: the embedded rows entering layer 0.
    layout: the batch's `attention.Layout` (rows like x).
    microbatches: M (0 = 2 x stages).
    stages: P; default the mesh's `pipe` size.
    remat: `remat(f) -> f'`, applied to each layer of each tick (the plan's remat policy as a
      `jax.checkpoint`); None: no remat.

  Returns:
    The residual stream after layer L-1, [B, T, E], rows in their original order.
  """
  pre, attend, post = pieces
  s = stages or mesh_stages()
  m = resolve_microbatches(microbatches, s)
  n_layers = jax.tree.leaves(layers)[0].shape[0]
  if n_layers % s:
    raise ValueError(f"model.n_layers={n_layers} must be a multiple of mesh.pipe={s} (each "
                     "pipeline stage holds n_layers / pipe layers)")
  per_stage = n_layers // s
  ticks = num_ticks(s, m)

  # [L, ...] -> [P, L/P, ...]: the pipe-sharded layer dim splits into stages locally.
  stage_params = jax.tree.map(lambda a: a.reshape(s, per_stage, *a.shape[1:]), layers)
  x_MxBmxTxE = to_microbatches(x_BxTxE, m)
  # Per-tick arrays (a backend's plans of every tick, `per_tick_backend`) are scanned over the
  # ticks; every other layout array is per row and goes with its microbatch.
  tick_xs = {k[len(TICK_PREFIX):]: unpack_tick_array(v, s, m)
             for k, v in layout.extra.items() if k.startswith(TICK_PREFIX)}
  lay_M = to_microbatches(layout.replace(extra={k: v for k, v in layout.extra.items()
                                                if not k.startswith(TICK_PREFIX)}), m)
  slot_axes = ("stage", "batch", "length", "embed")
  pre_s = jax.vmap(pre, spmd_axis_name=PIPE_AXIS)
  post_s = jax.vmap(post, spmd_axis_name=PIPE_AXIS)

  def layer(all_params, j, x_PxBmxTxE, lay_P, tick_x):
    # Layer j of every stage; the weights are sliced inside the (rematerialized) layer, so a
    # slice is never a residual of its own.
    p = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, j, 1, keepdims=False), all_params)
    q, k, v = pre_s(p, x_PxBmxTxE, lay_P)
    flat_lay = jax.tree.map(_flat, lay_P)
    o = attend((_flat(q), _flat(k), _flat(v)), flat_lay.replace(extra={**flat_lay.extra, **tick_x}))
    return post_s(p, x_PxBmxTxE, _unflat(o, s))

  if remat is not None:
    layer = remat(layer)

  stage_ids = jnp.arange(s)

  def tick(carry, xs):
    t, tick_x = xs
    slots, out = carry
    # 1. stage 0 takes microbatch t (the clamped index in the drain ticks feeds a bubble).
    x_in = lax.dynamic_index_in_dim(x_MxBmxTxE, jnp.minimum(t, m - 1), 0, keepdims=False)
    first = (stage_ids == 0).reshape(s, 1, 1, 1)
    slots = jnp.where(first, x_in[None].astype(slots.dtype), slots)
    slots = nn.with_logical_constraint(slots, slot_axes)
    # 2. every stage's layers on its slot, with the layout of the microbatch it holds.
    mb = jnp.clip(t - stage_ids, 0, m - 1)
    lay_P = jax.tree.map(
        lambda a: nn.with_logical_constraint(jnp.take(a, mb, axis=0),
                                             ("stage", "batch") + (None,) * (a.ndim - 2)),
        lay_M)

    def body(x, j):
      return layer(stage_params, j, x, lay_P, tick_x), None

    slots, _ = lax.scan(body, slots, jnp.arange(per_stage))
    # 3. the last stage finished microbatch t - P + 1; earlier (warm-up) ticks write index 0,
    # which tick P - 1 overwrites with microbatch 0.
    done = jnp.maximum(t - (s - 1), 0)
    out = lax.dynamic_update_index_in_dim(out, slots[s - 1], done, 0)
    # 4. shift one stage down the pipe.
    slots = nn.with_logical_constraint(jnp.roll(slots, 1, axis=0), slot_axes)
    return (slots, out), None

  slots0 = nn.with_logical_constraint(jnp.zeros((s, *x_MxBmxTxE.shape[1:]), x_BxTxE.dtype),
                                      slot_axes)
  out0 = jnp.zeros_like(x_MxBmxTxE)
  with jax.named_scope(TICKS_SCOPE):
    (_, out), _ = lax.scan(tick, (slots0, out0), (jnp.arange(ticks), tick_xs))
  return from_microbatches(out)


@contextlib.contextmanager
def head_rules(rows: int):
  """Logical-axis rules for the final norm, LM head and loss after a pipeline: `batch` over
  (pipe, data) when the rows divide, so each row's head runs on one pipe rank."""
  mesh = jax.sharding.get_abstract_mesh()
  shape = dict(mesh.shape) if mesh is not None and mesh.shape else {}
  split = shape.get(PIPE_AXIS, 1) * shape.get("data", 1)
  rules = nn.get_logical_axis_rules()
  if shape.get(PIPE_AXIS, 1) > 1 and rows % split == 0:
    rules = tuple((name, ("data", PIPE_AXIS) if name == "batch" else axis)
                  for name, axis in rules)
  with nn.logical_axis_rules(rules):
    yield
