"""Baselines in the same system as CAD: `packed_dp`, `wlb` and `cp` core-attention backends.

The trainer builds them through `distca_jax.backends` (modules `packed_dp`, `cp`, `wlb`), from
the constructors here (`packed_dp_backend`, `group_backend`):

* ``packed_dp``: no balancing; each rank computes its own rows' documents in one fused varlen call
  (``host_prepare`` adds the per-row document lengths). Runs in the trainer as it is.
* ``cp``: per-sequence context parallelism (Megatron / MaxText): groups of ``cp_size`` consecutive
  ``data`` ranks; a group's packed sequence cut into ``2 cp`` head-tail chunks, rank ``i`` holding
  chunks ``i`` and ``2cp - 1 - i``; K/V all-gathered in the group; document masks respected.
* ``wlb``: WLB-LLM variable-length packing (documents dealt to DP groups to equalize
  ``W = sum (l/B)^2 + l/B`` under the per-rank cap ``Lmax = alpha T``) with per-document context
  parallelism inside each group (every document in ``2 cp`` chunks, rank ``i`` holding ``i`` and
  ``2cp - 1 - i``), K/V all-gathered in the group.

``cp`` and ``wlb`` change which tokens live on which rank, so their batch must be rearranged on the
host before the step: ``Backend.host_arrange(np_batch, doclens) -> np_batch`` does it (it also adds
the task tables under ``extra/``); the trainer calls it on its input thread
(``trainer.add_host_plan``). A step given an unarranged batch fails with an error saying so.

Modules: ``packing`` (host planning: WLB packing, CP placements, task tables), ``device``
(the shard_map functions), ``metrics`` (per-rank work / tokens / bytes of every strategy, CAD
included).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import checks
from distca_jax import ops
from distca_jax.errors import UserError
from distca_jax.baselines import device, metrics, packing
from distca_jax.baselines.metrics import (ModelDims, RankMetrics, Hardware, cp_metrics,
                                          distca_metrics, estimate_layer_seconds, imbalance,
                                          packed_dp_metrics, placement_metrics, rank_metrics,
                                          wlb_metrics, wlb_row_tokens)
from distca_jax.baselines.packing import (Placement, WlbPacking, cp_placement, natural_placement,
                                          task_tables, wlb_pack, wlb_placement)

EXTRA_PREFIX = attn_lib.EXTRA_PREFIX  # batch keys that become `layout.extra`
DEFAULT_MAX_DOCS_PER_ROW = 128

__all__ = [
    "Hardware", "ModelDims", "Placement", "RankMetrics", "WlbPacking", "arrange_batch",
    "cp_metrics", "cp_placement", "distca_metrics", "estimate_layer_seconds",
    "group_backend", "imbalance", "natural_placement", "packed_dp_backend", "packed_dp_metrics",
    "placement_metrics", "rank_metrics", "task_tables", "wlb_metrics", "wlb_pack",
    "wlb_placement", "wlb_row_tokens",
]


def _check_cp(cp_size, name: str) -> int:
  return checks.check_int(f"backend {name!r}: cp_size", cp_size, 1,
                          "dividing mesh.data; set attention.baselines.cp_size, or 0 there to have "
                          "backends.build(config) choose it")


# ----------------------------------------------------------------------------------------------
# packed_dp
# ----------------------------------------------------------------------------------------------
def packed_dp_backend(kernel: str = "auto",
                      max_docs_per_row: int = DEFAULT_MAX_DOCS_PER_ROW) -> attn_lib.Backend:
  """``packed_dp`` backend: options ``kernel`` (``ops.KERNELS``), ``max_docs_per_row`` (table cap)."""
  kernel = ops.check_kernel(kernel)
  nd = packing.check_pos_int("max_docs_per_row", max_docs_per_row)

  def host_prepare(doclens, tokens_per_row):
    return {"doc_lens": packing.packed_doc_lens(doclens, tokens_per_row, nd)}

  return attn_lib.Backend(functools.partial(device.packed_dp_attention, kernel=kernel),
                          host_prepare)


# ----------------------------------------------------------------------------------------------
# cp and wlb
# ----------------------------------------------------------------------------------------------
def _tables_with_prefix(pl: Placement, max_tasks: int, cap_key: str) -> dict[str, np.ndarray]:
  return {EXTRA_PREFIX + k: v
          for k, v in task_tables(pl, max_tasks=max_tasks, cap_key=cap_key).items()}


def arrange_batch(strategy: str, np_batch: dict[str, np.ndarray],
                  doclens: Sequence[Sequence[int]], *, cp_size: int, rows_per_rank: int = 1,
                  alpha: float = 1.0, balance_len: float | None = None,
                  max_docs_per_row: int = DEFAULT_MAX_DOCS_PER_ROW
                  ) -> tuple[dict[str, np.ndarray], Placement]:
  """Rearranges a trainer batch for ``cp`` or ``wlb`` and adds the task tables.

  Args:
    strategy: 'cp' or 'wlb'.
    np_batch: arrays [B, T] (rows rank-major: row b on rank b // rows_per_rank).
    doclens: per-row document lengths of ``np_batch``.
    cp_size, rows_per_rank: the DP x CP split and rows per rank.
    alpha: ``wlb``: per-rank token cap Lmax = floor(alpha T) (the arranged rows' length).
    balance_len: ``wlb``: B of W = (l/B)^2 + l/B (``ModelDims.balance_len``).
    max_docs_per_row: task slots per row.

  Returns:
    (arranged batch [B, T'] with ``extra/kv_index``, ``extra/cu_seqlens_q``,
    ``extra/cu_seqlens_k``; the placement).
  """
  rows, t = np.asarray(np_batch["segment_ids"]).shape
  if len(doclens) != rows:
    raise ValueError(f"{len(doclens)=} must equal the batch's {rows} rows")
  nat = natural_placement(doclens, t, rows_per_rank=rows_per_rank)
  c = _check_cp(cp_size, strategy)
  if strategy == "cp":
    lanes = metrics.lanes_from_rows(doclens, c, rows_per_rank)
    pl = cp_placement(lanes, c, t, rows_per_rank=rows_per_rank)
    # cp numbers documents lane by lane, in the order lanes_from_rows concatenated the rows.
    first = np.cumsum([len(d) for d in doclens]) - np.array([len(d) for d in doclens])
    src = []
    for lane in range(rows // c):
      g, j = divmod(lane, rows_per_rank)
      for i in range(c):
        b = (g * c + i) * rows_per_rank + j
        src.extend(range(int(first[b]), int(first[b]) + len(doclens[b])))
    src_doc = np.asarray(src, np.int64)
    src_off = np.zeros(src_doc.size, np.int64)
  elif strategy == "wlb":
    if balance_len is None:
      raise ValueError("wlb needs balance_len (ModelDims.from_model(cfg).balance_len)")
    pk = wlb_pack(nat.doc_lens_J.tolist(), rows // c, c, wlb_row_tokens(alpha, t), balance_len)
    pl = wlb_placement(pk, rows_per_rank=rows_per_rank)
    src_doc, src_off = pk.src_J, pk.offset_J
  else:
    raise ValueError(f"arrange_batch: {strategy=} must be 'cp' or 'wlb'")
  out = packing.arrange_arrays(np_batch, nat, pl, src_doc, src_off)
  out.update(_tables_with_prefix(pl, max_docs_per_row, packing.WLB_TASKS_KEY
                                 if strategy == "wlb" else packing.MAX_DOCS_KEY))
  return out, pl


def group_backend(name: str, cp_size=None, kernel: str = "auto",
                  max_docs_per_row: int = DEFAULT_MAX_DOCS_PER_ROW, rows_per_rank: int = 1,
                  alpha: float = 1.0, balance_len: float | None = None) -> attn_lib.Backend:
  """``cp`` or ``wlb`` (``name``): the batch rearranged on the host by ``arrange_batch``, K/V
  all-gathered in groups of ``cp_size`` data ranks (``device.group_attention``)."""
  c = _check_cp(cp_size, name)
  kernel = ops.check_kernel(kernel)
  if name == "wlb":
    wlb_row_tokens(alpha, 2)  # validates alpha
    if balance_len is None or not balance_len > 0:
      raise ValueError(f"wlb needs balance_len > 0 (got {balance_len!r}): the document length "
                       "where attention FLOPs equal token-linear FLOPs, "
                       "ModelDims.from_model(model_cfg).balance_len")

  def host_arrange(np_batch, doclens):
    return arrange_batch(name, np_batch, doclens, cp_size=c, rows_per_rank=rows_per_rank,
                         alpha=alpha, balance_len=balance_len,
                         max_docs_per_row=max_docs_per_row)[0]

  fn = functools.partial(device.group_attention, cp_size=c, kernel=kernel, name=name)
  return attn_lib.Backend(fn, host_arrange=host_arrange)


# ----------------------------------------------------------------------------------------------
# The choice of a baseline configuration left to the run (cp: its CP size; wlb: its CP size and
# alpha), shared by backends.cp, backends.wlb and distca_jax.choose (which checks memory).
# ----------------------------------------------------------------------------------------------
def baseline_choice(c: "ml_collections.ConfigDict", backend: str, need_fn=None):
  """``baselines.ideal.wlb_choice_from_config`` (``backend`` 'wlb') or ``cp_choice_from_config``
  ('cp') of config ``c``, memoized per (backend, config). When it chooses (``cp_size`` 0, or
  wlb's ``wlb_alpha`` 0) on a device with a memory capacity (``memory_capacity(c)``), its
  candidates must fit it, each estimated by ``need_fn(cp_size, alpha, tasks)`` (bytes per device
  of the compiled train step: ``distca_jax.choose``, which runs above the trainer, passes it);
  without ``need_fn`` there, a UserError names ``choose.resolve``. Where no capacity is known
  (CPUs) the fastest predicted candidate is taken, unchecked."""
  key = (backend, c.to_json_best_effort(sort_keys=True))
  if key not in _CHOICES:
    from distca_jax.baselines import ideal  # pylint: disable=import-outside-toplevel
    b = c.attention.baselines
    if backend == "wlb":
      given, from_config = b.cp_size and b.wlb_alpha, ideal.wlb_choice_from_config
      keys = "attention.baselines.cp_size and wlb_alpha"
    elif backend == "cp":
      given, from_config = b.cp_size, ideal.cp_choice_from_config
      keys = "attention.baselines.cp_size"
    else:
      raise ValueError(f"baseline_choice: backend={backend!r} must be 'wlb' or 'cp'")
    cap = memory_capacity(c) if not given else None
    if cap is not None and need_fn is None:
      raise UserError(
          f"attention.backend={backend!r} with {keys} 0 on a device with {cap / 2**30:.2f} GiB: "
          "the configuration is chosen before the trainer starts (each candidate's step compiled "
          "to check it fits); run distca_jax.train, call distca_jax.choose.resolve(config) first, "
          "or set " + keys)
    _CHOICES[key] = from_config(c, need_fn=need_fn if cap else None, capacity=cap)
  return _CHOICES[key]


_CHOICES: dict = {}


def memory_capacity(c: "ml_collections.ConfigDict") -> int | None:
  """Bytes per device a chosen wlb or cp configuration must fit:
  ``attention.baselines.memory_gib`` when positive, else the first device's ``bytes_limit``
  (None where it reports none: not checked)."""
  import jax  # pylint: disable=import-outside-toplevel
  from distca_jax import memory  # pylint: disable=import-outside-toplevel
  gib = float(c.attention.baselines.memory_gib)
  if gib < 0:
    raise ValueError(f"config.attention.baselines.memory_gib={gib} must be >= 0 (0: the "
                     "device's bytes_limit)")
  return int(gib * 2**30) if gib else memory.device_capacity_bytes(jax.devices()[0])
