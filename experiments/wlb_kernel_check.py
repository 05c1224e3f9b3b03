"""WLB-ideal's per-rank core-attention time on real packings: measured on one GPU vs the simulator.

  python -m experiments.wlb_kernel_check --out results/micro/wlb_kernel_check

For each workload it builds the run a training job with ``attention.backend=wlb`` and WLB-ideal
(``attention.baselines.cp_size=0``, ``wlb_alpha=0``) would be on ``--ranks`` data ranks of
``--tokens`` tokens (configs/gpu_bench.py: Llama-3-8B shapes, ``--layers`` layers), and lets the
backend's own host code do what training does: ``backends.build`` picks the split and alpha
(``baselines.ideal.choose_wlb`` on batches the run never trains on), ``trainer.add_host_plan`` packs each
sampled batch (WLB packing, per-document CP, task tables). Then, rank after rank on ONE device, it
times forward + backward of the call ``baselines.device.group_attention`` makes on that rank
(``ops.core_attention`` of the rank's queries, its key buffer and its task table; the K/V
all-gather and the gather into the key buffer are left out) with ``profiling.time_call``.

Next to each rank: the simulator's kernel model on the same tasks (``sim.validate.kernel_model``:
the FA3 cost table plus the fitted time per task; one layer, forward + backward),
and ``sim.step.run_wlb``'s per-rank seconds (the simulator's own packing of the same documents,
which must give the same tasks). Per batch: the imbalance (max / mean over ranks) measured and
predicted. Writes OUT.json (with every rank's task lengths, so ``sim.validate`` can replay the tables with
the current kernel model) and OUT.md.

``--tiny``: a tiny model on short rows with the 'auto' kernel (a CPU smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os

import numpy as np

import experiments
from distca_jax.plan import cost as plan_cost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = ("model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
              "model.mlp_dim=128", "model.vocab_size=256", "model.dtype=float32")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--ranks", type=int, default=8, help="data ranks of the packed run")
  p.add_argument("--tokens", type=int, default=131072, help="tokens per rank (row length T)")
  p.add_argument("--layers", type=int, default=32,
                 help="model layers (WLB's balance length depends on them)")
  p.add_argument("--steps", type=int, default=2, help="sampled batches (training steps 0..)")
  p.add_argument("--iters", type=int, default=3, help="timed trials per rank")
  p.add_argument("--kernel", default="flash3", help="ops.core_attention kernel")
  p.add_argument("--tasks-per-row", type=int, default=0,
                 help="attention.baselines.wlb_tasks_per_row (0: sized by the backend from "
                      "sampled batches at its configuration)")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--tiny", action="store_true",
                 help="tiny model, 4 ranks of 1024 tokens, kernel 'auto' (CPU)")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "micro", "wlb_kernel_check"))
  a = p.parse_args(argv)
  if a.tiny:
    a.ranks, a.tokens, a.layers, a.iters, a.kernel = 4, 1024, 2, 1, "auto"
  return a


def run_config(a, workload: str):
  """The training config of a WLB-ideal run of ``workload`` (host side only: no mesh is built)."""
  from distca_jax import configs_io  # pylint: disable=import-outside-toplevel
  over = [f"data.workload={workload}", f"tokens_per_rank={a.tokens}", "rows_per_rank=1",
          f"model.n_layers={a.layers}", f"mesh.data={a.ranks}", "attention.backend=wlb",
          "attention.baselines.cp_size=0", "attention.baselines.wlb_alpha=0",
          f"attention.kernel={a.kernel}",
          f"attention.baselines.wlb_tasks_per_row={a.tasks_per_row}"]
  return configs_io.load_config(a.config, over + (list(TINY_MODEL) if a.tiny else []))


def rank_tables(arranged: dict) -> list[tuple[np.ndarray, np.ndarray, int, int]]:
  """Per rank (one row each): (cu_seqlens_q, cu_seqlens_k, query rows, key-buffer rows) of the
  call ``group_attention`` makes on an arranged batch."""
  from distca_jax.baselines import EXTRA_PREFIX  # pylint: disable=import-outside-toplevel
  cu_q = np.asarray(arranged[EXTRA_PREFIX + "cu_seqlens_q"])
  cu_k = np.asarray(arranged[EXTRA_PREFIX + "cu_seqlens_k"])
  rows, t = np.asarray(arranged["segment_ids"]).shape
  nkv = np.asarray(arranged[EXTRA_PREFIX + "kv_index"]).shape[1]
  return [(cu_q[r], cu_k[r], t, nkv) for r in range(rows)]


def predicted_s(cu_q, cu_k, dims, km) -> float:
  """The kernel model's seconds of a task table (one layer, forward + backward)."""
  lq, lk = np.diff(cu_q), np.diff(cu_k)
  keep = lq > 0
  return float(km.task_seconds(lq[keep], lk[keep], dims).sum())


