"""The CAD data plane: move each CA-task's rows to its attention server, attend, bring O back.

The host planner (``distca_jax.plan``) decides which server computes which query shard and
packs that decision into one int32 array per batch (``plan.HostPlan.packed``). This package
executes it on devices inside one compiled step:

* ``copies``: row copies (gathers, placements) and their custom VJPs;
* ``exchange``: ``send_to_servers`` / ``return_to_owners`` and ``ragged_exchange`` (send and
  receive buffers of capped totals, per-peer routes; ragged all-to-all on GPU), and
  ``two_level_exchange`` across hosts (each row over the inter-host link once);
* ``body``: the per-device body (send, ONE fused ``ops.core_attention`` call over all of the
  server's tasks, return) and ``dispatch_attention``, its ``shard_map`` given a packed plan;
* here: ``run_plan(q, k, v, host_plan, mesh)``, the notebook entry: places a
  ``plan.HostPlan`` (made by the caller, e.g. ``plan.fit_host_plan``) on the mesh and runs the
  jitted device part.

The trainer's backend is ``distca_jax.backends.distca``. Nothing here plans: shapes come from the
``plan.PlanSpec`` and the packed plan is the only input from the host.

Letters (docs/design.md, "Words and letters"): S servers (= data ranks; pipe x data ranks under
a pipeline, or one stage's data ranks with per-stage CAD), R rows per device, T tokens per row
(per rank in the notebook entry), H query heads, K kv heads, D head dim, W packed plan width per
row.
"""

from __future__ import annotations

import functools
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from distca_jax.dataplane.body import (MEMORY_MODES, DispatchOptions, count_primitives,
                                       dispatch_attention)
from distca_jax.dataplane.mesh import mesh_and_servers
from distca_jax.dataplane.copies import gather_two, place_unique, take_rows
from distca_jax.dataplane.exchange import (COLLECTIVES, DEFAULT_EXCHANGE_BUCKETS,
                                           LEG_COLLECTIVES, ExchangeOptions, dense_block_rows,
                                           dense_wire_rows, ragged_exchange, resolve_collective,
                                           return_to_owners, round_wire_rows, send_to_servers,
                                           two_level_exchange)
from distca_jax.plan.spec import HostPlan

__all__ = [
    "COLLECTIVES", "DEFAULT_EXCHANGE_BUCKETS", "DispatchOptions", "ExchangeOptions",
    "LEG_COLLECTIVES", "MEMORY_MODES", "count_primitives", "dense_block_rows", "dense_wire_rows",
    "dispatch_attention", "gather_two", "mesh_and_servers", "place_unique", "ragged_exchange",
    "resolve_collective", "return_to_owners", "round_wire_rows", "run_plan", "send_to_servers",
    "take_rows", "two_level_exchange",
]


@functools.partial(jax.jit, static_argnames=("spec", "options", "mesh"))
def _dispatch_jit(q, k, v, plan, *, spec, options, mesh):
  return dispatch_attention(q, k, v, plan, spec, options, mesh=mesh)


def run_plan(q: jax.Array, k: jax.Array, v: jax.Array, host_plan: HostPlan, mesh,
             options: DispatchOptions = DispatchOptions()):
  """Each document's causal attention, computed by CAD from a host plan: dispatch, fused kernel,
  return.

  Args:
    q: ``[ranks, tokens_per_rank, q_heads, head_dim]``, sharded over ``mesh``'s
      ``options.data_axis``.
    k, v: ``[ranks, tokens_per_rank, kv_heads, head_dim]``, sharded the same way.
    host_plan: the batch's ``plan.HostPlan`` for ``ranks`` servers of one row of
      ``tokens_per_rank`` tokens (e.g. ``plan.fit_host_plan(doc_lens, ranks, tokens_per_rank)``);
      made on the host, also when this is called under ``jit``/``grad``.
    mesh: a ``jax.sharding.Mesh`` with a ``data_axis`` of size ``ranks``.
    options: kernel, memory mode, softmax scale, head axis, ``return_lse``, kernel options and
      the exchange (``DispatchOptions``).

  Returns:
    O shaped like q (zeros at padding); ``(O, lse)`` with ``options.return_lse``.
    Differentiable in q, k, v.
  """
  if q.ndim != 4 or k.ndim != 4:
    raise ValueError(f"q must be [ranks, tokens_per_rank, q_heads, head_dim] and k, v "
                     f"[ranks, tokens_per_rank, kv_heads, head_dim]; got {q.shape=} {k.shape=}")
  s, t = q.shape[:2]
  data_axis = options.data_axis
  if data_axis not in mesh.axis_names or mesh.shape[data_axis] != s:
    raise ValueError(f"q has {s} ranks but mesh {dict(mesh.shape)} has "
                     f"{data_axis}={mesh.shape.get(data_axis)}; the ranks are the data axis")
  spec = host_plan.spec
  if (spec.num_servers, spec.tokens_per_device) != (s, t):
    raise ValueError(f"the host plan is for {spec.num_servers} servers x "
                     f"{spec.tokens_per_device} tokens but q has {s} ranks x {t} tokens; plan "
                     "the batch for q's shape")
  plan = host_plan.packed
  if not isinstance(q, jax.core.Tracer):
    plan = jax.device_put(plan, NamedSharding(mesh, P(data_axis, None)))
  return _dispatch_jit(q, k, v, plan, spec=spec, options=options, mesh=mesh)
