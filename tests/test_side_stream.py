"""The side-stream copy (``custom_ops/side_stream.py``, ``custom_ops/side_stream/``).

On CPU (the g++ handler, built here if missing): the copy equals its jnp reference bit for bit on
random routes (groups moved to a random order, a group pointing past x, unfilled rows) into a
poisoned buffer, two copies in flight at once finish in either order, the one-group case equals
the data plane's exchange on one device, bad inputs name the fix, and the books of calls in
flight (shared with the CUDA handler) take 64 at once, refuse a 65th and refuse a token no start
produced; the compiled, scheduled
program puts start before and done after every matrix product of the compute it overlaps, and
the check detects the serialized variant (done before the products) and a variant without the
barriers. The CUDA program cross-lowers with the attributes the handler reads and done's
aliasing. On a GPU (the nvcc library): the same equalities for several SM budgets, on the side
stream and on XLA's stream, with two copies in flight, and the scheduled GPU program keeps the
overlap order.

Run: .venv/bin/python -m pytest -q tests/test_side_stream.py
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from custom_ops import side_stream as ss

ON_GPU = jax.default_backend() == "gpu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def _library():
  """The library of this platform; on CPU the g++ one is built when missing."""
  name = "libside_copy_cuda.so" if ON_GPU else "libside_copy_cpu.so"
  if not os.path.exists(os.path.join(ss.library_dir(), name)):
    if ON_GPU:
      pytest.skip(f"no {name} in {ss.library_dir()}: run custom_ops/side_stream/build.sh")
    subprocess.run(["bash", os.path.join(ROOT, "custom_ops/side_stream/build.sh"),
                    ss.library_dir(), "cpu"], check=True, cwd=ROOT,
                   env=dict(os.environ, PYTHON=sys.executable))  # its jax has the FFI headers


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def _inputs(seed, x_rows=300, recv_rows=340, groups=7, row=(4, 8), dtype=jnp.bfloat16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((x_rows,) + row), dtype)
  routes = ss.random_routes(rng, x_rows, recv_rows, groups)
  # One group (not the first) points past x's end: its rows past the end must come out zero.
  g = int(rng.integers(1, groups))
  routes[5, g] = x_rows - routes[3, g] // 2
  return x, jnp.asarray(routes), recv_rows


def _poison(recv_rows, x):
  return jnp.full((recv_rows,) + x.shape[1:], jnp.nan, x.dtype)


def _chain(a, b):
  for _ in range(3):
    a = jnp.tanh(a @ b)
  return a


@pytest.mark.parametrize("row,dtype", [((4, 8), jnp.bfloat16), ((8,), jnp.float32),
                                       ((2, 8, 128), jnp.bfloat16)])
def test_copy_equals_the_reference(seed, row, dtype):
  x, routes, n = _inputs(seed, row=row, dtype=dtype)
  ref = ss.side_copy_reference(x, routes, n)
  # The groups fill at most 90% of x's 300 rows, and one group runs past x's end: more than
  # n - 270 zero rows, all of which the copy must write.
  assert int(jnp.sum(jnp.all(ref == 0, axis=tuple(range(1, ref.ndim))))) > n - 270
  for into in (None, _poison(n, x)):
    @jax.jit
    def f(x, routes, into, a, b):
      y, tok = ss.side_copy_start(x, routes, n, 8, into=into)
      tok, a, b = jax.lax.optimization_barrier((tok, a, b))
      out = _chain(a, b)
      y, x, routes, tok, out = jax.lax.optimization_barrier((y, x, routes, tok, out))
      return ss.side_copy_done(y, x, routes, tok), out
    a = jnp.ones((16, 16)) * 0.1
    y, out = f(x, routes, into, a, a)
    np.testing.assert_array_equal(_bits(y), _bits(ref))
    np.testing.assert_allclose(out, _chain(a, a), rtol=1e-6)


def test_two_copies_in_flight_finish_in_either_order(seed):
  x, routes, n = _inputs(seed)
  x2, routes2, n2 = _inputs(seed + 1, x_rows=200, recv_rows=150, groups=3, row=(16,),
                            dtype=jnp.float32)

  @jax.jit
  def f(x, routes, x2, routes2):
    y, t = ss.side_copy_start(x, routes, n, 4)
    y2, t2 = ss.side_copy_start(x2, routes2, n2, 2, on_side=False)
    y, t, y2, t2 = jax.lax.optimization_barrier((y, t, y2, t2))  # both started
    y2 = ss.side_copy_done(y2, x2, routes2, t2)  # the second is done first
    y, t, y2 = jax.lax.optimization_barrier((y, t, y2))
    return ss.side_copy_done(y, x, routes, t), y2

  y, y2 = f(x, routes, x2, routes2)
  np.testing.assert_array_equal(_bits(y), _bits(ss.side_copy_reference(x, routes, n)))
  np.testing.assert_array_equal(_bits(y2), _bits(ss.side_copy_reference(x2, routes2, n2)))


@pytest.mark.skipif(ON_GPU, reason="the data plane's exchange on one fake CPU device")
def test_one_group_equals_the_data_plane_exchange(seed):
  from distca_jax.dataplane.exchange import ragged_exchange
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((50, 4, 8)), jnp.bfloat16)
  n = int(rng.integers(1, 50))
  routes = jnp.asarray([[0], [n], [int(rng.integers(0, 70 - n))], [n], [0], [0]], jnp.int32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  ex = jax.jit(jax.shard_map(
      lambda x, r: ragged_exchange(x, r[0], 70, "data", "ring"), mesh=mesh,
      in_specs=(P(), P("data")), out_specs=P("data")))
  want = ex(x, routes[None])
  y = jax.jit(lambda x, r: ss.side_copy_done(*_start_and_pass(x, r, 70)))(x, routes)
  np.testing.assert_array_equal(_bits(y), _bits(want))


def _start_and_pass(x, routes, n):
  y, t = ss.side_copy_start(x, routes, n, 1)
  return y, x, routes, t


def _variant(name, n):
  """The copy beside ``_chain``: 'overlap' and 'serial' (``ss.overlapped``), or 'nobarrier'
  (start and done with nothing tying them to the products)."""
  if name == "nobarrier":
    def f(x, routes, a, b):
      y, t = ss.side_copy_start(x, routes, n, 4)
      return ss.side_copy_done(y, x, routes, t), _chain(a, b)
    return f
  return lambda x, routes, a, b: ss.overlapped(x, routes, n, 4, _chain, a, b, order=name)


def test_scheduled_program_overlaps_and_serialized_variants_are_detected(seed):
  x, routes, n = _inputs(seed)
  a = jnp.ones((64, 64))
  got = {}
  for name in ("overlap", "serial", "nobarrier"):
    text = jax.jit(_variant(name, n)).lower(x, routes, a, a).compile().as_text()
    got[name] = (ss.schedule_order(text), ss.copy_overlaps_dots(text))
  assert got["overlap"][1], got
  assert got["serial"][0][:2] == ["start", "done"] and not got["serial"][1], got
  if not ON_GPU:  # XLA:CPU's schedule; XLA:GPU may group the products and place a free done
    assert got["overlap"][0] == ["start", "dot", "dot", "dot", "done"], got
    assert not got["nobarrier"][1], got  # nothing keeps done after the products
  into = jax.jit(lambda x, r, a, b, i: ss.overlapped(x, r, n, 4, _chain, a, b, into=i))
  text = into.lower(x, routes, a, a, _poison(n, x)).compile().as_text()
  assert ss.copy_overlaps_dots(text), ss.schedule_order(text)
  for name in ("overlap", "serial"):
    y, out = jax.jit(_variant(name, n))(x, routes, a, a)
    np.testing.assert_array_equal(_bits(y), _bits(ss.side_copy_reference(x, routes, n)))
    np.testing.assert_allclose(out, _chain(a, a), rtol=1e-6)


_RING_SCRIPT = """
import jax, jax.numpy as jnp
from custom_ops import side_stream as ss