@functools.lru_cache(maxsize=None)
def _fwd_bwd(kernel: str, bounds: tuple[int, int] | None):
  import jax  # pylint: disable=import-outside-toplevel
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  kw = {} if bounds is None else dict(max_seqlen_q=bounds[0], max_seqlen_k=bounds[1],
                                      grid_levels=1)

  def fwd_bwd(q, k, v, cu_q, cu_k):
    o, vjp = jax.vjp(lambda q, k, v: ops.core_attention(q, k, v, cu_q, cu_k, kernel=kernel,
                                                        **kw), q, k, v)
    return vjp(o)

  return jax.jit(fwd_bwd)


@functools.lru_cache(maxsize=4)
def _inputs(nq: int, nkv: int, heads: int, kv_heads: int, head_dim: int, dtype: str):
  import jax  # pylint: disable=import-outside-toplevel
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(kq, (nq, heads, head_dim), dtype),
          jax.random.normal(kk, (nkv, kv_heads, head_dim), dtype),
          jax.random.normal(kv, (nkv, kv_heads, head_dim), dtype))


def tight_bounds(cu_q, cu_k) -> tuple[int, int]:
  """flash3 launch bounds just above the longest task: the next power of two >= 128 (a few
  shapes to compile, at most 2x the longest task)."""
  up = lambda x: int(max(128, 1 << (int(x) - 1).bit_length()))
  return up(np.diff(cu_q).max()), up(np.diff(cu_k).max())


