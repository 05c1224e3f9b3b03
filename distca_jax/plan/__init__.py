"""Host planning (NumPy): which attention server computes which query shard, and the routing
tables the device step executes.

Modules, in dependency order: ``cost`` (pairs, FLOPs of a task table, measured kernel times,
the balance gate), ``options`` (``PlanOptions``: the planner's choices), ``capacity`` (the fixed
buffer sizes a plan must fit), ``metadata`` (``Plan``, ``PlanMetadata``, ``plan_to_metadata``:
the contract with ``distca_jax.dataplane``), ``intervals`` (the balancer's interval and bisection
helpers), ``balancer``, ``hosts`` (the balancer over several
hosts) and ``scheduling`` (``schedule``), ``two_level`` (the two-level exchange's legs: every row
crosses hosts once), ``spec`` (``PlanSpec``, ``host_plan``: a batch's plan packed for the step),
``ticks`` (the
pipeline's schedule on the host: which rows each tick's core-attention call sees), ``executor``
(the NumPy oracle of the contract) and ``diagnostics``.
Nothing here runs on a device or reads a run config: the package imports NumPy and the project's
checks and errors only (tests/test_layout.py). Caps sampled from a run's own batches are the
``distca`` backend's startup step (``distca_jax.backends.distca_sizing``).
"""

from distca_jax.plan.balancer import SPLITS, Balancer
from distca_jax.plan.scheduling import schedule
from distca_jax.plan.capacity import (CAP_FIELDS, EXCHANGE_FIELDS, Capacity, caps_with_headroom,
                                      default_capacity, required_capacity, resolve_capacity,
                                      row_multiple)
from distca_jax.plan.cost import (BWD_FWD_RATIO, DEFAULT_DTYPE_BYTES, DEFAULT_HEAD_DIM,
                                  DEFAULT_KV_HEADS, DEFAULT_MIN_SHARD, DEFAULT_Q_HEADS,
                                  DEFAULT_TOLERANCE, FWD_FLOPS_PER_PAIR, MFU_FWD_BWD_FACTOR,
                                  CostTable, as_cost_table, attention_pairs,
                                  core_attention_flops, imbalance, k_starts, layout_step_gain,
                                  pairs,
                                  predicted_step_gain,
                                  task_flops)
from distca_jax.plan.diagnostics import (diagnostics, exchange_bytes, pair_bytes, plot_loads,
                                         server_loads, traffic_rows)
from distca_jax.plan.executor import reference_document_attention, reference_execute
from distca_jax.plan.metadata import (ROUTE_ROWS, Plan, PlanMetadata, chunk_layout, parse_layout,
                                      plan_to_metadata, ranges, reverse_routes, split_at)
from distca_jax.plan.options import PlanOptions, auto_min_shard
from distca_jax.plan.two_level import TwoLevel
from distca_jax.plan.spec import (HostPlan, PlanSpec, device_layout, fit_host_plan, host_plan,
                                  nano_batch_rows, suggest_capacity)

__all__ = [
    "BWD_FWD_RATIO", "Balancer", "CAP_FIELDS", "Capacity", "CostTable", "DEFAULT_DTYPE_BYTES",
    "DEFAULT_HEAD_DIM", "DEFAULT_KV_HEADS", "DEFAULT_MIN_SHARD", "DEFAULT_Q_HEADS",
    "DEFAULT_TOLERANCE", "EXCHANGE_FIELDS", "FWD_FLOPS_PER_PAIR", "HostPlan", "MFU_FWD_BWD_FACTOR",
    "Plan", "PlanMetadata", "PlanOptions", "PlanSpec", "ROUTE_ROWS", "SPLITS", "as_cost_table",
    "attention_pairs", "auto_min_shard", "caps_with_headroom", "chunk_layout",
    "core_attention_flops",
    "default_capacity", "device_layout", "diagnostics", "exchange_bytes", "fit_host_plan",
    "host_plan", "imbalance", "k_starts", "layout_step_gain", "nano_batch_rows", "pair_bytes",
    "pairs",
    "parse_layout", "plan_to_metadata", "plot_loads", "predicted_step_gain", "ranges",
    "reference_document_attention", "reference_execute", "required_capacity", "resolve_capacity",
    "reverse_routes", "row_multiple", "schedule", "server_loads", "split_at", "suggest_capacity",
    "task_flops", "traffic_rows", "TwoLevel",
]
