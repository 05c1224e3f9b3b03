"""Mixed local / global attention in the simulator: layer types, windowed pairs, kernel seconds
and the key/value rows a windowed layer's exchange moves (host, NumPy only).

A model's layers are ``(count, window)`` types (``step.Options.attention_layers``): ``window``
0 is global causal attention, ``w > 0`` a sliding window in which query position ``p`` reads the
keys ``[max(0, p - w + 1), p]``; ``((5, 1024), (1, 0))`` is five window layers of 1024 per
global layer (Gemma-3's pattern). Every layer of a type costs the same; a stage's layers split
over the types in proportion to ``count``.

Every strategy keeps its placement in every layer (distca: one plan per batch, as the data
plane runs it): a query piece ``[a, b)`` of a document reads keys ``[max(0, a - w + 1), b)`` in
a window layer, ``window_pairs(a, b, w)`` pairs. Its kernel seconds are the measured table's
for the shape it reads (``b - a`` queries ending ``b - max(0, a - w + 1)`` keys) scaled by its
pairs over that shape's causal pairs, plus the fixed time per task: a windowed kernel skipping
the masked blocks in proportion (the window kernels' times are not measured). distca's window
layers move the same query rows and, per (document, server), only the union of its tasks' key
ranges (``window_kv_rows``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from distca_jax import plan as plan_lib
from distca_jax.sim import costs
from distca_jax.sim.costs import check_layers


def layer_fractions(layers: Sequence[tuple[int, int]]) -> list[tuple[float, int]]:
  """[(share of the layers, window)] of ``layers`` (() = every layer global)."""
  layers = check_layers(layers) or ((1, 0),)
  total = sum(c for c, _ in layers)
  return [(c / total, w) for c, w in layers]


def window_pairs(lo, hi, window: int):
  """Query-key pairs of queries [lo, hi) of a document under a window of ``window`` keys
  (0: global causal): ``plan.pairs`` with the window, on int64 arrays."""
  return plan_lib.pairs(np.asarray(lo, np.int64), np.asarray(hi, np.int64), max(window, 0))


def window_task_seconds(km: costs.KernelModel, lo, hi, window: int, dims) -> np.ndarray:
  """[N] seconds (one layer, forward + backward) of tasks with queries [lo, hi) under a window
  of ``window`` keys (module docstring; 0: ``KernelModel.task_seconds``)."""
  lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
  if window <= 0 or lo.size == 0:
    return km.task_seconds(hi - lo, hi, dims)
  q = hi - lo
  kv = hi - np.maximum(0.0, lo - window + 1)
  shape_pairs = q * kv - q * (q - 1) / 2
  share = window_pairs(lo.astype(np.int64), hi.astype(np.int64), window) / shape_pairs
  heads = dims.q_heads * dims.head_dim / costs.TABLE_HEADS_X_DIM
  return (km.table.time(q, kv) * share + km.task_s) * heads


def window_kv_rows(plan: plan_lib.Plan, window: int) -> np.ndarray:
  """[S, S] key/value rows per (owner, server) a window layer's exchange moves: per (document,
  server) the union of its tasks' key ranges ``[max(0, a - window + 1), b)``, less the rows the
  server owns, by owning rank (``plan.pair_kv_rows`` when ``window`` is 0)."""
  if window <= 0:
    return plan.pair_kv_rows
  s, t = plan.num_servers, plan.tokens_per_rank
  out = np.zeros((s, s))
  spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for doc, a, b, srv in plan.tasks.tolist():
    spans.setdefault((doc, srv), []).append((int(plan_lib.k_starts(a, window)), b))
  for (doc, srv), ivs in spans.items():
    g = int(plan.doc_starts[doc])
    ivs.sort()
    merged = [list(ivs[0])]
    for lo, hi in ivs[1:]:
      if lo <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], hi)
      else:
        merged.append([lo, hi])
    for lo, hi in merged:
      x = g + lo
      while x < g + hi:  # cut where the owning rank changes
        owner = x // t
        e = min(g + hi, (owner + 1) * t)
        if owner != srv:
          out[owner, srv] += e - x
        x = e
  return out


def has_windows(spec: costs.ModelSpec) -> bool:
  """Whether any of ``spec``'s layers is a window layer."""
  return any(w > 0 for _, w in spec.attention_layers)


def check_no_windows(spec: costs.ModelSpec, strategy: str) -> None:
  """Raises for window layers under a strategy whose window traffic is not modelled."""
  if has_windows(spec):
    raise ValueError(f"{strategy}: window layers ({spec.name} attention_layers="
                     f"{spec.attention_layers}) are priced for packed_dp and distca only; "
                     "simulate those strategies (its K/V traffic under a window is not modelled)")


def mixed_task_seconds(km: costs.KernelModel, lo, hi, spec: costs.ModelSpec) -> np.ndarray:
  """[N] seconds of tasks with queries [lo, hi) in one mean layer of ``spec``'s layer types
  (``KernelModel.task_seconds`` when every layer is global)."""
  lo, hi = np.asarray(lo), np.asarray(hi)
  if not has_windows(spec):
    return km.task_seconds(hi - lo, hi, spec.dims)
  return sum(share * window_task_seconds(km, lo, hi, w, spec.dims)
             for share, w in layer_fractions(spec.attention_layers))


def mixed_exchange_seconds(comm_of, plan: plan_lib.Plan, spec: costs.ModelSpec,
                           window_layers_local: bool = False) -> np.ndarray:
  """[S] exchange seconds of one mean layer of ``spec``'s types: ``comm_of(plan)`` of the plan
  with each type's key/value rows (``window_kv_rows``); window layers none when
  ``window_layers_local``."""
  if not has_windows(spec):
    return comm_of(plan)
  return sum(share * comm_of(dataclasses.replace(plan, pair_kv_rows=window_kv_rows(plan, w)))
             for share, w in layer_fractions(spec.attention_layers)
             if w == 0 or not window_layers_local)


def exchanged_share(spec: costs.ModelSpec, window_layers_local: bool) -> float:
  """Share of the layers that run the exchange: all, or the global ones when window layers run
  locally."""
  if not (window_layers_local and has_windows(spec)):
    return 1.0
  return sum(share for share, w in layer_fractions(spec.attention_layers) if w == 0)


def local_seconds(plan: plan_lib.Plan, spec: costs.ModelSpec, km: costs.KernelModel
                  ) -> np.ndarray:
  """[S] seconds of one mean layer of ``spec``'s types when the global layers run the plan's
  tasks and the window layers each rank's own rows (its documents' segments, one task each)."""
  s, t = plan.num_servers, plan.tokens_per_rank
  starts, lens = plan.doc_starts.astype(np.int64), plan.doc_lens.astype(np.int64)
  first, last = starts // t, (starts + lens - 1) // t
  nseg = last - first + 1
  doc = np.repeat(np.arange(lens.size), nseg)
  rank = first[doc] + np.arange(doc.size) - np.repeat(np.cumsum(nseg) - nseg, nseg)
  lo = np.maximum(0, rank * t - starts[doc])
  hi = np.minimum(lens[doc], (rank + 1) * t - starts[doc])
  task = plan.tasks
  out = np.zeros(s)
  for share, w in layer_fractions(spec.attention_layers):
    if w == 0:
      sec = km.task_seconds(task[:, 2] - task[:, 1], task[:, 2], spec.dims)
      out += share * np.bincount(task[:, 3], weights=sec, minlength=s)
    else:
      sec = window_task_seconds(km, lo, hi, w, spec.dims)
      out += share * np.bincount(rank, weights=sec, minlength=s)
  return out
