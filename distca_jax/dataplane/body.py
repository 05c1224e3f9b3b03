"""The per-device body (send, one fused kernel call over all of a server's tasks, return) and
its ``shard_map`` over the mesh: ``dispatch_attention``, the device function of CAD.

Backward: the gathers of ``exchange`` transpose to scatters (dK/dV of a key/value row used by
several tasks or servers are summed) and the ragged exchange to the same exchange with its
routes reversed; the kernel has its own ``custom_vjp``. Memory modes:
  'keep'    default autodiff: the kernel's residuals (the server's received Q/K/V attention
            buffers, O and LSE) stay alive until the backward.
  'resend'  ``jax.checkpoint`` around the per-device body whose policy saves only the kernel's
            outputs (O, LSE): the attention buffers are rebuilt in the backward by re-running the
            gathers and the collective (the owners re-send Q/K/V), and the kernel's forward is
            not rerun. The plain-jnp 'reference' kernel names no outputs to save, so its forward
            is recomputed too (it is a test kernel).
The layer's remat policy (``ModelConfig.remat``) wraps all of this: 'full' reruns the whole
forward in the backward (exchange, kernel, return); 'save_attention' keeps the kernel's outputs
and inputs ('keep'; with 'resend' the inputs are still re-sent) and the returned O.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from custom_ops.varlen_attention import check_window
from distca_jax import ops
from distca_jax.dataplane.mesh import axes_of, mesh_and_servers
from distca_jax.dataplane.exchange import ExchangeOptions, return_to_owners, send_to_servers
from distca_jax.plan.buckets import BucketSpecs
from distca_jax.plan.spec import PlanSpec

MEMORY_MODES = ("keep", "resend")
# Primitives of Pallas kernel calls; ``count_primitives`` counts them under their kernel's name.
KERNEL_CALLS = ("pallas_call", "mpmd_map")


@dataclasses.dataclass(frozen=True)
class DispatchOptions:
  """Everything static about one ``dispatch_attention`` call (hashable: a jit static argument).

  Attributes:
    kernel: the ``ops.core_attention`` kernel (``ops.KERNELS``).
    memory_mode: 'keep' or 'resend' (module docstring).
    softmax_scale: default ``1 / sqrt(D)``.
    data_axis: the mesh axis the rows are sharded over (a tuple of axes: their product, e.g. a
      pipeline's (pipe, data)); the ``shard_map``'s in/out specs.
    server_axis: the mesh axis every exchange collective runs over, its size the plan's servers;
      None = ``data_axis`` (every row device is one server). It must be the trailing axes of
      ``data_axis``: each index of the leading ones is one server group of consecutive row
      blocks that exchanges within itself (per-stage CAD: rows over (pipe, data), servers over
      data).
    head_axis: mesh axis the heads are split over (tensor parallelism), or None.
    return_lse: also return the softmax log-sum-exp ``[B, T, H]`` (f32; -inf at padding).
    kernel_options: extra keywords for ``ops.core_attention`` (e.g. ``block_sizes``); a mapping
      is stored as sorted ``(name, value)`` pairs.
    exchange: collective and signal-only (``exchange.ExchangeOptions``).
    window: the layer's sliding window (0 = full causal): the kernel's static ``window``
      (``ops.core_attention``). The plan must be one made for the same window
      (``plan.PlanOptions.window``): its tasks carry only the keys ``[k_start, b)`` the window
      reads, so a window plan run with another window computes other attention.
  """
  kernel: str = "auto"
  memory_mode: str = "keep"
  softmax_scale: float | None = None
  data_axis: str | tuple[str, ...] = "data"
  server_axis: str | tuple[str, ...] | None = None
  head_axis: str | None = None
  return_lse: bool = False
  kernel_options: tuple[tuple[str, Any], ...] = ()
  exchange: ExchangeOptions = ExchangeOptions()
  window: int = 0

  def __post_init__(self):
    ops.check_kernel(self.kernel, "kernel")
    check_window(self.window)
    if self.memory_mode not in MEMORY_MODES:
      raise ValueError(f"distca memory_mode={self.memory_mode!r}; choose one of {MEMORY_MODES}")
    if isinstance(self.kernel_options, Mapping):
      object.__setattr__(self, "kernel_options", tuple(sorted(self.kernel_options.items())))
    if not isinstance(self.exchange, ExchangeOptions):
      raise TypeError(f"exchange={self.exchange!r} must be an ExchangeOptions")
    rows, servers = axes_of(self.data_axis), axes_of(self.exchange_axis)
    if not servers or rows[len(rows) - len(servers):] != servers:
      raise ValueError(f"server_axis={self.server_axis!r} must be the trailing axes of "
                       f"data_axis={self.data_axis!r} (e.g. data_axis=('pipe', 'data'), "
                       "server_axis='data'), or None for data_axis itself")

  @property
  def exchange_axis(self) -> str | tuple[str, ...]:
    """The axis the exchange runs over: ``server_axis``, else ``data_axis``."""
    return self.data_axis if self.server_axis is None else self.server_axis


def _device_body(q_RxTxHxD, k_RxTxKxD, v_RxTxKxD, plan_RxW, *, spec: PlanSpec | BucketSpecs,
                 options: DispatchOptions):
  """One device: send, fused kernel over all of its tasks, return.

  With the 'resend' memory mode the kernel's inputs are not named for the layer's remat policy,
  so a policy that keeps them ('save_attention') cannot undo the re-send.
  """
  r, t, h, d = q_RxTxHxD.shape
  kh = k_RxTxKxD.shape[2]
  return_lse = options.return_lse
  send, back = (_bucket_moves if isinstance(spec, BucketSpecs) else _moves)(plan_RxW, spec,
                                                                           options)
  q_attn, k_attn, v_attn, cu_seqlens_q, cu_seqlens_k = send(
      q_RxTxHxD.reshape(r * t, h, d), k_RxTxKxD.reshape(r * t, kh, d),
      v_RxTxKxD.reshape(r * t, kh, d))
  # 4. One fused varlen call over all of this server's tasks.
  out = ops.core_attention(q_attn, k_attn, v_attn, cu_seqlens_q, cu_seqlens_k,
                           kernel=options.kernel, softmax_scale=options.softmax_scale,
                           return_lse=return_lse, name_inputs=options.memory_mode != "resend",
                           window=options.window, **dict(options.kernel_options))
  o_attn, lse_attn = out if return_lse else (out, None)
  # 5. O back to the owners (zeros at padding).
  o_RxTxHxD = back(o_attn, 0).reshape(r, t, h, d)
  if not return_lse:
    return o_RxTxHxD
  lse_RxTxH = back(lse_attn, -jnp.inf).reshape(r, t, h)
  return o_RxTxHxD, lse_RxTxH


def _moves(plan_RxW, spec: PlanSpec, options: DispatchOptions):
  """(send, back) of one device under one plan: ``send(q, k, v)`` -> the attention inputs and
  ``cu_seqlens_q``, ``cu_seqlens_k``; ``back(x, fill)`` -> ``x``'s rows at their owners."""
  axis, wire = options.exchange_axis, options.exchange
  m = spec.unpack_local(plan_RxW)

  def send(q, k, v):
    return send_to_servers(q, k, v, m, spec, axis, wire) + (m["cu_seqlens_q"],
                                                            m["cu_seqlens_k"])

  return send, lambda x, fill: return_to_owners(x, m, spec, axis, fill, wire)


def _bucket_moves(plan_RxW, spec: BucketSpecs, options: DispatchOptions):
  """``_moves`` with capacity buckets (``plan.buckets``): each of send and back is one
  ``lax.switch`` over the buckets' exchanges, on the bucket index in the plan's last column (the
  host writes the same index into every row of a call); bucket ``k`` reads its packed plan from
  the first ``spec.specs[k].width`` columns. The attention inputs have one shape in every bucket,
  so the kernel runs once, outside the switch."""
  i = jnp.clip(plan_RxW[0, -1], 0, len(spec.specs) - 1)

  def sends(one: PlanSpec):
    return lambda q, k, v, p: _moves(p[:, :one.width], one, options)[0](q, k, v)

  def backs(one: PlanSpec, fill):
    return lambda x, p: _moves(p[:, :one.width], one, options)[1](x, fill)

  def send(q, k, v):
    return jax.lax.switch(i, [sends(one) for one in spec.specs], q, k, v, plan_RxW)

  def back(x, fill):
    return jax.lax.switch(i, [backs(one, fill) for one in spec.specs], x, plan_RxW)

  return send, back


def dispatch_attention(q_BxTxHxD: jax.Array, k_BxTxKxD: jax.Array, v_BxTxKxD: jax.Array,
                       plan_BxW: jax.Array, spec: PlanSpec,
                       options: DispatchOptions = DispatchOptions(), *, mesh=None):
  """Core attention of every document by CAD, given a packed plan (device side, jit-able).

  Args:
    q_BxTxHxD: queries, rows ``B = G * S * R`` sharded over ``options.data_axis`` (heads over
      ``options.head_axis``): G server groups (1 unless ``options.server_axis`` is only the
      trailing part of the data axis) of S servers (``options.exchange_axis``) of R rows.
    k_BxTxKxD, v_BxTxKxD: keys and values, sharded the same way.
    plan_BxW: int32 packed plan (``HostPlan.packed``, or ``BucketSpecs.pack``'s array), rows
      sharded over the data axis.
    spec: the plan's static shapes: a ``PlanSpec``, or ``plan.buckets.BucketSpecs`` (capacity
      buckets: ``_bucket_moves``).
    options: kernel, memory mode, axes, exchange (``DispatchOptions``).
    mesh: the mesh; default the one set by ``jax.set_mesh`` (``trainer.mesh_context``).

  Returns:
    O ``[B, T, H, D]`` like q (zeros at padding), or ``(O, lse)``.
  """
  data_axis, head_axis = options.data_axis, options.head_axis
  mesh, devices = mesh_and_servers(mesh, data_axis)
  _, s = mesh_and_servers(mesh, options.exchange_axis)
  b, t, h, d = q_BxTxHxD.shape
  kh = k_BxTxKxD.shape[2]
  if k_BxTxKxD.shape != (b, t, kh, d) or v_BxTxKxD.shape != k_BxTxKxD.shape:
    raise ValueError(f"expected q [B,T,H,D], k and v [B,T,K,D]; got {q_BxTxHxD.shape=} "
                     f"{k_BxTxKxD.shape=} {v_BxTxKxD.shape=}")
  if not q_BxTxHxD.dtype == k_BxTxKxD.dtype == v_BxTxKxD.dtype:
    raise ValueError(f"q, k, v must share a dtype (one all-to-all carries them); got "
                     f"{q_BxTxHxD.dtype=} {k_BxTxKxD.dtype=} {v_BxTxKxD.dtype=}")
  if s != spec.num_servers or b != devices * spec.rows_per_device or t != spec.tokens_per_row:
    raise ValueError(f"q {q_BxTxHxD.shape} with rows on {data_axis}={devices} and servers on "
                     f"{options.exchange_axis}={s} does not match the plan's {spec}: expected "
                     f"servers = {spec.num_servers}, rows = {devices} x {spec.rows_per_device}, "
                     f"tokens per row = {spec.tokens_per_row}")
  if plan_BxW.shape != (b, spec.width) or plan_BxW.dtype != jnp.int32:
    raise ValueError(f"{plan_BxW.shape=} {plan_BxW.dtype=} must be int32 {(b, spec.width)} "
                     "(built by host_plan for the same capacity, rows_per_rank and mesh)")
  if head_axis is not None:
    tp = mesh.shape[head_axis]
    if h % tp or kh % tp:
      raise ValueError(f"query heads {h} and kv heads {kh} must divide by {head_axis}={tp}")
  scale = options.softmax_scale
  options = dataclasses.replace(options, softmax_scale=1.0 / math.sqrt(d) if scale is None
                                else float(scale))
  body = functools.partial(_device_body, spec=spec, options=options)
  if options.memory_mode == "resend":
    body = jax.checkpoint(body, policy=ops.saves_kernel_outputs)
  qkv = P(data_axis, None, head_axis, None)
  out_specs = (qkv, P(data_axis, None, head_axis)) if options.return_lse else qkv
  # check_vma=False: kernel primitives (Mosaic GPU's mpmd_map, flash3's FFI call) carry no
  # varying-manual-axes types.
  f = jax.shard_map(body, mesh=mesh, in_specs=(qkv, qkv, qkv, P(data_axis, None)),
                    out_specs=out_specs, check_vma=False)
  return f(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, plan_BxW)


def count_primitives(jaxpr, names) -> collections.Counter:
  """Primitives of ``names`` one execution of ``jaxpr`` runs (nested jaxprs included; a bucket
  switch counts its largest branch), plus every Pallas kernel call (``pallas_call``, Mosaic GPU's
  ``mpmd_map``) under its kernel's name (e.g. ``mosaic_attention_fwd``). Benchmarks and tests
  read a CAD program's structure with it."""
  acc = collections.Counter()
  for e in jaxpr.eqns:
    if e.primitive.name in names:
      acc[e.primitive.name] += 1
    if e.primitive.name in KERNEL_CALLS:
      acc[str(e.params["name"])] += 1
    if e.primitive.name == "cond":
      per_branch = [count_primitives(b.jaxpr, names) for b in e.params["branches"]]
      for key in set().union(*per_branch):
        acc[key] += max(c[key] for c in per_branch)
      continue
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          acc.update(count_primitives(inner, names))
  return acc
