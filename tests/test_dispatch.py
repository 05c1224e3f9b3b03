"""CAD data plane on 8 fake CPU devices: outputs and gradients equal per-document attention.

Every comparison is against each document's causal attention computed alone (dense, float32, one
device), on random layouts from both workloads (documents spanning ranks, a rank holding one huge
document, padding) and random plans with tolerance in [0, 0.3].
"""

import collections
import dataclasses
import functools
import os

import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from distca_jax import attention as attn_lib
from distca_jax import backends, configs_io, dataplane, trainer
from distca_jax import plan as plan_lib
from distca_jax import sharding as shard_lib
from distca_jax.backends import distca as distca_backend
from distca_jax.data import make_source
from distca_jax.data.workloads import WorkloadSampler
from distca_jax.plan.buckets import bucket_specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S, T, H, KH, D = 8, 128, 4, 2, 16
# Fixed buffers for every layout below (flat layouts whose documents span all ranks need
# kv_tokens >= S * T on the server computing a document's last rows; twice that lets mirrored
# pieces of one all-rank document balance).
CAP = plan_lib.Capacity(q_send=T, kv_send=S * T, q_recv=2 * T, kv_recv=S * T,
                        q_tokens=3 * T // 2, kv_tokens=2 * S * T, tasks=48)
SPEC = plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP)
ATOL, RTOL = 2e-5, 2e-4


def _mesh(data=S, tensor=1):
  devs = np.asarray(jax.devices()[:data * tensor]).reshape(data, tensor)
  return jax.sharding.Mesh(devs, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def _segments(doc_lens, rows, t):
  """[1, rows * t] segment ids of a flat or per-row layout (each document its own id)."""
  lens, starts = plan_lib.parse_layout(doc_lens, rows, t)
  seg = np.zeros(rows * t, np.int32)
  for j, (g, n) in enumerate(zip(starts.tolist(), lens.tolist())):
    seg[g:g + n] = j + 1
  return seg[None]


@jax.jit
def _reference(q, k, v, seg, ct):
  """Each document alone: dense masked attention over all ranks' tokens as one row, and its VJP."""
  b, t = q.shape[:2]
  flat = lambda x: x.reshape((1, b * t) + x.shape[2:])
  layout = attn_lib.Layout(seg, jnp.zeros_like(seg))

  def f(q, k, v):
    o = attn_lib.dense_reference(flat(q), flat(k), flat(v), layout, softmax_scale=D**-0.5)
    return o.reshape(q.shape)

  o, vjp = jax.vjp(f, q, k, v)
  return (o, *vjp(ct))


def _inputs(rng, rows=S, t=T):
  q = rng.standard_normal((rows, t, H, D), np.float32)
  k = rng.standard_normal((rows, t, KH, D), np.float32)
  v = rng.standard_normal((rows, t, KH, D), np.float32)
  ct = rng.standard_normal((rows, t, H, D), np.float32)
  return q, k, v, ct


def _options(collective="auto", signal_only=False, **dispatch):
  """``DispatchOptions`` from flat keywords (the exchange's two, then the rest)."""
  wire = dataplane.ExchangeOptions(collective=collective, signal_only=signal_only)
  return dataplane.DispatchOptions(exchange=wire, **dispatch)


def _make_run(mesh, spec, trace_counter=None, head_axis=None, **options):
  """jit(output and VJP of dispatch_attention); the plan is an argument (one trace)."""
  opts = _options(head_axis=head_axis, **options)

  def run(q, k, v, plan, ct):
    if trace_counter is not None:
      trace_counter.append(1)
    o, vjp = jax.vjp(lambda q, k, v: dataplane.dispatch_attention(
        q, k, v, plan, spec, opts, mesh=mesh), q, k, v)
    return (o, *vjp(ct))

  qkv = NamedSharding(mesh, P("data", None, head_axis, None))
  return jax.jit(run, in_shardings=(qkv, qkv, qkv, NamedSharding(mesh, P("data", None)), qkv))


def _layouts(seed):
  """(name, doc_lens, tolerance) cases: both workloads, per rank and flat, hand-made extremes."""
  rng = np.random.default_rng(seed)
  eps = [0.0, 0.3] + list(rng.uniform(0.0, 0.3, 6))
  out = []
  for i, name in enumerate(("pretrain", "prolong")):
    ws = WorkloadSampler(name, T, seed=int(rng.integers(1 << 20)))
    out.append((f"{name}-per-rank", ws.step_doclens(int(rng.integers(100)), S), eps[i]))
    wide = WorkloadSampler(name, T, seed=int(rng.integers(1 << 20)), context_length=4 * T)
    out.append((f"{name}-flat", wide.flat_doclens(int(rng.integers(100)), S), eps[2 + i]))
  # One rank holding one huge document (the whole rank), the others short documents + padding.
  nested = [list(rng.integers(1, 24, size=int(rng.integers(1, 5)))) for _ in range(S)]
  nested[int(rng.integers(S))] = [T]
  out.append(("huge-rank", [[int(x) for x in r] for r in nested], eps[4]))
  # A document spanning five ranks, short documents around it, a padded tail.
  short = [int(x) for x in rng.integers(1, 40, size=6)]
  out.append(("span-5-ranks", short[:3] + [5 * T + 17] + short[3:], eps[5]))
  # Half-empty ranks (padding in the middle of the global token range).
  nested = [[int(x) for x in rng.integers(1, 30, size=int(rng.integers(0, 4)))] for _ in range(S)]
  out.append(("sparse", nested, eps[6]))
  # Everything in one document: all servers share its work.
  out.append(("one-doc", [S * T], eps[7]))
  return out


def _check(got, want, what):
  for g, w, n in zip(got, want, ("o", "dq", "dk", "dv")):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=ATOL, rtol=RTOL,
                               err_msg=f"{what}: {n}")


@pytest.mark.slow
def test_outputs_and_grads_equal_per_document_attention_single_trace(seed):
  mesh = _mesh()
  traces = []
  run = _make_run(mesh, SPEC, trace_counter=traces)  # memory_mode 'keep', the ring exchange
  rng = np.random.default_rng(seed)
  moves = split_docs = 0
  packed = []
  for name, doc_lens, eps in _layouts(seed):
    hp = plan_lib.host_plan(doc_lens, SPEC,
                            options=plan_lib.PlanOptions(tolerance=float(eps), q_heads=H,
                                                         kv_heads=KH, head_dim=D, dtype_bytes=4,
                                                         min_shard=None))
    q, k, v, ct = _inputs(rng)
    got = run(q, k, v, hp.packed, ct)
    want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
    _check(got, want, f"{name} eps={eps:.3f} seed={seed} {hp.plan.summary()}")
    pad = _segments(doc_lens, S, T).reshape(S, T) == 0
    assert not np.asarray(got[0])[pad].any() and not np.asarray(got[1])[pad].any()
    moves += hp.plan.num_moves
    per_doc = collections.Counter(hp.plan.tasks[:, 0].tolist())
    split_docs += sum(1 for d, n in per_doc.items()
                      if len(set(hp.plan.tasks[hp.plan.tasks[:, 0] == d, 3].tolist())) > 1)
    packed.append(hp.packed)
  # The plans really moved work and split documents over servers; one trace served them all.
  assert moves >= 10 and split_docs >= 5, (moves, split_docs)
  assert len(traces) == 1
  assert all(not np.array_equal(packed[0], p) for p in packed[1:])


