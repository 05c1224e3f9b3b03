"""Load a config file (`configs/*.py` with `get_config()`) from Python, with overrides.

The command line uses ml_collections' config flags; notebooks, tests and scripts use this.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import os
from typing import Iterable

import ml_collections

from distca_jax.errors import UserError


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
    if key not in config_keys(c):
      raise UserError(unknown_key_message(c, key))
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


def config_keys(c: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
  """Every dotted key of `c`, sections included (`model`, `model.dim`, ...)."""
  out = []
  for name, value in c.items():
    out.append(prefix + name)
    if isinstance(value, ml_collections.ConfigDict):
      out += config_keys(value, prefix + name + ".")
  return out


def unknown_key_message(c: ml_collections.ConfigDict, key: str) -> str:
  """One line: `key` is not a config key, and the nearest valid keys (by the whole dotted name,
  else by its last part, which finds a right key under a wrong section)."""
  keys = config_keys(c)
  near = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
  if not near:
    leaves = {k: k.rsplit(".", 1)[-1] for k in keys}
    close = set(difflib.get_close_matches(key.rsplit(".", 1)[-1], set(leaves.values()), n=3,
                                          cutoff=0.6))
    near = [k for k, leaf in leaves.items() if leaf in close][:3]
  hint = (f"nearest valid keys: {', '.join(near)}" if near
          else "every key is defined (and documented) in distca_jax/config.py")
  return f"unknown config key {key!r}; {hint}"
