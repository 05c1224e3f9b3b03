"""The exchange on a side CUDA stream, spanning independent compute (one server per group).

With ``ExchangeOptions.side_blocks = N > 0`` (config ``attention.distca.side_stream_blocks``)
the exchange of one server (the exchange axis of size 1: every route is the device's own group,
one GPU per process-local group) runs as the side-stream copy of ``custom_ops/side_stream.py``
with a grid of ``N`` CTAs. Exchanges over several servers refuse (one line): writing a peer's
receive buffer needs peer pointers and a cross-device completion signal that the copy does not
have (docs/design.md, "The side-stream exchange").

Two ways in:
  ``side_exchange``  inside ``ragged_exchange`` (its custom VJP: the backward's exchange on the
                     side stream too): start, then done at once. Same results; nothing runs
                     beside the copy, so nothing is hidden.
  ``span``           in the global view, around other work: every copy of ``moves`` starts, an
                     ``lax.optimization_barrier`` ties the tokens to the work's inputs, the work
                     runs, another barrier ties its outputs to the copies' operands, and the
                     copies are done. Its custom VJP runs the backward the same way: the
                     cotangents' copies (routes reversed) start, the work's VJP runs, they are
                     done. ``dispatch_beside`` is CAD's core attention with its two exchanges
                     (send; output return) each spanning a step of other work: the ping-pong of
                     ``distca_jax.side_pingpong`` hands it the other nano-batch's post-CA and
                     pre-CA.

Residency rule (``check_blocks``): the copy's grid must be resident at once, one CTA of 1024
threads per SM at most, so ``blocks`` may not exceed the GPU's SMs (``sm_count``; 132, the
H100's, on platforms without SMs, so the CPU tests refuse what an H100 refuses). A grid that
waits on other devices' signals would hang with a CTA that never gets an SM; this copy waits on
none, and the rule keeps it that way for the multi-device version.

CPU: the copy's CPU handler runs the same program synchronously (fake devices, tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from distca_jax import ops
from distca_jax.dataplane.copies import gather_two, place_unique, take_rows
from distca_jax.dataplane.mesh import mesh_and_servers
from distca_jax.plan.metadata import reverse_routes

# SMs of the GPU the rule assumes where the device reports none (an H100 SXM).
DEFAULT_SMS = 132


def sm_count(device=None) -> int:
  """Streaming multiprocessors of ``device`` (default the first device); ``DEFAULT_SMS`` where
  the platform reports none (CPU)."""
  d = device if device is not None else jax.devices()[0]
  n = getattr(d, "core_count", None) if d.platform in ("gpu", "cuda") else None
  return int(n) if n else DEFAULT_SMS


def check_blocks(blocks, sms: int | None = None) -> int:
  """The residency rule (module docstring): ``blocks`` an integer in ``[1, sms]``."""
  sms = sm_count() if sms is None else int(sms)
  if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or not (
      1 <= blocks <= sms):
    raise ValueError(f"attention.distca.side_stream_blocks={blocks!r}: the side copy's grid "
                     f"(one 1024-thread CTA per SM) must be resident at once on {sms} SMs; set "
                     f"1..{sms} (8-16 hid the exchange on 1 x H100), or 0 to turn it off")
  return int(blocks)


def check_options(exchange) -> None:
  """One-line errors for ``ExchangeOptions`` the side-stream exchange cannot run."""
  check_blocks(exchange.side_blocks)
  if exchange.signal_only:
    raise ValueError("distca signal_only=True with side_stream_blocks > 0: the side copy moves "
                     "whole groups; set one of them off")
  if exchange.collective == "two_level":
    raise ValueError("distca collective='two_level' with side_stream_blocks > 0: the side copy "
                     "runs one server's exchange only; set attention.distca.side_stream_blocks=0")


def check_servers(servers: int, blocks: int) -> None:
  if servers != 1:
    raise ValueError(f"attention.distca.side_stream_blocks={blocks} runs the exchange of one "
                     f"server (its own group) only, not of {servers} servers: the side copy has "
                     "no peer pointers; set side_stream_blocks=0 or one data rank per exchange")


def side_exchange(x, routes, recv_rows: int, blocks: int, servers: int):
  """``ragged_exchange``'s contract for one server (inside ``shard_map``): the side copy of
  ``x`` by ``routes`` into ``[recv_rows, ...]``, started and done at once."""
  from custom_ops import side_stream as ss  # pylint: disable=import-outside-toplevel
  check_blocks(blocks)
  check_servers(servers, blocks)
  y, token = ss.side_copy_start(x, routes, recv_rows, blocks)
  return ss.side_copy_done(y, x, routes, token)


@dataclasses.dataclass(frozen=True)
class Where:
  """Where the global arrays of ``span`` live: rows over ``data_axis`` (a name or a tuple),
  heads (dim 1 of every row array) over ``head_axis`` or None."""
  mesh: object
  data_axis: tuple[str, ...]
  head_axis: str | None = None

  @property
  def rows(self):
    return P(self.data_axis, self.head_axis)

  @property
  def per_device(self):  # one entry per device (tokens)
    return P(self.data_axis + ((self.head_axis,) if self.head_axis else ()))

  def map(self, f, in_specs, out_specs):
    return jax.shard_map(f, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def _starts(where: Where, rows: tuple[int, ...], blocks: int, xs, routes):
  """Starts every copy (``xs[i]`` by ``routes[i]`` ``[G, 6, S]`` into ``rows[i]`` rows);
  returns (ys, tokens)."""
  from custom_ops import side_stream as ss  # pylint: disable=import-outside-toplevel

  def f(xs, routes):
    out = [ss.side_copy_start(x, r[0], n, blocks)
           for x, r, n in zip(xs, routes, rows)]
    return tuple(y for y, _ in out), tuple(t.reshape(1) for _, t in out)
  k = len(xs)
  return where.map(f, ((where.rows,) * k, (P(where.data_axis),) * k),
                   ((where.rows,) * k, (where.per_device,) * k))(tuple(xs), tuple(routes))


def _dones(where: Where, ys, xs, routes, tokens):
  from custom_ops import side_stream as ss  # pylint: disable=import-outside-toplevel

  def f(ys, xs, routes, tokens):
    return tuple(ss.side_copy_done(y, x, r[0], t[0])
                 for y, x, r, t in zip(ys, xs, routes, tokens))
  k = len(xs)
  return where.map(f, ((where.rows,) * k, (where.rows,) * k, (P(where.data_axis),) * k,
                       (where.per_device,) * k), (where.rows,) * k)(ys, xs, routes, tokens)


def _run(where, rows, blocks, order, fn, xs, routes, args):
  """The copies spanning ``fn(*args)`` (``order='overlap'``), or done before it ('serial')."""
  ys, tokens = _starts(where, rows, blocks, xs, routes)
  if order == "serial":
    ys = _dones(where, ys, xs, routes, tokens)
    ys, args = lax.optimization_barrier((ys, args))
    return ys, fn(*args)
  tokens, args = lax.optimization_barrier((tokens, args))  # the work after every start
  out = fn(*args)
  (ys, xs, routes, tokens), out = lax.optimization_barrier(((ys, xs, routes, tokens), out))
  return _dones(where, ys, xs, routes, tokens), out  # every done after the work


def _nothing(*_):
  return ()


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _span(where, rows, blocks, order, fn, xs, routes, args):
  return _run(where, rows, blocks, order, fn, xs, routes, args)


def _span_fwd(where, rows, blocks, order, fn, xs, routes, args):
  ys, (out, vjp) = _run(where, rows, blocks, order, lambda *a: jax.vjp(fn, *a), xs, routes,
                        args)
  return (ys, out), (routes, tuple(x.shape[0] // _row_blocks(where) for x in xs), vjp)


def _span_bwd(where, rows, blocks, order, fn, res, cts):
  routes, x_rows, vjp = res
  dys, dout = cts
  dxs, dargs = _run(where, x_rows, blocks, order, vjp, tuple(dys),
                    tuple(reverse_routes(r) for r in routes), (dout,))
  return tuple(dxs), None, dargs


_span.defvjp(_span_fwd, _span_bwd)


def _row_blocks(where: Where) -> int:
  return math.prod(where.mesh.shape[a] for a in where.data_axis)


def span(where: Where, moves, blocks: int, fn=None, args=(), order: str = "overlap"):
  """``(ys, fn(*args))``: the side copies of ``moves`` (``(x, routes, recv_rows)``: ``x`` rows
  ``[G * Cs, ...]`` over ``where.data_axis``, routes ``[G, 6, S]`` per device, ``recv_rows``
  per device) started before ``fn(*args)`` and done after it (module docstring), in the global
  view. ``fn`` None: nothing beside (start, then done). ``order='serial'``: done before ``fn``
  (the single-stream order, for comparison). Differentiable in every ``x`` and in ``args``."""
  if order not in ("overlap", "serial"):
    raise ValueError(f"side span order={order!r}; choose 'overlap' or 'serial'")
  check_blocks(blocks)
  xs, routes, rows = (tuple(m[i] for m in moves) for i in range(3))
  ys, out = _span(where, tuple(int(r) for r in rows), int(blocks), order, fn or _nothing, xs,
                  routes, tuple(args))
  return tuple(ys), out


def dispatch_beside(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, plan_BxW, spec, options, mesh, *,
                    send=None, back=None, order: str = "overlap"):
  """``body.dispatch_attention`` (``options`` checked by it, side-stream exchange, one server
  per group) with its two exchanges spanning other work: the query and key/value exchange spans
  ``send`` = ``(fn, args)``, the output return spans ``back`` = ``(fn, args)`` or a function of
  ``send``'s output giving it; either may be None (nothing beside). Returns ``(O, send's
  output, back's output)`` (``(O, lse)`` first with ``options.return_lse``)."""
  blocks = options.exchange.side_blocks
  if not blocks:
    raise ValueError("dispatch_beside needs options.exchange.side_blocks > 0 "
                     "(attention.distca.side_stream_blocks)")
  check_servers(mesh_and_servers(mesh, options.exchange_axis)[1], blocks)
  if options.memory_mode != "keep":
    raise ValueError(f"distca memory_mode={options.memory_mode!r} with the side-stream "
                     "ping-pong: it keeps the kernel's inputs; set attention.distca.memory_mode="
                     "'keep'")
  axes = tuple(options.data_axis) if isinstance(options.data_axis, (tuple, list)) else (
      options.data_axis,)
  where = Where(mesh, axes, options.head_axis)
  cap = spec.capacity
  r, t, h, d = q_BxTxHxD.shape[0] // _row_blocks(where), *q_BxTxHxD.shape[1:]
  kh = k_BxTxKxD.shape[2]
  scale = 1.0 / math.sqrt(d) if options.softmax_scale is None else float(options.softmax_scale)
  qkv, plan = P(axes, None, options.head_axis, None), P(axes, None)

  def local(q, k, v):
    return q.reshape(r * t, h, d), k.reshape(r * t, kh, d), v.reshape(r * t, kh, d)

  def gathers(q, k, v, p):  # 1. sender gathers
    q, k, v = local(q, k, v)
    m = spec.unpack_local(p)
    kv = jnp.concatenate([take_rows(k, m["kv_send_idx"]), take_rows(v, m["kv_send_idx"])], 1)
    return take_rows(q, m["q_send_idx"], unique=True), kv, m["q_routes"][None], m["kv_routes"][None]

  rows_, dev = where.rows, P(axes)
  q_send, kv_send, q_routes, kv_routes = where.map(
      gathers, (qkv, qkv, qkv, plan), (rows_, rows_, dev, dev))(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                                                                plan_BxW)
  fn, args = send or (None, ())
  (q_recv, kv_recv), out1 = span(where, [(q_send, q_routes, cap.q_recv),
                                         (kv_send, kv_routes, cap.kv_recv)], blocks, fn, args,
                                 order)

  def attend(q, k, v, p, q_recv, kv_recv):  # 3. server gathers, 4. the kernel, 5. return gathers
    q, k, v = local(q, k, v)
    m = spec.unpack_local(p)
    out = ops.core_attention(
        place_unique(q, q_recv, m["q_attn_idx"]), gather_two(k, kv_recv[:, :kh], m["kv_attn_idx"]),
        gather_two(v, kv_recv[:, kh:], m["kv_attn_idx"]), m["cu_seqlens_q"], m["cu_seqlens_k"],
        kernel=options.kernel, softmax_scale=scale, return_lse=options.return_lse,
        name_inputs=True, **dict(options.kernel_options))
    outs = out if options.return_lse else (out,)
    return outs, tuple(take_rows(o, m["o_send_idx"], unique=True) for o in outs)

  n = 2 if options.return_lse else 1
  attn, sends = where.map(attend, (qkv, qkv, qkv, plan, rows_, rows_),
                          ((rows_,) * n, (rows_,) * n))(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD,
                                                        plan_BxW, q_recv, kv_recv)
  step = back(out1) if callable(back) else back
  fn, args = step or (None, ())
  o_routes = reverse_routes(q_routes)  # the query exchange's routes reversed
  recvs, out2 = span(where, [(s, o_routes, cap.q_send) for s in sends], blocks, fn, args, order)

  def place(p, attn, recvs):  # 5. into the owners' rows (zeros, -inf LSE, at padding)
    m = spec.unpack_local(p)
    outs = [place_unique(a, b, m["o_local_idx"], fill) for a, b, fill in
            zip(attn, recvs, (0, -jnp.inf))]
    o = outs[0].reshape(r, t, h, d)
    return (o, outs[1].reshape(r, t, h)) if options.return_lse else o

  lse = P(axes, None, options.head_axis)
  result = where.map(place, (plan, (rows_,) * n, (rows_,) * n),
                     (qkv, lse) if options.return_lse else qkv)(plan_BxW, attn, recvs)
  return result, out1, out2
