"""The ping-pong of two nano-batches with each core attention's exchanges on the side stream,
spanning the other nano-batch's linear work (``model.ping_pong_layers``' schedule and math).

``model.ping_pong_layers`` runs CA_i(B) beside post_i(A) + pre_{i+1}(A) and leaves the overlap
to XLA's scheduler, which runs one stream. Here the distca backend's ``beside_fn``
(``dataplane.side.dispatch_beside``, ``attention.distca.side_stream_blocks > 0``) gets that
work: B's query and key/value exchange starts on the side stream, A's post-CA of layer i runs,
the exchange is done, B's kernel runs, B's output return starts, A's pre-CA of layer i+1 runs,
the return is done; then the same with the nano-batches swapped. Barriers fix that order in the
scheduled program, forward and backward (the span's custom VJP runs the cotangents' exchanges
beside the work's transposes). The losses and gradients are those of ``model.ping_pong_layers``
(tests/test_side_pingpong.py).

``ping_pong_beside(plan, pieces, beside_fn, layers, x, layout)``: ``plan`` a ping-pong
``model.ExecutionPlan`` (its remat policy wraps each unit), ``pieces`` ``model.layer_pieces``
(pre and post are used), ``beside_fn`` the backend's; the other arguments as
``model.ping_pong_layers``.
"""

from __future__ import annotations

import math
import re

import jax
from jax.ad_checkpoint import checkpoint_name

from distca_jax import model


def ping_pong_beside(plan: model.ExecutionPlan, pieces, beside_fn, layers, x_BxTxE, layout,
                     *, head_dim: int, order: str = "overlap"):
  """The decoder stack (module docstring); ``head_dim`` gives the softmax scale; ``order``
  'serial' does every exchange before the work it would span (for comparison)."""
  if plan.schedule != model.PING_PONG:
    raise ValueError(f"ping_pong_beside runs the ping-pong schedule, not {plan.schedule!r} "
                     "(attention.nano_batches=2, mesh.pipe=1)")
  if beside_fn is None:
    raise ValueError("ping_pong_beside needs the distca backend's beside_fn: set "
                     "attention.distca.side_stream_blocks > 0")
  scale = 1.0 / math.sqrt(head_dim)
  pre, _, post = pieces
  (x_a, x_b), (lay_a, lay_b) = model.split_rows(x_BxTxE, 2), model.split_rows(layout, 2)

  def ca(name, qkv, lay, send=None, back=None):
    """CA of one nano-batch; its exchanges span ``send`` and ``back`` (``(fn, args)``)."""
    with jax.named_scope(f"{model.PING_PONG_SCOPE}_ca_{name}"):
      q, k, v = (checkpoint_name(a, "qkv") for a in qkv)
      o, out1, out2 = beside_fn(q, k, v, lay, softmax_scale=scale, send=send, back=back,
                                order=order)
      return checkpoint_name(o, "ca_out"), out1, out2

  def named(name, fn):
    def f(*args):
      with jax.named_scope(f"{model.PING_PONG_SCOPE}_{name}"):
        return fn(*args)
    return f

  pre_a, pre_b = named("pre_A", pre), named("pre_B", pre)
  post_a, post_b = named("post_A", post), named("post_B", post)

  def prologue(p0, x_a, x_b):
    qkv_a = pre_a(p0, x_a, lay_a)
    o_a, qkv_b, _ = ca("A", qkv_a, lay_a, send=(pre_b, (p0, x_b, lay_b)))
    return x_a, o_a, x_b, qkv_b

  def unit(p_i, p_next, carry):
    x_a, o_a, x_b, qkv_b = carry
    o_b, x_a, qkv_a = ca("B", qkv_b, lay_b, send=(post_a, (p_i, x_a, o_a)),
                         back=lambda x: (pre_a, (p_next, x, lay_a)))
    o_a, x_b, qkv_b = ca("A", qkv_a, lay_a, send=(post_b, (p_i, x_b, o_b)),
                         back=lambda x: (pre_b, (p_next, x, lay_b)))
    return x_a, o_a, x_b, qkv_b

  def epilogue(p_last, carry):
    x_a, o_a, x_b, qkv_b = carry
    o_b, x_a, _ = ca("B", qkv_b, lay_b, send=(post_a, (p_last, x_a, o_a)))
    return x_a, post_b(p_last, x_b, o_b)

  return model.ping_pong_units(plan, layers, x_a, x_b, prologue, unit, epilogue)


_SCOPE = re.compile(rf"{model.PING_PONG_SCOPE}_(ca|post|pre)_([AB])")


def spans_other(hlo_text: str):
  """``(copies, forward, backward)`` of a compiled, scheduled program of this ping-pong: its
  side copies (``side_stream.schedule_spans``) and how many of them, forward and backward (a
  transposed start), have a matrix product of the OTHER nano-batch's post-/pre-CA scheduled
  between start and done."""
  from custom_ops import side_stream as ss  # pylint: disable=import-outside-toplevel
  spans = ss.schedule_spans(hlo_text)
  fwd = bwd = 0
  for start, _, dots in spans:
    mine = [m.group(2) for m in _SCOPE.finditer(start) if m.group(1) == "ca"]
    if not mine:
      raise ValueError(f"spans_other: a copy outside the ping-pong's core attention: {start}")
    last = [list(_SCOPE.finditer(d))[-1] for d in dots if _SCOPE.search(d)]
    if any(m.group(1) != "ca" and m.group(2) != mine[-1] for m in last):
      if "transpose" in start:
        bwd += 1
      else:
        fwd += 1
  return spans, fwd, bwd
