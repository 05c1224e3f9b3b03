"""CAD data plane: the ragged exchange's implementations on real plans, and 'keep' vs 'resend'.

For each workload, a few batches are planned on the host (``plan_lib.host_plan``, per-rank
document lists as the trainer makes them, caps = ``plan_lib.suggest_capacity`` of those batches,
or with ``--caps default`` the caps of a run that leaves them at 0, ``plan_lib.default_capacity``;
one compiled program serves them all) and every device-side piece is timed on every visible
device (one server per device, the mesh's ``data`` axis):

  exchange   sender gather + ``dataplane.ragged_exchange`` of Q and of K/V + server gather
             (``dataplane.send_to_servers``), once per collective of ``--collectives``:
             'ragged' (``lax.ragged_all_to_all``, GPU only), 'ring' (S - 1 ``lax.ppermute``
             rounds of the whole send buffer), 'dense' (one ``lax.all_to_all`` of every group
             padded to ``min(send cap, recv cap)`` rows); 'auto' names the step's default;
  signal     the same exchange with ``signal_only=True`` (one row per group on the wire): the
             stage's cost without the wire;
  return     O gather + the same collective backwards + owner placement
             (``dataplane.return_to_owners``);
  raw a2a    a bare ``lax.all_to_all`` moving (a) the mean useful bytes per device, evenly
             spread over the peers, and (b) the busiest sender's useful bytes from every device;
  CAD attention a chain of ``--layers`` ``dataplane.dispatch_attention`` calls with the 'auto'
             collective (each layer's O is the next one's Q, so every layer's residuals are
             alive before the backward, as in a model), memory mode 'keep' and 'resend': forward
             and forward+backward time per layer, XLA's compiled temp memory, and the jaxpr's
             collective and kernel-forward counts (resend adds one exchange per layer and no
             kernel forward);
  no CAD     each device's own documents through the same kernel, no exchange (forward+backward).
``--exchange-only`` times the first four alone.

Bytes per device (``plan_lib.exchange_bytes``): useful = mean over devices of the Q+K+V (or O)
rows the plan sends to other devices, which is what the ragged exchange puts on the wire;
buffer = the send and receive buffers the caps allocate, whatever the batch; wire = what each
collective moves off a device (``wire_bytes``: 'ragged' the useful bytes, 'ring' S - 1 whole send
buffers, 'dense' S - 1 padded groups). Effective bandwidth = useful bytes / time of the whole
stage. Two fractions per stage and collective: (a) ``fraction_of_raw`` = mean useful bandwidth /
raw all-to-all bandwidth for the same bytes (the target is >= 80%); (b)
``busiest_fraction_of_raw`` = the busiest sender's useful bytes / stage time, over the raw
all-to-all bandwidth per device when every device sends that many bytes. No exchange can finish
before its busiest sender has sent, and with 2 servers the traffic is often one-directional,
which caps (a) near 50%; (b) is the fair measure then. Times are medians over ``--iters`` runs
after a warm-up.

Run:
  python -m experiments.dispatch_bench          # every visible GPU on `data` (e.g. 2 H200s):
                                                # Llama-3-8B heads, bf16, 64K tokens per GPU
  python -m experiments.dispatch_bench --tiny   # CPU smoke test: 8 fake devices, tiny shapes
Writes results/dispatch_bench.{json,md} (--tiny: results/dispatch_bench_tiny.{json,md}; --out
changes the stem) and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The implementations of the ragged exchange (dataplane.COLLECTIVES less 'auto').
IMPLEMENTATIONS = ("remote", "ragged", "ring", "dense")


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true",
                 help="CPU smoke test on 8 fake devices with tiny shapes")
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens-per-rank", type=int, default=None, help="default 65536 (tiny: 256)")
  p.add_argument("--heads", type=int, default=None, help="query heads (default 32; tiny: 4)")
  p.add_argument("--kv-heads", type=int, default=None, help="default 8 (tiny: 2)")
  p.add_argument("--head-dim", type=int, default=None, help="default 128 (tiny: 16)")
  p.add_argument("--dtype", default=None, help="default bfloat16 (tiny: float32)")
  p.add_argument("--kernel", default="auto",
                 choices=("auto", "reference", "blockwise", "mosaic", "flash3"),
                 help="auto: flash3 if installed on a GPU and the shapes fit it, else mosaic on "
                 "GPU, reference on CPU")
  p.add_argument("--tolerance", type=float, default=0.1)
  p.add_argument("--caps", default="suggest", choices=("suggest", "default"),
                 help="suggest: the envelope of the planned batches (the tightest caps); default: "
                 "plan_lib.default_capacity, what a run with caps left at 0 and "
                 "caps_from_batches = 0 uses (training derives tight caps like 'suggest' from its "
                 "first batches by default)")
  p.add_argument("--collectives", default=None,
                 help="comma-separated exchange implementations to compare, of 'auto', "
                 f"{', '.join(repr(c) for c in IMPLEMENTATIONS)} (default: all of them on GPU; "
                 "ring,dense elsewhere: 'remote' and 'ragged' need a GPU)")
  p.add_argument("--exchange-only", action="store_true",
                 help="time only the exchanges, their signal-only twins and the returns (no CAD "
                 "chains, no no-CAD baseline, no memory report)")
  p.add_argument("--batches", type=int, default=None, help="planned batches (default 3; tiny: 2)")
  p.add_argument("--iters", type=int, default=None, help="timed runs (default 10; tiny: 2)")
  p.add_argument("--layers", type=int, default=None,
                 help="CAD attentions chained for the keep/resend runs (default 4; tiny: 2)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--profile", action="store_true",
                 help="also trace one CAD fwd+bwd call ('keep', first batch) per workload and "
                 "record its device time per op (the top ops by summed time, per device)")
  p.add_argument("--out", default=None, help="output stem (default results/dispatch_bench)")
  a = p.parse_args()
  tiny = a.tiny
  for name, big, small in (("tokens_per_rank", 65536, 256), ("heads", 32, 4), ("kv_heads", 8, 2),
                           ("head_dim", 128, 16), ("dtype", "bfloat16", "float32"),
                           ("batches", 3, 2), ("iters", 10, 2), ("layers", 4, 2)):
    if getattr(a, name) is None:
      setattr(a, name, small if tiny else big)
  if a.out is None:
    a.out = os.path.join(REPO, "results", "dispatch_bench_tiny" if tiny else "dispatch_bench")
  if a.collectives is not None:
    names = [c.strip() for c in a.collectives.split(",") if c.strip()]
    bad = [c for c in names if c not in ("auto",) + IMPLEMENTATIONS]
    if not names or bad:
      p.error(f"--collectives={a.collectives!r}: choose from 'auto', "
              f"{', '.join(repr(c) for c in IMPLEMENTATIONS)}")
    a.collectives = names
  return a


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.tiny:  # before jax is imported
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from custom_ops import flash3_attention as fa3
from distca_jax import aot, dataplane, ops, profiling
from distca_jax import plan as plan_lib
from distca_jax.baselines import packing
from distca_jax.data.workloads import WorkloadSampler
import experiments

AXIS = "data"
# The kernels' forward calls as dataplane.count_primitives counts them (the plain-jnp kernels,
# 'reference' and 'blockwise', make no kernel call: 0).
KERNEL_FORWARDS = ("mosaic_attention_fwd", "flash_mha_varlen_fwd")
# The collectives' primitives (a ring's loop body counts once).
COLLECTIVE_PRIMITIVES = ("ragged_all_to_all", "ppermute", "all_to_all")


def resolve_collectives(names: list[str] | None, platform: str) -> list[str]:
  """The implementations to time: ``names`` with 'auto' resolved for ``platform``, or the default
  (every implementation ``platform`` runs). Raises on a name given twice (after resolving) and
  on 'ragged' off GPU."""
  gpu = platform in ("gpu", "cuda", "rocm")
  if names is None:
    return list(IMPLEMENTATIONS) if gpu else ["ring", "dense"]
  out = [dataplane.resolve_collective(c, platform) for c in names]
  if len(set(out)) != len(out):
    raise ValueError(f"--collectives={','.join(names)} names one implementation twice on "
                     f"{platform} (resolved: {out})")
  if "ragged" in out and not gpu:  # 'remote' off GPUs: resolve_collective raised above
    raise ValueError(f"--collectives: 'ragged' (lax.ragged_all_to_all) needs a GPU; this backend "
                     f"is {platform}: use ring,dense")
  return out


def wire_bytes(collective: str, cap: plan_lib.Capacity, s: int, by: dict, bq: int,
               bkv: int) -> dict[str, float]:
  """Bytes one device puts on the wire in one forward exchange (dispatch: Q + K/V) and its
  output return, per implementation (``dataplane.exchange``): 'remote' and 'ragged' the routed
  rows (mean over devices: ``by``, from ``plan_lib.exchange_bytes``), 'ring' S - 1 whole send
  buffers, 'dense' S - 1 groups of ``min(send cap, recv cap)`` rows. ``bq`` / ``bkv``: bytes of
  a Q row and of a K plus V row."""
  if collective in ("remote", "ragged"):
    return {"dispatch": by["dispatch_useful"], "return": by["return_useful"]}
  if collective == "ring":
    return {"dispatch": (s - 1) * (cap.q_send * bq + cap.kv_send * bkv),
            "return": (s - 1) * cap.q_recv * bq}
  if collective == "dense":
    b_q, b_kv = min(cap.q_send, cap.q_recv), min(cap.kv_send, cap.kv_recv)
    return {"dispatch": (s - 1) * (b_q * bq + b_kv * bkv), "return": (s - 1) * b_q * bq}
  raise ValueError(f"collective={collective!r}; choose one of {IMPLEMENTATIONS}")


def _pick_kernel(a, dtype) -> str:
  if a.kernel != "auto":
    return a.kernel
  if jax.default_backend() != "gpu":
    return "reference"
  ok = (importlib.util.find_spec("flash_attn3_jax") is not None
        and a.head_dim in fa3.FLASH3_HEAD_DIMS and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))
  return "flash3" if ok else "mosaic"


_time = profiling.time_call  # median / min seconds after one compiling call


def _zeros(shape, dtype, sharding):
  """Zeros created directly in their sharding (no full copy on one device)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def _profile_ops(fn, args, logdir: str, top: int = 15) -> dict:
  """One traced call of ``fn`` (already compiled and run: the caller timed it): per device, the
  summed time of its ops and the top ops by time (ops on different streams overlap, so the sum
  can exceed the call's wall time)."""
  _, path = profiling.capture(fn, *args, logdir=logdir)
  per_dev: dict[int, dict[str, float]] = {}
  for ev in profiling.load_events(path):
    name = ev.hlo_op or ev.name
    ops_ms = per_dev.setdefault(ev.device, {})
    ops_ms[name] = ops_ms.get(name, 0.0) + ev.dur_us / 1e3
  return {str(dev): {"summed_op_ms": sum(d.values()),
                     "top_ms": sorted(d.items(), key=lambda kv: -kv[1])[:top]}
          for dev, d in sorted(per_dev.items())}