@pytest.mark.slow
def test_notebook_entry_flat_and_per_rank_with_grads(seed):
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  q, k, v, ct = _inputs(rng)
  sh = NamedSharding(mesh, P("data"))
  doc_lens = [40, 3 * T + 5, 77, 200, 9]  # flat, spanning ranks, padded tail

  shapes = dict(q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4)
  flat_plan = plan_lib.fit_host_plan(doc_lens, S, T, options=plan_lib.PlanOptions(
      tolerance=0.05, min_shard=None, **shapes))

  @jax.jit
  def grads(q, k, v, ct):
    o, vjp = jax.vjp(lambda q, k, v: dataplane.run_plan(q, k, v, flat_plan, mesh), q, k, v)
    return (o, *vjp(ct))

  got = grads(*(jax.device_put(x, sh) for x in (q, k, v, ct)))
  _check(got, _reference(q, k, v, _segments(doc_lens, S, T), ct), "notebook flat")
  # Per-rank lists, eager call (jitted inside), and the log-sum-exp.
  nested = [[T], [60, 60], [5], [], [128], [1, 2, 3], [100], [127]]
  hp = plan_lib.fit_host_plan(nested, S, T, options=plan_lib.PlanOptions(
      tolerance=0.0, min_shard=None, **shapes))
  o, lse = dataplane.run_plan(*(jax.device_put(x, sh) for x in (q, k, v)), hp, mesh,
                                    dataplane.DispatchOptions(return_lse=True))
  want_o, want_lse = plan_lib.reference_document_attention(nested, q, k, v)
  np.testing.assert_allclose(np.asarray(o), want_o, atol=ATOL, rtol=RTOL)
  seg = _segments(nested, S, T).reshape(S, T)
  lse = np.asarray(lse)
  np.testing.assert_allclose(lse[seg > 0], want_lse[seg > 0], atol=ATOL, rtol=RTOL)
  assert np.isneginf(lse[seg == 0]).all()
  assert hp.plan.num_moves > 0


_count_prims = dataplane.count_primitives  # structure of one execution (the package's)


def _blockwise_forwards(jaxpr, in_loop=False) -> int:
  """Forward passes of the blockwise kernel one execution of a forward+backward ``jaxpr`` runs.

  Its tile products are the programs' only matmuls inside ``while`` loops: 2 per key step in a
  forward pass, 5 in the backward pass (one per call). A switch counts its largest branch.
  """
  def products(jaxpr, in_loop):
    n = 0
    for e in jaxpr.eqns:
      n += e.primitive.name == "dot_general" and in_loop
      if e.primitive.name == "cond":
        n += max(products(b.jaxpr, in_loop) for b in e.params["branches"])
        continue
      for p in e.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
          inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
          if inner is not None and hasattr(inner, "eqns"):
            n += products(inner, in_loop or e.primitive.name == "while")
    return n
  n = products(jaxpr, in_loop)
  assert n >= 5 and (n - 5) % 2 == 0, f"{n} products in loops: not the blockwise kernel's"
  return (n - 5) // 2


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["reference", "blockwise"])
def test_resend_equals_keep_and_resends_in_the_backward(seed, kernel):
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  name, doc_lens, eps = _layouts(seed)[int(rng.integers(8))]
  hp = plan_lib.host_plan(doc_lens, SPEC,
                          options=plan_lib.PlanOptions(tolerance=float(eps), min_shard=None))
  q, k, v, ct = _inputs(rng)
  keep = _make_run(mesh, SPEC, memory_mode="keep", kernel=kernel)
  resend = _make_run(mesh, SPEC, memory_mode="resend", kernel=kernel)
  want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
  _check(keep(q, k, v, hp.packed, ct), want, f"{kernel} keep {name} seed={seed}")
  _check(resend(q, k, v, hp.packed, ct), want, f"{kernel} resend {name} seed={seed}")

  # Keep: 3 exchanges forward (Q out, K/V out, O back; each one ppermute in its ring loop) +
  # their 3 transposes. Resend also re-sends Q and K/V in the backward (two more), and never
  # reruns the blockwise kernel's forward (it saves the kernel's named outputs; 'reference'
  # names none, so its forward is recomputed).
  counts = {}
  for mode, fn in (("keep", keep), ("resend", resend)):
    jaxpr = jax.make_jaxpr(fn)(q, k, v, hp.packed, ct).jaxpr
    counts[mode] = _count_prims(jaxpr, {"ppermute"})
    if kernel == "blockwise":
      counts[mode]["forwards"] = _blockwise_forwards(jaxpr)
  assert counts["keep"]["ppermute"] == 6, counts
  assert counts["resend"]["ppermute"] == 8, counts
  if kernel == "blockwise":
    assert counts["keep"]["forwards"] == counts["resend"]["forwards"] == 1, counts


@pytest.mark.slow
def test_rows_per_device_with_inner_padding_and_tensor_heads(seed):
  """data=4 x tensor=2, two rows per device, rows padded inside a device's token range."""
  mesh = _mesh(data=4, tensor=2)
  rows, r = 8, 2
  spec = plan_lib.PlanSpec(num_servers=4, tokens_per_row=T, rows_per_device=r,
                           capacity=plan_lib.resolve_capacity(None, r * T, r))
  rng = np.random.default_rng(seed)
  # At most 3 documents of <= 42 tokens: a row never overflows its T = 128 tokens.
  per_row = [[int(x) for x in rng.integers(1, 43, size=int(rng.integers(0, 4)))]
             for _ in range(rows)]
  per_row[3] = [T]
  per_row[6] = [90, 38]
  hp = plan_lib.host_plan(per_row, spec, options=plan_lib.PlanOptions(tolerance=0.0, min_shard=8))
  assert hp.plan.num_moves > 0, f"no moves for {per_row=} (seed={seed})"
  q, k, v, ct = _inputs(rng, rows=rows)
  run = _make_run(mesh, spec, head_axis="tensor")
  got = run(q, k, v, hp.packed, ct)
  _check(got, _reference(q, k, v, _segments(per_row, rows, T), ct), f"R=2 TP=2 seed={seed}")


