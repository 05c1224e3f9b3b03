"""XLA's ragged all-to-all (the exchange's 'ragged' collective) on synthetic group matrices.

  python -m experiments.ragged_probe --out results/four/ragged_probe

Times ``dataplane.ragged_exchange(..., 'ragged')`` on the visible devices (4 needed) for
(sender, server) group matrices chosen to tell apart what its time follows: one group of
several sizes, one sender fanning out to three servers, every pair at once, uneven groups,
half-size rows (same bytes, twice the rows), a send buffer 4x larger than its groups, and no
rows at all. Each row records the group matrix (rows per (sender, server)), the row bytes and
the median wall ms of ``--iters`` calls; ``sim.validate`` replays them against its model.
"""

from __future__ import annotations

import argparse
import json
import os

import experiments

# name -> (off-diagonal groups {(sender, server): rows}, heads of 128 bf16 per row, send buffer
# rows over the largest sender's total).
PATTERNS = {
    "one 12.5K": ({(0, 1): 12500}, 32, 1), "one 25K": ({(0, 1): 25000}, 32, 1),
    "one 50K": ({(0, 1): 50000}, 32, 1),
    "fan-out 3 x 25K": ({(0, 1): 25000, (0, 2): 25000, (0, 3): 25000}, 32, 1),
    "all 12 x 25K": ({(i, j): 25000 for i in range(4) for j in range(4) if i != j}, 32, 1),
    "uneven 50K+10K+10K": ({(0, 1): 50000, (0, 2): 10000, (3, 2): 10000}, 32, 1),
    "one 50K half rows": ({(0, 1): 50000}, 16, 1),
    "one 25K, 4x buffer": ({(0, 1): 25000}, 32, 4),
    "empty": ({}, 32, 1),
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import (  # pylint: disable=import-outside-toplevel
      Mesh, NamedSharding, PartitionSpec as P)
  from distca_jax import dataplane  # pylint: disable=import-outside-toplevel
  from distca_jax.plan import metadata  # pylint: disable=import-outside-toplevel
  from distca_jax.profiling import time_call  # pylint: disable=import-outside-toplevel
  devs = jax.devices()
  s = len(devs)
  if s != 4:
    raise SystemExit(f"ragged_probe's patterns are for 4 devices; this process sees {s}")
  mesh = Mesh(np.asarray(devs), ("data",))
  sh = NamedSharding(mesh, P("data"))
  rows = []
  for name, (groups, heads, buf) in PATTERNS.items():
    g = np.zeros((s, s), np.int64)
    for (i, j), n in groups.items():
      g[i, j] = n
    send_off = np.cumsum(g, axis=1) - g
    recv_off = (np.cumsum(g, axis=0) - g).T
    r = metadata.routes(g, send_off, recv_off, np.arange(s)).reshape(s * 6, s)
    cs, cr = max(1, int(g.sum(1).max()) * buf), max(1, int(g.sum(0).max()))
    x = jax.jit(lambda k, shape=(s * cs, heads, 128): jax.random.normal(k, shape, jnp.bfloat16),
                out_shardings=sh)(jax.random.key(0))
    f = jax.jit(jax.shard_map(lambda x, r, cr=cr: dataplane.ragged_exchange(x, r, cr, "data",
                                                                            "ragged"),
                              mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data")))
    ms = time_call(f, x, jax.device_put(jnp.asarray(r), sh), iters=a.iters, warmup=2)
    row = dict(pattern=name, groups=g.tolist(), row_bytes=heads * 128 * 2, send_rows=cs,
               recv_rows=cr, ms=ms["median_s"] * 1e3, trials_ms=[t * 1e3 for t in ms["trials_s"]])
    print(json.dumps(row), flush=True)
    rows.append(row)
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
      json.dump({"command": experiments.command_line(__file__, argv),
                 "device": f"{s} x {devs[0].device_kind}", "jax": jax.__version__,
                 "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
  main()
