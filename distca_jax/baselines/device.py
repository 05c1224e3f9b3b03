"""Device functions of the baselines: each a `CoreAttentionFn` run inside `shard_map` over `data`.

Both run where the trainer calls core attention (inside jit, under the mesh set by
`trainer.mesh_context`): q [B, T, H, D] and k, v [B, T, K, D] with rows sharded over `data` (heads
over `tensor` when the mesh has that axis), host-planned tables in `layout.extra` (rows over
`data` too). Each rank runs ONE fused varlen `ops.core_attention` call per row it holds.

* `packed_dp_attention`: every rank computes its own rows' documents; no communication.
* `group_attention` (`cp` and `wlb`): ranks form CP groups of `cp_size` consecutive `data` ranks;
  K and V are all-gathered inside the group (`lax.all_gather` with `axis_index_groups`; its
  transpose, a grouped reduce-scatter, sums dK/dV in the backward), every task's key prefix is
  gathered from them into a per-row key buffer (`kv_index`), and the row's tasks run in one call.
  The rows must already hold the CP arrangement (`packing.cp_placement` / `wlb_placement`).

Under a pipeline (mesh.pipe > 1) a call's rows are the slots of every stage, sharded over
(pipe, data) (`pipeline.pipeline_layers`): each rank still computes the rows it holds, and a CP
group's all-gather runs over `data` only, so it gathers the K/V of its own stage's microbatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from distca_jax import attention as attn_lib
from distca_jax import ops

DATA_AXIS = "data"
PIPE_AXIS = "pipe"
TENSOR_AXIS = "tensor"


def _mesh_and_specs(name: str):
  """(mesh, spec of q/k/v [B, T, H, D]): rows over `data`, or over (pipe, data) under a pipeline
  (mesh.pipe > 1: a call's rows are every stage's slot, `pipeline.pipeline_layers`), heads over
  `tensor` when the mesh has it."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or DATA_AXIS not in mesh.axis_names:
    raise ValueError(
        f"core-attention backend {name!r} runs inside shard_map over the {DATA_AXIS!r} mesh axis, "
        f"but no mesh with that axis is set (got axes {mesh.axis_names}); call it under "
        "`with jax.set_mesh(mesh)` (the trainer's `mesh_context` does this)")
  heads = TENSOR_AXIS if TENSOR_AXIS in mesh.axis_names else None
  rows = (PIPE_AXIS, DATA_AXIS) if dict(mesh.shape).get(PIPE_AXIS, 1) > 1 else DATA_AXIS
  return mesh, P(rows, None, heads, None)


def _extra(layout: attn_lib.Layout, name: str, keys: tuple[str, ...], how: str):
  missing = [k for k in keys if k not in layout.extra]
  if missing:
    raise ValueError(
        f"core-attention backend {name!r} needs layout.extra{missing} (host-planned tables), "
        f"got keys {sorted(layout.extra)}; {how}")
  return [layout.extra[k] for k in keys]


def packed_dp_task_table(doc_lens_RxN: jax.Array, tokens_per_row: int):
  """(cu_seqlens_q, cu_seqlens_k) of ``packed_dp``'s one fused call over ``R`` rows.

  Each row's documents, then its padding as two pseudo-tasks (its queries without keys, its keys
  without queries) so the next row's tasks start at the right offsets and padding outputs are
  0. Empty slots (a row's unused document slots, zero padding) go last, the others in order
  (the offsets do not change): flash3 then launches only the slots in use (its launch buckets
  cut trailing empty slots). With them between rows, one call over 2 rows of 64K took 224 ms
  forward+backward against 185 ms for one call per row.
  """
  lens = doc_lens_RxN.astype(jnp.int32)
  pad_R1 = tokens_per_row - lens.sum(1, keepdims=True)
  zero_R1 = jnp.zeros_like(pad_R1)
  lens_q = jnp.concatenate([lens, pad_R1, zero_R1], axis=1).reshape(-1)
  lens_k = jnp.concatenate([lens, zero_R1, pad_R1], axis=1).reshape(-1)
  order = jnp.argsort((lens_q == 0) & (lens_k == 0), stable=True)
  zero = jnp.zeros((1,), jnp.int32)
  return tuple(jnp.concatenate([zero, jnp.cumsum(x[order])]).astype(jnp.int32)
               for x in (lens_q, lens_k))


