"""The two-level exchange (``plan.two_level``, ``dataplane.two_level_exchange``) on 8
fake CPU devices as 2 hosts x 4: every row crosses hosts once, the legs move what the NumPy
oracle moves (VJP included), and the data plane equals per-document attention and the ring."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from distca_jax import configs_io, dataplane, trainer
from distca_jax import plan as plan_lib
from distca_jax.backends import distca as distca_backend
from distca_jax.data import make_source
from distca_jax.plan import two_level as tl_lib
from distca_jax.plan.executor import part_exchange
from test_dispatch import (CAP, D, H, KH, S, SPEC, T, _check, _inputs, _layouts, _make_run, _mesh,
                           _random_send_len, _reference, _segments, _tiny_config)

L = 4  # servers per host: 2 hosts x 4


def _two_level(cap=CAP, s=S, l=L):
  return tl_lib.TwoLevel(l, tl_lib.safe_relay(cap.q_send, cap.q_recv, s, l),
                         tl_lib.safe_relay(cap.kv_send, cap.kv_recv, s, l))


def _spec(l=L):
  return plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP,
                           two_level=_two_level(l=l))


def _tables(ln, l, send_cap, recv_cap):
  """(meta-like namespace of part 'q' for ``part_exchange``, relay rows): the one-level routes in
  the two-level receive order and both legs' tables."""
  s = ln.shape[0]
  relay = tl_lib.safe_relay(send_cap, recv_cap, s, l)
  send_off, recv_off = plan_lib.metadata.packed_offsets(ln, plan_lib.metadata.recv_order(s, l))
  ranks = np.arange(s)
  a, b, idx = tl_lib.relay_tables(ln, send_off, send_cap, relay, l, ranks, "q")
  meta = types.SimpleNamespace(q_routes=plan_lib.metadata.routes(ln, send_off, recv_off, ranks),
                               q_a_routes=a, q_b_routes=b, q_b_idx=idx)
  return meta, relay


