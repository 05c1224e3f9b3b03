"""The CAD data plane: move each CA-task's rows to its attention server, attend, bring O back.

The host planner (``distca_jax.plan``) decides which server computes which query shard and
packs that decision into one int32 array per batch (``plan.HostPlan.packed``). This package
executes it on devices inside one compiled step:

* ``copies``: row copies (gathers, placements) and their custom VJPs;
* ``exchange``: ``send_to_servers`` / ``return_to_owners`` and ``ragged_exchange`` (send and
  receive buffers of capped totals, per-peer routes; ragged all-to-all on GPU);
* ``body``: the per-device body (send, ONE fused ``ops.core_attention`` call over all of the
  server's tasks, return) and ``dispatch_attention``, its ``shard_map`` given a packed plan;
* here: ``core_attention(q, k, v, doc_lens, mesh, ...)``, the notebook entry that plans on the
  host and runs the jitted device part.

The trainer's backend is ``distca_jax.backends.distca``. Nothing here plans: shapes come from the
``plan.PlanSpec`` and the packed plan is the only input from the host.

Letters: S servers (= data ranks), R rows per device, T tokens per row (per rank in the notebook
entry), H query heads, K kv heads, D head dim, W packed plan width per row.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from distca_jax.dataplane.body import (MEMORY_MODES, DispatchOptions, count_primitives,
                                       dispatch_attention, mesh_and_servers)
from distca_jax.dataplane.copies import gather_two, place_unique, take_rows
from distca_jax.dataplane.exchange import (COLLECTIVES, DEFAULT_EXCHANGE_BUCKETS, ExchangeOptions,
                                           dense_block_rows, dense_wire_rows, ragged_exchange,
                                           resolve_collective, return_to_owners, send_to_servers)
from distca_jax.plan import cost
from distca_jax.plan.capacity import Capacity
from distca_jax.plan.spec import fit_host_plan

__all__ = [
    "COLLECTIVES", "DEFAULT_EXCHANGE_BUCKETS", "DispatchOptions", "ExchangeOptions",
    "MEMORY_MODES", "core_attention", "count_primitives", "dense_block_rows", "dense_wire_rows",
    "dispatch_attention", "gather_two", "mesh_and_servers", "place_unique", "ragged_exchange",
    "resolve_collective", "return_to_owners", "send_to_servers", "take_rows",
]


@functools.partial(jax.jit, static_argnames=("spec", "options", "mesh"))
def _dispatch_jit(q, k, v, plan, *, spec, options, mesh):
  return dispatch_attention(q, k, v, plan, spec, options, mesh=mesh)


def core_attention(q: jax.Array, k: jax.Array, v: jax.Array, doc_lens, mesh, *,
                   tolerance: float = cost.DEFAULT_TOLERANCE,
                   capacity: Capacity | Mapping[str, int | None] | None = None,
                   kernel: str = "auto", softmax_scale: float | None = None,
                   memory_mode: str = "keep", min_shard: int | None = None,
                   data_axis: str = "data", head_axis: str | None = None,
                   return_lse: bool = False, return_plan: bool = False,
                   kernel_options: Mapping[str, Any] | None = None,
                   exchange: ExchangeOptions = ExchangeOptions(), **schedule_options):
  """Each document's causal attention, computed by CAD: plan, dispatch, fused kernel, return.

  Args:
    q: ``[ranks, tokens_per_rank, q_heads, head_dim]``, sharded over ``mesh``'s ``data_axis``.
    k, v: ``[ranks, tokens_per_rank, kv_heads, head_dim]``, sharded the same way.
    doc_lens: as ``plan.schedule`` takes it: a flat list packed in order across ranks
      (documents may span ranks; the unfilled tail is padding) or one list per rank. Must be
      concrete (Python ints): the plan is made on the host, also under ``jit``/``grad``.
    mesh: a ``jax.sharding.Mesh`` with a ``data_axis`` of size ``ranks``.
    tolerance: balancing epsilon (every server within ``(1 + tolerance)`` x mean pairs).
    capacity: buffer caps (``Capacity`` or dict); None or missing fields: the plan's own
      required sizes rounded up to a row multiple (a new layout may then recompile).
    kernel: ``ops.core_attention`` backend: 'reference', 'blockwise' (CPU), 'mosaic' or 'flash3'
      (GPU), or 'auto'.
    softmax_scale: default ``1 / sqrt(head_dim)``.
    memory_mode: 'keep' or 'resend' (what the backward keeps; ``dataplane.body``).
    min_shard: shortest query piece a split may create; None = ``plan.auto_min_shard``.
    data_axis: the mesh axis of the ranks (= attention servers).
    head_axis: mesh axis the heads are sharded over, if any.
    return_lse: also return the log-sum-exp ``[ranks, tokens_per_rank, q_heads]``.
    return_plan: also return the ``HostPlan`` (last element).
    kernel_options: extra ``ops.core_attention`` keywords (``block_sizes``, ...).
    exchange: collective, signal-only (``exchange.ExchangeOptions``).
    **schedule_options: further ``plan.schedule`` keywords (split, cost_model, ...).

  Returns:
    O shaped like q (zeros at padding); ``(O, lse)`` with ``return_lse``; the ``HostPlan``
    appended with ``return_plan``. Differentiable in q, k, v.
  """
  options = DispatchOptions(kernel=kernel, memory_mode=memory_mode, softmax_scale=softmax_scale,
                            data_axis=data_axis, head_axis=head_axis, return_lse=return_lse,
                            kernel_options=dict(kernel_options or {}), exchange=exchange)
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [ranks, tokens_per_rank, q_heads, head_dim] and k, v "
                     f"[ranks, tokens_per_rank, kv_heads, head_dim]; got {q.shape=} {k.shape=}")
  s, t, h, d = q.shape
  if data_axis not in mesh.axis_names or mesh.shape[data_axis] != s:
    raise ValueError(f"q has {s} ranks but mesh {dict(mesh.shape)} has "
                     f"{data_axis}={mesh.shape.get(data_axis)}; the ranks are the data axis")
  byte_model = dict(q_heads=h, kv_heads=k.shape[2], head_dim=d,
                    dtype_bytes=jnp.dtype(q.dtype).itemsize)
  byte_model.update(schedule_options)
  hp = fit_host_plan(doc_lens, s, t, capacity, tolerance=tolerance, min_shard=min_shard,
                     **byte_model)
  plan = hp.packed
  if not isinstance(q, jax.core.Tracer):
    plan = jax.device_put(plan, NamedSharding(mesh, P(data_axis, None)))
  out = _dispatch_jit(q, k, v, plan, spec=hp.spec, options=options, mesh=mesh)
  if return_plan:
    return (*out, hp) if return_lse else (out, hp)
  return out
