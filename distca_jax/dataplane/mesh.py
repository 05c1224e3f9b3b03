"""The mesh a CAD data plane runs on: its axes and number of servers (device side)."""

from __future__ import annotations

import math

import jax


def axes_of(axis) -> tuple[str, ...]:
  """A mesh axis name or a sequence of them, as a tuple."""
  return tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def mesh_and_servers(mesh, data_axis: str | tuple[str, ...]):
  """(mesh, servers): the given mesh or the one set by `jax.set_mesh`, and the size of its
  data axis (or the product of several: a pipeline's servers are every pipe x data rank)."""
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      raise ValueError("CAD core attention needs a mesh: pass mesh= or trace under "
                       "jax.set_mesh(mesh) (the trainer's mesh_context)")
  axes = axes_of(data_axis)
  if not set(axes) <= set(mesh.axis_names):
    raise ValueError(f"{data_axis=} is not an axis of the mesh {dict(mesh.shape)}")
  return mesh, math.prod(mesh.shape[a] for a in axes)
