"""The baselines' configuration a config leaves to the run, chosen before the trainer starts.

``cp`` with ``attention.baselines.cp_size = 0``, and ``wlb`` with ``cp_size`` or ``wlb_alpha`` 0,
take WLB-ideal's pick (``baselines.ideal``: the fastest predicted candidate on batches the run
never trains) whose train step fits the device. A candidate's need is its train step compiled
ahead of time (``aot.baseline_need_bytes``), so the choice runs here, above the trainer, and
hands its result down as config values: ``resolve(c)`` is ``c`` with the chosen values set
(``distca_jax.launch.run`` calls it before training; ``experiments.e2e_bench`` before each run).
A backend given an open configuration chooses by itself only where the device reports no memory
capacity (CPUs: nothing to check); elsewhere it stops with one line naming ``resolve``.
"""

from __future__ import annotations

from typing import Callable

import jax
import ml_collections

from distca_jax import aot
from distca_jax import baselines
from distca_jax import config as config_lib

# The config keys each baseline leaves to the run (0 = chosen), with the choice's field of each.
CHOSEN_KEYS = {
    "cp": (("attention.baselines.cp_size", "cp_size"),),
    "wlb": (("attention.baselines.cp_size", "cp_size"), ("attention.baselines.wlb_alpha", "alpha"),
            ("attention.baselines.wlb_tasks_per_row", "tasks_per_row")),
}


def need_fn(c: ml_collections.ConfigDict, backend: str) -> Callable[[int, float, int], int]:
  """``need(cp_size, alpha, tasks)``: bytes per device of config ``c``'s train step as the
  ``backend`` baseline in that configuration (``aot.baseline_need_bytes``, compiled on the run's
  devices: the mesh's count, from the first)."""
  devices = jax.devices()[:config_lib.data_ranks(c) * int(c.mesh.tensor) * int(c.mesh.pipe)]
  return lambda cp, alpha, tasks: aot.baseline_need_bytes(c, backend, cp, alpha, tasks,
                                                          devices=devices)


def baseline_choice(c: ml_collections.ConfigDict, backend: str):
  """``baselines.baseline_choice`` of config ``c`` for ``backend`` ('wlb' or 'cp'), its
  candidates checked against the device's memory by their compiled steps (``need_fn``);
  memoized per config there."""
  return baselines.baseline_choice(c, backend, need_fn=need_fn(c, backend))


def chosen(c: ml_collections.ConfigDict) -> dict:
  """{config key: value} of the baseline configuration config ``c`` leaves to the run, as
  ``baseline_choice`` picks it ({} for another backend, or when ``c`` gives it)."""
  backend, b = c.attention.backend, c.attention.baselines
  if backend not in CHOSEN_KEYS or (b.cp_size and (backend == "cp" or b.wlb_alpha)):
    return {}
  choice = baseline_choice(c, backend)
  return {key: (float if field == "alpha" else int)(getattr(choice, field))
          for key, field in CHOSEN_KEYS[backend]}


def resolve(c: ml_collections.ConfigDict, log: Callable[[str], None] | None = None
            ) -> ml_collections.ConfigDict:
  """``c`` with the baseline configuration it leaves to the run set (``chosen``); ``c`` itself
  when it leaves none. ``log`` gets one line naming the values chosen."""
  over = chosen(c)
  if not over:
    return c
  if log is not None:
    log(f"attention backend '{c.attention.backend}' configuration chosen before training on "
        "sampled batches the run never trains (a positive value in the config keeps its own): "
        + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in over.items()))
  return config_lib.with_overrides(c, over)
