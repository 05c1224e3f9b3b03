"""The exchange alone on real plans: time, useful (= ragged wire) bytes, buffer bytes, and the
fraction of a raw all-to-all's bandwidth on the same bytes, per collective.

  python -m experiments.exchange_bench --workloads pretrain,prolong --tokens 131072 \\
      --collectives ragged,dense --out results/four/exchange_bench

On the visible devices (every one a server), plans ``--batches`` batches of ``configs/gpu_bench.py``
(Llama-3-8B heads, bf16) with the run's own ``distca`` backend (startup caps sampled as in
training), then times the forward exchange of each batch's query and key/value send buffers
(``dataplane.ragged_exchange``, random rows) for every collective, checks that every collective
returns the same receive buffers bit for bit, and times a raw ``lax.all_to_all`` moving the
busiest device's useful bytes in equal blocks. ``bandwidth fraction`` = (busiest device's useful
bytes / exchange time) / (the same bytes / raw all-to-all time). ``--xla-flags A;B`` reruns the
whole measurement in a child process per XLA flag set (the flags are read when JAX starts), e.g.
``--xla-flags ";--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true"``.
``--remote-grids 132x128,264x64x1,132x128x2x132`` also times the 'remote' kernel
(``custom_ops/remote_exchange``) with other CTA counts, chunk lines, SMEM slots and extra
CTAs that zero the unfilled receive rows beside the copies.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(a) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  from distca_jax import configs_io, dataplane, trainer
  from distca_jax.profiling import time_call

  def seconds(f, *args):
    return time_call(f, *args, iters=a.iters, warmup=2)["median_s"]

  from distca_jax import plan as plan_lib
  from distca_jax.data import make_source

  devs = jax.devices()
  s = len(devs)
  mesh = jax.sharding.Mesh(np.asarray(devs), ("data",),
                           axis_types=(jax.sharding.AxisType.Auto,))
  sh = NamedSharding(mesh, P("data"))
  # What is timed, by name: each collective through the data plane's exchange, and the 'remote'
  # kernel at each --remote-grids grid (BLOCKSxCHUNK[xSLOTS[xZERO_BLOCKS]]); fn(x, routes,
  # recv_rows).
  variants = {col: lambda x, r, cr, col=col: dataplane.ragged_exchange(x, r, cr, "data", col)
              for col in a.collectives.split(",")}
  for grid in filter(None, a.remote_grids.split(",")):
    from custom_ops import remote_exchange as rx  # pylint: disable=import-outside-toplevel
    parts = [int(v) for v in grid.split("x")]  # the kernel's defaults where the grid stops
    if not 2 <= len(parts) <= 4:
      raise SystemExit(f"--remote-grids {grid!r}: expected BLOCKSxCHUNK[xSLOTS[xZERO_BLOCKS]]")
    blocks, chunk, slots, zero_blocks = parts + [rx.DEFAULT_SLOTS,
                                                 rx.DEFAULT_ZERO_BLOCKS][len(parts) - 2:]
    variants[f"remote_{grid}"] = functools.partial(
        lambda x, r, cr, **kw: rx.remote_exchange(x, r, cr, "data", **kw), blocks=blocks,
        chunk=chunk, slots=slots, zero_blocks=zero_blocks)
  rows = []
  for workload in a.workloads.split(","):
    for tokens in [int(t) for t in a.tokens.split(",")]:
      c = configs_io.load_config(a.config, [
          f"data.workload={workload}", f"tokens_per_rank={tokens}", f"mesh.data={s}",
          f"attention.distca.caps_from_batches={a.caps_from_batches}"])
      backend = trainer.make_backend(c)
      m = c.model
      src = make_source(c.data, rows=s * c.rows_per_rank, tokens_per_row=tokens,
                        vocab_size=m.vocab_size, seed=c.seed)
      cap = None
      for step in range(a.batches):
        (hp,) = backend.host_plans(src.doclens(step), tokens)
        meta, cap = hp.meta, hp.spec.capacity
        eb = plan_lib.exchange_bytes(meta, q_heads=m.n_heads, kv_heads=m.n_kv_heads,
                                     head_dim=m.head_dim, dtype_bytes=2)
        parts = {"q": (cap.q_send, cap.q_recv, m.n_heads, meta.q_routes, meta.q_send_len),
                 "kv": (cap.kv_send, cap.kv_recv, 2 * m.n_kv_heads, meta.kv_routes,
                        meta.kv_send_len)}
        row = {"workload": workload, "tokens": tokens, "servers": s, "step": step,
               "imbalance_before": hp.plan.imbalance_before,
               "imbalance_after": hp.plan.imbalance_after,
               "dispatch_useful_mb": eb["dispatch_useful"] / 1e6,
               "dispatch_buffer_mb": eb["dispatch_buffer"] / 1e6, "caps": dict(vars(cap))}
        busiest = 0.0
        for name, (cs, cr, heads, routes, lens) in parts.items():
          # Random rows made on the devices (host RNG of GBs would dominate the run).
          x = jax.jit(lambda k, shape=(s * cs, heads, m.head_dim): jax.random.normal(
              k, shape, jnp.bfloat16), out_shardings=sh)(jax.random.key(step))
          r = jax.device_put(jnp.asarray(routes.reshape(s * 6, s)), sh)
          row_bytes = heads * m.head_dim * 2
          useful = float(max(lens.sum(1).max(), lens.sum(0).max())) * row_bytes
          busiest += useful
          row[f"{name}_busiest_mb"] = useful / 1e6
          outs = {}
          for name_v, fn in variants.items():
            # check_vma=False: kernel primitives (the 'remote' collective) carry no axis info
            f = jax.jit(jax.shard_map(functools.partial(fn, cr=cr), mesh=mesh,
                                      in_specs=(P("data"), P("data")), out_specs=P("data"),
                                      check_vma=False))
            try:
              outs[name_v] = f(x, r)
              row[f"{name}_{name_v}_ms"] = seconds(f, x, r) * 1e3
            except Exception as e:  # noqa: BLE001  (a collective this platform lacks: say so)
              first = str(e).splitlines()[0][:200] if str(e) else ""
              row[f"{name}_{name_v}_error"] = f"{type(e).__name__}: {first}"
          ref = next(iter(outs.values()), None)
          row[f"{name}_collectives_equal"] = all(bool(jnp.array_equal(o, ref))
                                                 for o in outs.values())
          outs.clear()
          # Raw all_to_all of the busiest device's useful bytes in S equal blocks.
          blk = max(1, int(useful // row_bytes) // s)
          raw_x = jax.device_put(jnp.zeros((s * s * blk, heads, m.head_dim), jnp.bfloat16)
                                 + 1, sh)
          raw = jax.jit(jax.shard_map(lambda x: jax.lax.all_to_all(x, "data", 0, 0, tiled=True),
                                      mesh=mesh, in_specs=P("data"), out_specs=P("data")))
          row[f"{name}_raw_a2a_ms"] = seconds(raw, raw_x) * 1e3
          for col in variants:
            if f"{name}_{col}_ms" in row:
              row[f"{name}_{col}_bw_fraction"] = row[f"{name}_raw_a2a_ms"] / row[f"{name}_{col}_ms"]
        row["busiest_useful_mb"] = busiest / 1e6
        print(json.dumps(row), flush=True)
        rows.append(row)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens", default="131072")
  p.add_argument("--batches", type=int, default=3)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--collectives", default="ragged,dense")
  p.add_argument("--caps-from-batches", type=int, default=8,
                 help="batches the backend samples to size its caps (training samples 32)")
  p.add_argument("--remote-grids", default="",
                 help="BLOCKSxCHUNK[xSLOTS[xZERO_BLOCKS]],... : also time the 'remote' kernel "
                      "with these CTA counts, chunk lines, SMEM slots and zeroing CTAs (those "
                      "left out: the kernel's defaults, 2 and 66), e.g. 132x128,132x128x2x0")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--xla-flags", default=None,
                 help="';'-separated XLA flag sets, one child process each")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  results = {}
  if a.xla_flags is None:
    results[os.environ.get("XLA_FLAGS", "")] = measure(a)
  else:
    for flags in a.xla_flags.split(";"):
      args = list(argv or sys.argv[1:])
      i = args.index("--xla-flags")
      del args[i:i + 2]
      child_out = f"/tmp/exchange_bench_{abs(hash(flags))}"
      if "--out" in args:
        j = args.index("--out")
        del args[j:j + 2]
      env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags).strip())
      print(f"=== XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
      r = subprocess.run([*experiments.module_argv(__file__), *args, "--out",
                          child_out], cwd=ROOT, env=env, timeout=900)
      try:
        with open(child_out + ".json") as f:
          results[flags] = next(iter(json.load(f)["results"].values()))
      except (OSError, KeyError):
        results[flags] = [{"error": f"child exited {r.returncode}"}]
  if a.out:
    with open(a.out + ".json", "w") as f:
      json.dump({"command": experiments.command_line(__file__, argv), "results": results}, f,
                indent=2)
  return results


if __name__ == "__main__":
  main()