def test_suggested_config_caps_fit_the_run_batches():
  c = _tiny_config("distca", 4, 2, 0, rows_per_rank=4, nano_batches=2)
  caps = distca_backend.suggest_config_capacity(c, num_batches=6, data=4)
  for k, v in caps.items():
    c.attention.distca[k] = v
  backend = trainer.make_backend(c)
  src = make_source(c.data, rows=16, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  spec = plan_lib.PlanSpec(4, c.tokens_per_rank, 2, plan_lib.Capacity(**caps))
  width = bucket_specs(spec, c.attention.distca.buckets).width  # the bucket index last
  for step in range(6):
    plan = backend.host_prepare(src.doclens(step), c.tokens_per_rank)[distca_backend.PLAN_KEY]
    assert plan.shape == (16, width) and plan.dtype == np.int32


def test_startup_caps_come_from_the_runs_batches_and_plan_every_later_batch(seed):
  """Caps left at 0 are derived from the run's first batches (with headroom and floors); later
  batches of the same run still plan (a tighter need only degrades balance, never fails)."""
  c = _tiny_config("distca", 4, 1, seed, rows_per_rank=4, nano_batches=2)
  c.attention.distca.caps_from_batches = 6
  c.attention.distca.kv_recv = 96  # set by the user: kept
  rows = c.tokens_per_rank * 2  # rows per device and call (4 rows / 2 nano-batches)
  got = distca_backend.startup_capacity(c)
  sugg = distca_backend.suggest_config_capacity(c, num_batches=6)
  assert set(got) == {"q_send", "kv_send", "q_recv", "q_tokens", "kv_tokens"}, got  # never tasks
  mult = plan_lib.row_multiple(rows)
  for name, v in got.items():
    assert v % mult == 0 and v >= sugg[name] * 1.1 - 1e-9, (name, v, sugg, seed)
  assert got["q_tokens"] >= rows and got["kv_tokens"] >= rows
  backend = trainer.make_backend(c)
  assert backend.caps["kv_recv"] == 96 and backend.caps["tasks"] == 0
  assert all(backend.caps[k] == v for k, v in got.items())
  src = make_source(c.data, rows=16, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  for step in range(6, 30):  # batches the caps never saw
    plans = backend.host_plans(src.doclens(step), c.tokens_per_rank)
    assert all(hp.plan.imbalance_after <= hp.plan.imbalance_before + 1e-9 for hp in plans)
  # Caps too tight for a batch: the plan still runs, and the backend says so once.
  c.attention.distca.caps_from_batches = 0
  c.attention.distca.q_recv = c.attention.distca.kv_recv = 16
  tight = trainer.make_backend(c)
  with pytest.warns(UserWarning, match=r"stopped short.*capacity blocked moves.*raise them"):
    for step in range(30):
      tight.host_prepare(src.doclens(step), c.tokens_per_rank)
  # Off, or every row cap given: nothing derived. A headroom below 1 names the fix.
  c.attention.distca.caps_from_batches = 0
  assert distca_backend.startup_capacity(c) == {}
  c.attention.distca.caps_from_batches = 6
  for name in plan_lib.EXCHANGE_FIELDS + ("q_tokens", "kv_tokens"):
    c.attention.distca[name] = 512
  assert distca_backend.startup_capacity(c) == {}
  c.attention.distca.caps_headroom = 0.9
  with pytest.raises(ValueError, match=r"caps_headroom=0.9 must be >= 1"):
    distca_backend.startup_capacity(c)


def test_errors_name_the_fix():
  with pytest.raises(ValueError, match="memory_mode"):
    backends.get("distca", memory_mode="forget")
  with pytest.raises(ValueError, match="kernel"):
    backends.get("distca", kernel="cudnn")
  with pytest.raises(ValueError, match="q_tokens"):
    backends.get("distca", q_tokens=-1)
  tight = plan_lib.PlanSpec(num_servers=2, tokens_per_row=64, rows_per_device=1,
                            capacity=plan_lib.Capacity(q_send=8, kv_send=8, q_recv=8,
                                                       kv_recv=8, q_tokens=64, kv_tokens=64,
                                                       tasks=2))
  with pytest.raises(ValueError, match=r"capacity\.tasks >= 3"):
    plan_lib.host_plan([[10, 10, 10], [5]], tight)
  backend = backends.get("distca", rows_per_rank=2)
  with pytest.raises(ValueError, match="rows_per_rank=2"):
    backend.host_prepare([[4], [4], [4]], 16)
  with pytest.raises(ValueError, match="nano_batches"):
    backends.get("distca", rows_per_rank=3, nano_batches=2)
  with pytest.raises(ValueError, match="host_prepare"):
    q = jnp.zeros((1, 8, H, D))
    backend.fn(q, q, q, attn_lib.Layout(jnp.ones((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32)),
               softmax_scale=1.0)


# ---------------------------------------------------------------------------------------------
# Train step with the 'distca' backend.
# ---------------------------------------------------------------------------------------------
def _tiny_config(backend, data, tensor, seed, rows_per_rank=None, nano_batches=1):
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"))
  c.model.n_layers = 2
  c.model.n_heads, c.model.n_kv_heads, c.model.head_dim = 4, 2, 16
  c.model.dim = 64
  c.model.mlp_dim = 128
  c.model.loss_chunk = 64
  c.tokens_per_rank = 64
  c.rows_per_rank = rows_per_rank or 8 // data
  c.attention.nano_batches = nano_batches
  c.attention.block_q = 16
  c.attention.block_k = 32
  c.attention.backend = backend
  c.attention.distca.tolerance = 0.05
  c.attention.distca.min_gain = 0.0  # tiny models' batches are near-balanced: balance them anyway
  c.attention.distca.local_gain = 0.0
  c.mesh.data, c.mesh.tensor = data, tensor
  c.data.context_length = 256  # documents up to a few rows long, cut at row boundaries
  c.seed = seed
  return c


def _grad_fn(c, mesh, backend, traces=None):
  model = trainer.make_model(c, backend)

  def f(params, batch):
    if traces is not None:
      traces.append(1)
    total, count = model.apply({"params": params}, batch["inputs"], batch["targets"],
                               batch["loss_mask"], trainer.layout_of(batch), method=model.loss)
    return total / count

  return jax.jit(jax.value_and_grad(f))


@pytest.mark.slow
@pytest.mark.parametrize("data,tensor,rows_per_rank,nano_batches", [(8, 1, 1, 1), (2, 2, 4, 2)])
def test_train_loss_and_grads_distca_equal_local(seed, data, tensor, rows_per_rank, nano_batches):
  """Two batches per mesh: equal loss and gradients, and one trace of the distca step.

  data=8 exchanges by 7 ring rounds (the 'auto' collective on CPU); data=2 x tensor=2 by one
  and runs ping-pong (two nano-batches of two rows per rank, each planned apart).
  """
  c_local = _tiny_config("local", data, tensor, seed, rows_per_rank, nano_batches)
  c_cad = _tiny_config("distca", data, tensor, seed, rows_per_rank, nano_batches)
  mesh = shard_lib.make_mesh(data=data, tensor=tensor, devices=jax.devices()[:data * tensor])
  cad = trainer.make_backend(c_cad)
  local = trainer.make_backend(c_local)
  # The backend has no parameters: one state serves both models.
  params = trainer.create_train_state(c_local, trainer.make_model(c_local, local),
                                      trainer.make_optimizer(c_local), mesh).params
  src = make_source(c_cad.data, rows=data * rows_per_rank, tokens_per_row=c_cad.tokens_per_rank,
                    vocab_size=c_cad.model.vocab_size, seed=seed)
  traces = []
  with trainer.mesh_context(mesh):
    f_local = _grad_fn(c_local, mesh, local)
    f_cad = _grad_fn(c_cad, mesh, cad, traces)
    plans = []
    for step in np.random.default_rng(seed).choice(1000, size=2, replace=False).tolist():
      batch = trainer.add_host_plan(src.batch(step), cad, src.doclens(step), c_cad.tokens_per_rank)
      plans.append(batch["extra/" + distca_backend.PLAN_KEY])
      loss_l, g_l = f_local(params, trainer.device_batch(src.batch(step), mesh))
      loss_c, g_c = f_cad(params, trainer.device_batch(batch, mesh))
      assert np.isfinite(float(loss_l)) and float(loss_l) > 1.0
      np.testing.assert_allclose(float(loss_c), float(loss_l), rtol=1e-5)
      flat_l, flat_c = jax.tree.leaves(g_l), jax.tree.leaves(g_c)
      assert len(flat_l) == len(flat_c)
      for a, b in zip(flat_l, flat_c):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6)
  assert not np.array_equal(plans[0], plans[1])
  assert len(traces) == 1


@pytest.mark.slow
def test_train_and_evaluate_with_distca_compiles_once(seed, tmp_path, monkeypatch):
  """The real job (Prefetcher -> host_prepare -> jitted step) over different batches, one trace."""
  c = _tiny_config("distca", 8, 1, seed)
  c.rows_per_rank = 2  # 16 rows: two per device
  c.num_steps, c.log_every, c.checkpoint_every, c.tensorboard = 3, 1, 0, False
  c.optim.warmup_steps = 1
  make_step = trainer.make_train_step
  monkeypatch.setattr(trainer, "make_train_step",
                      lambda *a: chex.assert_max_traces(make_step(*a), n=1))
  records = trainer.train_and_evaluate(c, str(tmp_path))
  assert [r["step"] for r in records] == [1, 2, 3]
  assert all(np.isfinite(r["loss"]) and r["loss"] > 1.0 for r in records)
  # The share of each window's steps (one step here) on the local branch.
  assert all(r.get("local_step_share") in (0.0, 1.0) for r in records[1:]), records


def test_config_min_gain_gates_plans_with_the_model_weight(seed):
  """attention.distca.min_gain reaches every plan with the model's linear work per token: a
  batch whose predicted step gain is below it moves nothing; min_gain 0 balances it."""
  from distca_jax import config as config_lib
  from distca_jax import metrics
  c = _tiny_config("distca", 4, 1, seed)
  lin = metrics.linear_pairs_per_token(config_lib.model_config(c))
  src = make_source(c.data, rows=4 * c.rows_per_rank, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=c.seed)
  backend = trainer.make_backend(c)
  # A batch the balancer has work on (imbalance above its tolerance).
  rows = next(r for r in map(src.doclens, range(50))
              if backend.host_plans(r, c.tokens_per_rank)[0].plan.imbalance_before > 1.2)
  gains = []
  for min_gain in (0.0, 1.0):
    c.attention.distca.min_gain = min_gain
    (hp,) = trainer.make_backend(c).host_plans(rows, c.tokens_per_rank)
    want = plan_lib.predicted_step_gain(hp.plan.loads_before, hp.spec.tokens_per_device, lin)
    assert hp.plan.predicted_gain == pytest.approx(want) and 0 < want < 1.0
    assert hp.plan.gated == (min_gain == 1.0)
    gains.append(hp.plan.num_moves)
  assert gains[0] > 0 and gains[1] == 0  # the ungated plan moved rows, the gated one none
  with pytest.raises(ValueError, match=r"min_gain=-0.5 must be a finite number >= 0"):
    backends.get("distca", min_gain=-0.5)


def test_config_cost_table_reaches_the_planner(monkeypatch):
  """A benchmark's cost_table option is loaded and handed to the planner for every plan."""
  import os
  seen = []
  real = plan_lib.schedule

  def spy(*a, **kw):
    seen.append(kw["options"].cost_model)
    return real(*a, **kw)

  monkeypatch.setattr(plan_lib.spec, "schedule", spy)
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                      "cost_table_flash3_h200.json")
  backend = backends.get("distca", cost_table=path, q_heads=4, kv_heads=2, head_dim=16)
  backend.host_prepare([[100, 28], [60, 60, 8]], 128)
  assert seen and all(s == path for s in seen)


# ---------------------------------------------------------------------------------------------
# The ragged exchange and signal-only mode.
# ---------------------------------------------------------------------------------------------
def _exchange_layouts(seed):
  """(name, doc_lens, tolerance): no exchange at all, a heavy one, and both workloads at random."""
  rng = np.random.default_rng(seed)
  light = [[64, 64]] * S  # identical ranks: balanced as they are, nothing moves
  nested = [[int(x) for x in rng.integers(1, 24, size=int(rng.integers(1, 5)))] for _ in range(S)]
  nested[int(rng.integers(S))] = [T]  # one rank's whole row is one document: it must spread
  out = [("light", light, 0.0), ("huge-rank", nested, 0.0)]
  for name in ("pretrain", "prolong"):
    ws = WorkloadSampler(name, T, seed=int(rng.integers(1 << 20)), context_length=2 * T)
    out.append((f"{name}-flat", ws.flat_doclens(int(rng.integers(100)), S),
                float(rng.uniform(0.0, 0.3))))
  return out


def _operand_rows(jaxpr, prim, out=None):
  """Leading dimension of every ``prim`` operand, in program order (nested jaxprs included)."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name == prim:
      out.append(int(e.invars[0].aval.shape[0]))
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          _operand_rows(inner, prim, out)
  return out


@pytest.mark.parametrize("collective,modes", [
    ("ring", ("keep", "resend")),
    pytest.param("dense", ("keep", "resend"), marks=pytest.mark.slow)])
def test_exchange_equals_reference_both_memory_modes_single_trace(seed, collective, modes):
  """Outputs and grads per collective and memory mode on layouts that move nothing, a lot and
  something; one trace across them."""
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  traces = {m: [] for m in modes}
  runs = {m: _make_run(mesh, SPEC, trace_counter=traces[m], memory_mode=m, collective=collective)
          for m in modes}
  for name, doc_lens, eps in _exchange_layouts(seed):
    hp = plan_lib.host_plan(doc_lens, SPEC,
                            options=plan_lib.PlanOptions(tolerance=eps, q_heads=H, kv_heads=KH,
                                                         head_dim=D, dtype_bytes=4,
                                                         min_shard=None))
    by = plan_lib.exchange_bytes(hp.meta, q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4)
    q, k, v, ct = _inputs(rng)
    want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
    for mode, run in runs.items():
      _check(run(q, k, v, hp.packed, ct), want,
             f"{name} {mode} {collective} seed={seed} useful={by['dispatch_useful']}")
    if name == "light":
      assert by["dispatch_useful"] == 0 and by["return_useful"] == 0, by
    if name == "huge-rank":
      assert by["dispatch_useful"] > 0, by
  assert all(len(t) == 1 for t in traces.values()), traces


def _random_send_len(rng, s, send_cap, recv_cap):
  """A random [S, S] send-length matrix within the totals (self pair 0)."""
  ln = np.zeros((s, s), np.int64)
  for _ in range(4 * s * s):
    p, d = rng.integers(s, size=2)
    add = int(rng.integers(0, 7))
    if p != d and ln[p].sum() + add <= send_cap and ln[:, d].sum() + add <= recv_cap:
      ln[p, d] += add
  return ln


def _random_routes(rng, s, send_cap, recv_cap):
  """[S, 6, S] routes of a random [S, S] send-length matrix within the totals (self pair 0)."""
  ln = _random_send_len(rng, s, send_cap, recv_cap)
  send_off = np.cumsum(ln, axis=1) - ln
  recv_off = (np.cumsum(ln, axis=0) - ln).T
  return plan_lib.metadata.routes(ln, send_off, recv_off, np.arange(s)), ln


@pytest.mark.parametrize("collective,buckets", [("ring", 1), ("dense", 8), ("dense", 1)])
def test_ragged_exchange_moves_each_group_and_its_vjp_sends_it_back(seed, collective, buckets):
  """Random routes on 8 devices: every group lands where its routes say (NumPy oracle), rows no
  group fills are zero, and the VJP is the exchange of the cotangents with the routes reversed."""
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  cs, cr = 40, 56
  routes, ln = _random_routes(rng, S, cs, cr)
  assert ln.sum() > 0, seed
  x = rng.standard_normal((S, cs, 3, 2)).astype(np.float32)
  dy = rng.standard_normal((S, cr, 3, 2)).astype(np.float32)

  def body(x, r, dy):
    y, vjp = jax.vjp(lambda x: dataplane.ragged_exchange(x[0], r[0], cr, "data", collective,
                                                         buckets)[None], x)
    return y, vjp(dy)[0]

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),) * 3,
                            out_specs=(P("data"), P("data"))))
  y, dx = (np.asarray(a) for a in f(x, jnp.asarray(routes), dy))
  want = plan_lib.executor._exchange(list(x), routes, cr)
  want_dx = plan_lib.executor._exchange(list(dy), plan_lib.reverse_routes(routes), cs)
  for d in range(S):
    np.testing.assert_array_equal(y[d], want[d], err_msg=f"{collective} device {d} seed={seed}")
    np.testing.assert_array_equal(dx[d], want_dx[d], err_msg=f"{collective} grad {d} seed={seed}")
    assert not y[d, ln[:, d].sum():].any()  # past the received groups: zeros


def test_exchange_buffers_do_not_grow_with_the_number_of_servers():
  """Same tokens and caps per device on 2, 4 and 8 servers: every buffer the ring passes on and
  every attention buffer has the same rows (only the [6, S] routes grow); the dense baseline's
  all_to_all grows with S. On the host, the capacity's bytes do not depend on S but for routes."""
  q = jax.ShapeDtypeStruct((0, T, H, D), jnp.float32)
  per = {}
  for s in (2, 4, 8):
    spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=T, rows_per_device=1, capacity=CAP)
    mesh = _mesh(data=s)
    qs = jax.ShapeDtypeStruct((s, T, H, D), jnp.float32)
    ks = jax.ShapeDtypeStruct((s, T, KH, D), jnp.float32)
    plan = jax.ShapeDtypeStruct((s, spec.width), jnp.int32)
    fwd = lambda q, k, plan, col: dataplane.dispatch_attention(
        q, k, k, plan, spec, _options(collective=col), mesh=mesh)
    ring = jax.make_jaxpr(functools.partial(fwd, col="ring"))(qs, ks, plan).jaxpr
    dense = jax.make_jaxpr(functools.partial(fwd, col="dense"))(qs, ks, plan).jaxpr
    per[s] = (_operand_rows(ring, "ppermute"), _operand_rows(dense, "all_to_all"))
    mem = CAP.memory_bytes(s, q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4)
    per[s] += ({k: v for k, v in mem.items() if k not in ("metadata", "total")},)
  del q
  # Ring: Q out, K/V out, O back; each passes on one whole send buffer per round.
  assert per[2][0] == per[4][0] == per[8][0] == [CAP.q_send, CAP.kv_send, CAP.q_recv], per
  assert per[2][2] == per[4][2] == per[8][2]
  # Dense: S padded blocks, one all_to_all per nonzero block size of each exchange's switch.
  sizes = [len(dataplane.dense_block_rows(min(a, b), 8)) - 1
           for a, b in ((CAP.q_send, CAP.q_recv), (CAP.kv_send, CAP.kv_recv),
                        (CAP.q_recv, CAP.q_send))]
  for s in (2, 4, 8):
    assert len(per[s][1]) == sum(sizes) and set(per[s][1]) == {s}, (s, per[s][1])