@pytest.mark.parametrize("l", [1, 2, 4, 8])
def test_legs_cross_hosts_once_with_exactly_the_useful_rows(seed, l):
  """On the host, for random send matrices and every split of 8 servers into hosts: leg A pairs
  only devices of one local index on different hosts and moves exactly the cross-host rows of
  each (sender, host) pair, leg B stays inside hosts and delivers every server's rows; the relay
  gather reads every source row once; the NumPy two-level exchange equals the one-level one (both
  ways)."""
  rng = np.random.default_rng(seed)
  cs, cr = 40, 56
  for _ in range(5):
    ln = _random_send_len(rng, S, cs, cr)
    a, b = tl_lib.leg_lengths(ln, l)
    tl_lib.check_crossings(ln, a, b, l)
    host = np.arange(S) // l
    cross = ln[host[:, None] != host[None, :]].sum()
    assert a.sum() == cross  # the inter-host rows are exactly the useful cross-host rows
    assert b.sum() == ln.sum()
    meta, relay = _tables(ln, l, cs, cr)
    assert (tl_lib.relay_rows(ln, l) <= relay).all()
    for f, row in enumerate(meta.q_b_idx):
      used = row[row < cs + relay]
      assert used.size == np.unique(used).size == b[f].sum()
    x = [rng.standard_normal((cs, 3)) for _ in range(S)]
    got = part_exchange(x, meta, "q", cr)
    want = plan_lib.executor._exchange(x, meta.q_routes, cr)
    for d in range(S):
      np.testing.assert_array_equal(got[d], want[d], err_msg=f"device {d} l={l}")
    y = [rng.standard_normal((cr, 3)) for _ in range(S)]
    got = part_exchange(y, meta, "q", cs, reverse=True)
    want = plan_lib.executor._exchange(y, plan_lib.reverse_routes(meta.q_routes), cs)
    for d in range(S):
      np.testing.assert_array_equal(got[d], want[d], err_msg=f"reverse device {d} l={l}")
    # Leg A's rounds on the wire: per round the smallest bucket holding its largest group.
    hosts = S // l
    sizes = dataplane.dense_block_rows(cs, 8)
    i = np.arange(S)
    want = sum(min(z for z in sizes if z >= a[i, ((i // l + r) % hosts) * l + i % l].max())
               for r in range(1, hosts))
    assert dataplane.round_wire_rows(a, cs, 8, l, "hosts") == want
    assert dataplane.round_wire_rows(a, cs, 1, l, "hosts") == (hosts - 1) * cs
  # A leg pattern that crosses twice or moves padding is refused.
  bad_a = a.copy()
  bad_a[0, 0] += 1
  with pytest.raises(ValueError, match="leg A must move only between hosts"):
    tl_lib.check_crossings(ln, bad_a, b, l)


@pytest.mark.parametrize("l,inter,intra,buckets", [
    (L, "rounds", "rounds", 8), (L, "rounds", "rounds", 1), (L, "ring", "dense", 8),
    (1, "rounds", "rounds", 8), (2, "rounds", "rounds", 8), (S, "rounds", "rounds", 8)])
def test_two_level_exchange_equals_the_oracle_and_its_vjp_sends_back(seed, l, inter, intra,
                                                                     buckets):
  """Random routes on 8 devices (2 hosts x 4; and 8, 4 hosts, 1 host): the two-level exchange
  puts every group where the one-level routes (in the two-level receive order) do, rows no group
  fills are zero; its VJP equals the one-level exchange of the cotangents with the routes
  reversed, and so does the reverse direction (the output return)."""
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  cs, cr = 40, 56
  ln = _random_send_len(rng, S, cs, cr)
  assert ln.sum() > 0, seed
  meta, relay = _tables(ln, l, cs, cr)
  x = rng.standard_normal((S, cs, 3, 2)).astype(np.float32)
  dy = rng.standard_normal((S, cr, 3, 2)).astype(np.float32)

  def body(x, a, b, idx, dy):
    legs = (a[0], b[0], idx[0])
    ex = lambda x, rows, rev: dataplane.two_level_exchange(
        x, legs, rows, "data", l, inter, intra, buckets, reverse=rev)
    y, vjp = jax.vjp(lambda x: ex(x[0], cr, False)[None], x)
    back = ex(dy[0], cs, True)[None]
    return y, vjp(dy)[0], back

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 5,
                            out_specs=(P("data"),) * 3))
  y, dx, back = (np.asarray(v) for v in f(x, meta.q_a_routes, meta.q_b_routes, meta.q_b_idx, dy))
  want = plan_lib.executor._exchange(list(x), meta.q_routes, cr)
  want_dx = plan_lib.executor._exchange(list(dy), plan_lib.reverse_routes(meta.q_routes), cs)
  for d in range(S):
    np.testing.assert_array_equal(y[d], want[d], err_msg=f"device {d} seed={seed}")
    np.testing.assert_array_equal(dx[d], want_dx[d], err_msg=f"grad {d} seed={seed}")
    np.testing.assert_array_equal(back[d], want_dx[d], err_msg=f"reverse {d} seed={seed}")
    assert not y[d, ln[:, d].sum():].any()


def _host_plan(doc_lens, spec, eps):
  return plan_lib.host_plan(doc_lens, spec, options=plan_lib.PlanOptions(
      tolerance=float(eps), q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4, min_shard=None))


def test_reference_executor_runs_two_level_plans(seed):
  """The NumPy executor on two-level metadata (2 hosts x 4) equals per-document attention."""
  rng = np.random.default_rng(seed)
  spec = _spec()
  for name, doc_lens, eps in _layouts(seed)[:4]:
    hp = _host_plan(doc_lens, spec, eps)
    assert hp.meta.q_b_idx is not None
    q, k, v = (x.astype(np.float64) for x in _inputs(rng)[:3])
    o, lse = plan_lib.reference_execute(hp.meta, q, k, v)
    wo, wl = plan_lib.reference_document_attention(doc_lens, q, k, v)
    np.testing.assert_allclose(o, wo, atol=1e-10, err_msg=name)
    np.testing.assert_allclose(lse, wl, atol=1e-10, err_msg=name)


@pytest.mark.slow
def test_data_plane_with_two_level_equals_per_document_attention_and_the_ring(seed):
  """Fuzzed layouts (one document spanning every rank among them), 2 hosts x 4: outputs and
  gradients of the data plane with the two-level exchange equal each document's attention and
  the ring exchange's result, in both memory modes ('resend' re-sends Q and K/V in the backward);
  one trace serves every plan."""
  mesh = _mesh()
  spec = _spec()
  traces = []
  run = _make_run(mesh, spec, trace_counter=traces, collective="two_level")
  resend = _make_run(mesh, spec, collective="two_level", memory_mode="resend")
  ring = _make_run(mesh, SPEC, collective="ring")
  rng = np.random.default_rng(seed)
  layouts = _layouts(seed)
  assert any(doc == [S * T] for _, doc, _ in layouts)  # one document over every rank
  crossed = 0
  for name, doc_lens, eps in layouts:
    hp = _host_plan(doc_lens, spec, eps)
    one = _host_plan(doc_lens, SPEC, eps)
    np.testing.assert_array_equal(hp.plan.tasks, one.plan.tasks)
    host = np.arange(S) // L
    crossed += int(hp.meta.q_send_len[host[:, None] != host[None, :]].sum())
    q, k, v, ct = _inputs(rng)
    got = run(q, k, v, hp.packed, ct)
    want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
    _check(got, want, f"{name} eps={eps:.3f} seed={seed} {hp.plan.summary()}")
    _check(got, ring(q, k, v, one.packed, ct), f"{name} vs ring seed={seed}")
    _check(resend(q, k, v, hp.packed, ct), want, f"{name} resend seed={seed}")
  assert crossed > 0 and len(traces) == 1


@pytest.mark.slow
def test_two_level_over_a_pipelines_pooled_axes(seed):
  """Servers over (pipe 2, data 4), a pipeline's pooled CAD, as 2 hosts x 4: outputs and
  gradients equal each document's attention."""
  devs = np.asarray(jax.devices()[:S]).reshape(2, S // 2)
  mesh = jax.sharding.Mesh(devs, ("pipe", "data"), axis_types=(AxisType.Auto,) * 2)
  opts = dataplane.DispatchOptions(exchange=dataplane.ExchangeOptions(collective="two_level"),
                                   data_axis=("pipe", "data"))
  spec = _spec()

  def run(q, k, v, plan, ct):
    o, vjp = jax.vjp(lambda q, k, v: dataplane.dispatch_attention(q, k, v, plan, spec, opts,
                                                                  mesh=mesh), q, k, v)
    return (o, *vjp(ct))

  rows = NamedSharding(mesh, P(("pipe", "data")))
  f = jax.jit(run, in_shardings=(rows,) * 5)
  rng = np.random.default_rng(seed)
  for name, doc_lens, eps in _layouts(seed)[2:4]:
    hp = _host_plan(doc_lens, spec, eps)
    q, k, v, ct = _inputs(rng)
    _check(f(q, k, v, hp.packed, ct), _reference(q, k, v, _segments(doc_lens, S, T), ct),
           f"{name} seed={seed}")


@pytest.mark.slow
def test_run_plan_returns_the_lse_through_the_two_level_exchange(seed):
  """O and the softmax LSE back through the reverse legs (the LSE's padding rows -inf) equal
  each document's attention, on a layout with a document over every rank."""
  rng = np.random.default_rng(seed)
  q, k, v, _ = _inputs(rng)
  doc_lens = [3 * T + 5, 2 * T, S * T - 5 * T - 40]
  hp = _host_plan(doc_lens, _spec(), 0.05)
  opts = dataplane.DispatchOptions(exchange=dataplane.ExchangeOptions(collective="two_level"),
                                   return_lse=True)
  o, lse = dataplane.run_plan(q, k, v, hp, _mesh(), opts)
  wo, wl = plan_lib.reference_document_attention(doc_lens, q, k, v)
  pad = _segments(doc_lens, S, T).reshape(S, T) == 0
  np.testing.assert_allclose(np.asarray(o), wo, atol=2e-5, rtol=2e-4)
  np.testing.assert_allclose(np.asarray(lse)[~pad], wl[~pad], atol=2e-5, rtol=2e-4)
  assert np.isneginf(np.asarray(lse)[pad]).all() and pad.any()


def test_two_level_needs_plans_built_for_it_and_checks_its_options():
  """Invalid combinations name the fix."""
  mesh = _mesh()
  q, k, v, _ = _inputs(np.random.default_rng(0))
  one_level = plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1,
                                capacity=CAP)
  hp = _host_plan([[T]] * S, one_level, 0.1)
  opts = dataplane.DispatchOptions(exchange=dataplane.ExchangeOptions(collective="two_level"))
  with pytest.raises(ValueError, match=r"two-level exchange needs plans built for it"):
    dataplane.run_plan(q, k, v, hp, mesh, opts)
  hp2 = _host_plan([[T]] * S, _spec(), 0.1)
  with pytest.raises(ValueError, match=r"collective 'ring'.*two_level=TwoLevel"):
    dataplane.run_plan(q, k, v, hp2, mesh, dataplane.DispatchOptions(
        exchange=dataplane.ExchangeOptions(collective="ring")))
  with pytest.raises(ValueError, match=r"servers_per_host=3 must divide the 8 servers"):
    plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP,
                      two_level=tl_lib.TwoLevel(3, 16, 16))
  with pytest.raises(ValueError, match=r"in_host='remote'.*rounds"):
    dataplane.ExchangeOptions(collective="two_level", in_host="remote")
  with pytest.raises(ValueError, match=r"signal_only=True.*one-level"):
    dataplane.ExchangeOptions(collective="two_level", signal_only=True)
  assert dataplane.resolve_collective("auto", "gpu", one_process=False) == "two_level"
  # A relay buffer too small for a plan names its key.
  small = plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP,
                            two_level=tl_lib.TwoLevel(L, 1, 1))
  with pytest.raises(ValueError, match=r"relays \d+ .*rows between hosts > \w+_relay=1"):
    _host_plan([S * T], small, 0.0)


