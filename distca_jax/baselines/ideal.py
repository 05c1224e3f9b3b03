"""WLB-ideal: the ``wlb`` split (CP size) and alpha that run fastest, as the paper's baseline
picks them, and the ``cp`` baseline's CP size chosen the same way (host, NumPy).

``choose_wlb`` scores every (CP size dividing the data ranks, alpha) on sampled batches with
``metrics.estimate_layer_seconds`` (the shared work model over the stated hardware model, K/V
traffic not hidden, linear layers on the padded ``Lmax = alpha T`` rows the backend runs) and
returns the best one whose rows fit a token cap. ``wlb_choice_from_config`` does it for a
training config (``attention.baselines.cp_size = 0`` or ``wlb_alpha = 0`` ask for it) on batches
the run never trains on (steps from ``num_steps`` on: no hindsight on timed or trained batches),
and keeps only a configuration whose train step fits the device: given a memory estimate
(``need_fn``: ``distca_jax.aot.baseline_need_bytes``, the compiled step's buffers plus the
kernels' workspace, as the trainer's pre-flight counts them) it walks the candidates fastest
first and takes the first that fits, recording the need of every one it tried.

The task tables (``attention.baselines.wlb_tasks_per_row``, 0 = sized here) hold every document
piece of a row; per-document CP cuts each document into a head and a tail chunk per rank, so a
row holds up to twice its lane's documents. ``wlb_tasks_needed`` sizes them for a configuration
from ``TASK_SAMPLE_STEPS`` batches the run never trains on either (``sizing_steps``: the most
pieces a row held, times ``TASKS_HEADROOM``, rounded up to ``TASKS_MULTIPLE``); a trained batch
that still needs more stops with one line naming ``wlb_tasks_per_row``.

``choose_cp`` / ``cp_choice_from_config`` do the same for ``cp`` (``attention.baselines.cp_size
= 0``): every CP size dividing the data ranks up to ``MAX_CP_SIZE`` scored by the same layer-time
model (``slowest_layer_seconds``) on the same never-trained batches, then ``fastest_that_fits``
with ``cp``'s memory need; its task slots are ``attention.baselines.max_docs_per_row``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from distca_jax.baselines import metrics, packing

DEFAULT_ALPHAS = (1.0, 1.1, 1.2, 1.5, 2.0)
DEFAULT_BATCHES = 4
# Task-table sizing (wlb_tasks_needed): batches sampled (never trained), headroom, rounding.
TASK_SAMPLE_STEPS = 32
TASKS_HEADROOM = 1.25
TASKS_MULTIPLE = 8
# CP sizes tried by default: the divisors of the data ranks up to this (WLB-LLM's range).
MAX_CP_SIZE = 8


@dataclasses.dataclass(frozen=True)
class WlbChoice:
  """The chosen split and the score of every candidate (of ``wlb``, or of ``cp``: ``strategy``).

  Attributes:
    cp_size, alpha: the fastest candidate that fits (``cp``: alpha 1, its rows are T tokens).
    layer_seconds: its predicted seconds of the slowest rank's layer, mean over batches.
    candidates: (cp_size, alpha, layer seconds, fits the token cap) of every candidate tried.
    tasks_per_row: the chosen configuration's task slots per row (0: not sized).
    memory: (cp_size, alpha, tasks_per_row, need bytes per device) of every candidate whose
      memory was estimated, fastest first (the last one fits unless none did); empty when no
      memory estimate was made.
    capacity_bytes: the device memory the candidates had to fit (None: not checked).
    strategy: the backend chosen for, 'wlb' or 'cp'.
  """
  cp_size: int
  alpha: float
  layer_seconds: float
  candidates: tuple[tuple[int, float, float, bool], ...]
  tasks_per_row: int = 0
  memory: tuple[tuple[int, float, int, int], ...] = ()
  capacity_bytes: int | None = None
  strategy: str = "wlb"

  def label(self, cp_size: int, alpha: float) -> str:
    """The config keys of a candidate of this strategy, as an error names them."""
    return (f"cp_size={cp_size}" if self.strategy == "cp"
            else f"cp_size={cp_size} wlb_alpha={alpha:g}")

  def excluded_for_memory(self) -> tuple[tuple[int, float, int, int], ...]:
    """The ``memory`` entries over ``capacity_bytes`` (faster than the choice, did not fit)."""
    cap = self.capacity_bytes
    return tuple(m for m in self.memory if cap is not None and m[3] > cap)


def candidate_cp_sizes(ranks: int, cp_sizes: Sequence[int] | None = None) -> list[int]:
  """``cp_sizes`` (each must divide ``ranks``), default every divisor of ``ranks`` up to
  ``MAX_CP_SIZE``: the CP sizes ``choose_wlb`` and ``choose_cp`` score."""
  sizes = list(cp_sizes) if cp_sizes is not None else [
      c for c in range(1, min(ranks, MAX_CP_SIZE) + 1) if ranks % c == 0]
  for c in sizes:
    if c < 1 or ranks % c:
      raise ValueError(f"cp_size={c} does not divide the {ranks} ranks; pass divisors")
  return sizes


def slowest_layer_seconds(per_batch: Sequence[metrics.RankMetrics], dims: metrics.ModelDims,
                          hw: metrics.Hardware | None = None) -> float:
  """The predicted seconds of one layer's forward + backward of the slowest rank
  (``metrics.estimate_layer_seconds``: the shared work model, K/V traffic not hidden), mean over
  batches: the score of a candidate of ``choose_wlb`` and ``choose_cp``."""
  return float(np.mean([metrics.estimate_layer_seconds(m, dims, hw).max() for m in per_batch]))


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
  cands = []
  for c in candidate_cp_sizes(ranks, cp_sizes):
    for a in alphas:
      row = metrics.wlb_row_tokens(a, tokens_per_row)
      fits = max_row_tokens is None or row <= max_row_tokens
      padded = []
      for rows in batches:
        flat = [int(x) for r in rows for x in r]
        pk = packing.wlb_pack(flat, ranks // c, c, row, dims.balance_len)
        m = metrics.wlb_metrics(pk, dims, alpha=a)
        padded.append(dataclasses.replace(m, tokens_S=np.full_like(m.tokens_S, row)))
      cands.append((c, float(a), slowest_layer_seconds(padded, dims, hw), fits))
  ok = [x for x in cands if x[3]]
  if not ok:
    raise ValueError(f"no wlb candidate has Lmax <= {max_row_tokens=}; raise it or lower alphas")
  best = min(ok, key=lambda x: (x[2], x[0], x[1]))
  return WlbChoice(best[0], best[1], best[2], tuple(cands))


def choose_cp(batches: Sequence[Sequence[Sequence[int]]], tokens_per_row: int,
              dims: metrics.ModelDims, *, hw: metrics.Hardware | None = None,
              cp_sizes: Sequence[int] | None = None, rows_per_rank: int = 1) -> WlbChoice:
  """Best CP size for ``cp`` over sampled batches (per-row document lengths, rows rank-major).

  Each candidate's lanes are the trainer's (``metrics.lanes_from_rows``: a lane concatenates
  its group's rows) in head-tail chunks (``metrics.cp_metrics``), scored by
  ``slowest_layer_seconds`` as ``choose_wlb`` scores its candidates; ``cp_sizes`` defaults to
  every divisor of the data ranks up to ``MAX_CP_SIZE``. Returns a ``WlbChoice`` of strategy
  'cp' (alpha 1: every rank holds T tokens)."""
  if not batches:
    raise ValueError("choose_cp needs at least one sampled batch")
  r = int(rows_per_rank)
  if len(batches[0]) % r:
    raise ValueError(f"{len(batches[0])} rows do not split into ranks of {rows_per_rank=}")
  cands = []
  for c in candidate_cp_sizes(len(batches[0]) // r, cp_sizes):
    per_batch = [metrics.cp_metrics(metrics.lanes_from_rows(rows, c, r), c, tokens_per_row,
                                    dims, rows_per_rank=r) for rows in batches]
    cands.append((c, 1.0, slowest_layer_seconds(per_batch, dims, hw), True))
  best = min(cands, key=lambda x: (x[2], x[0]))
  return WlbChoice(best[0], best[1], best[2], tuple(cands), strategy="cp")


def ranked(choice: WlbChoice) -> list[tuple[int, float, float, bool]]:
  """The candidates within the token cap, fastest predicted first (ties: smaller CP, alpha)."""
  return sorted((x for x in choice.candidates if x[3]), key=lambda x: (x[2], x[0], x[1]))


def wlb_row_tasks(row_doclens: Sequence[Sequence[int]], tokens_per_row: int, cp_size: int,
                  alpha: float, balance_len: float, rows_per_rank: int = 1) -> int:
  """The most task-table entries (document pieces) a row holds once ``arrange_batch`` packs a
  batch of per-row document lengths for ``wlb`` with this CP size and alpha."""
  flat = [int(x) for r in row_doclens for x in r]
  pk = packing.wlb_pack(flat, len(row_doclens) // cp_size, cp_size,
                        metrics.wlb_row_tokens(alpha, tokens_per_row), balance_len)
  pl = packing.wlb_placement(pk, rows_per_rank=rows_per_rank)
  return int(np.bincount(pl.row_P, minlength=pl.num_rows).max(initial=0))


def tasks_with_headroom(most: int) -> int:
  """Task slots for a largest sampled count ``most``: x ``TASKS_HEADROOM``, rounded up to a
  multiple of ``TASKS_MULTIPLE``."""
  return max(TASKS_MULTIPLE, -(-math.ceil(most * TASKS_HEADROOM) // TASKS_MULTIPLE)
             * TASKS_MULTIPLE)


def wlb_tasks_needed(batches: Sequence[Sequence[Sequence[int]]], tokens_per_row: int,
                     cp_size: int, alpha: float, balance_len: float,
                     rows_per_rank: int = 1) -> int:
  """``tasks_with_headroom`` of the most pieces a row of any of ``batches`` (per-row document
  lengths) holds under this configuration."""
  return tasks_with_headroom(max(wlb_row_tasks(b, tokens_per_row, cp_size, alpha, balance_len,
                                               rows_per_rank) for b in batches))


NeedFn = Callable[[int, float, int], int]


def fastest_that_fits(choice: WlbChoice, tasks_fn: Callable[[int, float], int],
                      need_fn: NeedFn | None, capacity: int | None) -> WlbChoice:
  """``choice`` moved to the fastest candidate whose step fits ``capacity`` bytes per device.

  Candidates are tried fastest first (``ranked``): each is sized (``tasks_fn(cp, alpha)``) and
  its need estimated (``need_fn(cp, alpha, tasks)``) until one fits; every estimate is kept in
  ``memory``. Without ``need_fn`` or ``capacity`` the fastest stays, sized and unchecked. A
  ValueError names each candidate's need when none fits.
  """
  order = ranked(choice)
  if need_fn is None or capacity is None:
    best = order[0]
    return dataclasses.replace(choice, cp_size=best[0], alpha=best[1], layer_seconds=best[2],
                               tasks_per_row=tasks_fn(best[0], best[1]))
  tried = []
  for cp, alpha, secs, _ in order:
    tasks = tasks_fn(cp, alpha)
    need = int(need_fn(cp, alpha, tasks))
    tried.append((cp, alpha, tasks, need))
    if need <= capacity:
      return dataclasses.replace(choice, cp_size=cp, alpha=alpha, layer_seconds=secs,
                                 tasks_per_row=tasks, memory=tuple(tried),
                                 capacity_bytes=int(capacity))
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  least = sorted(tried, key=lambda x: x[3])[:3]
  raise ValueError(
      f"no {choice.strategy} configuration fits {gib(capacity)} per device ({len(tried)} tried; "
      "the least: " + ", ".join(f"{choice.label(c, a)} needs {gib(n)}" for c, a, _, n in least)
      + "); lower tokens_per_rank, set model.remat='full' or raise mesh.tensor")


def choice_steps(c) -> range:
  """The steps whose batches ``wlb_choice_from_config`` and ``cp_choice_from_config`` score:
  from ``num_steps`` on, which the run never trains or times (batches are a pure function of
  config, seed and step)."""
  return range(int(c.num_steps), int(c.num_steps) + DEFAULT_BATCHES)


def sizing_steps(c) -> range:
  """The steps whose batches size the task tables: ``TASK_SAMPLE_STEPS`` from ``num_steps`` on
  (never trained or timed; the choice batches among them)."""
  return range(int(c.num_steps), int(c.num_steps) + TASK_SAMPLE_STEPS)


def _choice_source(c, data_ranks: int | None):
  """(the run's data source, rows per rank, ``ModelDims``, data ranks) of a training config:
  the batches a choice samples are the trainer's own (config, seed and step)."""
  from distca_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from distca_jax.data import run_source  # pylint: disable=import-outside-toplevel
  if data_ranks is None:
    data_ranks = config_lib.data_ranks(c)
  dims = metrics.ModelDims.from_model(config_lib.model_config(c))
  return run_source(c, data_ranks), int(c.rows_per_rank), dims, data_ranks


def wlb_choice_from_config(c, data_ranks: int | None = None, need_fn: NeedFn | None = None,
                           capacity: int | None = None) -> WlbChoice:
  """``choose_wlb`` for a training config on the batches of ``choice_steps`` (CP sizes up to
  ``MAX_CP_SIZE`` dividing the data ranks, ``DEFAULT_ALPHAS`` from 1.0); a positive
  ``attention.baselines.cp_size`` or ``wlb_alpha`` stays as given. Then ``fastest_that_fits``
  with ``need_fn`` and ``capacity`` (bytes per device), each candidate's task slots
  ``attention.baselines.wlb_tasks_per_row`` or, when 0, ``wlb_tasks_needed`` over the batches of
  ``sizing_steps``. ``data_ranks`` defaults to the mesh's data axis."""
  b = c.attention.baselines
  src, r, dims, data_ranks = _choice_source(c, data_ranks)
  per_rank = lambda rows: [[x for row in rows[k * r:(k + 1) * r] for x in row]
                           for k in range(data_ranks)]
  choice = choose_wlb([per_rank(src.doclens(s)) for s in choice_steps(c)],
                      c.tokens_per_rank * r, dims,
                      alphas=(b.wlb_alpha,) if b.wlb_alpha else DEFAULT_ALPHAS,
                      cp_sizes=(b.cp_size,) if b.cp_size else None)
  sized = []  # the sizing batches, read when a candidate's task slots are sized

  def tasks_fn(cp, alpha):
    if b.wlb_tasks_per_row:
      return int(b.wlb_tasks_per_row)
    sized[:] = sized or [src.doclens(s) for s in sizing_steps(c)]
    return wlb_tasks_needed(sized, c.tokens_per_rank, cp, alpha, dims.balance_len, r)

  return fastest_that_fits(choice, tasks_fn, need_fn, capacity)


def cp_choice_from_config(c, data_ranks: int | None = None, need_fn: NeedFn | None = None,
                          capacity: int | None = None) -> WlbChoice:
  """``choose_cp`` for a training config on the batches of ``choice_steps`` (never trained or
  timed), CP sizes up to ``MAX_CP_SIZE`` dividing the data ranks; a positive
  ``attention.baselines.cp_size`` stays as given. Then ``fastest_that_fits`` with ``need_fn``
  (``need_fn(cp_size, 1.0, max_docs_per_row)``) and ``capacity`` (bytes per device); every
  candidate's task slots are ``attention.baselines.max_docs_per_row``. ``data_ranks`` defaults
  to the mesh's data axis."""
  b = c.attention.baselines
  src, r, dims, _ = _choice_source(c, data_ranks)
  choice = choose_cp([src.doclens(s) for s in choice_steps(c)], c.tokens_per_rank, dims,
                     cp_sizes=(b.cp_size,) if b.cp_size else None, rows_per_rank=r)
  return fastest_that_fits(choice, lambda cp, alpha: int(b.max_docs_per_row), need_fn, capacity)