def test_dense_block_rows_and_options():
  assert dataplane.dense_block_rows(64, 8) == (0, 8, 16, 24, 32, 40, 48, 56, 64)
  assert dataplane.dense_block_rows(64, 1) == (64,)
  assert dataplane.dense_block_rows(20, 8) == (0, 8, 16, 20)  # rounded to 8, at most full
  assert dataplane.ExchangeOptions().buckets == dataplane.DEFAULT_EXCHANGE_BUCKETS
  with pytest.raises(ValueError, match=r"exchange_buckets=0.*int >= 1"):
    dataplane.ExchangeOptions(buckets=0)


def test_pack_checks_routes_groups_and_rows_read_once(seed):
  hp = plan_lib.host_plan(_exchange_layouts(seed)[1][1], SPEC,
                          options=plan_lib.PlanOptions(tolerance=0.0, min_shard=None))
  meta = hp.meta
  # The routes on each device are its own rows of the [S, S] tables.
  for p in range(S):
    r = np.asarray(SPEC.unpack_local(jnp.asarray(hp.packed[p:p + 1]))["q_routes"])
    np.testing.assert_array_equal(r, meta.q_routes[p])
    assert r[1].tolist() == meta.q_send_len[p].tolist()
    assert r[3].tolist() == meta.q_send_len[:, p].tolist()
    assert r[1, p] == 0 and r[3, p] == 0  # own rows never cross the wire
  # A used entry moved past the routed rows, or offsets that do not tile the groups: refused.
  for name, lens in (("q_send_idx", meta.q_send_len.sum(1)),
                     ("kv_send_idx", meta.kv_send_len.sum(1))):
    p = int(np.argmax(lens))
    n = int(lens[p])
    idx = getattr(meta, name).copy()
    idx[p, -1], idx[p, n - 1] = idx[p, n - 1], T
    with pytest.raises(ValueError, match=rf"{name}\[{p}\].*packed from row 0"):
      SPEC.pack(dataclasses.replace(meta, **{name: idx}))
  bad = meta.kv_routes.copy()
  p = int(np.argmax((bad[:, 1] > 0).sum(1)))
  bad[p, 0] = bad[p, 0][::-1]
  with pytest.raises(ValueError, match=rf"kv_send_idx\[{p}\].*offsets"):
    SPEC.pack(dataclasses.replace(meta, kv_routes=bad))
  # Query / output rows read twice would make the inverse-map backward drop a contribution.
  bounds = {"q_send_idx": T, "q_attn_idx": T + CAP.q_recv, "o_send_idx": CAP.q_tokens,
            "o_local_idx": CAP.q_tokens + CAP.q_send}
  for name, bound in bounds.items():
    idx = getattr(meta, name).copy()
    flat = idx.reshape(S, -1)
    p = int(np.argmax((flat < bound).sum(axis=1)))
    used = np.flatnonzero(flat[p] < bound)
    flat[p, used[1]] = flat[p, used[0]]
    idx = flat.reshape(idx.shape)
    with pytest.raises(ValueError, match=rf"{name}\[{p}\] reads source row"):
      SPEC.pack(dataclasses.replace(meta, **{name: idx}))