def _ppermutes(jaxpr, out=None):
  """Every ``ppermute``'s permutation, nested jaxprs included."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name == "ppermute":
      out.append(tuple(e.params["perm"]))
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          _ppermutes(inner, out)
  return out


def test_dispatch_with_two_level_lowers_for_cuda(monkeypatch):
  """The data plane (forward and VJP) with the two-level exchange, as 'auto' resolves it in a
  multi-process GPU job, lowers for CUDA from CPU: leg A's rounds pair only devices of one local
  index on different hosts, leg B's only devices of one host."""
  from distca_jax.dataplane import exchange  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(exchange.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(exchange.jax, "process_count", lambda: 2)
  spec = _spec()
  run = _make_run(_mesh(), spec, collective="auto")
  q = jax.ShapeDtypeStruct((S, T, H, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((S, T, KH, 128), jnp.bfloat16)
  traced = run.trace(q, kv, kv, jax.ShapeDtypeStruct((S, spec.width), jnp.int32), q)
  perms = _ppermutes(traced.jaxpr.jaxpr)
  host = lambda i: i // L
  inter = [p for p in perms if all(host(a) != host(b) for a, b in p)]
  intra = [p for p in perms if all(host(a) == host(b) for a, b in p)]
  assert len(inter) + len(intra) == len(perms)
  assert all(a % L == b % L for p in inter for a, b in p)
  # Q, K/V and O forward and their VJPs (6 exchanges): 1 inter-host round, L - 1 in-host rounds
  # each, times the buckets' branches.
  assert len(inter) >= 6 and len(intra) >= 6 * (L - 1), (len(inter), len(intra))
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "collective_permute" in text


def _config(**distca):
  c = _tiny_config("distca", 8, 1, 0)
  for k, v in distca.items():
    c.attention.distca[k] = v
  return c


def test_startup_sizes_the_relay_buffers_from_the_runs_batches_and_overflow_moves_nothing():
  """With the two-level exchange the relay rows left at 0 come from the run's first batches
  (with headroom, within the safe bound); a batch that would relay more moves nothing and says
  so; explicit values are kept."""
  c = _config(collective="two_level", servers_per_host=L, caps_from_batches=6)
  got = distca_backend.startup_capacity(c)
  sugg = distca_backend.suggest_config_capacity(c, num_batches=6)
  backend = trainer.make_backend(c)
  spec = backend.host_plans(make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank,
                                        vocab_size=c.model.vocab_size, seed=c.seed).doclens(0),
                            c.tokens_per_rank)[0].spec
  cap = spec.capacity
  for f, send, recv in (("q_relay", cap.q_send, cap.q_recv), ("kv_relay", cap.kv_send,
                                                               cap.kv_recv)):
    assert 0 < sugg[f] <= got[f] <= tl_lib.safe_relay(send, recv, S, L), (f, got, sugg)
    assert getattr(spec.two_level, f) == got[f]
  assert spec.two_level.servers_per_host == L
  kept = trainer.make_backend(_config(collective="two_level", servers_per_host=2, q_relay=48,
                                      caps_from_batches=6))
  tl = kept.host_plans([[c.tokens_per_rank]] * S, c.tokens_per_rank)[0].spec.two_level
  assert (tl.servers_per_host, tl.q_relay) == (2, 48) and tl.kv_relay > 0
  c0 = _config(collective="ring", caps_from_batches=6)
  assert not set(distca_backend.startup_capacity(c0)) & {"q_relay", "kv_relay"}
  # Relay buffers too small for a per-rank batch that moves rows: it moves nothing instead.
  rng = np.random.default_rng(0)
  nested = [[int(x) for x in rng.integers(1, 24, size=3)] for _ in range(S)]
  nested[5] = [T]
  small = plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP,
                            two_level=tl_lib.TwoLevel(L, 1, 1))
  hp = _host_plan(nested, small, 0.0)
  assert hp.plan.num_moves == 0 and hp.plan.degraded
  assert re.search(r"relays \d+ q rows between hosts > q_relay=1.*moves nothing",
                   hp.plan.degraded_reason), hp.plan.degraded_reason
  assert _host_plan(nested, _spec(), 0.0).plan.num_moves > 0
  with pytest.raises(ValueError, match=r"servers_per_host=3 gives 3 servers per host.*divide"):
    trainer.make_backend(_config(collective="two_level", servers_per_host=3,
                                 caps_from_batches=0)).host_plans(
                                     [[c.tokens_per_rank]] * S, c.tokens_per_rank)


@pytest.mark.slow
def test_two_processes_with_two_level_match_one(tmp_path):
  """2 processes x 4 devices as 2 hosts x 4 servers (gloo), distca with the two-level exchange
  (leg A between the processes): 20 steps' losses equal 1 process x 8 devices with the ring
  exchange within 1e-5; the run's plans move rows between the hosts."""
  from test_multihost import TINY, _losses, _run  # pylint: disable=import-outside-toplevel
  distca = ["--config.attention.backend=distca", "--config.attention.distca.local_steps=False",
            "--config.attention.distca.min_gain=0"]
  args = distca + ["--config.num_steps=20", "--config.checkpoint_every=0"]
  # The same run's plans in this process (servers_per_host=4 as 2 processes resolve it).
  flags = TINY[2:] + distca + ["--config.attention.distca.collective=two_level",
                               "--config.attention.distca.servers_per_host=4"]
  c = configs_io.load_config(TINY[1], [f[len("--config."):] for f in flags])
  backend = trainer.make_backend(c)
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  host = np.arange(S) // L
  crossing = sum(int(hp.meta.q_send_len[host[:, None] != host[None, :]].sum())
                 for step in range(20)
                 for hp in backend.host_plans(src.doclens(step), c.tokens_per_rank))
  assert crossing > 0
  two, one = tmp_path / "two", tmp_path / "one"
  _run(2, 4, args + ["--config.attention.distca.collective=two_level"], two, tmp_path)
  _run(1, 8, args + ["--config.attention.distca.collective=ring"], one, tmp_path)
  l2, l1 = _losses(two), _losses(one)
  assert sorted(l2) == sorted(l1) == list(range(1, 21))
  for s in l1:
    assert abs(l2[s] - l1[s]) <= 1e-5 * abs(l1[s]), (s, l2[s], l1[s])
