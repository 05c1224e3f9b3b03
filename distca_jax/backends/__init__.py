"""Core-attention backends: one module per backend, each exporting the same names.

* ``Options``: a frozen dataclass of the backend's options, with ``Options.from_config(c)``
  reading them from a run config;
* ``make(options) -> attention.Backend``;
* optionally ``from_first_batches(c, options) -> Options``: the options a config leaves to the
  run's own data, measured at startup on its first batches (``distca``: buffer caps; ``wlb``:
  WLB-ideal's split and alpha; ``cp``: its CP size; ``baselines.baseline_choice``; where the
  device reports a memory capacity, ``distca_jax.choose.resolve`` sets those before the trainer
  starts, as each candidate's step must be compiled). ``from_config`` itself only reads the
  config.

``build(c, **overrides)`` is the one place a name becomes a backend (the trainer calls it;
benchmarks pass options that are no config keys, e.g. ``signal_only=True``, as overrides); it
runs the startup step after the overrides, so an option set there is not measured;
``get(name, **options)`` builds one from options alone (tests, notebooks).

==============  ======================================================================
``local``       each row attends its own documents (blockwise jnp, custom VJP)
``reference``   dense O(T^2) jnp (tests)
``distca``      core attention disaggregation: host plan + data plane (``plan``, ``dataplane``)
``packed_dp``   each rank its own documents, one fused varlen call
``cp``          per-sequence context parallelism
``wlb``         WLB-LLM packing + per-document context parallelism
==============  ======================================================================
"""

from __future__ import annotations

import dataclasses
import types

import ml_collections

from distca_jax import attention as attn_lib
from distca_jax import config as config_lib
from distca_jax import layer_types as types_lib
from distca_jax import pipeline
from distca_jax.errors import UserError
from distca_jax.backends import cp, distca, local, packed_dp, reference, wlb

BACKENDS: dict[str, types.ModuleType] = {
    "local": local, "reference": reference, "distca": distca, "packed_dp": packed_dp, "cp": cp,
    "wlb": wlb,
}


def module(name: str) -> types.ModuleType:
  """The backend module of ``name``."""
  if name not in BACKENDS:
    raise UserError(f"unknown core-attention backend {name!r}; available: {sorted(BACKENDS)}. "
                     "Set config.attention.backend to one of them.")
  return BACKENDS[name]


def build(c: ml_collections.ConfigDict, **overrides) -> attn_lib.Backend:
  """The configured backend (``config.attention.backend``), options from the config; keyword
  ``overrides`` replace single options (names of the backend's ``Options`` fields); options left
  to the data are then measured on the run's first batches (``from_first_batches``). Under a
  pipeline (``mesh.pipe > 1``) its host planning runs per tick (``pipeline.per_tick_backend``).
  A config that cannot run stops first with ``config.validate``'s one line (e.g. rows that do not
  form the pipeline's microbatches), whichever caller builds the backend."""
  config_lib.validate(c)
  m = module(c.attention.backend)
  given = dataclasses.replace(m.Options.from_config(c), **overrides)
  options = given
  if hasattr(m, "from_first_batches"):  # the startup step: sample the run's first batches
    options = m.from_first_batches(c, given)
  backend = with_layer_types(c, m, options)
  if c.mesh.pipe > 1:  # one core-attention call is one pipeline tick: host plans per tick
    backend = pipeline.per_tick_backend(backend, stages=c.mesh.pipe, rows_per_rank=c.rows_per_rank,
                                        microbatches=c.pipeline.microbatches)
  chosen = tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options)
                 if getattr(options, f.name) != getattr(given, f.name))
  return dataclasses.replace(backend, chosen=chosen) if chosen else backend


# Backends that run every layer over their own token arrangement as full causal attention.
_FULL_ONLY = {
    "cp": "its head-tail chunks of each sequence attend all earlier keys",
    "wlb": "its per-document context parallelism attends all earlier keys",
}


def with_layer_types(c: ml_collections.ConfigDict, m: types.ModuleType,
                     options) -> attn_lib.Backend:
  """Backend module ``m``'s backend of ``options`` for the model's layer types
  (``model.layer_pattern``; ``layer_types``). Every layer full: ``m.make(options)``. Else one
  backend per distinct sliding window when ``m``'s options hold a ``window`` (``distca``: its
  plans and kernel are windowed), and its host planning runs once per distinct layer type per
  batch (``layer_types.per_type_host_prepare``: each type's arrays under ``name@type``, chunk
  types planned over the chunk-cut documents; the step's ``attention.CROSSES_KEY`` the maximum
  over the types); with a local branch and several types each layer runs the backend's
  attention when its type's plan moves rows and ``local_fn`` when it does not
  (``layer_types.local_unless_crossing``). ``cp`` and ``wlb`` refuse local layers,
  ``attention.distca.branch='price'`` several types (one line each)."""
  backend = m.make(options)
  kinds = types_lib.distinct(config_lib.model_config(c).layer_types)
  if kinds == (types_lib.FULL_TYPE,):
    return backend
  name = c.attention.backend
  names = [t.name for t in kinds]
  if name in _FULL_ONLY:
    raise UserError(f"attention.backend={name!r} cannot run local layers {names} "
                    f"(model.layer_pattern={c.model.layer_pattern!r}): {_FULL_ONLY[name]}; use "
                    "'distca', 'packed_dp' or 'local'")
  if backend.local_fn is not None and len(kinds) > 1 and c.attention.distca.branch == "price":
    raise UserError(f"attention.distca.branch='price' prices the plans of one layer type; the "
                    f"model has {names}: set attention.distca.branch='gain'")
  if backend.host_prepare is None:  # no host arrays: the model's layout_for is all it needs
    return backend
  windowed = "window" in {f.name for f in dataclasses.fields(options)}
  made = {w: m.make(dataclasses.replace(options, window=w)) if windowed and w else backend
          for w in {t.window for t in kinds}}
  of = {t: made[t.window] for t in kinds}

  def per_window(attr: str):
    """The backends' ``attr`` functions as one, by the layer's ``window`` (a windowed
    backend's own function holds its window; the others take it as an argument)."""
    fns = {w: getattr(b, attr) for w, b in made.items()}
    if windowed:
      fns = {w: types_lib.dropping_window(f) for w, f in fns.items()}
    if backend.local_fn is not None and len(kinds) > 1:
      fns = {w: types_lib.local_unless_crossing(f, backend.local_fn) for w, f in fns.items()}
    return types_lib.by_window(fns)

  out = dataclasses.replace(backend, fn=per_window("fn"),
                            host_prepare=types_lib.per_type_host_prepare(
                                {t: b.host_prepare for t, b in of.items()},
                                shared=(attn_lib.CROSSES_KEY,)))
  if getattr(backend, "resend_fn", None) is not None:
    out = dataclasses.replace(out, resend_fn=per_window("resend_fn"))
  return out


def kernel_of(c: ml_collections.ConfigDict) -> str | None:
  """The ``ops.core_attention`` kernel the configured backend runs (``attention.kernel``), or
  None for a backend without one (``local``, ``reference``)."""
  fields = {f.name for f in dataclasses.fields(module(c.attention.backend).Options)}
  return c.attention.kernel if "kernel" in fields else None


def get(name: str, **options) -> attn_lib.Backend:
  """The backend ``name`` with ``options`` (its ``Options`` fields; the rest default)."""
  m = module(name)
  return m.make(m.Options(**options))
