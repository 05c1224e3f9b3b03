"""Layer types: which keys each layer's core attention sees (full causal, sliding window, chunked).

A model mixes local and global attention layers (``model.ModelConfig.layer_pattern`` with
``window`` or ``chunk``). In a layer of type

  * ``full``: query position p attends keys [0, p] of its document (causal);
  * ``window`` w: keys [max(0, p - w + 1), p];
  * ``chunk`` c: keys [(p // c) * c, p]: full causal attention over the document cut at multiples
    of c (positions stay document positions: RoPE is unchanged).

What a backend does with a type:

  * a window layer calls the backend's core attention with ``window=w``;
  * a chunk layer calls it on a layout whose segment ids are cut at chunk boundaries
    (``cut_segment_ids``) and whose host arrays come from the chunk-cut documents
    (``plan.chunk_layout``);
  * a backend with host planning (``host_prepare``) plans once per distinct layer type per step
    (``per_type_backend``): array ``name`` of type ``t`` travels as ``name@t`` in
    ``layout.extra``, and ``layout_for(layout, t)`` hands each layer its own type's arrays under
    their plain names.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax.plan.metadata import chunk_layout

FULL, WINDOW, CHUNK = "full", "window", "chunk"
TYPE_SEPARATOR = "@"  # ``layout.extra`` key of a per-type host array: ``name@<LayerType.name>``


@dataclasses.dataclass(frozen=True, order=True)
class LayerType:
  """One layer's attention: ``kind`` 'full', 'window' or 'chunk'; ``size`` the window or chunk
  in tokens (0 for 'full')."""
  kind: str = FULL
  size: int = 0

  def __post_init__(self):
    if self.kind not in (FULL, WINDOW, CHUNK):
      raise ValueError(f"layer type {self.kind!r}; choose {FULL!r}, {WINDOW!r} or {CHUNK!r}")
    if (self.kind == FULL) != (self.size == 0) or self.size < 0:
      raise ValueError(f"layer type {self.kind!r} with size {self.size}: 'full' has size 0, "
                       "'window' and 'chunk' a size >= 1 (tokens)")

  @property
  def name(self) -> str:
    """'full', 'window<w>' or 'chunk<c>': the key suffix and the metrics' name of the type."""
    return self.kind if self.kind == FULL else f"{self.kind}{self.size}"

  @property
  def window(self) -> int:
    """The sliding window a kernel applies (0 = none)."""
    return self.size if self.kind == WINDOW else 0


FULL_TYPE = LayerType()
_RATIO = re.compile(r"^(\d+):(\d+)$")


def parse_layer_pattern(pattern: str, n_layers: int, *, window: int = 0,
                        chunk: int = 0) -> tuple[LayerType, ...]:
  """The layer types of ``model.layer_pattern`` (``ModelConfig`` documents the keys).

  ``pattern``: '' (every layer full), 'local' (every layer local), 'K:G' (K local layers then G
  full ones, repeated from layer 0 and cut at ``n_layers``: Gemma 3's '5:1'), or one letter per
  layer, 'L' local and 'G' full (e.g. 'LLLLLG'). Local means a window of ``window`` tokens or
  chunks of ``chunk`` tokens (exactly one of them > 0 when a layer is local)."""
  key = "model.layer_pattern"
  if window < 0 or chunk < 0 or (window and chunk):
    raise ValueError(f"model.window={window}, model.chunk={chunk}: set at most one of them, > 0 "
                     "(local layers are sliding windows or chunks)")
  local = (LayerType(WINDOW, window) if window else LayerType(CHUNK, chunk) if chunk else None)
  p = str(pattern).strip()
  if p == "":
    if local is not None:
      raise ValueError(f"model.window={window} / model.chunk={chunk} with {key}='': no layer is "
                       f"local; set {key} ('local', 'K:G' e.g. '5:1', or 'L'/'G' per layer)")
    return (FULL_TYPE,) * n_layers
  if local is None:
    raise ValueError(f"{key}={pattern!r} needs model.window > 0 (sliding-window layers) or "
                     "model.chunk > 0 (chunked layers)")
  if p == "local":
    return (local,) * n_layers
  m = _RATIO.match(p)
  if m:
    k, g = int(m.group(1)), int(m.group(2))
    if k < 1 or g < 1:
      raise ValueError(f"{key}={pattern!r}: 'K:G' needs K >= 1 local and G >= 1 full layers "
                       "(use 'local' or '' for one kind only)")
    return tuple(local if i % (k + g) < k else FULL_TYPE for i in range(n_layers))
  if set(p) <= {"L", "G"}:
    if len(p) != n_layers:
      raise ValueError(f"{key}={pattern!r} names {len(p)} layers; model.n_layers={n_layers}: "
                       "give one letter per layer")
    return tuple(local if ch == "L" else FULL_TYPE for ch in p)
  raise ValueError(f"{key}={pattern!r}; use '' (all full), 'local', 'K:G' (e.g. '5:1') or one "
                   "letter per layer, 'L' local and 'G' full (e.g. 'LLLLLG')")


def distinct(types: Sequence[LayerType]) -> tuple[LayerType, ...]:
  """The distinct types of ``types`` in the order they first appear."""
  return tuple(dict.fromkeys(types))


def runs(types: Sequence[Any]) -> list[tuple[int, int, Any]]:
  """Maximal runs of equal consecutive entries: [(start, stop, value)]."""
  out = []
  for i, t in enumerate(types):
    if out and out[-1][2] == t:
      out[-1] = (out[-1][0], i + 1, t)
    else:
      out.append((i, i + 1, t))
  return out


