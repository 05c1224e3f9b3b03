"""Capacity buckets (``plan.buckets``): a call runs the smallest compiled exchange capacity its
plans fit; outputs and gradients equal per-document attention in every bucket, each bucket is
traced once, and its exchange buffers are its own capacity's."""

import collections
import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from distca_jax import dataplane
from distca_jax import plan as plan_lib
from distca_jax.dataplane import body as body_lib
from distca_jax.plan.buckets import BucketSpecs, bucket_capacities, bucket_specs
from distca_jax.plan.two_level import TwoLevel, required_relay, safe_relay
from test_dispatch import (D, H, KH, SPEC, S, T, _check, _inputs, _layouts, _make_run, _mesh,
                           _options, _reference, _segments)

BUCKETS = bucket_specs(SPEC, 4)
# The two-level exchange over 2 hosts x 4 servers: each bucket's relay rows within its caps' bound.
SPEC_2L = dataclasses.replace(SPEC, two_level=TwoLevel(
    4, safe_relay(SPEC.capacity.q_send, SPEC.capacity.q_recv, S, 4),
    safe_relay(SPEC.capacity.kv_send, SPEC.capacity.kv_recv, S, 4)))


def _plan_options(eps):
  return plan_lib.PlanOptions(tolerance=float(eps), q_heads=H, kv_heads=KH, head_dim=D,
                              dtype_bytes=4, min_shard=None)


def _bucketed(doc_lens, eps, specs=BUCKETS):
  """(bucket, bucketed plan array, host plan) of a layout planned under the largest bucket."""
  hp = plan_lib.host_plan(doc_lens, specs.specs[-1], options=_plan_options(eps))
  k = specs.choose(hp.plan)
  return k, specs.pack(specs.in_bucket(doc_lens, hp, k).packed, k), hp


def _cases(seed):
  """The dispatch tests' fuzzed layouts, layouts of many short documents (plans that move a
  few rows: the smaller buckets) and one that moves nothing (a gated plan)."""
  rng = np.random.default_rng(seed + 1)
  docs = lambda: [int(x) for x in rng.integers(2, 12, size=int(rng.integers(1, 12)))]
  short = [(f"short-docs-{i}", [docs() for _ in range(S)], 0.1) for i in range(4)]
  nested = [[int(x) for x in rng.integers(1, 40, size=3)] for _ in range(S)]
  return _layouts(seed) + short + [("balanced-as-is", nested, 0.9)]


@pytest.mark.slow
@pytest.mark.parametrize("collective,memory_mode", [("ring", "keep"), ("dense", "resend"),
                                                    ("two_level", "keep")])
def test_every_bucket_equals_per_document_attention_one_trace_per_bucket(
    seed, collective, memory_mode, monkeypatch):
  traced = collections.Counter()
  send_to_servers = body_lib.send_to_servers

  def counting(q, k, v, m, spec, *args):
    traced[spec.capacity] += 1
    return send_to_servers(q, k, v, m, spec, *args)

  monkeypatch.setattr(body_lib, "send_to_servers", counting)
  mesh, traces = _mesh(), []
  specs = bucket_specs(SPEC_2L, 4) if collective == "two_level" else BUCKETS
  run = _make_run(mesh, specs, trace_counter=traces, collective=collective,
                  memory_mode=memory_mode)
  rng = np.random.default_rng(seed)
  chosen = []
  for name, doc_lens, eps in _cases(seed):
    k, packed, hp = _bucketed(doc_lens, eps, specs)
    chosen.append((k, hp.plan.num_moves > 0))
    if specs.specs[k].two_level is not None:
      tl = specs.specs[k].two_level
      q_need, kv_need = required_relay(hp.plan, 4)
      assert q_need <= tl.q_relay and kv_need <= tl.kv_relay
    q, k_, v, ct = _inputs(rng)
    got = run(q, k_, v, packed, ct)
    want = _reference(q, k_, v, _segments(doc_lens, S, T), ct)
    _check(got, want, f"{name} bucket {k} eps={eps:.3f} seed={seed} {hp.plan.summary()}")
    pad = _segments(doc_lens, S, T).reshape(S, T) == 0
    assert not np.asarray(got[0])[pad].any()
  # Plans that move rows ran in a smaller bucket and in the largest; one trace of the step,
  # and one of each bucket's exchange, served every batch.
  last = len(specs.specs) - 1
  assert (last, True) in chosen and any(k < last and moved for k, moved in chosen), chosen
  assert len(traces) == 1
  assert dict(traced) == {s.capacity: 1 for s in specs.specs}, traced