def run_workload(name: str, a, mesh: Mesh, kernel: str, dtype, collectives: list[str]) -> dict:
  s = mesh.shape[AXIS]
  t, h, kh, d = a.tokens_per_rank, a.heads, a.kv_heads, a.head_dim
  dbytes = jnp.dtype(dtype).itemsize
  bq, bkv = h * d * dbytes, 2 * kh * d * dbytes
  byte_model = dict(q_heads=h, kv_heads=kh, head_dim=d, dtype_bytes=dbytes)
  sampler = WorkloadSampler(name, t, seed=a.seed)
  layouts = [sampler.step_doclens(step, s) for step in range(a.batches)]
  options = plan_lib.PlanOptions(tolerance=a.tolerance, min_shard=plan_lib.auto_min_shard(t),
                                 **byte_model)
  if a.caps == "default":
    cap = plan_lib.default_capacity(t)
  else:
    cap = plan_lib.suggest_capacity(layouts, s, t, multiple=plan_lib.row_multiple(t),
                                    options=options)
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
  print(f"[{name}] {s} servers x {t} tokens, heads {h}/{kh}x{d} {jnp.dtype(dtype).name}, "
        f"kernel {kernel}, collectives {collectives}, caps {cap}", flush=True)
  row_sh = NamedSharding(mesh, P(AXIS))
  plan_sh = NamedSharding(mesh, P(AXIS, None))

  # Random Q/K/V, cotangent and attention outputs, born sharded.
  def make_inputs(key):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (s, t, h, d), dtype)
    k = jax.random.normal(ks[1], (s, t, kh, d), dtype)
    v = jax.random.normal(ks[2], (s, t, kh, d), dtype)
    ct = jax.random.normal(ks[3], (s, t, h, d), dtype)
    o_attn = jax.random.normal(ks[4], (s, cap.q_tokens, h, d), dtype)
    return q, k, v, ct, o_attn

  make_inputs = jax.jit(make_inputs, out_shardings=(row_sh,) * 5)
  q, k, v, ct, o_attn = make_inputs(jax.random.key(a.seed))

  # Device programs (one compile each; every plan has the same shapes).
  def local(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False))

  # Per-rank layouts: no document (so no task) is longer than a rank's tokens; flash3's grid is
  # tasks x ceil(max_seqlen / 128) blocks, so pass the bound as the trainer's backend does.
  kopts = {"max_seqlen_q": t, "max_seqlen_k": t}  # flash3's bound; other kernels ignore it

  def stages(collective):
    """(exchange, signal-only exchange, return) programs with ``collective``."""
    wire = dataplane.ExchangeOptions(collective=collective)
    signal_wire = dataclasses.replace(wire, signal_only=True)

    def exchange(q, k, v, plan, opts=wire):
      qa, ka, va = dataplane.send_to_servers(q[0], k[0], v[0], spec.unpack_local(plan), spec,
                                             AXIS, opts)
      return qa[None], ka[None], va[None]

    def signal(q, k, v, plan):
      return exchange(q, k, v, plan, signal_wire)

    def ret(o_attn, plan):
      return dataplane.return_to_owners(o_attn[0], spec.unpack_local(plan), spec, AXIS, 0,
                                        wire)[None]

    return local(exchange), local(signal), local(ret)

  programs = {c: stages(c) for c in collectives}
  raw_f = local(lambda x: lax.all_to_all(x, AXIS, 1, 1, tiled=True))

  def raw_bytes(nbytes: float) -> dict:
    """A bare all_to_all moving ``nbytes`` off-device per device (at least one element a peer)."""
    per_peer = max(1, int(np.ceil(nbytes / (s - 1) / dbytes)))
    raw = _time(raw_f, _zeros((s, s, per_peer), dtype, row_sh), iters=a.iters)
    raw["bytes"] = per_peer * (s - 1) * dbytes
    raw["GBps"] = raw["bytes"] / raw["median_s"] / 1e9
    return raw

  def cad(mode):
    # A chain of `layers` CAD attentions (each layer's O is the next layer's Q), like a model's
    # stack: the residuals of every layer are alive together before the backward, which is where
    # 'keep' and 'resend' differ.
    options = dataplane.DispatchOptions(kernel=kernel, memory_mode=mode, kernel_options=kopts)

    def fwd(q, k, v, plan):
      x = q
      for _ in range(a.layers):
        x = dataplane.dispatch_attention(x, k, v, plan, spec, options, mesh=mesh)
      return x

    def fwd_bwd(q, k, v, plan, ct):
      _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, plan), q, k, v)
      return vjp(ct)

    return jax.jit(fwd), jax.jit(fwd_bwd)

  def no_cad_body(q, k, v, cu):
    def f(q, k, v):
      return ops.core_attention(q[0], k[0], v[0], cu[0], cu[0], kernel=kernel, **kopts)[None]

    o, vjp = jax.vjp(f, q, k, v)
    return vjp(o)  # the cotangent's values do not change the kernel's work

  no_cad_f = jax.jit(jax.shard_map(no_cad_body, mesh=mesh, in_specs=P(AXIS),
                                   out_specs=P(AXIS), check_vma=False))

  rows = []
  # No-CAD baseline: one task per own document; one table size for every batch (one compile).
  local_tasks = max(len(rank_lens) for layout in layouts for rank_lens in layout)
  modes = {} if a.exchange_only else {m: cad(m) for m in dataplane.MEMORY_MODES}
  for i, doc_lens in enumerate(layouts):
    hp = plan_lib.host_plan(doc_lens, spec, options)
    plan = jax.device_put(hp.packed, plan_sh)
    plan0 = plan if i == 0 else plan0
    by = plan_lib.exchange_bytes(hp.meta, **byte_model)
    rec = {"batch": i, "docs": int(hp.plan.doc_lens.size), "tasks": int(len(hp.plan.tasks)),
           "imbalance_before": hp.plan.imbalance_before,
           "imbalance_after": hp.plan.imbalance_after, "degraded": hp.plan.degraded,
           "moves": hp.plan.num_moves, **{f"bytes_{k}": v for k, v in by.items()},
           "collectives": {}}
    if s > 1:
      for stage, key in (("exchange", "dispatch"), ("return", "return")):
        # (a) raw all_to_all of the same mean useful bytes per device, evenly spread;
        rec[f"raw_a2a_{stage}_same_bytes"] = raw_bytes(by[f"{key}_useful"])
        # (b) every device sending what the busiest sender must send.
        rec[f"raw_a2a_{stage}_busiest_bytes"] = raw_bytes(by[f"{key}_useful_busiest_device"])
    for c, (exchange_f, signal_f, return_f) in programs.items():
      wb = wire_bytes(c, cap, s, by, bq, bkv)
      r = {"exchange": _time(exchange_f, q, k, v, plan, iters=a.iters),
           "exchange_signal_only": _time(signal_f, q, k, v, plan, iters=a.iters),
           "return": _time(return_f, o_attn, plan, iters=a.iters)}
      for stage, key in (("exchange", "dispatch"), ("return", "return")):
        st = r[stage]
        st["wire_bytes"] = wb[key]
        st["useful_GBps"] = by[f"{key}_useful"] / st["median_s"] / 1e9
        st["busiest_useful_GBps"] = by[f"{key}_useful_busiest_device"] / st["median_s"] / 1e9
        if s > 1:
          st["fraction_of_raw"] = (st["useful_GBps"]
                                   / rec[f"raw_a2a_{stage}_same_bytes"]["GBps"])
          st["busiest_fraction_of_raw"] = (st["busiest_useful_GBps"]
                                           / rec[f"raw_a2a_{stage}_busiest_bytes"]["GBps"])
      rec["collectives"][c] = r
    for mode, (fwd_f, fwd_bwd_f) in modes.items():
      for key, f, args in (("fwd", fwd_f, (q, k, v, plan)),
                           ("fwd_bwd", fwd_bwd_f, (q, k, v, plan, ct))):
        tm = _time(f, *args, iters=a.iters)
        rec[f"cad_{mode}_{key}"] = {"median_s": tm["median_s"] / a.layers,
                                    "min_s": tm["min_s"] / a.layers, "per": "layer"}
    if not a.exchange_only:
      cu = jax.device_put(packing.task_tables(packing.natural_placement(doc_lens, t),
                                              max_tasks=local_tasks)["cu_seqlens_q"], plan_sh)
      rec["no_cad_fwd_bwd"] = _time(no_cad_f, q, k, v, cu, iters=a.iters)
    rows.append(rec)
    nan = {"median_s": float("nan")}
    raw = rec.get("raw_a2a_exchange_same_bytes", nan)["median_s"]
    per = "; ".join(
        f"{c} {r['exchange']['median_s'] * 1e3:.2f} ms (signal "
        f"{r['exchange_signal_only']['median_s'] * 1e3:.2f}, return "
        f"{r['return']['median_s'] * 1e3:.2f}, fractions "
        f"{r['exchange'].get('fraction_of_raw', float('nan')):.2f} / "
        f"{r['exchange'].get('busiest_fraction_of_raw', float('nan')):.2f})"
        for c, r in rec["collectives"].items())
    print(f"  batch {i}: imbalance {rec['imbalance_before']:.2f} -> "
          f"{rec['imbalance_after']:.2f}; useful {by['dispatch_useful'] / 2**20:.3g} of "
          f"{by['dispatch_buffer'] / 2**20:.3g} MB buffers per device; raw a2a of the useful "
          f"bytes {raw * 1e3:.2f} ms; exchange {per}; CAD fwd+bwd keep "
          f"{rec.get('cad_keep_fwd_bwd', nan)['median_s'] * 1e3:.1f} ms, resend "
          f"{rec.get('cad_resend_fwd_bwd', nan)['median_s'] * 1e3:.1f} ms, no CAD "
          f"{rec.get('no_cad_fwd_bwd', nan)['median_s'] * 1e3:.1f} ms", flush=True)

  out = {"workload": name, "capacity": dataclasses.asdict(cap), "collectives": collectives,
         "batches": rows}
  if a.profile:
    if not modes:
      raise ValueError("--profile traces the CAD chain; drop --exchange-only")
    out["profile_cad_keep_fwd_bwd"] = _profile_ops(modes["keep"][1], (q, k, v, plan0, ct),
                                                   a.out + f"_trace_{name}")

  # Memory and structure of keep vs resend (the first batch's plan).
  for mode, (_, fwd_bwd_f) in modes.items():
    traced = fwd_bwd_f.trace(q, k, v, plan0, ct)  # one trace: structure and compiled memory
    out[f"cad_{mode}_memory"] = aot.memory_fields(traced.lower().compile())
    c = dataplane.count_primitives(traced.jaxpr.jaxpr,
                                   {*COLLECTIVE_PRIMITIVES, *KERNEL_FORWARDS})
    out[f"cad_{mode}_structure"] = {
        "collectives": sum(c[p] for p in COLLECTIVE_PRIMITIVES),
        "kernel_forward_calls": sum(c[name] for name in KERNEL_FORWARDS)}
  out["capacity_memory_bytes"] = cap.memory_bytes(s, q_heads=h, kv_heads=kh, head_dim=d,
                                                  dtype_bytes=dbytes)
  return out


