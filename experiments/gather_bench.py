"""Backward of the data plane's row gathers: XLA's scatter-add against the alternatives (one GPU).

Every data-plane step is a row gather ``y = x[idx]`` (out-of-range index -> 0), so its backward
is ``dx = zeros.at[idx].add(dy)``. Shapes of a ``--tokens`` server under
``plan.default_capacity``, bf16: the sources are the server's own rows and its flat receive
buffer, Q rows [T + Cqr, 32, 128] (``Cqr`` = q_recv) gathered into [Nq, 32, 128] (injective:
every source row is used at most once), K/V rows [T + Ckvr, 8, 128] (``Ckvr`` = kv_recv) into
[Nkv, 8, 128] (a row used by up to ``--uses`` tasks). 70% of the output rows are real, the rest
the sentinel. Variants of dx:

  scatter_bf16   ``jax.vjp`` of ``jnp.take`` (XLA scatter-add in bf16; what autodiff emits)
  scatter_f32    scatter-add of ``dy`` cast to f32, then cast back
  inverse_gather injective only: ``dx = dy[inv]`` with ``inv`` the inverse map (built on device
                 with an int32 scatter, included in the time)

Run: python -m experiments.gather_bench --out results/micro/gather_bench
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import profiling
from distca_jax import plan as plan_lib
import experiments


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=65536)
  p.add_argument("--uses", type=int, default=3, help="most tasks one K/V row feeds")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--out", default=os.path.join(ROOT, "results", "micro", "gather_bench"))
  return p.parse_args()


def _index(rng, n_src: int, n_out: int, used: float, uses: int) -> np.ndarray:
  """``n_out`` indices into ``n_src`` rows: a fraction ``used`` real, the rest the sentinel."""
  real = int(n_out * used)
  if uses == 1:
    idx = rng.permutation(n_src)[:real]
  else:
    base = rng.permutation(n_src)[: -(-real // uses)]
    idx = np.concatenate([base[: rng.integers(1, base.size + 1)] for _ in range(uses)])[:real]
    idx = np.concatenate([idx, rng.permutation(n_src)[: real - idx.size]])
  return np.concatenate([np.sort(idx), np.full(n_out - real, n_src)]).astype(np.int32)


def main(a):
  t = a.tokens
  cap = plan_lib.default_capacity(t)
  rng = np.random.default_rng(0)
  cases = {"q": (t + cap.q_recv, cap.q_tokens, 32, 1),
           "kv": (t + cap.kv_recv, cap.kv_tokens, 8, a.uses)}
  res = {"command": experiments.command_line(__file__), "device": jax.devices()[0].device_kind,
         "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": []}
  for name, (n_src, n_out, heads, uses) in cases.items():
    idx = jnp.asarray(_index(rng, n_src, n_out, 0.7, uses))
    x = jax.random.normal(jax.random.key(1), (n_src, heads, 128), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), (n_out, heads, 128), jnp.bfloat16)

    def fwd(x, idx):
      return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)

    def scatter_bf16(x, idx, dy):
      return jax.vjp(lambda x: fwd(x, idx), x)[1](dy)[0]

    def scatter_f32(x, idx, dy):
      z = jnp.zeros(x.shape, jnp.float32)
      return z.at[idx].add(dy.astype(jnp.float32), mode="drop").astype(x.dtype)

    def inverse_gather(x, idx, dy):
      inv = jnp.full((x.shape[0],), idx.shape[0], jnp.int32).at[idx].set(
          jnp.arange(idx.shape[0], dtype=jnp.int32), mode="drop")
      return jnp.take(dy, inv, axis=0, mode="fill", fill_value=0)

    variants = {"forward_gather": (fwd, (x, idx)), "scatter_bf16": (scatter_bf16, (x, idx, dy)),
                "scatter_f32": (scatter_f32, (x, idx, dy))}
    if uses == 1:
      variants["inverse_gather"] = (inverse_gather, (x, idx, dy))
    want = None
    for vname, (f, args) in variants.items():
      jf = jax.jit(f)
      out = jf(*args)
      if vname != "forward_gather":
        got = np.asarray(out.astype(jnp.float32))
        if want is None:
          want = got
        err = float(np.max(np.abs(got - want)))
      else:
        err = 0.0
      tm = profiling.time_call(jf, *args, iters=a.iters, warmup=1)
      nbytes = (n_out * heads * 128 * 2)
      row = {"case": name, "variant": vname, "src_rows": n_src, "out_rows": n_out,
             "heads": heads, "uses": uses, "ms": tm["median_s"] * 1e3,
             "GBps_of_dy": nbytes / tm["median_s"] / 1e9, "max_abs_diff_vs_scatter_bf16": err}
      res["rows"].append(row)
      print(f"{name:3s} {vname:15s} {row['ms']:7.3f} ms  ({row['GBps_of_dy']:.0f} GB/s of dy) "
            f"diff {err:.3g}", flush=True)
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump(res, f, indent=1)
  lines = [f"# Backward of the data plane's row gathers ({res['date']})", "",
           f"Command: `{res['command']}`", "", f"Device: 1 x {res['device']}. Median of "
           f"{a.iters}.", "", "| case | variant | source rows | out rows | heads | uses | ms | "
           "GB/s of dy | max diff |", "|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(f"| {r['case']} | {r['variant']} | {r['src_rows']} | {r['out_rows']} | "
                 f"{r['heads']} | {r['uses']} | {r['ms']:.3f} | {r['GBps_of_dy']:.0f} | "
                 f"{r['max_abs_diff_vs_scatter_bf16']:.3g} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(_args())
