"""Device mesh and the one table that maps logical axis names to mesh axes.

Mesh axes: `pipe` (pipeline stages, `distca_jax.pipeline`: the stacked layers' dim lives on it),
`data` (data-parallel ranks, which are also CAD's attention servers) and `tensor` (tensor
parallelism over heads, MLP and vocab).
Parameters and activations name their dimensions logically (`embed`, `heads`, ...); the rules
table (`rules(fsdp)`: `RULES`, plus `FSDP_RULE` with `mesh.fsdp`) alone decides where each name
lives.

FSDP (`mesh.fsdp`). `FSDP_RULE` puts the `embed` dimension on `data` too. Every weight has one
(the norm scales, Q/K/V/O, the MLP, the embedding and the LM head), while `heads`, `kv_heads`,
`mlp` and `vocab` already take `tensor`, so each weight, its gradient and both Adam moments are
split 1/data per device on top of the tensor split (the per-device share is the same whichever
dim carries `data`; `embed` is the one every weight has, and 4096 in Llama-3-8B divides every
power-of-two data size up to 4096). Activations name `batch` first, which takes `data` before `embed` can (the table is read
in order and a mesh axis is used once per array), so they keep their layout. The model gathers
each weight just before use (`gathered`: the weight constrained to its spec under `RULES`, which
is an all-gather over `data` inside the layer scan, and a reduce-scatter of its gradient in the
backward).
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

# mesh.fsdp: weights (their `embed` dim) also over `data`; after `batch`, so activations, which
# name `batch`, never take it (see the module docstring).
FSDP_RULE: tuple[str, str] = ("embed", "data")


def rules(fsdp: bool = False) -> tuple[tuple[str, str | None], ...]:
  """The rules table: `RULES`, with `FSDP_RULE` ahead of the `embed` entry when `fsdp`."""
  if not fsdp:
    return RULES
  at = [name for name, _ in RULES].index("embed")
  return RULES[:at] + (FSDP_RULE,) + RULES[at:]


def fsdp_active() -> bool:
  """Whether the logical-axis rules in effect (``nn.logical_axis_rules``) shard weights over
  `data` (FSDP)."""
  return FSDP_RULE in tuple(nn.get_logical_axis_rules())


def gathered(w, logical_axes: Sequence[str | None], dtype=None):
  """Weight ``w`` (cast to ``dtype`` if given) as the layers compute with it.

  Under FSDP rules: constrained to its sharding under `RULES` (tensor-parallel dims only), an
  all-gather over `data` where it is used (in the layer scan: once per layer, and again in a
  rematerialized backward), whose transpose reduce-scatters the gradient. The cast comes first,
  so a bf16 compute dtype halves the bytes gathered. Which copies the backward keeps is the
  layer's remat policy's choice: every policy but 'none' keeps no weight (the backward gathers
  again); under 'none' the backward keeps each layer's gathered weight (its matmuls' input), in
  the compute dtype. Without FSDP: ``w`` (cast) unchanged.
  """
  if dtype is not None:
    w = w.astype(dtype)
  if not fsdp_active():
    return w
  return nn.with_logical_constraint(w, logical_axes, rules=RULES)


def check_fsdp(dim: int, mesh: Mesh) -> None:
  """A UserError unless ``dim`` (the `embed` size) splits evenly over the mesh's `data` axis."""
  data = mesh.shape["data"]
  if dim % data:
    raise UserError(f"mesh.fsdp=True splits model.dim={dim} over mesh.data={data}, which does "
                    "not divide it; pick a mesh.data that divides model.dim or set mesh.fsdp=False")


def make_mesh(data: int = -1, tensor: int = 1, pipe: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (pipe, data, tensor) mesh; `data=-1` takes every device not used by the other axes."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  if pipe < 1:
    raise UserError(f"mesh.pipe={pipe} must be >= 1")
  if tensor < 1 or n % (tensor * pipe):
    more = ("; on a CPU, JAX_NUM_CPU_DEVICES=N in the environment makes N devices"
            if devices and devices[0].platform == "cpu" else "")
    raise UserError(f"mesh.tensor={tensor} x mesh.pipe={pipe} must divide the {n} devices: "
                    f"lower them, or run on more devices{more}")
  if data == -1:
    data = n // (tensor * pipe)
  if data * tensor * pipe != n:
    raise UserError(f"mesh data={data} x tensor={tensor} x pipe={pipe} = {data * tensor * pipe} "
                    f"but {n} devices are visible; set mesh.data=-1 to use them all")
  arr = np.asarray(devices).reshape(pipe, data, tensor)
  return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def logical_sharding(mesh: Mesh, logical_axes: Sequence[str | None],
                     fsdp: bool = False) -> NamedSharding:
  """NamedSharding for an array whose dimensions carry these logical names."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(logical_axes, rules(fsdp)))


def rows_sharding(mesh: Mesh) -> NamedSharding:
  """The leading dim (rows, logical `batch`) placed by the rules table, the rest replicated:
  every batch array, of any rank."""
  return logical_sharding(mesh, ("batch",))


def tree_shardings(mesh: Mesh, logical_specs, fsdp: bool = False):
  """Tree of logical PartitionSpecs -> tree of NamedShardings."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules(fsdp))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