def packed_dp_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *,
                        softmax_scale: float, kernel: str = "auto", window: int = 0):
  """Data parallel, no balancing: each rank's rows in one fused varlen call (``window`` > 0: a
  sliding-window layer's, the kernel's static window).

  Needs ``layout.extra['doc_lens']`` [B, Nd] int32 (``packing.packed_doc_lens``, the backend's
  ``host_prepare``): the lengths of each row's documents, zero-padded.
  """
  # pylint: disable-next=protected-access
  attn_lib.check_shapes(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout)
  (doc_lens_BxN,) = _extra(layout, "packed_dp", ("doc_lens",),
                           "the trainer adds them through Backend.host_prepare")
  _, spec = _mesh_and_specs("packed_dp")  # under a pipeline each rank computes its own rows too

  def per_rank(q_RxTxHxD, k_RxTxKxD, v_RxTxKxD, doc_lens_RxN):
    r, t, h, d = q_RxTxHxD.shape
    kh = k_RxTxKxD.shape[2]
    cu_q, cu_k = packed_dp_task_table(doc_lens_RxN, t)
    # No task is longer than a row (documents never cross rows): max_seqlen = t tells flash3
    # (its backward launches blocks per task x ceil(max_seqlen_k / 128)).
    o = ops.core_attention(q_RxTxHxD.reshape(r * t, h, d), k_RxTxKxD.reshape(r * t, kh, d),
                           v_RxTxKxD.reshape(r * t, kh, d), cu_q, cu_k, kernel=kernel,
                           softmax_scale=softmax_scale, max_seqlen_q=t, max_seqlen_k=t,
                           window=window)
    return o.reshape(r, t, h, d)

  # check_vma=False: kernel primitives (Mosaic GPU's mpmd_map, flash3's FFI custom_vjp) carry no
  # varying-manual-axes types; with checking on, flash3's backward fails type matching on GPUs.
  return jax.shard_map(per_rank, in_specs=(spec, spec, spec, P(spec[0], None)),
                       out_specs=spec, check_vma=False)(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, doc_lens_BxN)


def group_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout: attn_lib.Layout, *,
                    softmax_scale: float, cp_size: int, kernel: str = "auto",
                    name: str = "cp"):
  """Context parallelism over groups of ``cp_size`` consecutive `data` ranks (``cp``, ``wlb``).

  Needs ``layout.extra`` ``kv_index`` [B, Nkv], ``cu_seqlens_q`` / ``cu_seqlens_k`` [B, Nt + 1]
  (``packing.task_tables`` of the rows' placement) and rows holding that placement's tokens.
  """
  # pylint: disable-next=protected-access
  attn_lib.check_shapes(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, layout)
  kv_index_BxU, cu_q_BxN1, cu_k_BxN1 = _extra(
      layout, name, ("kv_index", "cu_seqlens_q", "cu_seqlens_k"),
      "arrange the batch with distca_jax.baselines.arrange_batch (the trainer does it through "
      "trainer.add_host_plan)")
  mesh, spec = _mesh_and_specs(name)
  c = int(cp_size)
  s = mesh.shape[DATA_AXIS]
  if c < 1 or s % c:
    raise ValueError(f"{name}: cp_size={cp_size} must divide the {s} ranks of the "
                     f"{DATA_AXIS!r} axis; set attention.baselines.cp_size to a divisor of "
                     "mesh.data")
  groups = [list(range(g * c, (g + 1) * c)) for g in range(s // c)]

  def per_rank(q_RxTxHxD, k_RxTxKxD, v_RxTxKxD, kv_index_RxU, cu_q_RxN1, cu_k_RxN1):
    r, t = q_RxTxHxD.shape[:2]
    kh, d = k_RxTxKxD.shape[2:]
    if c > 1:
      # [c, R, T, K, D] in group-rank order (what kv_index addresses).
      k_all = lax.all_gather(k_RxTxKxD, DATA_AXIS, axis_index_groups=groups)
      v_all = lax.all_gather(v_RxTxKxD, DATA_AXIS, axis_index_groups=groups)
    else:
      k_all, v_all = k_RxTxKxD[None], v_RxTxKxD[None]
    outs = []
    for j in range(r):  # rows per rank: a static, usually 1
      k_src = k_all[:, j].reshape(c * t, kh, d)
      v_src = v_all[:, j].reshape(c * t, kh, d)
      k_buf = jnp.take(k_src, kv_index_RxU[j], axis=0, mode="fill", fill_value=0)
      v_buf = jnp.take(v_src, kv_index_RxU[j], axis=0, mode="fill", fill_value=0)
      outs.append(ops.core_attention(q_RxTxHxD[j], k_buf, v_buf, cu_q_RxN1[j].astype(jnp.int32),
                                     cu_k_RxN1[j].astype(jnp.int32), kernel=kernel,
                                     softmax_scale=softmax_scale))
    return jnp.stack(outs)

  table = P(spec[0], None)
  # check_vma=False: see packed_dp_attention.
  return jax.shard_map(per_rank, in_specs=(spec, spec, spec, table, table, table),
                       out_specs=spec, check_vma=False)(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, kv_index_BxU, cu_q_BxN1,
                                       cu_k_BxN1)
