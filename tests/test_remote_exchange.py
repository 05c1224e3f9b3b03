"""The device-initiated exchange (``custom_ops/remote_exchange.py``, collective 'remote').

On CPU: the kernel cross-lowers for CUDA inside ``shard_map`` (Mosaic GPU's layout inference and
TMA checks run without a GPU), for the row shapes the data plane sends (query / key-value rows,
LSE rows), over one axis and over a pooled pair of axes; bad row widths name the fix.
On GPUs (all visible devices as servers, one process): random routes, self groups included,
every group lands where its routes say, bit for bit against the NumPy oracle, rows no group fills
are zero, the VJP sends the cotangents back, and repeated calls stay correct (the kernel's
semaphores persist across calls).

Run: .venv/bin/python -m pytest -q tests/test_remote_exchange.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from distca_jax import dataplane
from distca_jax import plan as plan_lib

ON_GPU = jax.default_backend() == "gpu"


def _routes(rng, s, send_cap, recv_cap, fill=0.8):
  """[S, 6, S] routes of a random [S, S] send-length matrix within the totals (self pairs too)."""
  ln = np.zeros((s, s), np.int64)
  for _ in range(8 * s * s):
    p, d = rng.integers(s, size=2)
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
  for call in range(3):  # the kernel's semaphores persist across calls
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
  # Lowered for CUDA from CPU: the collective's platform check must see the target platform.
  from distca_jax.dataplane import exchange  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(exchange.jax, "default_backend", lambda: "gpu")
  s, t, h, kh, d = 4, 128, 4, 2, 128
  cap = plan_lib.Capacity(q_send=t, kv_send=s * t, q_recv=2 * t, kv_recv=s * t,
                          q_tokens=3 * t // 2, kv_tokens=2 * s * t, tasks=48)
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
  mesh = _mesh((s, 2), ("data", "tensor"))
  opts = dataplane.DispatchOptions(exchange=dataplane.ExchangeOptions(collective="remote"),
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