def measure_s(cu_q, cu_k, nq: int, nkv: int, model_cfg, kernel: str, iters: int,
              tight: bool = False) -> float:
  """Median seconds of forward + backward of one rank's call (``profiling.time_call``).

  ``tight``: one flash3 launch shape with bounds ``tight_bounds`` instead of the buffers'
  lengths (and their launch buckets) the backend's call runs with.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel
  m = model_cfg
  q, k, v = _inputs(nq, nkv, m.n_heads, m.n_kv_heads, m.head_dim, m.dtype)
  fn = _fwd_bwd(kernel, tight_bounds(cu_q, cu_k) if tight else None)
  t = profiling.time_call(fn, q, k, v, jnp.asarray(cu_q, jnp.int32),
                          jnp.asarray(cu_k, jnp.int32), iters=iters)
  return t["median_s"]


def imbalance(x) -> float:
  x = np.asarray(x, np.float64)
  return float(x.max() / x.mean()) if x.size and x.mean() > 0 else 1.0


def check_workload(a, workload: str, km, measure=measure_s) -> dict:
  """One workload: the WLB-ideal choice, per-rank rows of every sampled batch, per-batch
  imbalance. ``measure(cu_q, cu_k, nq, nkv, model_cfg, kernel, iters, tight) -> seconds``;
  the tight launch bounds are timed too where the kernel takes them ('flash3')."""
  # pylint: disable=import-outside-toplevel
  from distca_jax import backends, trainer
  from distca_jax import config as config_lib
  from distca_jax.data import make_source
  from distca_jax.sim import costs, step
  c = run_config(a, workload)
  model_cfg = config_lib.model_config(c)
  spec = costs.spec_of_model("run", model_cfg)
  # WLB-ideal: the best predicted split and alpha
  opts = backends.wlb.from_first_batches(c, backends.wlb.Options.from_config(c))
  backend = backends.wlb.make(opts)
  src = make_source(c.data, rows=a.ranks, tokens_per_row=a.tokens,
                    vocab_size=model_cfg.vocab_size, seed=c.seed)
  variants = ("call", "tight") if a.kernel == "flash3" else ("call",)
  rows, batches, row_tokens = [], [], 0
  for s in range(a.steps):
    doclens = src.doclens(s)
    arranged = trainer.add_host_plan(src.batch(s), backend, doclens, a.tokens)
    sim = step.run_wlb(doclens, a.tokens, spec, km, opts.cp_size, opts.alpha)
    first = len(rows)
    for r, (cq, ck, nq, nkv) in enumerate(rank_tables(arranged)):
      row_tokens = nq
      p = predicted_s(cq, ck, spec.dims, km)
      lq = np.diff(cq)
      keep = lq > 0
      row = dict(workload=workload, step=s, rank=r, tasks=int(keep.sum()),
                 tokens=int(lq.sum()), q_rows=nq, kv_rows=nkv,
                 pairs=int(plan_cost.attention_pairs(cq, ck)), predicted_ms=p * 1e3,
                 sim_step_ms=float(sim.attn_s[r]) * 1e3, q_lens=lq[keep].tolist(),
                 kv_lens=np.diff(ck)[keep].tolist())
      for v in variants:
        ms = measure(cq, ck, nq, nkv, model_cfg, a.kernel, a.iters, v == "tight")
        row[f"measured_{v}_ms"] = ms * 1e3
        row[f"error_{v}"] = p / ms - 1.0
      rows.append(row)
      print(f"{workload} step {s} rank {r}: predicted {p * 1e3:8.2f} ms, measured "
            + ", ".join(f"{v} {row[f'measured_{v}_ms']:8.2f} ms ({row[f'error_{v}']:+.1%})"
                        for v in variants), flush=True)
    b = dict(workload=workload, step=s)
    for key in ["predicted_ms"] + [f"measured_{v}_ms" for v in variants]:
      x = [r[key] for r in rows[first:]]
      b[key.replace("_ms", "_max_ms")] = max(x)
      b[key.replace("_ms", "_imbalance")] = imbalance(x)
    batches.append(b)
  return dict(workload=workload, cp_size=opts.cp_size, alpha=opts.alpha, row_tokens=row_tokens,
              q_heads=model_cfg.n_heads, head_dim=model_cfg.head_dim, variants=list(variants),
              rows=rows, batches=batches)


def summarize(workloads: list[dict]) -> dict:
  """Per workload: errors over every rank row, imbalance means over batches, and how far the
  simulator's own packing (``run_wlb``) is from the backend's tables."""
  out = {}
  for w in workloads:
    s = dict(rank_rows=len(w["rows"]), predicted_imbalance=float(np.mean(
        [b["predicted_imbalance"] for b in w["batches"]])),
             sim_step_max_rel_diff=float(max(abs(r["sim_step_ms"] / r["predicted_ms"] - 1.0)
                                             for r in w["rows"] if r["predicted_ms"] > 0)))
    for v in w["variants"]:
      err = np.array([r[f"error_{v}"] for r in w["rows"]])
      s[f"mean_abs_error_{v}"] = float(np.abs(err).mean())
      s[f"max_abs_error_{v}"] = float(np.abs(err).max())
      s[f"measured_{v}_imbalance"] = float(np.mean([b[f"measured_{v}_imbalance"]
                                                    for b in w["batches"]]))
    out[w["workload"]] = s
  return out


def markdown(res: dict) -> str:
  vs = res["workloads"][0]["variants"]
  lines = [f"# WLB-ideal per-rank core attention: one-GPU measurement vs the simulator "
           f"({res['date']})", "", f"Command: `{res['command']}`", "",
           f"Device: 1 x {res['device']}; kernel `{res['kernel']}`; {res['ranks']} ranks x "
           f"{res['tokens']} tokens, {res['layers']}-layer model (WLB-ideal's choice below). "
           "Each rank: forward + backward of one layer's call, median of the timed trials; "
           "'call' is the wlb backend's call as it runs (launch bounds = buffer lengths), "
           "'tight' the same tasks in one flash3 launch shape whose bounds are the next power of two "
           "above the longest task. Predicted: "
           "the simulator's kernel model (cost table + "
           f"{res['task_s'] * 1e6:.0f} us per task). Imbalance: max / mean "
           "over ranks, mean over batches.", "",
           "| workload | cp | alpha | Lmax | rank rows | "
           + " | ".join(f"mean / max abs err ({v})" for v in vs)
           + " | imbalance predicted | " + " | ".join(f"imbalance measured ({v})" for v in vs)
           + " |", "|---" * (6 + 2 * len(vs)) + "|"]
  for w in res["workloads"]:
    s = res["summary"][w["workload"]]
    lines.append(f"| {w['workload']} | {w['cp_size']} | {w['alpha']:g} | {w['row_tokens']} | "
                 f"{s['rank_rows']} | "
                 + " | ".join(f"{s[f'mean_abs_error_{v}']:.1%} / {s[f'max_abs_error_{v}']:.1%}"
                              for v in vs)
                 + f" | {s['predicted_imbalance']:.3f} | "
                 + " | ".join(f"{s[f'measured_{v}_imbalance']:.3f}" for v in vs) + " |")
  lines += ["", "| workload | step | rank | tasks | tokens | pairs (M) | predicted ms | "
            + " | ".join(f"measured ms ({v}) | error ({v})" for v in vs) + " |",
            "|---" * (7 + 2 * len(vs)) + "|"]
  for w in res["workloads"]:
    for r in w["rows"]:
      lines.append(f"| {r['workload']} | {r['step']} | {r['rank']} | {r['tasks']} | "
                   f"{r['tokens']} | {r['pairs'] / 1e6:.0f} | {r['predicted_ms']:.2f} | "
                   + " | ".join(f"{r[f'measured_{v}_ms']:.2f} | {r[f'error_{v}']:+.1%}"
                                for v in vs) + " |")
  lines += ["", "| workload | step | max ms predicted | imbalance predicted | "
            + " | ".join(f"max ms measured ({v}) | imbalance measured ({v})" for v in vs) + " |",
            "|---" * (4 + 2 * len(vs)) + "|"]
  for w in res["workloads"]:
    for b in w["batches"]:
      lines.append(f"| {b['workload']} | {b['step']} | {b['predicted_max_ms']:.2f} | "
                   f"{b['predicted_imbalance']:.3f} | "
                   + " | ".join(f"{b[f'measured_{v}_max_ms']:.2f} | "
                                f"{b[f'measured_{v}_imbalance']:.3f}" for v in vs) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  a = parse_args(argv)
  import jax  # pylint: disable=import-outside-toplevel
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel
  from distca_jax.sim import validate  # pylint: disable=import-outside-toplevel
  km, _ = validate.kernel_model()
  res = dict(command=experiments.command_line(__file__, argv), device=jax.devices()[0].device_kind,
             date=datetime.datetime.now().isoformat(timespec="seconds"), kernel=a.kernel,
             ranks=a.ranks, tokens=a.tokens, layers=a.layers, task_s=km.task_s,
             summary={}, workloads=[])
  for w in a.workloads.split(","):
    res["workloads"].append(check_workload(a, w, km))
    res["summary"] = summarize(res["workloads"])
    profiling.write_tables(a.out, res, markdown(res))  # after each workload: a killed run keeps it
  return res


if __name__ == "__main__":
  main()
