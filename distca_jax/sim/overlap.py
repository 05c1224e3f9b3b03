"""The side-stream exchange's overlap credit, only as measured (``attention.distca.
side_stream_blocks``; ``distca_jax.dataplane.side``).

``measured(blocks)`` reads the committed overlap tables (``results/micro/overlap_bench*.json``:
a layer's exchange bytes copied on the side stream beside one 8B layer's projections on
1 x H100, XLA's cuBLAS GEMMs and Triton GEMMs) at exactly that SM budget: the fraction of the
copy hidden (the lowest of the tables, at most 1: above 1 is the matmuls' noise) and the
matmuls' slowdown (the highest, at least 1). A budget no table measured is refused (one line
naming the measured ones): no interpolation, no credit beyond the tables.

``credit(comm_s, linear_s, blocks, servers)``: per rank, the exposed exchange seconds
``comm_s x (1 - hidden)`` and the linear seconds times the slowdown. The side stream runs one
server's exchange only (several servers refuse, as the data plane does); the simulator prices
one server's exchange at 0 s (nothing crosses a wire), so the credit there is the slowdown
alone.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TABLES = ("results/micro/overlap_bench.json", "results/micro/overlap_bench_triton.json")


@functools.lru_cache(maxsize=None)
def _rows(tables: tuple[str, ...]) -> tuple[tuple[str, int, float, float], ...]:
  out = []
  for t in tables:
    with open(os.path.join(ROOT, t)) as f:
      for r in json.load(f)["rows"]:
        out.append((t, int(r["blocks"]), float(r["hidden"]), float(r["slowdown"])))
  return tuple(out)


def measured(blocks: int, tables: tuple[str, ...] = TABLES) -> dict:
  """``{'hidden', 'slowdown', 'tables'}`` of the SM budget ``blocks`` (module docstring)."""
  rows = [r for r in _rows(tuple(tables)) if r[1] == int(blocks)]
  if not rows:
    have = sorted({r[1] for r in _rows(tuple(tables))})
    raise ValueError(f"side_stream_blocks={blocks}: no overlap measured at this budget (measured "
                     f"{have} in {', '.join(tables)}); price a measured budget or measure it "
                     "(experiments/overlap_suite.sh)")
  return {"hidden": float(np.clip(min(r[2] for r in rows), 0.0, 1.0)),
          "slowdown": max(1.0, max(r[3] for r in rows)), "tables": sorted({r[0] for r in rows})}


def credit(comm_s, linear_s, blocks: int, servers: int):
  """``(exposed exchange seconds, linear seconds)`` per rank with the side stream at ``blocks``
  CTAs (module docstring); ``blocks`` 0: ``(comm_s, linear_s)`` unchanged."""
  if not blocks:
    return comm_s, linear_s
  if servers != 1:
    raise ValueError(f"side_stream_blocks={blocks} runs one server's exchange only, not "
                     f"{servers} servers' (dataplane.side); price it with 0")
  m = measured(blocks)
  return np.asarray(comm_s) * (1.0 - m["hidden"]), np.asarray(linear_s) * m["slowdown"]