@pytest.mark.slow
def test_signal_only_keeps_shapes_moves_one_row_and_is_wrong_by_design(seed):
  mesh = _mesh()
  rng = np.random.default_rng(seed)
  _, doc_lens, _ = _exchange_layouts(seed)[1]
  hp = plan_lib.host_plan(doc_lens, SPEC,
                          options=plan_lib.PlanOptions(tolerance=0.0, min_shard=None))
  q, k, v, ct = _inputs(rng)
  want = _reference(q, k, v, _segments(doc_lens, S, T), ct)
  for collective in ("ring", "dense"):
    sig = _make_run(mesh, SPEC, signal_only=True, return_lse=False, collective=collective)
    got = sig(q, k, v, hp.packed, ct)
    for g, w in zip(got, want):
      assert g.shape == w.shape and g.dtype == w.dtype and np.isfinite(np.asarray(g)).all()
    # Rows computed on another server came back wrong (their queries never arrived).
    assert np.abs(np.asarray(got[0]) - np.asarray(want[0])).max() > 1e-2, (collective, seed)


def test_exchange_options_reach_dispatch_and_bad_values_name_the_fix(monkeypatch):
  c = _tiny_config("distca", 8, 1, 0)
  assert c.attention.distca.collective == "auto"
  # Benchmark switches are backend options, not config keys.
  for name in ("signal_only", "split_exchange", "cost_table", "kernel"):
    assert name not in c.attention.distca, name
  c.attention.distca.collective = "nccl"
  with pytest.raises(ValueError, match=r"collective='nccl'.*ragged.*ring.*dense.*"
                                       r"config.attention.distca"):
    trainer.make_backend(c)
  with pytest.raises(ValueError, match=r"signal_only='yes'.*True or False"):
    backends.get("distca", signal_only="yes")
  c.attention.distca.collective = "dense"
  backend = trainer.make_backend(c, signal_only=True)
  seen = {}

  def spy(*args, **kwargs):
    seen["options"] = args[5]
    return args[0]

  monkeypatch.setattr(distca_backend, "dispatch_attention", spy)
  q = jnp.zeros((8, 16, H, D))
  layout = attn_lib.Layout(jnp.ones((8, 16), jnp.int32), jnp.zeros((8, 16), jnp.int32),
                           extra={distca_backend.PLAN_KEY: jnp.zeros((8, 1), jnp.int32)})
  with trainer.mesh_context(shard_lib.make_mesh(data=8, tensor=1, devices=jax.devices())):
    backend.fn(q, q, q, layout, softmax_scale=1.0)
  assert seen["options"].exchange == dataplane.ExchangeOptions(collective="dense",
                                                               signal_only=True)
  # 'auto' (the default): device-initiated copies on the GPUs of one process, the dense exchange
  # on those of several (measured fastest), the ring elsewhere.
  assert dataplane.ExchangeOptions().collective == "auto"
  assert distca_backend.Options.from_config(_tiny_config("distca", 8, 1, 0)).collective == "auto"
  assert dataplane.resolve_collective("auto", "gpu", one_process=True) == "remote"
  assert dataplane.resolve_collective("auto", "gpu", one_process=False) == "two_level"
  assert dataplane.resolve_collective("auto", "cpu") == "ring"
  assert dataplane.resolve_collective("auto") == "ring"  # the tests' platform
  assert dataplane.resolve_collective("dense", "gpu") == "dense"
  with pytest.raises(ValueError, match=r"collective='remote'.*'cpu' platform.*collective='auto'"):
    dataplane.resolve_collective("remote", "cpu")
  with pytest.raises(ValueError, match=r"collective='remote'.*processes.*collective='auto'"):
    dataplane.resolve_collective("remote", "gpu", one_process=False)


