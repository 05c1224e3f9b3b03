"""Caps for a run config from its own data: sample its first batches, plan them without caps
(``spec.suggest_capacity``), and add headroom at startup (``startup_capacity``).

The one module of ``distca_jax.plan`` that reads the data pipeline and the device count; the
package does not import it (``from distca_jax.plan import sizing``), so importing the planner
(or the data plane) loads neither."""

from __future__ import annotations

import dataclasses

import jax

from distca_jax import pipeline
from distca_jax.checks import check_int
from distca_jax.data import make_source
from distca_jax.plan.capacity import (EXCHANGE_FIELDS, caps_with_headroom, default_capacity,
                                      row_multiple)
from distca_jax.plan.spec import (PlanSpec, auto_min_shard, device_layout, nano_batch_rows,
                                  suggest_capacity)


def startup_capacity(c, *, data: int | None = None) -> dict[str, int]:
  """Row caps for a run: those its config leaves at 0, from its own first batches.

  ``config.attention.distca.caps_from_batches = N > 0``: ``suggest_config_capacity`` over the
  run's first N batches, times ``caps_headroom``, rounded up to whole row multiples. Each cap is
  at least what the no-move layout needs: ``q_tokens`` and ``kv_tokens`` hold a device's rows
  of one call, so every batch can be planned. A later batch that would need more only moves
  less (``Plan.degraded``). ``tasks`` is never derived: a batch with more documents than task
  slots cannot be planned at all, so it keeps ``default_capacity``'s value. Returns the
  overrides (name -> value) for the caps left at 0, or ``{}`` when N is 0 or every row cap is
  set.
  """
  d = c.attention.distca
  n = check_int("config.attention.distca.caps_from_batches", d.caps_from_batches, 0)
  headroom = float(d.caps_headroom)
  if not headroom >= 1.0:
    raise ValueError(f"config.attention.distca.caps_headroom={d.caps_headroom} must be >= 1 (a "
                     "margin over the sampled batches)")
  auto = [f for f in EXCHANGE_FIELDS + ("q_tokens", "kv_tokens") if not d[f]]
  if n == 0 or not auto:
    return {}
  sugg = suggest_config_capacity(c, num_batches=n, data=data)
  rows = int(c.tokens_per_rank) * call_rows_per_device(c)
  return caps_with_headroom(sugg, rows, headroom, auto)


def call_rows_per_device(c) -> int:
  """Rows a device holds in one core-attention call: ``rows_per_rank / nano_batches``, or
  ``rows_per_rank / M`` under a pipeline of M microbatches (``mesh.pipe > 1``)."""
  if c.mesh.pipe > 1:
    return int(c.rows_per_rank) // pipeline.resolve_microbatches(c.pipeline.microbatches,
                                                                  c.mesh.pipe)
  return int(c.rows_per_rank) // int(c.attention.nano_batches)


def _calls(c, doclens, data: int) -> list[list]:
  """The rows of each core-attention call of one batch, as ``host_prepare`` plans them: one per
  nano-batch, or under a pipeline one per tick (``pipeline.tick_rows``: every stage's rows, on
  ``pipe x data`` servers)."""
  r = int(c.rows_per_rank)
  if c.mesh.pipe > 1:
    return pipeline.tick_rows(doclens, stages=c.mesh.pipe, rows_per_rank=r,
                              microbatches=c.pipeline.microbatches)
  n = int(c.attention.nano_batches)
  return [[doclens[x] for x in nano_batch_rows(data, r, n, i)] for i in range(n)]


def suggest_config_capacity(c, *, num_batches: int = 32, quantile: float = 1.0,
                            data: int | None = None) -> dict[str, int]:
  """Caps for a run config from its own data source: ``config.attention.distca`` overrides.

  Plans ``num_batches`` batches of ``c.data`` (the steps a run starts with) the way
  ``host_prepare`` will (per nano-batch; under a pipeline per tick, over ``pipe x data``
  servers), without caps, and returns ``suggest_capacity``'s
  envelope as a dict of ``plan.CAP_FIELDS`` (e.g. print them as
  ``--config.attention.distca.<name>=<value>`` flags).

  Args:
    c: the run config (``config.base_config`` tree).
    num_batches: batches to sample.
    quantile: per-field quantile over the batches (1.0 = the maximum seen).
    data: the data-axis size; default ``c.mesh.data``, or (when -1) every visible device over
      ``c.mesh.tensor * c.mesh.pipe``.
  """
  if data is None:
    data = c.mesh.data if c.mesh.data > 0 else jax.device_count() // (c.mesh.tensor * c.mesh.pipe)
  r, t, rn = int(c.rows_per_rank), int(c.tokens_per_rank), call_rows_per_device(c)
  servers = data * max(int(c.mesh.pipe), 1)
  src = make_source(c.data, rows=data * r, tokens_per_row=t, vocab_size=c.model.vocab_size,
                    seed=c.seed)
  spec = PlanSpec(num_servers=servers, tokens_per_row=t, rows_per_device=rn,
                  capacity=default_capacity(rn * t, rn))
  layouts = [device_layout(rows, spec)[0]
             for step in range(num_batches) for rows in _calls(c, src.doclens(step), data)]
  d = c.attention.distca
  cap = suggest_capacity(layouts, servers, rn * t, quantile=quantile,
                         multiple=row_multiple(rn * t), tolerance=d.tolerance,
                         min_shard=d.min_shard or auto_min_shard(t), q_heads=c.model.n_heads,
                         kv_heads=c.model.n_kv_heads, head_dim=c.model.head_dim)
  return dataclasses.asdict(cap)
