"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `pipe` (pipeline stages, `distca_jax.pipeline`: the stacked layers' dim lives on it),
`data` (data-parallel ranks, which are also CAD's attention servers) and `tensor` (tensor
parallelism over heads, MLP and vocab).
Parameters and activations name their dimensions logically (`embed`, `heads`, ...); `RULES` alone
decides where each name lives.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from distca_jax.errors import UserError

MESH_AXES = ("pipe", "data", "tensor")

# logical name -> mesh axis (None: replicated). Keep this table short.
RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", "pipe"),   # the stacked layers' dim: stage s holds its L / pipe layers
    ("stage", "pipe"),    # a pipeline's per-stage activation slots (distca_jax.pipeline)
)


def make_mesh(data: int = -1, tensor: int = 1, pipe: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (pipe, data, tensor) mesh; `data=-1` takes every device not used by the other axes."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  if pipe < 1:
    raise UserError(f"mesh.pipe={pipe} must be >= 1")
  if tensor < 1 or n % (tensor * pipe):
    raise UserError(f"mesh.tensor={tensor} x mesh.pipe={pipe} must divide the {n} devices")
  if data == -1:
    data = n // (tensor * pipe)
  if data * tensor * pipe != n:
    raise UserError(f"mesh data={data} x tensor={tensor} x pipe={pipe} = {data * tensor * pipe} "
                    f"but {n} devices are visible; set mesh.data=-1 to use them all")
  arr = np.asarray(devices).reshape(pipe, data, tensor)
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
  """NamedSharding for an array whose dimensions carry these logical names."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(logical_axes, RULES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows over `data`, tokens unsharded: every [B, T] batch array."""
  return logical_sharding(mesh, ("batch", "length"))


def tree_shardings(mesh: Mesh, logical_specs):
  """Tree of logical PartitionSpecs -> tree of NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, RULES)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