@pytest.mark.slow
def test_remat_policies_equal_and_save_attention_never_reruns_the_kernel_or_exchange(seed):
  """Remat policies give the same loss and gradients as 'none' (distca, 2 servers, keep and
  resend); in the jaxpr of value_and_grad, 'save_attention' runs the kernel's forward and CAD's
  collectives as often as 'none' does (no recompute), while 'full' reruns both."""
  data = 2
  mesh = shard_lib.make_mesh(data=data, tensor=1, devices=jax.devices()[:data])
  step = int(np.random.default_rng(seed).integers(1000))
  cases = {  # (memory mode, kernel): remat policies
      ("keep", "reference"): ("none", "save_attention"),
      ("resend", "reference"): ("save_attention",),
      ("keep", "blockwise"): ("none", "full", "save_qkv_out", "save_attention"),
      ("resend", "blockwise"): ("none", "full", "save_attention"),
  }
  got, counts = {}, {}
  for (mode, kernel), remats in cases.items():
    c = _tiny_config("distca", data, 1, seed)
    c.attention.kernel, c.attention.distca.memory_mode = kernel, mode
    c.attention.distca.caps_from_batches = 0
    c.model.n_layers = 1
    cad = trainer.make_backend(c)
    src = make_source(c.data, rows=data * c.rows_per_rank, tokens_per_row=c.tokens_per_rank,
                      vocab_size=c.model.vocab_size, seed=seed)
    params = trainer.create_train_state(c, trainer.make_model(c, cad), trainer.make_optimizer(c),
                                        mesh).params
    batch = trainer.add_host_plan(src.batch(step), cad, src.doclens(step), c.tokens_per_rank)
    with trainer.mesh_context(mesh):
      dev = trainer.device_batch(batch, mesh)
      for remat in remats:
        c.model.remat = remat
        f = _grad_fn(c, mesh, cad)
        if kernel == "blockwise":  # and the structure: the kernel's passes are countable
          jaxpr = jax.make_jaxpr(f)(params, dev).jaxpr
          counts[mode, remat] = dataplane.count_primitives(jaxpr, {"ppermute"})
          counts[mode, remat]["forwards"] = _blockwise_forwards(jaxpr)
        got[mode, remat] = jax.tree.map(np.asarray, f(params, dev))
  ref_loss, ref_grads = got["keep", "none"]
  assert np.isfinite(float(ref_loss)) and float(ref_loss) > 1.0
  for key, (loss, grads) in got.items():
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5, err_msg=str(key))
    for a, b in zip(jax.tree.leaves(ref_grads), jax.tree.leaves(grads)):
      np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6, err_msg=f"{key} seed={seed}")
  fwd = {k: v["forwards"] for k, v in counts.items()}
  perm = {k: v["ppermute"] for k, v in counts.items()}
  assert fwd["keep", "none"] == fwd["keep", "save_attention"] == 1, fwd
  assert fwd["resend", "none"] == fwd["resend", "save_attention"] == 1, fwd
  assert fwd["keep", "full"] == fwd["keep", "save_qkv_out"] == fwd["resend", "full"] == 2, fwd
  # keep: the forward's three exchanges (Q, K/V, O) and their three transposes, nothing
  # recomputed; full reruns the forward's three; resend re-sends Q and K/V.
  assert perm["keep", "save_attention"] == perm["keep", "none"] == 6, perm
  assert perm["keep", "full"] == 9, perm
  assert perm["resend", "save_attention"] == perm["resend", "none"] == 8, perm


