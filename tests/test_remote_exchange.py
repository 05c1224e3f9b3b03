"""The device-initiated exchange (``custom_ops/remote_exchange.py``, collective 'remote').

On CPU: the kernel cross-lowers for CUDA inside ``shard_map`` (Mosaic GPU's layout inference and
TMA checks run without a GPU), for the row shapes the data plane sends (query / key-value rows,
LSE rows), over one axis and over a pooled pair of axes, in host groups of 4 of 8 devices and in
the signal-only data plane; the lowered call zeroes its semaphores in XLA before the call and
keeps XLA's barrier before the kernel (the kernel's safety argument); signal-only routes never
zero a row a sender writes (NumPy); bad row widths, grids, groups and cross-group routes name
the fix.
On GPUs (all visible devices as servers, one process): random routes, self groups included,
every group lands where its routes say, bit for bit against the NumPy oracle, rows no group fills
are zero, the VJP sends the cotangents back, and repeated calls stay correct (each call's
semaphores are zeroed before it, behind XLA's barrier); host groups; signal-only; a skewed peer
(one device busy with matrix products before each of several calls) in a child process with a
time limit, so a lost signal fails instead of hanging.

Run: .venv/bin/python -m pytest -q tests/test_remote_exchange.py
"""

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from distca_jax import dataplane
from distca_jax import plan as plan_lib
from distca_jax.dataplane.exchange import signal_only_routes

ON_GPU = jax.default_backend() == "gpu"


def _routes(rng, s, send_cap, recv_cap, fill=0.8, group=None):
  """[S, 6, S] routes of a random [S, S] send-length matrix within the totals (self pairs too;
  with ``group``, only between devices of one group of ``group`` consecutive devices)."""
  ln = np.zeros((s, s), np.int64)
  g = group or s
  for _ in range(8 * s * s):
    p, d = rng.integers(s, size=2)
    if p // g != d // g:
      continue
    add = int(rng.integers(0, max(2, int(fill * send_cap) // s)))
    if ln[p].sum() + add <= send_cap and ln[:, d].sum() + add <= recv_cap:
      ln[p, d] += add
  send_off = np.cumsum(ln, axis=1) - ln
  recv_off = (np.cumsum(ln, axis=0) - ln).T
  return plan_lib.metadata.routes(ln, send_off, recv_off, np.arange(s)), ln


def _mesh(shape, names):
  devs = np.asarray(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devs, names, axis_types=(AxisType.Auto,) * len(names))


def _fn(mesh, axis, cr, **kw):
  from custom_ops.remote_exchange import remote_exchange  # pylint: disable=import-outside-toplevel
  spec = P(mesh.axis_names)

  def body(x, r, dy):
    if kw:
      y = remote_exchange(x[0], r[0], cr, axis, **kw)[None]
      return y, y
    y, vjp = jax.vjp(lambda x: dataplane.ragged_exchange(x[0], r[0], cr, axis, "remote")[None],
                     x)
    return y, vjp(dy)[0]

  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec),
                               check_vma=False))


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
@pytest.mark.parametrize("row,dtype,axes", [
    ((8, 128), jnp.bfloat16, ("data",)), ((32,), jnp.float32, ("data",)),
    ((4, 128), jnp.bfloat16, ("pipe", "data"))])
