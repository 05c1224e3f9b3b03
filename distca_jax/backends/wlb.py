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
  a ``cp_size`` or ``alpha`` of 0 (or None) takes the fastest predicted split / alpha whose
  train step fits the device (``wlb_choice``), and task slots of 0 are sized for the
  configuration from sampled batches (``baselines.ideal.wlb_tasks_needed``)."""
  if options.cp_size and options.alpha and options.max_docs_per_row:
    return options
  if options.cp_size and options.alpha:  # the configuration is given: only its task tables
    c = config_lib.with_overrides(c, {"attention.baselines.cp_size": options.cp_size,
                                      "attention.baselines.wlb_alpha": options.alpha})
  choice = wlb_choice(c)
  best = {"cp_size": choice.cp_size, "alpha": choice.alpha,
          "max_docs_per_row": choice.tasks_per_row}
  return dataclasses.replace(options, **{k: v for k, v in best.items() if not getattr(options, k)})


def wlb_choice(c: ml_collections.ConfigDict):
  """``baseline_choice(c, 'wlb')``: WLB-ideal's (CP size, alpha) and task slots of config ``c``."""
  return baseline_choice(c, "wlb")


def baseline_choice(c: ml_collections.ConfigDict, backend: str):
  """``baselines.ideal.wlb_choice_from_config`` (``backend`` 'wlb') or ``cp_choice_from_config``
  ('cp') of config ``c``, memoized per (backend, config); when it chooses (``cp_size`` 0, or
  wlb's ``wlb_alpha`` 0) its candidates must fit ``memory_capacity(c)``, each estimated by
  ``aot.baseline_need_bytes`` (compiled ahead of time on this process's devices)."""
  key = (backend, c.to_json_best_effort(sort_keys=True))
  if key not in _CHOICES:
    from distca_jax import aot  # pylint: disable=import-outside-toplevel
    from distca_jax.baselines import ideal  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel
    b = c.attention.baselines
    if backend == "wlb":
      given, from_config = b.cp_size and b.wlb_alpha, ideal.wlb_choice_from_config
    elif backend == "cp":
      given, from_config = b.cp_size, ideal.cp_choice_from_config
    else:
      raise ValueError(f"baseline_choice: backend={backend!r} must be 'wlb' or 'cp'")
    cap = memory_capacity(c) if not given else None
    # The run's devices: the mesh's count, from the first (setup_run's default).
    devices = jax.devices()[:config_lib.data_ranks(c) * int(c.mesh.tensor) * int(c.mesh.pipe)]
    need = ((lambda cp, alpha, tasks: aot.baseline_need_bytes(c, backend, cp, alpha, tasks,
                                                              devices=devices))
            if cap else None)
    _CHOICES[key] = from_config(c, need_fn=need, capacity=cap)
  return _CHOICES[key]


_CHOICES: dict = {}


def memory_capacity(c: ml_collections.ConfigDict) -> int | None:
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


def make(options: Options) -> attn_lib.Backend:
  return baselines.group_backend("wlb", **dataclasses.asdict(options))
