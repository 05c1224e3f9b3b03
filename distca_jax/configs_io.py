"""Load a config file (`configs/*.py` with `get_config()`) from Python, with overrides.

The command line uses ml_collections' config flags; notebooks, tests and scripts use this.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from typing import Iterable

import ml_collections


def load_config(path: str, overrides: Iterable[str] = ()) -> ml_collections.ConfigDict:
  """`get_config()` of the file at `path`, then `KEY=VALUE` overrides (dotted keys)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path!r} not found (configs live in configs/*.py)")
  name = "_distca_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  if not hasattr(mod, "get_config"):
    raise ValueError(f"config file {path!r} defines no get_config()")
  c = mod.get_config()
  c.lock()
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:
      raise ValueError(f"override {item!r} must look like key=value (e.g. mesh.tensor=2)")
    node = c
    *parents, leaf = key.split(".")
    for part in parents:
      node = node[part]
    old = node[leaf]
    try:
      new = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      new = value
    if isinstance(old, bool) and isinstance(new, str):  # absl-flag style true/false
      if new.lower() not in ("true", "false"):
        raise ValueError(f"override {item!r}: {key} is a bool; use True/False (or true/false)")
      new = new.lower() == "true"
    if isinstance(old, float) and isinstance(new, int) and not isinstance(new, bool):
      new = float(new)
    node[leaf] = new
  return c