# ----------------------------------------------------------------------------------------------
# Chunked layers: documents cut at chunk boundaries.
# ----------------------------------------------------------------------------------------------
def cut_segment_ids(segment_ids_BxT: jax.Array, positions_BxT: jax.Array, chunk: int) -> jax.Array:
  """Segment ids [B, T] with a new segment at each chunk boundary (position % chunk == 0) and at
  each document start; 0 stays padding. Ids are 1, 2, ... per row."""
  seg, pos = segment_ids_BxT, positions_BxT
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  start = (seg != 0) & ((pos % chunk == 0) | (seg != prev))
  return jnp.where(seg != 0, jnp.cumsum(start.astype(jnp.int32), axis=1), 0).astype(seg.dtype)


# ----------------------------------------------------------------------------------------------
# Per-type host arrays.
# ----------------------------------------------------------------------------------------------
def typed_key(name: str, layer_type: LayerType) -> str:
  return f"{name}{TYPE_SEPARATOR}{layer_type.name}"


def layout_for(layout, layer_type: LayerType):
  """The layout one layer of ``layer_type`` hands its core attention: chunk layers' segment ids
  cut at chunk boundaries; the per-type host arrays (``name@type``) of this type under their
  plain names (arrays without a type suffix pass as they are). Raises when the layout holds
  per-type arrays but none of this type."""
  extra = layout.extra
  typed = [k for k in extra if TYPE_SEPARATOR in k]
  if typed:
    suffix = TYPE_SEPARATOR + layer_type.name
    mine = {k[:-len(suffix)]: v for k, v in extra.items() if k.endswith(suffix)}
    if not mine:
      raise ValueError(f"layout.extra holds per-type arrays {sorted(typed)} but none of layer "
                       f"type {layer_type.name!r}; plan the batch with the model's layer types "
                       "(layer_types.per_type_backend)")
    extra = {**{k: v for k, v in extra.items() if TYPE_SEPARATOR not in k}, **mine}
  seg = layout.segment_ids_BxT
  if layer_type.kind == CHUNK:
    seg = cut_segment_ids(seg, layout.positions_BxT, layer_type.size)
  return layout.replace(segment_ids_BxT=seg, extra=extra)


def doclens_for(doclens, layer_type: LayerType):
  """The documents a layer of ``layer_type`` attends within: chunk-cut for 'chunk'."""
  return chunk_layout(doclens, layer_type.size) if layer_type.kind == CHUNK else doclens


def per_type_host_prepare(prepares: Mapping[LayerType, Callable[..., dict]],
                          shared: Sequence[str] = ()) -> Callable[..., dict]:
  """One ``host_prepare`` of the ``prepares`` of each distinct layer type, run once per type per
  batch: type ``t``'s arrays as ``name@t`` (``layout_for`` reads them back), planned over
  ``doclens_for(doclens, t)``. Names in ``shared`` also keep their plain name, combined over the
  types (elementwise maximum, e.g. whether any plan of the step moves a row)."""

  def prepare(doclens, tokens_per_row: int) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t, host_prepare in prepares.items():
      for k, v in host_prepare(doclens_for(doclens, t), tokens_per_row).items():
        out[typed_key(k, t)] = v
        if k in shared:
          out[k] = v if k not in out else np.maximum(out[k], v)
    return out

  return prepare


def dropping_window(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
  """``fn``, a core attention whose window is built in, called as the model calls a window
  layer's (``window=`` among the keywords, dropped here)."""

  def attend(q, k, v, layout, *, softmax_scale: float, window: int = 0, **kwargs):
    del window
    return fn(q, k, v, layout, softmax_scale=softmax_scale, **kwargs)

  return attend


def by_window(fns: Mapping[int, Callable[..., jax.Array]]) -> Callable[..., jax.Array]:
  """Core attention that calls ``fns[window]`` for the layer's ``window`` keyword (0 when
  absent); the single function of a one-entry ``fns`` whatever the window."""

  def attend(q, k, v, layout, *, softmax_scale: float, window: int = 0, **kwargs):
    f = fns[window] if len(fns) > 1 else next(iter(fns.values()))
    kw = {"window": window} if window else {}
    return f(q, k, v, layout, softmax_scale=softmax_scale, **kw, **kwargs)

  return attend


def local_unless_crossing(fn: Callable[..., jax.Array], local_fn: Callable[..., jax.Array],
                          crosses_key: str = attn_lib.CROSSES_KEY) -> Callable[..., jax.Array]:
  """Core attention that runs ``fn`` when the layer's own type's plan moves rows (its
  ``crosses_key`` array, ``layout_for``'s, has a nonzero entry) and ``local_fn`` (each device
  its own rows) when it does not: one ``lax.cond`` per layer, one compiled program."""

  def attend(q, k, v, layout, *, softmax_scale: float, **kwargs):
    if crosses_key not in layout.extra:
      raise ValueError(f"layout.extra lacks {crosses_key!r} (keys {sorted(layout.extra)}); plan "
                       "the batch with the backend's host_prepare")
    crosses = jnp.any(layout.extra[crosses_key] != 0)
    run = lambda f: lambda q, k, v: f(q, k, v, layout, softmax_scale=softmax_scale, **kwargs)
    return jax.lax.cond(crosses, run(fn), run(local_fn), q, k, v)

  return attend
