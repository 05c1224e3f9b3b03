"""NumPy reference executor: runs ``PlanMetadata`` step by step (gather, exchange, per-task
attention, return) as the test oracle of the plan contract, and each document's attention
computed alone as the oracle of the whole data plane."""

from __future__ import annotations

import math

import numpy as np

from distca_jax.plan.metadata import PlanMetadata, parse_layout, reverse_routes


def _take(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
  """``jnp.take(x, idx, axis=0, mode='fill', fill_value=0)`` in NumPy."""
  out = np.zeros(idx.shape + x.shape[1:], dtype=x.dtype)
  ok = (idx >= 0) & (idx < x.shape[0])
  out[ok] = x[idx[ok]]
  return out


def _causal_attention(q_NxHxD, k_MxKxD, v_MxKxD, scale: float, window: int = 0):
  """Causal attention with queries aligned to the last rows of the keys (each query sees the
  ``window`` keys ending at its own when > 0); returns (O, LSE)."""
  n, h, _ = q_NxHxD.shape
  m, kh, _ = k_MxKxD.shape
  rep = h // kh
  k_HxDxM = np.repeat(k_MxKxD, rep, axis=1).transpose(1, 2, 0)
  v_HxMxD = np.repeat(v_MxKxD, rep, axis=1).transpose(1, 0, 2)
  s = np.matmul(q_NxHxD.transpose(1, 0, 2), k_HxDxM) * scale  # [H, N, M]
  qpos = (m - n) + np.arange(n)
  kpos = np.arange(m)[None, None, :]
  seen = kpos <= qpos[None, :, None]
  if window:
    seen &= kpos > qpos[None, :, None] - window
  s = np.where(seen, s, -np.inf)
  mx = s.max(axis=-1, keepdims=True)
  p = np.exp(s - mx)
  denom = p.sum(axis=-1, keepdims=True)
  o = np.matmul(p / denom, v_HxMxD).transpose(1, 0, 2)  # [N, H, D]
  lse = (mx + np.log(denom))[..., 0].T  # [n, h]
  return o, lse


def reference_execute(meta: PlanMetadata, q_STHD: np.ndarray, k_STKD: np.ndarray,
                      v_STKD: np.ndarray, *, scale: float | None = None, window: int = 0):
  """Runs the metadata with NumPy: gather, ragged exchange, per-task attention (sliding
  ``window`` when > 0, the plan's), return.

  Args:
    meta: metadata built for every rank (``ranks`` = all, in order).
    q_STHD: [S, T, H, D] queries per rank; k_STKD, v_STKD: [S, T, K, D].
    scale: softmax scale (default 1 / sqrt(D)).

  Returns:
    (o [S, T, H, D], lse [S, T, H]); padding rows are zero.
  """
  s, t = meta.num_servers, meta.tokens_per_rank
  if not np.array_equal(meta.ranks, np.arange(s)):
    raise ValueError("reference_execute needs metadata for every rank (ranks=None)")
  if q_STHD.shape[:2] != (s, t) or k_STKD.shape[:2] != (s, t) or v_STKD.shape != k_STKD.shape:
    raise ValueError(f"expected q [S={s}, T={t}, H, D], k/v [S, T, K, D]; got {q_STHD.shape=} "
                     f"{k_STKD.shape=} {v_STKD.shape=}")
  h, dim = q_STHD.shape[2:]
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  cap = meta.capacity
  # 1-2. Sender gather and ragged exchange (one or two levels).
  q_recv = part_exchange([_take(q_STHD[p], meta.q_send_idx[p]) for p in range(s)], meta, "q",
                         cap.q_recv)
  k_recv = part_exchange([_take(k_STKD[p], meta.kv_send_idx[p]) for p in range(s)], meta, "kv",
                         cap.kv_recv)
  v_recv = part_exchange([_take(v_STKD[p], meta.kv_send_idx[p]) for p in range(s)], meta, "kv",
                         cap.kv_recv)
  o_attn, lse_attn = [], []
  for d in range(s):
    # 3. Server gather into attention inputs.
    qa = _take(np.concatenate([q_STHD[d], q_recv[d]]), meta.q_attn_idx[d])
    ka = _take(np.concatenate([k_STKD[d], k_recv[d]]), meta.kv_attn_idx[d])
    va = _take(np.concatenate([v_STKD[d], v_recv[d]]), meta.kv_attn_idx[d])
    # 4. One varlen call: every task [cu_q[i], cu_q[i+1]) x [cu_k[i], cu_k[i+1]).
    o = np.zeros(qa.shape, dtype=np.float64)
    lse = np.zeros(qa.shape[:2], dtype=np.float64)
    cq_, ck_ = meta.cu_seqlens_q[d], meta.cu_seqlens_k[d]
    for i in range(cap.tasks):
      q0, q1, k0, k1 = int(cq_[i]), int(cq_[i + 1]), int(ck_[i]), int(ck_[i + 1])
      if q1 == q0:
        continue
      if k1 - k0 < q1 - q0:
        raise ValueError(f"server {d} task {i}: {q1 - q0} queries but only {k1 - k0} keys")
      o[q0:q1], lse[q0:q1] = _causal_attention(qa[q0:q1], ka[k0:k1], va[k0:k1], scale, window)
    o_attn.append(o)
    lse_attn.append(lse)
  # 5. Return to owners: the query exchange's routes backwards.
  o_recv = part_exchange([_take(o_attn[d], meta.o_send_idx[d]) for d in range(s)], meta, "q",
                         cap.q_send, reverse=True)
  l_recv = part_exchange([_take(lse_attn[d], meta.o_send_idx[d]) for d in range(s)], meta, "q",
                         cap.q_send, reverse=True)
  out_o = np.zeros(q_STHD.shape, dtype=np.float64)
  out_l = np.zeros(q_STHD.shape[:3], dtype=np.float64)
  for p in range(s):
    out_o[p] = _take(np.concatenate([o_attn[p], o_recv[p]]), meta.o_local_idx[p])
    out_l[p] = _take(np.concatenate([lse_attn[p], l_recv[p]]), meta.o_local_idx[p])
  return out_o, out_l


def _exchange(sends: list[np.ndarray], routes_Sx6xS: np.ndarray, recv_rows: int):
  """The ragged exchange in NumPy: group ``d`` of sender ``p``'s send buffer (``send_off``,
  ``send_len``) lands at ``peer_recv_off[d]`` of server ``d``'s receive buffer."""
  s = len(sends)
  out = [np.zeros((recv_rows,) + x.shape[1:], dtype=x.dtype) for x in sends]
  for p in range(s):
    off, ln, dst = routes_Sx6xS[p, 0], routes_Sx6xS[p, 1], routes_Sx6xS[p, 4]
    for d in range(s):
      n = int(ln[d])
      out[d][int(dst[d]):int(dst[d]) + n] = sends[p][int(off[d]):int(off[d]) + n]
  return out


def part_exchange(sends: list[np.ndarray], meta: PlanMetadata, part: str, recv_rows: int, *,
                  reverse: bool = False):
  """One part's exchange (``part`` 'q' or 'kv') as the metadata routes it, in NumPy: the one
  ragged exchange of ``{part}_routes``, or with the two-level tables (``plan.two_level``) leg A,
  the relay gather and leg B; ``reverse`` runs the way back (the output return): the reverse
  legs in reverse order, the relay gather inverted."""
  rts = getattr(meta, f"{part}_routes")
  b_idx = getattr(meta, f"{part}_b_idx")
  if b_idx is None:
    return _exchange(sends, reverse_routes(rts) if reverse else rts, recv_rows)
  a_rts, b_rts = getattr(meta, f"{part}_a_routes"), getattr(meta, f"{part}_b_routes")
  width = b_idx.shape[1]
  if not reverse:
    cs = sends[0].shape[0]
    relay = _exchange(sends, a_rts, width - cs)
    legb = [_take(np.concatenate([x, r]), i) for x, r, i in zip(sends, relay, b_idx)]
    return _exchange(legb, b_rts, recv_rows)
  back = _exchange(sends, reverse_routes(b_rts), width)
  src = []
  for y, i in zip(back, b_idx):
    out = np.zeros_like(y)
    ok = i < width
    out[i[ok]] = y[ok]
    src.append(out)
  home = _exchange([x[recv_rows:] for x in src], reverse_routes(a_rts), recv_rows)
  return [x[:recv_rows] + h for x, h in zip(src, home)]


def reference_document_attention(doc_lens, q_STHD: np.ndarray, k_STKD: np.ndarray,
                                 v_STKD: np.ndarray, *, scale: float | None = None,
                                 window: int = 0):
  """Each document's causal attention computed alone (sliding ``window`` keys per query when
  > 0); (o [S,T,H,D], lse [S,T,H]), pads zero."""
  s, t, h, dim = q_STHD.shape
  lens, starts = parse_layout(doc_lens, s, t)
  scale = 1.0 / math.sqrt(dim) if scale is None else scale
  qf = q_STHD.reshape(s * t, h, dim)
  kf = k_STKD.reshape((s * t,) + k_STKD.shape[2:])
  vf = v_STKD.reshape((s * t,) + v_STKD.shape[2:])
  o = np.zeros((s * t, h, dim))
  lse = np.zeros((s * t, h))
  for g, n in zip(starts.tolist(), lens.tolist()):
    o[g:g + n], lse[g:g + n] = _causal_attention(qf[g:g + n], kf[g:g + n], vf[g:g + n], scale,
                                                 window)
  return o.reshape(s, t, h, dim), lse.reshape(s, t, h)


# ---------------------------------------------------------------------------------------------
# Diagnostics.