def many(n):
  x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
  r = jnp.asarray([[0], [8], [0], [8], [0], [0]], jnp.int32)
  def f(x, r):
    started = [ss.side_copy_start(x + i, r, 8, 1) for i in range(n)]
    started = jax.lax.optimization_barrier(started)  # every start before any done
    return [ss.side_copy_done(y, x, r, t) for y, t in started]
  return jax.jit(f)(x, r)

def run(name, fn):
  try:
    fn()
    print(name, "ok")
  except Exception as e:
    print(name, "error:", str(e).splitlines()[0][:300])

run("in_flight_64", lambda: jax.block_until_ready(many(64)))
y = jnp.zeros((8, 4)); x = jnp.zeros((8, 4)); r = jnp.zeros((6, 1), jnp.int32)
run("foreign_token", lambda: jax.block_until_ready(
    jax.jit(ss.side_copy_done)(y, x, r, jnp.int32(0))))
run("in_flight_65", lambda: jax.block_until_ready(many(65)))
"""


@pytest.mark.skipif(ON_GPU, reason="the CPU handler's books (a child process: a refused call "
                    "leaves its slots taken)")
def test_calls_in_flight_are_bounded_and_tokens_checked():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _RING_SCRIPT], cwd=ROOT, env=env, timeout=120,
                       capture_output=True, text=True)
  lines = {l.split()[0]: l for l in out.stdout.splitlines() if l.strip()}
  assert lines.get("in_flight_64", "").endswith(" ok"), out.stdout + out.stderr
  assert "no start in flight" in lines.get("foreign_token", ""), out.stdout + out.stderr
  assert "64 calls already in flight" in lines.get("in_flight_65", ""), out.stdout + out.stderr


@pytest.mark.skipif(ON_GPU, reason="cross-lowering: the CPU check of the CUDA program")
def test_cuda_program_lowers_with_the_handlers_attributes():
  x = jax.ShapeDtypeStruct((96, 2, 8, 128), jnp.bfloat16)
  r = jax.ShapeDtypeStruct((6, 8), jnp.int32)
  a = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16)
  text = jax.jit(lambda x, r, a, b: ss.overlapped(x, r, 128, 16, _chain, a, b)).trace(
      x, r, a, a).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count(f"@{ss.START}(") == 1 and text.count(f"@{ss.DONE}(") == 1, text
  assert "mhlo.backend_config = {blocks = 16 : i64, on_side = 1 : i64}" in text, text
  done = next(line for line in text.splitlines() if f"@{ss.DONE}(" in line)
  assert "output_operand_aliases" in done and "operand_index = 0" in done, done
  assert text.count("optimization_barrier") == 2, text


def test_bad_inputs_name_the_fix():
  x = jnp.zeros((10, 4, 8), jnp.bfloat16)
  r = jnp.zeros((6, 3), jnp.int32)
  for args, match in [((x, r[:5], 12, 4), "int32 \\[6, S\\]"),
                      ((x, r.astype(jnp.float32), 12, 4), "int32 \\[6, S\\]"),
                      ((jnp.zeros((10, 3), jnp.bfloat16), r, 12, 4), "multiple of 16 bytes"),
                      ((x, r, 12, 0), "blocks=0"), ((x, r, -1, 4), "recv_rows=-1")]:
    with pytest.raises(ValueError, match=match):
      ss.side_copy_start(*args)
  with pytest.raises(ValueError, match="into bfloat16\\[11, 4, 8\\]"):
    ss.side_copy_start(x, r, 12, 4, into=jnp.zeros((11, 4, 8), jnp.bfloat16))
  with pytest.raises(ValueError, match="order='both'"):
    ss.overlapped(x, r, 12, 4, _chain, order="both")


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("blocks", [1, 4, 16, 132, 300])
@pytest.mark.parametrize("on_side", [True, False])
def test_gpu_copy_equals_the_reference(seed, blocks, on_side):
  x, routes, n = _inputs(seed, x_rows=5000, recv_rows=6000, groups=9, row=(32, 128))
  ref = ss.side_copy_reference(x, routes, n)
  a = jnp.ones((1024, 1024), jnp.bfloat16) * 0.01
  f = jax.jit(lambda x, r, a, b, into: ss.overlapped(x, r, n, blocks, _chain, a, b, on_side=on_side,
                                                     into=into))
  for _ in range(3):
    y, out = f(x, routes, a, a, _poison(n, x))
    np.testing.assert_array_equal(_bits(y), _bits(ref))
  text = f.lower(x, routes, a, a, _poison(n, x)).compile().as_text()
  assert ss.copy_overlaps_dots(text), ss.schedule_order(text)


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the benchmark's CPU smoke run")
def test_overlap_bench_runs_checks_and_stops_on_a_wrong_copy(tmp_path, monkeypatch):
  from experiments import overlap_bench
  a = overlap_bench._args(["--tiny", "--budgets", "2,8", "--out", str(tmp_path / "ob")])
  assert overlap_bench.main(a) == 0
  with open(tmp_path / "ob.json") as f:
    res = json.load(f)
  assert [r["blocks"] for r in res["rows"]] == [2, 8], res["rows"]
  assert all(r["schedule_ok"] for r in res["rows"]), res["rows"]
  assert res["gate"]["passed"] is None  # CPU times are not judged
  real = ss.side_copy_reference
  monkeypatch.setattr(overlap_bench.ss, "side_copy_reference",
                      lambda x, r, n: real(x, r, n).at[-1].add(1))  # an unfilled row, nonzero
  with pytest.raises(overlap_bench.Mismatch, match="differs from the jnp reference"):
    overlap_bench.main(overlap_bench._args(["--tiny", "--budgets", "2", "--out",
                                            str(tmp_path / "bad")]))
