"""WLB-ideal: the ``wlb`` split (CP size) and alpha that run fastest, as the paper's baseline
picks them (host, NumPy).

``choose_wlb`` scores every (CP size dividing the data ranks, alpha) on sampled batches with
``metrics.estimate_layer_seconds`` (the shared work model over the stated hardware model, K/V
traffic not hidden, linear layers on the padded ``Lmax = alpha T`` rows the backend runs) and
returns the best one whose rows fit a token cap. ``wlb_options_from_config`` does it for a
training config (``attention.baselines.cp_size = 0`` or ``wlb_alpha = 0`` ask for it) on batches
the run never trains on (steps from ``num_steps`` on: no hindsight on timed or trained batches).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from distca_jax.baselines import metrics, packing

DEFAULT_ALPHAS = (1.0, 1.1, 1.2, 1.5, 2.0)
DEFAULT_BATCHES = 4
# CP sizes tried by default: the divisors of the data ranks up to this (WLB-LLM's range).
MAX_CP_SIZE = 8


@dataclasses.dataclass(frozen=True)
class WlbChoice:
  """The chosen split and the score of every candidate.

  Attributes:
    cp_size, alpha: the fastest candidate that fits.
    layer_seconds: its predicted seconds of the slowest rank's layer, mean over batches.
    candidates: (cp_size, alpha, layer seconds, fits) of every candidate tried.
  """
  cp_size: int
  alpha: float
  layer_seconds: float
  candidates: tuple[tuple[int, float, float, bool], ...]


def choose_wlb(batches: Sequence[Sequence[Sequence[int]]], tokens_per_row: int,
               dims: metrics.ModelDims, *, hw: metrics.Hardware | None = None,
               alphas: Sequence[float] = DEFAULT_ALPHAS,
               cp_sizes: Sequence[int] | None = None,
               max_row_tokens: int | None = None) -> WlbChoice:
  """Best (CP size, alpha) for ``wlb`` over sampled batches (per-row document lengths).

  Args:
    batches: sampled batches, each one list of document lengths per row (one row per rank).
    tokens_per_row: T.
    dims: the model (``ModelDims.from_model``).
    hw: the hardware model of ``estimate_layer_seconds``.
    alphas: alphas tried (each >= 1).
    cp_sizes: CP sizes tried (default: every divisor of the rank count up to ``MAX_CP_SIZE``).
    max_row_tokens: the largest ``Lmax`` that fits memory (default: no cap).

  Returns:
    The ``WlbChoice``; a ValueError when no candidate fits the cap.
  """
  if not batches:
    raise ValueError("choose_wlb needs at least one sampled batch")
  ranks = len(batches[0])
  sizes = list(cp_sizes) if cp_sizes is not None else [
      c for c in range(1, min(ranks, MAX_CP_SIZE) + 1) if ranks % c == 0]
  cands = []
  for c in sizes:
    if ranks % c:
      raise ValueError(f"cp_size={c} does not divide the {ranks} ranks; pass divisors")
    for a in alphas:
      row = metrics.wlb_row_tokens(a, tokens_per_row)
      fits = max_row_tokens is None or row <= max_row_tokens
      secs = []
      for rows in batches:
        flat = [int(x) for r in rows for x in r]
        pk = packing.wlb_pack(flat, ranks // c, c, row, dims.balance_len)
        m = metrics.wlb_metrics(pk, dims, alpha=a)
        padded = dataclasses.replace(m, tokens_S=np.full_like(m.tokens_S, row))
        secs.append(float(metrics.estimate_layer_seconds(padded, dims, hw).max()))
      cands.append((c, float(a), float(np.mean(secs)), fits))
  ok = [x for x in cands if x[3]]
  if not ok:
    raise ValueError(f"no wlb candidate has Lmax <= {max_row_tokens=}; raise it or lower alphas")
  best = min(ok, key=lambda x: (x[2], x[0], x[1]))
  return WlbChoice(best[0], best[1], best[2], tuple(cands))


def choice_steps(c) -> range:
  """The steps whose batches ``wlb_choice_from_config`` scores: from ``num_steps`` on, which the
  run never trains or times (batches are a pure function of config, seed and step)."""
  return range(int(c.num_steps), int(c.num_steps) + DEFAULT_BATCHES)


def wlb_choice_from_config(c, data_ranks: int | None = None) -> WlbChoice:
  """``choose_wlb`` for a training config on the batches of ``choice_steps`` (CP sizes up to
  ``MAX_CP_SIZE`` dividing the data ranks, ``DEFAULT_ALPHAS`` from 1.0); a positive
  ``attention.baselines.cp_size`` or ``wlb_alpha`` stays as given. ``data_ranks`` defaults to
  the mesh's data axis."""
  from distca_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from distca_jax.data import make_source  # pylint: disable=import-outside-toplevel
  b = c.attention.baselines
  if data_ranks is None:
    data_ranks = config_lib.data_ranks(c)
  m = config_lib.model_config(c)
  rows = data_ranks * c.rows_per_rank
  src = make_source(c.data, rows=rows, tokens_per_row=c.tokens_per_rank, vocab_size=m.vocab_size,
                    seed=c.seed)
  per_rank = lambda r: [[x for row in r[k * c.rows_per_rank:(k + 1) * c.rows_per_rank]
                         for x in row] for k in range(data_ranks)]
  batches = [per_rank(src.doclens(s)) for s in choice_steps(c)]
  return choose_wlb(batches, c.tokens_per_rank * c.rows_per_rank, metrics.ModelDims.from_model(m),
                    alphas=(b.wlb_alpha,) if b.wlb_alpha else DEFAULT_ALPHAS,
                    cp_sizes=(b.cp_size,) if b.cp_size else None)


def wlb_options_from_config(c, data_ranks: int | None = None) -> dict[str, Any]:
  """``cp_size`` and ``alpha`` of ``wlb_choice_from_config`` (the wlb backend's options)."""
  choice = wlb_choice_from_config(c, data_ranks)
  return {"cp_size": choice.cp_size, "alpha": choice.alpha}
