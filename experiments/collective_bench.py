"""The data plane's collectives on this host's devices: all_to_all vs ppermute rounds, and
whether XLA runs an all_to_all and an independent row gather at the same time.

  a2a       ``lax.all_to_all`` (tiled) of ``[S, F]`` per device: F elements to every device, its
            own slot included (a local copy the exchange never reads).
  permute   ``S - 1`` ``lax.ppermute`` rounds (round k: device i sends to i + k), peers only.
  overlap   one jit holding an all_to_all of X bytes and an independent row gather of the shape
            of a server's own-query gather (``--gather-rows`` rows of 32 x 128 bf16): each alone,
            then both; ``hidden`` = (a2a + gather - both) / min(a2a, gather): 1 = the shorter one
            is fully hidden, 0 = the times add up.

Every time is the median wall time of ``--iters`` calls. Run it under different ``XLA_FLAGS``
to compare scheduler settings (the flags in effect are recorded).

Run: python -m experiments.collective_bench --out results/collective_bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from distca_jax import profiling
import experiments

AXIS = "data"


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--mb", type=float, nargs="+", default=[64.0, 150.0, 300.0],
                 help="off-device MB each device sends, per case")
  p.add_argument("--gather-rows", type=int, default=84864,
                 help="rows of the independent gather (a server's query buffer)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--out", default=os.path.join(ROOT, "results", "collective_bench"))
  return p.parse_args()


def main(a):
  devs = jax.devices()
  s = len(devs)
  if s < 2:
    raise SystemExit(f"collective_bench needs at least 2 devices; this process sees {s}")
  mesh = Mesh(np.array(devs), (AXIS,))
  sh = NamedSharding(mesh, P(AXIS))

  def local(f):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                                 check_vma=False))

  def a2a(x):  # x [1, S, F]
    return lax.all_to_all(x[0], AXIS, 0, 0, tiled=True)[None]

  def permute(x):  # x [1, S - 1, F]: round k's slot is x[0, k - 1]
    outs = [lax.ppermute(x[0, k - 1], AXIS, [(i, (i + k) % s) for i in range(s)])
            for k in range(1, s)]
    return jnp.stack(outs)[None]

  h, d = 32, 128
  # Source rows in the proportions of a 64K-token server with tight caps: 65536 own rows plus
  # two received slots of 19328 rows, for 84864 gathered rows (3/4 of them real).
  n_src = int(a.gather_rows * 104192 / 84864)
  rng = np.random.default_rng(0)
  idx = np.concatenate([rng.permutation(n_src)[:int(a.gather_rows * 0.75)],
                        np.full(a.gather_rows - int(a.gather_rows * 0.75), n_src)])
  idx_sh = jax.device_put(np.tile(idx.astype(np.int32), (s, 1)), sh)

  def gather(rows, idx):
    return jnp.take(rows[0], idx[0], axis=0, mode="fill", fill_value=0)[None]

  def both(x, rows, idx):
    return a2a(x), gather(rows, idx)

  make = lambda shape: jax.jit(lambda: jax.random.normal(jax.random.key(0), shape, jnp.bfloat16),
                               out_shardings=sh)()
  rows = make((s, n_src, h, d))
  gather_bytes = a.gather_rows * h * d * 2
  res = {"command": experiments.command_line(__file__), "device": f"{s} x {devs[0].device_kind}",
         "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": []}
  f_a2a, f_perm, f_gather, f_both = local(a2a), local(permute), local(gather), local(both)
  t_gather = profiling.time_call(f_gather, rows, idx_sh, iters=a.iters, warmup=1)["median_s"]
  for mb in a.mb:
    per_peer = int(mb * 1e6 / (s - 1) / 2)
    x = make((s, s, per_peer))
    xp = make((s, s - 1, per_peer))
    if mb == a.mb[0]:  # the permute rounds deliver what all_to_all does (small arrays)
      xs = np.arange(s * s * 8, dtype=np.float32).reshape(s, s, 8)
      rolled = np.stack([[xs[i, (i + k) % s] for k in range(1, s)] for i in range(s)])
      got_a = np.asarray(f_a2a(jax.device_put(xs, sh)))
      got_p = np.asarray(f_perm(jax.device_put(rolled, sh)))
      want = np.stack([[got_a[i, (i - k) % s] for k in range(1, s)] for i in range(s)])
      if not np.array_equal(got_p, want):
        raise AssertionError("ppermute rounds do not deliver what all_to_all does")
    t_a2a = profiling.time_call(f_a2a, x, iters=a.iters, warmup=1)["median_s"]
    t_perm = profiling.time_call(f_perm, xp, iters=a.iters, warmup=1)["median_s"]
    t_both = profiling.time_call(f_both, x, rows, idx_sh, iters=a.iters, warmup=1)["median_s"]
    off = per_peer * (s - 1) * 2
    hidden = (t_a2a + t_gather - t_both) / min(t_a2a, t_gather)
    row = {"mb_off_device": off / 1e6, "a2a_ms": t_a2a * 1e3, "a2a_GBps": off / t_a2a / 1e9,
           "permute_ms": t_perm * 1e3, "permute_GBps": off / t_perm / 1e9,
           "gather_ms": t_gather * 1e3, "gather_GBps_written": gather_bytes / t_gather / 1e9,
           "a2a_and_gather_ms": t_both * 1e3, "hidden": hidden}
    res["rows"].append(row)
    print(f"{row['mb_off_device']:7.1f} MB: a2a {row['a2a_ms']:.3f} ms ({row['a2a_GBps']:.0f} "
          f"GB/s), permute {row['permute_ms']:.3f} ms ({row['permute_GBps']:.0f} GB/s); gather "
          f"{row['gather_ms']:.3f} ms, both {row['a2a_and_gather_ms']:.3f} ms, hidden "
          f"{hidden:.2f}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump(res, f, indent=1)
  lines = [f"# Data-plane collectives ({res['date']})", "", f"Command: `{res['command']}`", "",
           f"Device: {res['device']}; XLA_FLAGS `{res['xla_flags'] or '(none)'}`. Median of "
           f"{a.iters}. The gather writes {gather_bytes / 1e6:.0f} MB ({a.gather_rows} rows of "
           f"{h} x {d} bf16).", "",
           "| MB off-device per device | all_to_all ms | GB/s | ppermute rounds ms | GB/s | "
           "gather alone ms | all_to_all + gather ms | hidden |", "|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(f"| {r['mb_off_device']:.0f} | {r['a2a_ms']:.3f} | {r['a2a_GBps']:.0f} | "
                 f"{r['permute_ms']:.3f} | {r['permute_GBps']:.0f} | {r['gather_ms']:.3f} | "
                 f"{r['a2a_and_gather_ms']:.3f} | {r['hidden']:.2f} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(_args())