def _eqns(jaxpr):
  """Every equation of ``jaxpr``, nested jaxprs included (a switch's every branch)."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          yield from _eqns(inner)


def test_each_bucket_compiles_its_own_exchange_buffers(seed):
  """Two switches of one branch per bucket (the sends, the output's return); branch k's wire
  carries bucket k's send buffers (query and key/value rows; the return: its query receive
  buffer), the kernel runs outside them, and the compiled module holds every bucket's
  buffers."""
  mesh = _mesh()
  q, k, v, _ = _inputs(np.random.default_rng(seed))
  plan = np.zeros((S, BUCKETS.width), np.int32)
  opts = _options("ring", kernel="reference")
  f = lambda q, k, v, p: dataplane.dispatch_attention(q, k, v, p, BUCKETS, opts, mesh=mesh)
  jaxpr = jax.make_jaxpr(f)(q, k, v, plan).jaxpr
  conds = [e for e in _eqns(jaxpr)
           if e.primitive.name == "cond" and len(e.params["branches"]) == len(BUCKETS.specs)]
  assert len(conds) == 2
  for cond, fields in zip(conds, (("q_send", "kv_send"), ("q_recv",))):
    for spec, branch in zip(BUCKETS.specs, cond.params["branches"]):
      eqns = list(_eqns(branch.jaxpr))
      rows = {int(x.aval.shape[0]) for e in eqns if e.primitive.name == "ppermute"
              for x in e.invars}
      assert rows == {getattr(spec.capacity, f) for f in fields}, (fields, spec.capacity)
      assert not any(e.primitive.name == "dot_general" for e in eqns)  # no kernel inside
  assert any(e.primitive.name == "dot_general" for e in _eqns(jaxpr))
  assert [s.capacity.kv_send for s in BUCKETS.specs] == [256, 512, 768, 1024]
  hlo = jax.jit(f).lower(q, k, v, plan).as_text()
  for s in BUCKETS.specs:  # every bucket's key/value send buffer: [Ckvs, 2 KH, D] f32
    assert f"tensor<{s.capacity.kv_send}x{2 * KH}x{D}xf32>" in hlo, s.capacity


def test_bucket_capacities_choice_and_packing(seed):
  full = SPEC.capacity
  caps = bucket_capacities(full, 3, tokens_per_device=T)
  assert caps[-1] == full and len(caps) == 3
  for f in plan_lib.EXCHANGE_FIELDS:  # 1/3, 2/3, 1 of the cap, whole row multiples (16 here)
    want = [max(16, -(-int(np.ceil(i * getattr(full, f) / 3)) // 16) * 16) for i in (1, 2, 3)]
    assert [getattr(c, f) for c in caps] == want, f
  for f in ("q_tokens", "kv_tokens", "tasks"):
    assert {getattr(c, f) for c in caps} == {getattr(full, f)}
  assert bucket_capacities(full, 1) == (full,)
  # Buckets that round to the same capacity are one.
  tiny = dataclasses.replace(full, q_send=16, kv_send=16, q_recv=16, kv_recv=16)
  assert bucket_capacities(tiny, 4, tokens_per_device=T) == (tiny,)
  # The chosen bucket is the smallest that holds the plan; packing puts its index last.
  for name, doc_lens, eps in _cases(seed):
    k, packed, hp = _bucketed(doc_lens, eps)
    need = plan_lib.required_capacity(hp.plan)
    fits = [all(getattr(need, f) <= getattr(s.capacity, f) for f in plan_lib.CAP_FIELDS)
            for s in BUCKETS.specs]
    assert k == fits.index(True), (name, need)
    assert packed.shape == (S, BUCKETS.width) and (packed[:, -1] == k).all()
    assert np.array_equal(packed[:, :BUCKETS.specs[k].width],
                          BUCKETS.in_bucket(doc_lens, hp, k).packed)


def test_bucket_errors_name_the_fix():
  with pytest.raises(ValueError, match="buckets"):
    bucket_capacities(SPEC.capacity, 0)
  other = dataclasses.replace(SPEC, capacity=dataclasses.replace(SPEC.capacity, q_tokens=T))
  with pytest.raises(ValueError, match="more than its exchange caps"):
    BucketSpecs((other, SPEC))
  with pytest.raises(ValueError, match="0 <= k"):
    BUCKETS.pack(np.zeros((S, BUCKETS.specs[0].width), np.int32), 5)
  with pytest.raises(ValueError, match="one or more plans"):
    BUCKETS.choose()
