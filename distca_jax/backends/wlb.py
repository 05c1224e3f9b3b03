"""``wlb``: WLB-LLM variable-length packing over DP groups plus per-document context parallelism
inside each group (``baselines.group_backend``)."""

from __future__ import annotations

import dataclasses

import ml_collections

from distca_jax import attention as attn_lib
from distca_jax import baselines
from distca_jax import config as config_lib


@dataclasses.dataclass(frozen=True)
class Options:
  """Attributes: as ``cp.Options`` (``max_docs_per_row``: the task slots per row, from
  ``attention.baselines.wlb_tasks_per_row``), plus ``alpha`` (per-rank token cap ``alpha x T``,
  >= 1) and ``balance_len`` (``baselines.ModelDims.balance_len`` of the model; required)."""
  cp_size: int | None = None
  kernel: str = "auto"
  max_docs_per_row: int = baselines.DEFAULT_MAX_DOCS_PER_ROW
  rows_per_rank: int = 1
  alpha: float = 1.0
  balance_len: float | None = None

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Options":
    """The config's options (no data read: ``cp_size`` / ``alpha`` / ``max_docs_per_row`` 0
    stay 0 until ``from_first_batches``)."""
    b = c.attention.baselines
    dims = baselines.ModelDims.from_model(config_lib.model_config(c))
    return cls(cp_size=b.cp_size, kernel=c.attention.kernel,
               max_docs_per_row=b.wlb_tasks_per_row, rows_per_rank=c.rows_per_rank,
               alpha=b.wlb_alpha, balance_len=dims.balance_len)


def from_first_batches(c: ml_collections.ConfigDict, options: Options) -> Options:
  """WLB-ideal at startup (``backends.build`` calls this once per run, after ``from_config``):
  a ``cp_size`` or ``alpha`` of 0 (or None) takes the fastest predicted split / alpha
  (``baselines.baseline_choice``, memoized per config; a UserError on a device with a memory
  capacity, where ``distca_jax.choose.resolve`` chooses them before the trainer starts), and task
  slots of 0 are sized for the configuration from sampled batches
  (``baselines.ideal.wlb_tasks_needed``)."""
  if options.cp_size and options.alpha and options.max_docs_per_row:
    return options
  if options.cp_size and options.alpha:  # the configuration is given: only its task tables
    c = config_lib.with_overrides(c, {"attention.baselines.cp_size": options.cp_size,
                                      "attention.baselines.wlb_alpha": options.alpha})
  choice = baselines.baseline_choice(c, "wlb")
  best = {"cp_size": choice.cp_size, "alpha": choice.alpha,
          "max_docs_per_row": choice.tasks_per_row}
  return dataclasses.replace(options, **{k: v for k, v in best.items() if not getattr(options, k)})


def make(options: Options) -> attn_lib.Backend:
  return baselines.group_backend("wlb", **dataclasses.asdict(options))