def _profile_markdown(prof: dict) -> list[str]:
  lines = []
  for dev, d in prof.items():
    lines += ["", f"Device {dev}: {d['summed_op_ms']:.1f} ms of device ops, summed (streams "
              "overlap), in one CAD fwd+bwd call (keep, first batch, all layers); top ops:", "",
              "| op | ms |", "|---|---|"]
    lines += [f"| `{n[:90]}` | {ms:.2f} |" for n, ms in d["top_ms"]]
  return lines


def _markdown(res: dict) -> str:
  mb = 2**20
  nan = float("nan")

  def fmt(x):
    return f"{x:.3g}"

  lines = [f"# CAD data plane benchmark ({res['date']})", "",
           f"Command: `{res['command']}`", "",
           f"Device: {res['devices']} x {res['device_kind']} ({res['backend']}); mesh data="
           f"{res['servers']}; tokens per device {res['tokens_per_rank']}; heads "
           f"{res['heads']}/{res['kv_heads']} x {res['head_dim']} {res['dtype']}; kernel "
           f"`{res['kernel']}`; tolerance {res['tolerance']}; caps {res['caps']}; collectives "
           f"{', '.join(res['collectives'])} (CAD chains: {res['cad_collective']}). "
           f"Times: median of {res['iters']}.",
           ""]
  for w in res["workloads"]:
    lines += [f"## {w['workload']}", "", f"Capacity: `{w['capacity']}`", "",
              "Bytes per device per forward dispatch (Q + K + V): useful = the plan's rows sent "
              "to other devices, mean over devices (what 'ragged' puts on the wire); buffer = "
              "the send and receive buffers the caps allocate; wire = what the collective moves "
              "off a device. Raw a2a: a bare all_to_all of the useful bytes. Fractions: (a) "
              "useful GB/s over raw all_to_all GB/s of the same bytes; (b) busiest sender's "
              "useful GB/s over raw all_to_all GB/s with every device sending that many bytes. "
              "Signal = the exchange with one row per group on the wire.", "",
              "| batch | imbalance | useful MB/dev | busiest MB | buffer MB/dev | raw a2a ms | "
              "collective | wire MB/dev | exchange ms | signal ms | useful GB/s | (a) | (b) | "
              "return ms | return GB/s | return (a) | return (b) |",
              "|" + "---|" * 17]
    for r in w["batches"]:
      raw = r.get("raw_a2a_exchange_same_bytes", {}).get("median_s", nan)
      for c, cr in r["collectives"].items():
        ex, rt = cr["exchange"], cr["return"]
        lines.append(
            f"| {r['batch']} | {r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f} | "
            f"{fmt(r['bytes_dispatch_useful'] / mb)} | "
            f"{fmt(r['bytes_dispatch_useful_busiest_device'] / mb)} | "
            f"{fmt(r['bytes_dispatch_buffer'] / mb)} | {fmt(raw * 1e3)} | {c} | "
            f"{fmt(ex['wire_bytes'] / mb)} | {fmt(ex['median_s'] * 1e3)} | "
            f"{fmt(cr['exchange_signal_only']['median_s'] * 1e3)} | {fmt(ex['useful_GBps'])} | "
            f"{ex.get('fraction_of_raw', nan):.2f} | "
            f"{ex.get('busiest_fraction_of_raw', nan):.2f} | {fmt(rt['median_s'] * 1e3)} | "
            f"{fmt(rt['useful_GBps'])} | {rt.get('fraction_of_raw', nan):.2f} | "
            f"{rt.get('busiest_fraction_of_raw', nan):.2f} |")
    if res.get("exchange_only"):
      lines.append("")
      continue
    lines += ["", "Per-layer attention time (ms; CAD = plan's exchange + fused kernel + return; "
              "no CAD = each device's own documents, same kernel, the slowest device sets the "
              "time):", "",
              "| batch | CAD fwd keep | CAD fwd+bwd keep | CAD fwd resend | CAD fwd+bwd resend | "
              "no-CAD fwd+bwd |", "|---|---|---|---|---|---|"]
    for r in w["batches"]:
      lines.append(
          f"| {r['batch']} | {fmt(r['cad_keep_fwd']['median_s'] * 1e3)} | "
          f"{fmt(r['cad_keep_fwd_bwd']['median_s'] * 1e3)} | "
          f"{fmt(r['cad_resend_fwd']['median_s'] * 1e3)} | "
          f"{fmt(r['cad_resend_fwd_bwd']['median_s'] * 1e3)} | "
          f"{fmt(r['no_cad_fwd_bwd']['median_s'] * 1e3)} |")
    lines += ["", f"Memory of the {res['layers']}-layer CAD chain's forward+backward program "
              "(XLA buffer assignment, per device; collectives: the program's collective "
              "primitives, a ring's loop counted once):", "",
              "| memory mode | temp MB | collectives | kernel forwards |", "|---|---|---|---|"]
    for mode in ("keep", "resend"):
      m, st = w[f"cad_{mode}_memory"], w[f"cad_{mode}_structure"]
      lines.append(f"| {mode} | {fmt(m.get('temp_size_in_bytes', nan) / mb)} | "
                   f"{st['collectives']} | {st['kernel_forward_calls']} |")
    if "profile_cad_keep_fwd_bwd" in w:
      lines += _profile_markdown(w["profile_cad_keep_fwd_bwd"])
    lines.append("")
  return "\n".join(lines)


