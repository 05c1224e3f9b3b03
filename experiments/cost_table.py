"""Measures the core-attention kernel's time per CA-task over a (q_len, kv_len) grid.

The scheduler's measured cost model (``distca_jax.plan.CostTable``, option
``schedule(..., cost_model=PATH)``) reads the JSON this writes. A grid point (q, kv) times one
fused varlen call of ``n = max(1, tokens // kv)`` identical tasks, each with q query rows aligned
at the end of kv keys (the shape of a CA-task ``[kv - q, kv)``), forward alone and forward +
backward (grad of <O, dO> in q, k, v); the per-task time is the call's median time over ``n``.
Fusing many tasks is how the data plane runs them, so launch overhead is amortized as in a step.

Run on a GPU (the lead's machine):
  python -m experiments.cost_table --kernel flash3 --out results/cost_table_flash3_h200.json
CPU smoke test (seconds):
  python -m experiments.cost_table --kernel reference --tiny --out /tmp/cost_table_tiny.json

Output JSON: ``q_lens`` [Q], ``kv_lens`` [K], ``fwd_s`` and ``fwd_bwd_s`` [Q][K] seconds per task
(null where q_len > kv_len), ``fwd_tflops`` / ``fwd_bwd_tflops`` (throughput counting
4 * Hq * D * pairs forward and ``BWD_FWD_RATIO`` x that backward) and ``meta`` (device, kernel,
shapes, dtype, command; free-form, read by no code).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np


from distca_jax import plan as plan_lib
import experiments

_FULL_Q = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
_FULL_KV = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288]
_TINY_Q = [16, 32, 64]
_TINY_KV = [16, 32, 64, 128]


def _parse() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--kernel", required=True, choices=("reference", "blockwise", "mosaic", "flash3"))
  experiments.reject_renamed_flag(p, "--backend", "--kernel")
  p.add_argument("--tiny", action="store_true",
                 help="tiny grid and shapes for a CPU smoke test (reference kernel)")
  p.add_argument("--q-lens", type=str, default=None, help="comma-separated query lengths")
  p.add_argument("--kv-lens", type=str, default=None, help="comma-separated key lengths")
  p.add_argument("--q-heads", type=int, default=None, help="default 32 (2 with --tiny)")
  p.add_argument("--kv-heads", type=int, default=None, help="default 8 (1 with --tiny)")
  p.add_argument("--head-dim", type=int, default=None, help="default 128 (16 with --tiny)")
  p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                 help="default bfloat16 (float32 with --tiny)")
  p.add_argument("--tokens", type=int, default=None,
                 help="key rows per timed call (n = max(1, tokens // kv) tasks); default 131072 "
                      "(256 with --tiny)")
  p.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 5)")
  p.add_argument("--warmup", type=int, default=1, help="untimed calls after compiling")
  p.add_argument("--no-backward", action="store_true", help="forward only")
  p.add_argument("--out", required=True, help="JSON file to write")
  return p.parse_args()


def _ints(text: str | None, default: list[int]) -> list[int]:
  if text is None:
    return list(default)
  vals = [int(v) for v in text.split(",") if v.strip()]
  if not vals or any(v < 1 for v in vals) or sorted(set(vals)) != vals:
    raise SystemExit(f"lengths must be increasing positive ints; got {text!r}")
  return vals


def _median_s(fn, args, warmup: int, repeats: int) -> float:
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel  (after XLA setup)
  return profiling.time_call(fn, *args, iters=repeats, warmup=warmup)["median_s"]


def main() -> None:
  args = _parse()
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from distca_jax import ops  # pylint: disable=import-outside-toplevel

  tiny = args.tiny
  q_lens = _ints(args.q_lens, _TINY_Q if tiny else _FULL_Q)
  kv_lens = _ints(args.kv_lens, _TINY_KV if tiny else _FULL_KV)
  hq = args.q_heads or (2 if tiny else plan_lib.DEFAULT_Q_HEADS)
  hkv = args.kv_heads or (1 if tiny else plan_lib.DEFAULT_KV_HEADS)
  dim = args.head_dim or (16 if tiny else plan_lib.DEFAULT_HEAD_DIM)
  dtype = jnp.dtype(args.dtype or ("float32" if tiny else "bfloat16"))
  tokens = args.tokens or (256 if tiny else 131072)
  repeats = args.repeats or (2 if tiny else 5)
  if hq % hkv:
    raise SystemExit(f"--q-heads={hq} must be a multiple of --kv-heads={hkv}")

  def fwd(q, k, v, cu_q, cu_k, mq, mk):
    return ops.core_attention(q, k, v, cu_q, cu_k, kernel=args.kernel,
                              max_seqlen_q=mq, max_seqlen_k=mk)

  def fwd_bwd(q, k, v, do, cu_q, cu_k, mq, mk):
    def loss(q_, k_, v_):
      o = fwd(q_, k_, v_, cu_q, cu_k, mq, mk)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  fwd_j = jax.jit(fwd, static_argnums=(5, 6))
  fwd_bwd_j = jax.jit(fwd_bwd, static_argnums=(6, 7))
  nan = float("nan")
  t_fwd = np.full((len(q_lens), len(kv_lens)), nan)
  t_all = np.full((len(q_lens), len(kv_lens)), nan)
  key = jax.random.PRNGKey(0)
  for j, kv in enumerate(kv_lens):
    n = max(1, tokens // kv)
    for i, ql in enumerate(q_lens):
      if ql > kv:
        continue
      key, kq, kk, kvv, kd = jax.random.split(key, 5)
      q = jax.random.normal(kq, (n * ql, hq, dim), jnp.float32).astype(dtype)
      k = jax.random.normal(kk, (n * kv, hkv, dim), jnp.float32).astype(dtype)
      v = jax.random.normal(kvv, (n * kv, hkv, dim), jnp.float32).astype(dtype)
      do = jax.random.normal(kd, q.shape, jnp.float32).astype(dtype)
      cu_q = jnp.arange(n + 1, dtype=jnp.int32) * ql
      cu_k = jnp.arange(n + 1, dtype=jnp.int32) * kv
      t_fwd[i, j] = _median_s(fwd_j, (q, k, v, cu_q, cu_k, ql, kv), args.warmup, repeats) / n
      if not args.no_backward:
        t_all[i, j] = _median_s(fwd_bwd_j, (q, k, v, do, cu_q, cu_k, ql, kv), args.warmup,
                            repeats) / n
      pairs = float(plan_lib.pairs(kv - ql, kv))
      f = float(plan_lib.task_flops(pairs, hq, dim, backward=False))
      msg = f"q={ql:7d} kv={kv:7d} tasks={n:5d} fwd {t_fwd[i, j] * 1e6:10.1f} us " \
            f"({f / t_fwd[i, j] / 1e12:8.3g} TF/s)"
      if not args.no_backward:
        fb = float(plan_lib.task_flops(pairs, hq, dim, backward=True))
        msg += f"  fwd+bwd {t_all[i, j] * 1e6:10.1f} us ({fb / t_all[i, j] / 1e12:8.3g} TF/s)"
      print(msg, flush=True)

  def _grid(a: np.ndarray) -> list[list[float | None]]:
    return [[None if not np.isfinite(x) else float(x) for x in row] for row in a]

  qg = np.asarray(q_lens, np.float64)[:, None]
  kg = np.asarray(kv_lens, np.float64)[None, :]
  pairs_g = qg * (2 * kg - qg + 1) / 2
  flops_g = plan_lib.task_flops(pairs_g, hq, dim, backward=False)
  with np.errstate(invalid="ignore", divide="ignore"):
    out = {
        "format": "distca-jax cost table v1",
        "q_lens": q_lens, "kv_lens": kv_lens,
        "fwd_s": _grid(t_fwd),
        "fwd_tflops": _grid(flops_g / t_fwd / 1e12),
        "meta": {
            "kernel": args.kernel, "device": str(jax.devices()[0].device_kind),
            "platform": jax.default_backend(), "jax": jax.__version__,
            "q_heads": hq, "kv_heads": hkv, "head_dim": dim, "dtype": str(dtype),
            "tokens_per_call": tokens, "repeats": repeats,
            "bwd_fwd_ratio_for_tflops": plan_lib.BWD_FWD_RATIO,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": experiments.command_line(__file__),
        },
    }
    if not args.no_backward:
      out["fwd_bwd_s"] = _grid(t_all)
      out["fwd_bwd_tflops"] = _grid(flops_g * (1 + plan_lib.BWD_FWD_RATIO) / t_all / 1e12)
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  # Prove the file loads as the scheduler will load it.
  key_name = "fwd_s" if args.no_backward else "fwd_bwd_s"
  table = plan_lib.CostTable.from_json(args.out, key=key_name)
  print(f"wrote {args.out}: {len(q_lens)} x {len(kv_lens)} grid ({key_name}); "
        f"t(q={q_lens[0]}, kv={kv_lens[-1]}) = {float(table.time(q_lens[0], kv_lens[-1])):.3e} s")


if __name__ == "__main__":
  main()