def test_remote_exchange_lowers_for_cuda(row, dtype, axes):
  shape = (2, 2) if len(axes) == 2 else (4,)
  mesh = _mesh(shape, axes)
  axis = axes if len(axes) == 2 else axes[0]
  s = int(np.prod(shape))
  x = jax.ShapeDtypeStruct((s, 40) + row, dtype)
  r = jax.ShapeDtypeStruct((s, 6, s), jnp.int32)
  text = _fn(mesh, axis, 56).trace(x, r, jax.ShapeDtypeStruct((s, 56) + row, dtype)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("remote_exchange") >= 2, "forward and VJP kernels"


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
def test_remote_exchange_with_zeroing_blocks_lowers_for_cuda():
  mesh = _mesh((4,), ("data",))
  x = jax.ShapeDtypeStruct((4, 40, 4, 128), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((4, 6, 4), jnp.int32)
  f = _fn(mesh, "data", 56, blocks=5, chunk=16, zero_blocks=3)
  text = f.trace(x, r, jax.ShapeDtypeStruct((4, 56, 4, 128), jnp.bfloat16)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "remote_exchange" in text


def test_bad_row_width_names_the_fix():
  from custom_ops.remote_exchange import line_width  # pylint: disable=import-outside-toplevel
  assert line_width((8, 128), jnp.bfloat16) == 128 and line_width((32,), jnp.float32) == 32
  with pytest.raises(ValueError, match=r"\(3, 5\).*multiple of 128.*collective='dense'"):
    line_width((3, 5), jnp.float32)


@pytest.mark.skipif(not ON_GPU or jax.device_count() < 2, reason="needs 2+ GPUs")
@pytest.mark.parametrize("row,dtype,kw", [
    ((8, 128), jnp.bfloat16, {}), ((32,), jnp.float32, {}),
    ((4, 128), jnp.bfloat16, {"blocks": 3, "chunk": 8}),
    ((4, 128), jnp.bfloat16, {"blocks": 5, "chunk": 16, "slots": 1}),
    ((2, 128), jnp.bfloat16, {"blocks": 264, "chunk": 64, "slots": 3}),
    ((4, 128), jnp.bfloat16, {"blocks": 5, "chunk": 16, "zero_blocks": 3}),
    ((8, 128), jnp.bfloat16, {"zero_blocks": 132})])
def test_remote_exchange_equals_the_oracle_on_gpus(seed, row, dtype, kw):
  s = jax.device_count()
  mesh = _mesh((s,), ("data",))
  rng = np.random.default_rng(seed)
  cs, cr = 700, 900
  f = _fn(mesh, "data", cr, **kw)
  for call in range(3):  # each call zeroes its own semaphores, behind XLA's barrier
    routes, ln = _routes(rng, s, cs, cr)
    x = rng.standard_normal((s, cs) + row).astype(np.float32)
    dy = rng.standard_normal((s, cr) + row).astype(np.float32)
    xd, dyd = jnp.asarray(x, dtype), jnp.asarray(dy, dtype)
    y, dx = (np.asarray(a.astype(jnp.float32)) for a in f(xd, jnp.asarray(routes), dyd))
    xs, dys = np.asarray(xd.astype(jnp.float32)), np.asarray(dyd.astype(jnp.float32))
    want = plan_lib.executor._exchange(list(xs), routes, cr)
    for d in range(s):
      msg = f"device {d} call {call} {row} {kw} seed={seed} lens={ln.tolist()}"
      np.testing.assert_array_equal(y[d], want[d], err_msg=msg)
      assert not y[d, ln[:, d].sum():].any(), msg
    if not kw:
      want_dx = plan_lib.executor._exchange(list(dys), plan_lib.reverse_routes(routes), cs)
      for d in range(s):
        np.testing.assert_array_equal(dx[d], want_dx[d], err_msg=f"grad {d} seed={seed}")


@pytest.mark.skipif(not ON_GPU or jax.device_count() != 4, reason="needs 4 GPUs")
def test_remote_exchange_over_two_axes_on_gpus(seed):
  """Servers pooled over (pipe, data): linear peer ids over both axes, row-major."""
  mesh = _mesh((2, 2), ("pipe", "data"))
  rng = np.random.default_rng(seed)
  cs, cr = 300, 400
  routes, ln = _routes(rng, 4, cs, cr)
  x = jnp.asarray(rng.standard_normal((4, cs, 2, 128)), jnp.bfloat16)
  f = _fn(mesh, ("pipe", "data"), cr)
  y = np.asarray(f(x, jnp.asarray(routes), jnp.zeros((4, cr, 2, 128), jnp.bfloat16))[0]
                 .astype(jnp.float32))
  want = plan_lib.executor._exchange(list(np.asarray(x.astype(jnp.float32))), routes, cr)
  for d in range(4):
    np.testing.assert_array_equal(y[d], want[d], err_msg=f"device {d} seed={seed}")


@pytest.mark.skipif(ON_GPU, reason="cross-lowering on 8 fake CPU devices")
def test_dispatch_with_remote_lowers_for_cuda(monkeypatch):
  """The whole data plane (forward and VJP) with collective 'remote' on a (data 4, tensor 2)
  mesh: the kernel runs over the data axis inside the map over both axes."""
  _dispatch_lowers(monkeypatch, signal_only=False)


def _dispatch_lowers(monkeypatch, signal_only: bool):
  # Lowered for CUDA from CPU: the collective's platform check must see the target platform.
  from distca_jax.dataplane import exchange  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(exchange.jax, "default_backend", lambda: "gpu")
  s, t, h, kh, d = 4, 128, 4, 2, 128
  cap = plan_lib.Capacity(q_send=t, kv_send=s * t, q_recv=2 * t, kv_recv=s * t,
                          q_tokens=3 * t // 2, kv_tokens=2 * s * t, tasks=48)
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
  mesh = _mesh((s, 2), ("data", "tensor"))
  opts = dataplane.DispatchOptions(
      exchange=dataplane.ExchangeOptions(collective="remote", signal_only=signal_only),
      head_axis="tensor")

  def run(q, k, v, plan):
    o, vjp = jax.vjp(lambda q, k, v: dataplane.dispatch_attention(q, k, v, plan, spec, opts,
                                                                  mesh=mesh), q, k, v)
    return o, vjp(o)

  q = jax.ShapeDtypeStruct((s, t, h, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((s, t, kh, d), jnp.bfloat16)
  plan = jax.ShapeDtypeStruct((s, spec.width), jnp.int32)
  text = jax.jit(run).trace(q, kv, kv, plan).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("remote_exchange") >= 6, "Q, K/V and O forward; their VJPs"


def _lowered(mesh, axis, s, cr=56, row=(4, 128), **kw):
  x = jax.ShapeDtypeStruct((s, 40) + row, jnp.bfloat16)
  r = jax.ShapeDtypeStruct((s, 6, s), jnp.int32)
  return _fn(mesh, axis, cr, **kw).trace(x, r, jax.ShapeDtypeStruct((s, cr) + row, jnp.bfloat16)
                                        ).lower(lowering_platforms=("cuda",)).as_text()


def _semaphore_operands(text):
  """Per ``mosaic_gpu_v2`` call: its backend config and the definition of the operand that is
  aliased to an output (the GMEM scratch holding the ``pl.get_global`` semaphores)."""
  defs = dict(re.findall(r"^\s*(%[\w#]+) = (.*)$", text, re.M))
  out = []
  for m in re.finditer(r"custom_call @mosaic_gpu_v2\(([^)]*)\) (.*)$", text, re.M):
    operands = [o.strip() for o in m.group(1).split(",")]
    alias = re.search(r"output_operand_alias<output_tuple_indices = \[\d+\], operand_index = "
                      r"(\d+)", m.group(2))
    assert alias, m.group(2)[:300]
    out.append((m.group(2), defs[operands[int(alias.group(1))]], defs))
  return out


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
@pytest.mark.parametrize("group,sems", [(None, 2 * 8), (4, 2 * 4)])
def test_lowered_call_zeroes_its_semaphores_behind_xla_barrier(group, sems):
  """The safety argument of the module docstring, on the lowered program: the semaphores are an
  operand aliased to an output and computed as zeros before the call (``sems`` i32: ready and
  done, one per peer of the group), and the call keeps XLA's barrier before the kernel
  (``skip_device_barrier = false``) and uses XLA's collective metadata (what launches it)."""
  mesh = _mesh((8,), ("data",))
  calls = _semaphore_operands(_lowered(mesh, "data", 8, group=group, blocks=3, chunk=16))
  assert len(calls) == 1
  config, scratch, defs = calls[0]
  assert "skip_device_barrier = false" in config and "uses_xla_collective_metadata = true" in config
  assert 'xla_replica_ids = "0,1,2,3,4,5,6,7"' in config
  zero = re.fullmatch(rf"stablehlo.broadcast_in_dim (%\w+), dims = \[\] : \(tensor<i32>\) -> "
                      rf"tensor<{sems}xi32>", scratch)
  assert zero, scratch
  assert defs[zero.group(1)] == "stablehlo.constant dense<0> : tensor<i32>"


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
def test_host_groups_lower_for_cuda():
  """group=4 on a (data 8) mesh (the in-host leg of a two-level exchange over two hosts of 4),
  with the default grid; and groups of 2 over a pooled (pipe 2, data 4) pair of axes."""
  text = _lowered(_mesh((8,), ("data",)), "data", 8, row=(8, 128), group=4)
  assert text.count("remote_exchange") >= 1
  text = _lowered(_mesh((2, 4), ("pipe", "data")), ("pipe", "data"), 8, group=2, blocks=5,
                  chunk=16, zero_blocks=3)
  assert text.count("remote_exchange") >= 1


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
def test_bad_grids_and_groups_name_the_fix():
  from custom_ops import remote_exchange as rx  # pylint: disable=import-outside-toplevel
  assert rx.check_grid(132, 128, 2, 66, 256) == (132, 128, 2, 66)
  for kw, msg in [({"chunk": 48}, r"chunk=48 must be a power of two.*use 32 or 64"),
                  ({"chunk": 0}, r"chunk=0 must be an int >= 1"),
                  ({"chunk": 2.0}, r"chunk=2.0 must be an int"),
                  ({"blocks": 0}, r"blocks=0 must be an int >= 1"),
                  ({"slots": 0}, r"slots=0 must be an int >= 1"),
                  ({"zero_blocks": -1}, r"zero_blocks=-1 must be an int >= 0"),
                  ({"blocks": True}, r"blocks=True must be an int"),
                  ({"chunk": 256, "slots": 3}, r"chunk=256 x slots=3 needs 262144 bytes.*smaller "
                                               r"chunk or fewer slots")]:
    args = {"blocks": 132, "chunk": 128, "slots": 2, "zero_blocks": 66} | kw
    with pytest.raises(ValueError, match=msg) as e:
      rx.check_grid(line_bytes=256, **args)
    assert "\n" not in str(e.value)
  assert rx.check_group(None, 8) == 8 and rx.check_group(4, 8) == 4
  with pytest.raises(ValueError, match=r"group=3 does not divide the 8 servers.*divisor of 8"):
    rx.check_group(3, 8)
  with pytest.raises(ValueError, match=r"group=0 must be an int >= 1"):
    rx.check_group(0, 8)


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
def test_bad_chunk_is_refused_when_the_kernel_is_traced():
  mesh = _mesh((4,), ("data",))
  with pytest.raises(ValueError, match=r"chunk=24 must be a power of two.*use 16 or 32"):
    _lowered(mesh, "data", 4, chunk=24)
  with pytest.raises(ValueError, match=r"group=3 does not divide the 4 servers"):
    _lowered(mesh, "data", 4, group=3)


def test_group_routes_are_checked_on_the_host(seed):
  from custom_ops import remote_exchange as rx  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  _, ln = _routes(rng, 8, 300, 400, group=4)
  assert ln[:4, :4].any() and ln[4:, 4:].any() and not ln[:4, 4:].any() and not ln[4:, :4].any()
  rx.check_group_routes(ln, 4)
  rx.check_group_routes(ln, None)
  p, d = int(rng.integers(4)), 4 + int(rng.integers(4))
  ln[p, d] = 7
  with pytest.raises(ValueError, match=rf"group=4: 7 rows from device {p} \(group 0\) to device "
                                       rf"{d} \(group 1\)"):
    rx.check_group_routes(ln, 4)


def test_signal_only_zeroing_never_meets_a_row_a_sender_writes(seed):
  """Which rows the kernel writes on server ``d`` (NumPy): senders ``p`` write rows
  ``[peer_recv_off, + send_len)`` of ``d``'s buffer by their (cut) routes, ``d`` zeroes rows
  ``[keep, Cr)``. Signal-only's ``keep`` (the uncut groups' rows) never meets a written row;
  the cut routes' own total (the kernel's default keep for them) does, on these routes."""
  rng = np.random.default_rng(seed)
  s, cr = 4, 900
  routes, ln = _routes(rng, s, 700, cr, fill=1.0)
  assert (ln >= 2).sum(axis=0).min() >= 2, "every server receives two groups of 2+ rows"
  raced = 0
  for signal in (False, True):
    if signal:
      cut, keep = zip(*(signal_only_routes(jnp.asarray(routes[d])) for d in range(s)))
      cut = np.asarray(cut)
    else:  # the real exchange: the kernel's default keep
      cut, keep = routes, routes[:, 3].sum(axis=1)
    for d in range(s):
      written = np.zeros(cr, np.int64)
      for p in range(s):  # sender p's group for d: its send_len[d] rows at its peer_recv_off[d]
        start, n = cut[p, 4, d], cut[p, 1, d]
        written[start:start + n] += 1
      zeroed = np.arange(cr) >= int(keep[d])
      assert written.max() <= 1 and not (written.astype(bool) & zeroed).any(), (signal, d)
      if not signal:  # the real exchange: every row written exactly once
        np.testing.assert_array_equal(written + zeroed, 1)
      else:  # one row per group, at the group's start; the cut total would zero written rows
        assert written.sum() == (ln[:, d] > 0).sum()
        raced += (written.astype(bool) & (np.arange(cr) >= cut[d, 3].sum())).any()
  assert raced == s, "the cut routes' total zeroes a signal row on every server"


@pytest.mark.skipif(ON_GPU, reason="cross-lowering on 8 fake CPU devices")
def test_signal_only_remote_dispatch_lowers_for_cuda(monkeypatch):
  """Signal-only with 'remote' (forward and VJP): the kernel gets the cut routes and the uncut
  total."""
  _dispatch_lowers(monkeypatch, signal_only=True)


@pytest.mark.skipif(not ON_GPU or jax.device_count() < 4 or jax.device_count() % 2,
                    reason="needs an even number (4+) of GPUs")
def test_host_groups_equal_the_oracle_on_gpus(seed):
  s = jax.device_count()
  mesh = _mesh((s,), ("data",))
  rng = np.random.default_rng(seed)
  cs, cr = 700, 900
  f = _fn(mesh, "data", cr, group=s // 2)
  for call in range(3):
    routes, ln = _routes(rng, s, cs, cr, group=s // 2)
    x = jnp.asarray(rng.standard_normal((s, cs, 4, 128)), jnp.bfloat16)
    y = np.asarray(f(x, jnp.asarray(routes), jnp.zeros((s, cr, 4, 128), jnp.bfloat16))[0]
                   .astype(jnp.float32))
    want = plan_lib.executor._exchange(list(np.asarray(x.astype(jnp.float32))), routes, cr)
    for d in range(s):
      np.testing.assert_array_equal(y[d], want[d], err_msg=f"device {d} call {call} seed={seed}")


@pytest.mark.skipif(not ON_GPU or jax.device_count() < 2, reason="needs 2+ GPUs")
def test_signal_only_on_gpus(seed):
  """One row per group at its start; rows past the uncut groups zero."""
  s = jax.device_count()
  mesh = _mesh((s,), ("data",))
  rng = np.random.default_rng(seed)
  cs, cr = 700, 900
  routes, ln = _routes(rng, s, cs, cr)
  x = rng.standard_normal((s, cs, 2, 128)).astype(np.float32)
  spec = P("data")
  f = jax.jit(jax.shard_map(
      lambda x, r: dataplane.ragged_exchange(x[0], r[0], cr, "data", "remote",
                                             signal_only=True)[None],
      mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))
  y = np.asarray(f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(routes)).astype(jnp.float32))
  xs = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  for d in range(s):
    for p in range(s):
      if ln[p, d]:
        np.testing.assert_array_equal(y[d, routes[d, 2, p]], xs[p, routes[p, 0, d]],
                                      err_msg=f"{p} -> {d} seed={seed}")
    assert not y[d, ln[:, d].sum():].any(), f"device {d} seed={seed}"


def _skewed_fn(s: int, calls: int, cr: int, rounds: int):
  """Exchange calls ``0 .. calls - 1`` on a (data ``S``) mesh; before call ``c`` device
  ``c % S`` runs ``rounds`` products of 8192 x 8192 bf16 matrices (tens of ms on an H100) that
  the call's input depends on, so its peers enter the call long before it."""
  from custom_ops.remote_exchange import remote_exchange  # pylint: disable=import-outside-toplevel

  def body(x, r, a):
    me = lax.axis_index("data")
    ys, late = [], jnp.zeros((), jnp.float32)
    for c in range(calls):
      def busy(m):
        return lax.fori_loop(0, rounds, lambda _, m: jnp.tanh(m @ m), m)
      # ``late`` ties the products to the previous call's output, so they run between calls.
      m = lax.cond(me == c % s, busy, lambda m: m, a[0] + late.astype(a.dtype))
      gate = (jnp.abs(m[0, 0]) > 2).astype(x.dtype)  # always 0 (|tanh| <= 1), unknown to XLA
      y = remote_exchange(x[0, c] + gate, r[0, c], cr, "data")
      late = (jnp.abs(y[0, 0, 0]) > 3e38).astype(jnp.float32)
      ys.append(y)
    return jnp.stack(ys)[None]

  spec = P("data")
  return jax.jit(jax.shard_map(body, mesh=_mesh((s,), ("data",)), in_specs=(spec,) * 3,
                               out_specs=spec, check_vma=False))


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the kernel")
def test_skewed_peer_program_lowers_for_cuda():
  f = _skewed_fn(4, 3, 56, 2)
  text = f.trace(jax.ShapeDtypeStruct((4, 3, 40, 4, 128), jnp.bfloat16),
                 jax.ShapeDtypeStruct((4, 3, 6, 4), jnp.int32),
                 jax.ShapeDtypeStruct((4, 8192, 8192), jnp.bfloat16)
                 ).lower(lowering_platforms=("cuda",)).as_text()
  assert len(_semaphore_operands(text)) == 3


def skewed_peer_run(seed: int, calls: int = 4, rounds: int = 24):
  """``_skewed_fn`` on every visible GPU, run twice (the second run has no compile between the
  devices' launches): every call's output equals the oracle. Run by the skewed-peer test in a
  child process."""
  s = jax.device_count()
  rng = np.random.default_rng(seed)
  cs, cr = 700, 900
  drawn = [_routes(rng, s, cs, cr) for _ in range(calls)]
  routes = jnp.asarray(np.stack([r for r, _ in drawn], axis=1))  # [S, calls, 6, S]
  x = jnp.asarray(rng.standard_normal((s, calls, cs, 4, 128)), jnp.bfloat16)
  m = rng.standard_normal((8192, 8192), dtype=np.float32) / 90.5
  a = jnp.asarray(np.broadcast_to(m, (s,) + m.shape), jnp.bfloat16)
  f = _skewed_fn(s, calls, cr, rounds)
  xs = np.asarray(x.astype(jnp.float32))
  for run in range(2):
    y = np.asarray(f(x, routes, a).astype(jnp.float32))
    for c, (r, _) in enumerate(drawn):
      want = plan_lib.executor._exchange(list(xs[:, c]), r, cr)
      for d in range(s):
        np.testing.assert_array_equal(y[d, c], want[d],
                                      err_msg=f"run {run} call {c} device {d} seed={seed}")


@pytest.mark.skipif(not ON_GPU or jax.device_count() < 2, reason="needs 2+ GPUs")
def test_skewed_peer_is_exact_and_does_not_hang(seed):
  """``skewed_peer_run`` in a child process with a time limit: a lost signal shows as a
  timeout, not a hung test run."""
  code = ("import runpy, sys; sys.path.insert(0, '.'); "
          f"runpy.run_path({__file__!r})['skewed_peer_run']({seed})")
  try:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=420, cwd=os.path.dirname(os.path.dirname(__file__)),
                          check=False)
  except subprocess.TimeoutExpired:
    pytest.fail(f"skewed peer: no result within 420 s (a lost signal hangs the kernel) "
                f"seed={seed}")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