def main(a) -> None:
  devices = jax.devices()
  mesh = Mesh(np.asarray(devices), (AXIS,), axis_types=(AxisType.Auto,))
  dtype = jnp.dtype(a.dtype)
  kernel = _pick_kernel(a, dtype)
  backend = jax.default_backend()
  collectives = resolve_collectives(a.collectives, backend)
  res = {"command": experiments.command_line(__file__),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "backend": backend, "devices": len(devices),
         "device_kind": devices[0].device_kind, "servers": len(devices),
         "tokens_per_rank": a.tokens_per_rank, "heads": a.heads, "kv_heads": a.kv_heads,
         "head_dim": a.head_dim, "dtype": dtype.name, "kernel": kernel,
         "tolerance": a.tolerance, "caps": a.caps, "collectives": collectives,
         "cad_collective": dataplane.resolve_collective("auto", backend),
         "exchange_only": a.exchange_only,
         "iters": a.iters,
         "layers": a.layers, "tiny": a.tiny,
         "workloads": []}
  for name in a.workloads.split(","):
    res["workloads"].append(run_workload(name, a, mesh, kernel, dtype, collectives))
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump(res, f, indent=1, default=str)
  md = _markdown(res)
  with open(a.out + ".md", "w") as f:
    f.write(md + "\n")
  print(md)
  print(f"wrote {a.out}.json and {a.out}.md")


if __name__ == "__main__":
  main(ARGS)
