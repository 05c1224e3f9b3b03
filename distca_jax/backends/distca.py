"""The ``distca`` core-attention backend of the trainer: plan each batch on the input thread
(``distca_jax.plan``), run the data plane inside the step (``distca_jax.dataplane``)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Mapping

import numpy as np

from distca_jax import attention as attn_lib
from distca_jax.checks import check_float, check_int
from distca_jax.dataplane import check_options, dispatch_attention, mesh_and_servers
from distca_jax.dataplane.exchange import DEFAULT_COLLECTIVE
from distca_jax.plan import cost
from distca_jax.plan.capacity import resolve_capacity
from distca_jax.plan.spec import (DEFAULT_EXCHANGE_BUCKETS, HostPlan, PlanSpec, host_plan,
                                  nano_batch_rows)

PLAN_KEY = "distca_plan"  # the one key of ``layout.extra`` this backend reads


def make_backend(*, tolerance: float = cost.DEFAULT_TOLERANCE, min_shard: int = 0,
                 q_slot: int = 0, kv_slot: int = 0, q_tokens: int = 0, kv_tokens: int = 0,
                 tasks: int = 0, kernel: str = "reference", memory_mode: str = "keep",
                 rows_per_rank: int = 1, nano_batches: int = 1,
                 q_heads: int = cost.DEFAULT_Q_HEADS, kv_heads: int = cost.DEFAULT_KV_HEADS,
                 head_dim: int = cost.DEFAULT_HEAD_DIM, dtype_bytes: int = cost.DEFAULT_DTYPE_BYTES,
                 data_axis: str = "data", head_axis: str | None = "tensor",
                 cost_table: str = "", exchange_buckets: int = DEFAULT_EXCHANGE_BUCKETS,
                 collective: str = DEFAULT_COLLECTIVE,
                 signal_only: bool = False, split_exchange: bool = False,
                 min_gain: float = 0.0,
                 linear_pairs_per_token: float = 0.0) -> "DistcaBackend":
  """The ``distca`` core-attention backend (options: ``config.attention.distca`` + model shapes).

  Returns a ``DistcaBackend``.

  ``host_prepare(doclens, tokens_per_row)`` plans each batch on the input thread (one list of
  document lengths per row; ``len(doclens) = data ranks x rows_per_rank``) and returns
  ``{'distca_plan': int32 [rows, W]}``; ``fn`` reads it from ``layout.extra`` and runs
  ``dispatch_attention`` over the mesh set by ``trainer.mesh_context``.

  With ``nano_batches = n`` (ping-pong, ``model.split_rows``) the model calls core attention once
  per nano-batch, on rows ``[i R/n, (i+1) R/n)`` of every rank's block; each nano-batch is planned
  and balanced on its own, and its plan is stored in exactly those rows of ``distca_plan``, so
  ``split_rows`` hands every call its own plan.

  Caps are per device for one call (``R/n`` rows of ``tokens_per_row``); 0 takes
  ``default_capacity``, ``min_shard`` 0 takes ``auto_min_shard``. ``min_gain`` and
  ``linear_pairs_per_token`` gate each plan (``plan.schedule``: a plan whose predicted
  speedup is below ``1 + min_gain`` moves nothing; the trainer derives
  ``linear_pairs_per_token`` from the model). ``exchange_buckets``, ``split_exchange``,
  ``collective`` and ``signal_only`` (benchmarks only: wrong results) go to
  ``dispatch_attention``.
  """
  try:
    check_options(kernel, memory_mode, exchange_buckets, signal_only, collective,
                   split_exchange)
  except ValueError as e:
    raise ValueError(f"{e} (config.attention.distca)") from e
  r = check_int("rows_per_rank", rows_per_rank, 1)
  n = check_int("nano_batches", nano_batches, 1)
  # Checked here, not only by each plan's schedule(): a bad value fails at startup.
  check_float("config.attention.distca.min_gain", min_gain,
                 hint="0 = always balance; default 0.02")
  check_float("linear_pairs_per_token", linear_pairs_per_token,
                 hint="the trainer derives it: metrics.linear_pairs_per_token")
  if r % n:
    raise ValueError(f"{rows_per_rank=} must be a multiple of {nano_batches=}")
  caps = dict(q_slot=q_slot, kv_slot=kv_slot, q_tokens=q_tokens, kv_tokens=kv_tokens,
              tasks=tasks)
  for name, v in caps.items():
    check_int(f"config.attention.distca.{name} (0 = auto)", v, 0)
  rn = r // n  # rows per device in one core-attention call
  byte_model = dict(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                    dtype_bytes=dtype_bytes)

  def spec_for(num_servers: int, tokens_per_row: int) -> PlanSpec:
    return PlanSpec(num_servers=num_servers, tokens_per_row=tokens_per_row, rows_per_device=rn,
                    capacity=resolve_capacity(caps, rn * tokens_per_row, rn))

  def host_plans(doclens, tokens_per_row: int) -> list[HostPlan]:
    rows = len(doclens)
    if rows % r:
      raise ValueError(f"the batch has {rows} rows, not a multiple of {rows_per_rank=}")
    s = rows // r
    spec = spec_for(s, int(tokens_per_row))
    # Nano-batch i: rows [i rn, (i + 1) rn) of every device's block (model.split_rows).
    return [host_plan([list(doclens[x]) for x in nano_batch_rows(s, r, n, i)], spec,
                      tolerance=tolerance, min_shard=min_shard or None,
                      cost_model=cost_table or None, min_gain=min_gain,
                      linear_pairs_per_token=linear_pairs_per_token, **byte_model)
            for i in range(n)]

  warned = []

  def host_prepare(doclens, tokens_per_row: int) -> dict[str, np.ndarray]:
    plans = host_plans(doclens, tokens_per_row)
    capped = [hp.plan.degraded_reason for hp in plans
              if hp.plan.degraded and "capacity" in hp.plan.degraded_reason]
    if capped and not warned:  # once per backend: the caps are the same for every batch
      warned.append(True)
      warnings.warn(f"distca: a batch's plan stopped short of its tolerance: {capped[0]} (caps "
                    f"{caps}; raise them in config.attention.distca, or caps_headroom / "
                    "caps_from_batches). Training goes on with that balance; this warning is "
                    "shown once.", stacklevel=2)
    spec = plans[0].spec
    s = spec.num_servers
    out = np.zeros((s, r, spec.width), np.int32)
    for i, hp in enumerate(plans):
      out[:, i * rn:(i + 1) * rn] = hp.packed.reshape(s, rn, spec.width)
    return {PLAN_KEY: out.reshape(s * r, spec.width)}

  def fn(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *, softmax_scale: float):
    if PLAN_KEY not in layout.extra:
      raise ValueError(f"the 'distca' backend needs layout.extra['{PLAN_KEY}'] (got keys "
                       f"{sorted(layout.extra)}); run backend.host_prepare on the batch "
                       "(trainer.add_host_plan)")
    mesh, s = mesh_and_servers(None, data_axis)
    if q_BxTxHxD.shape[0] != s * rn:
      raise ValueError(f"core attention got {q_BxTxHxD.shape[0]} rows on {data_axis}={s}; the "
                       f"backend was built for {rows_per_rank=} / {nano_batches=} = {rn} rows per "
                       "device and call (pass the config's values to make_backend)")
    spec = spec_for(s, q_BxTxHxD.shape[1])
    hax = head_axis if head_axis in mesh.axis_names and mesh.shape[head_axis] > 1 else None
    # Documents never cross a row, so no task has more than a row's query or key rows: the bound
    # for flash3 (its grid is tasks x ceil(max_seqlen / 128) blocks; the buffers are up to 3x
    # longer); other kernels ignore it.
    kopts = {"max_seqlen_q": spec.tokens_per_row, "max_seqlen_k": spec.tokens_per_row}
    return dispatch_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout.extra[PLAN_KEY], spec,
                              kernel=kernel, memory_mode=memory_mode,
                              softmax_scale=softmax_scale, data_axis=data_axis, head_axis=hax,
                              exchange_buckets=exchange_buckets, collective=collective,
                              signal_only=signal_only, split_exchange=split_exchange,
                              kernel_options=kopts)

  return DistcaBackend(fn=fn, host_prepare=host_prepare, host_plans=host_plans, caps=caps)


@dataclasses.dataclass(frozen=True)
class DistcaBackend(attn_lib.Backend):
  """The ``distca`` backend; ``host_plans(doclens, tokens_per_row) -> [HostPlan]`` (one per
  nano-batch) is the planning ``host_prepare`` packs, for benchmarks and diagnostics; ``caps``
  the capacity options it was built with (0 = ``default_capacity``'s value)."""
  host_plans: Callable[..., list[HostPlan]] | None = None
  caps: Mapping[str, int] | None = None


attn_lib.register_backend("distca", make_backend)
