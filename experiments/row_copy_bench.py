"""How fast XLA copies rows by index: the forms of the data plane's forward row gather (one GPU).

Every local step of the CAD exchange (send gather, own rows into the attention buffers, received
rows into place, the return) is ``y = x[idx]`` over rows of ``heads x head_dim`` bf16, an index
past the end giving a zero row (``dataplane.take_rows``). This times ways of writing the same copy,
on the shapes of a 64K-token server, with the index a real plan would hold: mostly runs of
consecutive rows (``--run``), a fraction ``--used`` of the output real, the rest the sentinel:

  take         ``jnp.take(x, idx, axis=0, mode='fill')`` on ``[N, H, D]`` bf16 (the reference form)
  take_flat    the same on ``[N, H * D]``
  take_u32     rows viewed as uint32 pairs (``lax.bitcast_convert_type``), gathered, viewed back
  take_clip_select  the index clipped in range (``mode='clip'``), then zeros where it was not
  copy         ``x[:n_out] * 1``: a plain contiguous copy of as many bytes, the ceiling

Each variant's output is checked equal to ``take``'s. The variants are timed round-robin
(``--rounds``, alternating order; the median round is reported), so no variant gains or loses
from its place in the order. GB/s counts the bytes written plus the
bytes read (2 x output bytes): HBM traffic.

Run: python -m experiments.row_copy_bench [--tiny] --out results/micro/row_copy_bench
"""

from __future__ import annotations

import argparse
import datetime
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from distca_jax import profiling
import experiments


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tiny", action="store_true", help="CPU smoke test: small shapes, 2 iters")
  p.add_argument("--tokens", type=int, default=None, help="source rows (default 65536; tiny 512)")
  p.add_argument("--out-rows", type=float, default=1.3, help="output rows / source rows")
  p.add_argument("--used", type=float, default=0.8, help="fraction of output rows that are real")
  p.add_argument("--run", type=int, default=2048, help="mean length of consecutive-row runs")
  p.add_argument("--iters", type=int, default=None, help="default 20 (tiny: 2)")
  p.add_argument("--rounds", type=int, default=3, help="the variants are timed round-robin this "
                 "many times (order effects cancel); the median round is reported")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "micro", "row_copy_bench"))
  a = p.parse_args()
  a.tokens = a.tokens or (512 if a.tiny else 65536)
  a.iters = a.iters or (2 if a.tiny else 20)
  return a


def _index(rng, n_src: int, n_out: int, used: float, run: int) -> np.ndarray:
  """Runs of consecutive source rows (shuffled run order), then the sentinel ``n_src``."""
  real = min(n_src, int(n_out * used))
  starts = np.sort(rng.choice(n_src, size=max(1, real // max(1, run)), replace=False))
  runs = np.split(np.arange(n_src), starts[1:])
  order = rng.permutation(len(runs))
  idx = np.concatenate([runs[i] for i in order])[:real]
  return np.concatenate([idx, np.full(n_out - real, n_src)]).astype(np.int32)


def take(x, idx):
  return jnp.take(x, idx, axis=0, mode="fill", fill_value=0)


def take_flat(x, idx):
  n, *feat = x.shape
  return jnp.take(x.reshape(n, -1), idx, axis=0, mode="fill", fill_value=0).reshape(
      (idx.shape[0], *feat))


def take_u32(x, idx):
  n, *feat = x.shape
  words = lax.bitcast_convert_type(x.reshape(n, -1, 2), jnp.uint32)  # [n, F / 2]
  got = jnp.take(words, idx, axis=0, mode="fill", fill_value=0)
  return lax.bitcast_convert_type(got, x.dtype).reshape((idx.shape[0], *feat))


def take_clip_select(x, idx):
  ok = idx < x.shape[0]
  got = jnp.take(x, jnp.minimum(idx, x.shape[0] - 1), axis=0, mode="clip")
  return jnp.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)), got, jnp.zeros((), x.dtype))


def copy(x, idx):
  n = idx.shape[0]
  reps = -(-n // x.shape[0])
  src = x if reps == 1 else jnp.concatenate([x] * reps)
  return src[:n] * jnp.asarray(1, x.dtype)


VARIANTS = {"take": take, "take_flat": take_flat, "take_u32": take_u32,
            "take_clip_select": take_clip_select, "copy": copy}


def main(a):
  if a.tiny:
    jax.config.update("jax_platforms", "cpu")
  rng = np.random.default_rng(0)
  t = a.tokens
  dtype = jnp.bfloat16
  res = {"command": experiments.command_line(__file__),
         "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
         "date": datetime.datetime.now().isoformat(timespec="seconds"), "rows": []}
  for name, heads in (("q", 32 if not a.tiny else 4), ("kv", 8 if not a.tiny else 2)):
    d = 128 if not a.tiny else 16
    n_out = int(t * a.out_rows)
    idx = jnp.asarray(_index(rng, t, n_out, a.used, a.run))
    x = jax.random.normal(jax.random.key(1), (t, heads, d), dtype)
    want = np.asarray(jax.jit(take)(x, idx).astype(jnp.float32))
    jitted = {vname: jax.jit(f) for vname, f in VARIANTS.items()}
    for vname, jf in jitted.items():
      got = jf(x, idx)
      if vname != "copy":
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want, err_msg=vname)
    times = {vname: [] for vname in VARIANTS}
    for r in range(a.rounds):
      order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
      for vname in order:
        times[vname].append(profiling.time_call(jitted[vname], x, idx, iters=a.iters,
                                                warmup=1)["median_s"])
    for vname in VARIANTS:
      med = float(np.median(times[vname]))
      nbytes = 2 * n_out * heads * d * jnp.dtype(dtype).itemsize
      row = {"case": name, "variant": vname, "src_rows": t, "out_rows": n_out, "heads": heads,
             "ms": med * 1e3, "round_ms": [x * 1e3 for x in times[vname]],
             "traffic_GBps": nbytes / med / 1e9}
      res["rows"].append(row)
      print(f"{name:3s} {vname:17s} {row['ms']:7.3f} ms  {row['traffic_GBps']:6.0f} GB/s",
            flush=True)
  lines = [f"# Row copies by index ({res['date']})", "", f"Command: `{res['command']}`", "",
           f"Device: 1 x {res['device']}. Median over {a.rounds} round-robin rounds of the "
           f"median of {a.iters} calls. Index: runs of ~{a.run} "
           f"consecutive rows, {a.used:.0%} of the output real. GB/s = (read + written bytes) / "
           "time.", "", "| case | variant | source rows | out rows | heads | ms | GB/s |",
           "|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(f"| {r['case']} | {r['variant']} | {r['src_rows']} | {r['out_rows']} | "
                 f"{r['heads']} | {r['ms']:.3f} | {r['traffic_GBps']:.0f} |")
  profiling.write_tables(a.out, res, "\n".join(lines))


if __name__ == "__main__":
  main(_args())