def test_row_copies_as_words_are_bit_exact_and_differentiate_like_take(seed):
  """``_take`` / ``_take_two`` copy rows as 32-bit words: every dtype, row shape and fill (the
  LSE's -inf) comes out bit for bit as ``jnp.take`` gives it, and the gradients match."""
  rng = np.random.default_rng(seed)
  for dtype in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.int8):
    for shape in ((50, 4, 16), (50, 3), (50, 3, 5), (50,)):
      x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
      idx = jnp.asarray(rng.integers(0, 60, size=40), jnp.int32)  # >= 50: the fill
      fills = (0, -np.inf) if jnp.issubdtype(dtype, jnp.floating) else (0, 7)
      for fill in fills:
        got = dataplane.take_rows(x, idx, fill)
        want = jnp.take(x, idx, axis=0, mode="fill", fill_value=fill)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8),
                                      err_msg=f"{dtype} {shape} fill={fill} seed={seed}")
  # The two-source gather of the key/value buffers, and its VJP, against concat + take; and
  # the query placement (every source row read once).
  t, c = 40, 24
  own = jnp.asarray(rng.standard_normal((t, 2, 4)), jnp.float32)
  recv = jnp.asarray(rng.standard_normal((c, 2, 4)), jnp.float32)
  idx = jnp.asarray(rng.integers(0, t + c + 5, size=70), jnp.int32)
  plain = lambda own, recv: jnp.take(jnp.concatenate([own, recv]), idx, axis=0, mode="fill",
                                     fill_value=0)
  words = lambda own, recv: dataplane.gather_two(own, recv, idx)
  np.testing.assert_array_equal(np.asarray(words(own, recv)), np.asarray(plain(own, recv)))
  ct = jnp.asarray(rng.standard_normal((70, 2, 4)), jnp.float32)
  for g, w in zip(jax.vjp(words, own, recv)[1](ct), jax.vjp(plain, own, recv)[1](ct)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6,
                               err_msg=f"seed={seed}")
  uidx = jnp.asarray(np.r_[rng.permutation(t + c)[:50], [t + c + 3] * 6], jnp.int32)
  placed = dataplane.place_unique(own, recv, uidx, fill=-1.0)
  want = jnp.take(jnp.concatenate([own, recv]), uidx, axis=0, mode="fill", fill_value=-1.0)
  np.testing.assert_array_equal(np.asarray(placed), np.asarray(want))



# ---------------------------------------------------------------------------------------------
# Batches whose plans move no row: the step without the exchange.
# ---------------------------------------------------------------------------------------------
def test_a_batch_whose_plans_move_nothing_runs_the_local_step(seed):
  """distca's host_prepare says whether a batch's plans move a row (attention.CROSSES_KEY); the
  train step holds two branches (CAD, and packed_dp's attention) and a gated batch takes the
  second: its loss and updated parameters equal the CAD branch's on the same batch (the flag
  forced on), and a balanced batch crosses. Ping-pong: a batch is local only when no
  nano-batch's plan moves."""
  from distca_jax import attention as attn
  key = "extra/" + attn.CROSSES_KEY
  c = _tiny_config("distca", 4, 1, seed, rows_per_rank=2, nano_batches=2)
  c.optim.warmup_steps = 0  # the first step updates the parameters
  run = trainer.setup_run(c, devices=jax.devices()[:4])
  src = make_source(c.data, rows=8, tokens_per_row=c.tokens_per_rank,
                    vocab_size=c.model.vocab_size, seed=seed)
  step = int(np.random.default_rng(seed).integers(1000))
  gated = dataclasses.replace(run, backend=backends.get(
      "distca", **{**dataclasses.asdict(distca_backend.Options.from_config(c)), "min_gain": 1e9,
                   **run.backend.caps}))
  moved = trainer.add_host_plan(src.batch(step), run.backend, src.doclens(step),
                                c.tokens_per_rank)
  still = trainer.add_host_plan(src.batch(step), gated.backend, src.doclens(step),
                                c.tokens_per_rank)
  assert moved[key].tolist() == [1] * 8, [
      hp.plan.summary() for hp in run.backend.host_plans(src.doclens(step), c.tokens_per_rank)]
  assert still[key].tolist() == [0] * 8
  assert trainer.runs_local(still) and not trainer.runs_local(moved)
  assert trainer.runs_local([(0, 4, {k: v[:4] for k, v in still.items()}),
                             (4, 8, {k: v[4:] for k, v in still.items()})])
  assert not trainer.runs_local(src.batch(step))  # no flag: the backend has no local branch
  lines = []
  state = trainer.create_train_state(c, run.model, run.tx, run.mesh)
  step_fn, _, need, _ = trainer.preflight(c, gated, state, still, log=lines.append)
  assert need > 0
  assert "conditional" in step_fn.as_text()
  forced = {**still, key: np.ones_like(still[key])}  # the CAD branch on the same plans
  with trainer.mesh_context(run.mesh):
    copy = lambda s: jax.tree.map(lambda x: x.copy(), s)  # the step donates its state
    s_local, m_local = step_fn(copy(state), trainer.device_batch(still, run.mesh))
    s_cad, m_cad = step_fn(copy(state), trainer.device_batch(forced, run.mesh))
  np.testing.assert_allclose(float(m_local["loss"]), float(m_cad["loss"]), rtol=1e-5,
                             err_msg=f"seed={seed}")
  for a, b in zip(jax.tree.leaves(s_local.params), jax.tree.leaves(s_cad.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6,
                               err_msg=f"seed={seed}")
  # The flag picks the branch: with a local attention that outputs zeros, only the all-zero
  # flag changes the update (the q, k, v projections get no gradient, so Adam leaves them).
  zeros = dataclasses.replace(gated, backend=dataclasses.replace(
      gated.backend, local_fn=lambda q, k, v, layout, softmax_scale: jnp.zeros_like(q)))
  step_z, _, _, _ = trainer.preflight(c, zeros, state, still, log=lines.append)
  with trainer.mesh_context(run.mesh):
    s_zero, _ = step_z(copy(state), trainer.device_batch(still, run.mesh))
    s_flag, _ = step_z(copy(state), trainer.device_batch(forced, run.mesh))
  diff = lambda x, y: max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                          for a, b in zip(jax.tree.leaves(x.params), jax.tree.leaves(y.params)))
  lr = float(trainer.learning_rate(c, 0))
  assert lr > 0 and diff(s_zero, s_cad) > lr / 2 and diff(s_flag, s_cad) < 1e-6, (
      lr, diff(s_zero, s_cad), diff(s_flag, s_cad))


