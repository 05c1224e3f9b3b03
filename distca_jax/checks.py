"""Argument checks shared by the planner, the data plane, the kernels and the baselines."""

from __future__ import annotations

import numpy as np


def check_int(name: str, v, lo: int, hint: str = "") -> int:
  """``int(v)``, or a ValueError naming ``name`` (and ``hint``, the fix) unless ``v`` is an int
  (not a bool) >= ``lo``."""
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
    raise ValueError(f"{name}={v!r} must be an int >= {lo}" + (f" ({hint})" if hint else ""))
  return int(v)


def check_float(name: str, v, lo: float = 0.0, hint: str = "") -> float:
  """``float(v)``, or a ValueError naming ``name`` (and ``hint``, the fix) unless ``v`` is a
  finite real number (not a bool) >= ``lo``."""
  if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
      or not lo <= float(v) < float("inf")):
    raise ValueError(f"{name}={v!r} must be a finite number >= {lo:g}"
                     + (f" ({hint})" if hint else ""))
  return float(v)