def test_local_gain_sends_a_batch_that_cannot_win_enough_to_the_local_branch(seed):
  """attention.distca.local_gain: a batch whose every plan could gain less than it moves nothing
  (the local branch); a batch with one plan above it is planned with min_gain only, so its other
  plans still balance. The backend's gain of a layout is the planner's."""
  from distca_jax import attention as attn
  rng = np.random.default_rng(seed)
  opts = dict(q_heads=H, kv_heads=KH, head_dim=D, rows_per_rank=2, nano_batches=2,
              linear_pairs_per_token=4.0)
  t = 128
  base = backends.get("distca", **opts)
  ws = WorkloadSampler("pretrain", t, seed=int(rng.integers(1 << 20)))
  rows = [r for _ in range(4) for r in ws.step_doclens(int(rng.integers(100)), 2)]  # 8 rows
  plans = base.host_plans(rows, t)
  gains = [hp.plan.predicted_gain for hp in plans]
  for i, hp in enumerate(plans):
    call = [rows[x] for x in plan_lib.nano_batch_rows(4, 2, 2, i)]
    assert plan_lib.layout_step_gain(call, t, 4.0) == pytest.approx(hp.plan.predicted_gain)
  lo, hi = sorted(gains)
  assert hi > lo > 0, gains
  # Above both: every plan moves nothing, the batch runs the local branch.
  above = backends.get("distca", **opts, local_gain=hi * 1.01)
  assert [hp.plan.gated for hp in above.host_plans(rows, t)] == [True, True]
  assert above.host_prepare(rows, t)[attn.CROSSES_KEY].tolist() == [0] * 8
  # Between them: min_gain (0) alone gates, so both plans balance as without local_gain.
  between = backends.get("distca", **opts, local_gain=(lo + hi) / 2)
  assert [hp.plan.num_moves for hp in between.host_plans(rows, t)] == [
      hp.plan.num_moves for hp in plans]
  # Under a pipeline (no local branch) local_gain changes nothing.
  piped = backends.get("distca", **opts, local_gain=hi * 1.01, data_axis=("pipe", "data"))
  assert [hp.plan.num_moves for hp in piped.host_plans(rows, t)] == [
      hp.plan.num_moves for hp in plans]
  with pytest.raises(ValueError, match=r"local_gain=-1.0 must be a finite number >= 0"):
    backends.get("distca", local_gain=-1.0)


def test_local_steps_off_or_under_a_pipeline_leave_one_step():
  """attention.distca.local_steps=False, or a pipeline (rows over (pipe, data)), builds no
  local step and no host flag; a bad value names the fix."""
  from distca_jax import attention as attn
  for kw in ({"local_steps": False}, {"data_axis": ("pipe", "data")}):
    b = backends.get("distca", q_heads=H, kv_heads=KH, head_dim=D, **kw)
    assert b.local_fn is None
    extra = b.host_prepare([[100, 28], [60, 60, 8]], 128)
    assert attn.CROSSES_KEY not in extra and "doc_lens" not in extra, sorted(extra)
  b = backends.get("distca", q_heads=H, kv_heads=KH, head_dim=D)
  assert b.local_fn is not None
  assert b.host_prepare([[64, 64], [64, 64]], 128)[attn.CROSSES_KEY].tolist() == [0, 0]
  with pytest.raises(ValueError, match=r"local_steps='yes' must be True or False"):
    backends.get("distca", local_steps="yes")


@pytest.mark.parametrize("collective", ["ring", "dense"])
def test_a_layer_scan_holds_no_exchange_buffer_across_its_loop(collective):
  """Differentiated under a layer scan, the exchange computes nothing of a buffer's size before
  the loop: a constant receive buffer would be, and held while the loop runs."""
  spec = plan_lib.PlanSpec(num_servers=S, tokens_per_row=T, rows_per_device=1, capacity=CAP)
  mesh = _mesh(data=S)
  qs = jax.ShapeDtypeStruct((S, T, H, D), jnp.float32)
  plan = jax.ShapeDtypeStruct((S, spec.width), jnp.int32)
  opts = _options(collective=collective)

  def layers(ws, q, plan):
    body = lambda x, w: (dataplane.dispatch_attention(x * w, x, x, plan, spec, opts,
                                                      mesh=mesh), None)
    return jnp.sum(lax.scan(body, q, ws)[0])

  jaxpr = jax.make_jaxpr(jax.grad(layers, argnums=1))(
      jax.ShapeDtypeStruct((2,), jnp.float32), qs, plan).jaxpr
  first_scan = next(i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "scan")
  # Send and receive buffers of every device, as the shard_map's global outputs (the CPU
  # kernel's own masks have the attention buffers' rows, q_tokens / kv_tokens: not these).
  rows = {S * c for c in (CAP.q_send, CAP.q_recv, CAP.kv_send, CAP.kv_recv)}
  assert not rows & {S * CAP.q_tokens, S * CAP.kv_tokens}
  before = [(e.primitive.name, v.aval.shape) for e in jaxpr.eqns[:first_scan] for v in e.outvars
            if len(getattr(v.aval, "shape", ())) == 3 and v.aval.shape[0] in rows
            and v.aval.shape[-1] == D]
  assert not before, before


def test_one_server_runs_no_exchange_and_equals_per_document_attention(seed, monkeypatch):
  """One device on the servers' axis (a one-GPU job, where 'auto' resolves to 'remote'): the data
  plane lowers for CUDA with no exchange kernel and no collective (nothing crosses a wire; one GPU
  has no peers), and, run on CPU as on a GPU ('auto' -> 'remote'), outputs and gradients equal
  each document's attention alone."""
  from distca_jax.dataplane import exchange  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(exchange.jax, "default_backend", lambda: "gpu")
  assert exchange.resolve_collective("auto") == "remote"
  rng = np.random.default_rng(seed)
  t = 4 * T
  lens, left = [], t - int(rng.integers(0, 40))  # documents, then a padded tail
  while left:
    lens.append(int(min(left, rng.integers(1, t // 2))))
    left -= lens[-1]
  spec = plan_lib.PlanSpec(num_servers=1, tokens_per_row=t, rows_per_device=1,
                           capacity=plan_lib.default_capacity(t))
  hp = plan_lib.host_plan([lens], spec, options=plan_lib.PlanOptions(
      q_heads=H, kv_heads=KH, head_dim=D, dtype_bytes=4, min_shard=None))
  run = _make_run(_mesh(data=1), spec)
  q, k, v, ct = _inputs(rng, rows=1, t=t)
  text = run.trace(q, k, v, hp.packed, ct).lower(lowering_platforms=("cuda",)).as_text()
  assert "remote_exchange" not in text and "all_to_all" not in text, "one server moves nothing"
  _check(run(q, k, v, hp.packed, ct), _reference(q, k, v, _segments([lens], 1, t), ct),
         f"one server seed={seed} lens={lens}")
