"""Planning time of ``distca_jax.plan.schedule`` on one CPU core (Pretrain, 128K budgets).

Plans are made on the host while the previous step runs, so they must be cheap: the targets are
<= 20 ms per plan for 64 servers and <= 200 ms for 512 servers with 128K-token budgets on the
Pretrain workload. The process pins itself to one core; the machine's load average is recorded
because other processes sharing the core inflate the numbers (the minimum is the least disturbed).

Run:
  python -m experiments.plan_bench            # writes results/plan_bench.{json,md}
  python -m experiments.plan_bench --steps 5  # quicker
"""

from __future__ import annotations

import os

# One core, one thread: set before NumPy loads its thread pools.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_var, "1")

import argparse
import json
import platform
import time

import numpy as np


from distca_jax import plan as plan_lib
from distca_jax.data.workloads import WorkloadSampler
import experiments

_TARGET_MS = {64: 20.0, 512: 200.0}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workload", default="pretrain", choices=("pretrain", "prolong"))
  p.add_argument("--tokens-per-rank", type=int, default=131072)
  p.add_argument("--servers", default="64,512")
  p.add_argument("--steps", type=int, default=20, help="batches (plans) per server count")
  p.add_argument("--tolerance", type=float, default=plan_lib.DEFAULT_TOLERANCE)
  p.add_argument("--out", default="results/plan_bench")
  args = p.parse_args()
  core = experiments.pin_to_one_core()
  command = experiments.command_line(__file__)
  t = args.tokens_per_rank
  sampler = WorkloadSampler(args.workload, t, seed=0)
  rows = []
  load_before = os.getloadavg()
  for s in [int(v) for v in args.servers.split(",")]:
    layouts = [sampler.flat_doclens(step, s) for step in range(args.steps + 1)]
    plan_lib.schedule(layouts[-1], s, tokens_per_rank=t,
                      options=plan_lib.PlanOptions(tolerance=args.tolerance))  # warm up
    times, cpu, meta_times, moves, imb_b, imb_a, docs = [], [], [], [], [], [], []
    for doc_lens in layouts[:-1]:
      t0, c0 = time.perf_counter(), time.thread_time()
      plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t,
                               options=plan_lib.PlanOptions(tolerance=args.tolerance))
      times.append(time.perf_counter() - t0)
      cpu.append(time.thread_time() - c0)
      t0 = time.perf_counter()
      plan_lib.plan_to_metadata(plan, ranks=[0])  # one device's tables, as one host builds
      meta_times.append(time.perf_counter() - t0)
      moves.append(plan.num_moves)
      imb_b.append(plan.imbalance_before)
      imb_a.append(plan.imbalance_after)
      docs.append(int(plan.doc_lens.size))
    ms = np.asarray(times) * 1e3
    row = {
        "servers": s, "tokens_per_rank": t, "workload": args.workload, "plans": len(times),
        "docs_mean": float(np.mean(docs)), "moves_mean": float(np.mean(moves)),
        "imbalance_before_mean": float(np.mean(imb_b)),
        "imbalance_after_max": float(np.max(imb_a)),
        "plan_ms_min": float(ms.min()), "plan_ms_median": float(np.median(ms)),
        "plan_ms_p90": float(np.percentile(ms, 90)), "plan_ms_max": float(ms.max()),
        "plan_cpu_ms_median": float(np.median(cpu) * 1e3),
        "metadata_one_rank_ms_median": float(np.median(meta_times) * 1e3),
        "target_ms": _TARGET_MS.get(s),
    }
    row["meets_target_median"] = (None if row["target_ms"] is None
                                  else row["plan_ms_median"] <= row["target_ms"])
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = {
      "command": command, "tolerance": args.tolerance, "rows": rows,
      "cpu": platform.processor() or platform.machine(), "pinned_core": core,
      "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
      "numpy": np.__version__, "python": platform.python_version(),
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(out, f, indent=1)
  lines = [
      "# Scheduler planning time (one CPU core)", "", f"Command: `{command}`", "",
      f"Workload {args.workload}, {t // 1024}K tokens per rank, tolerance {args.tolerance}; "
      f"{args.steps} batches per row; process pinned to core {core}; load average "
      f"{load_before[0]:.1f} before, {out['loadavg_after'][0]:.1f} after (a shared machine "
      "inflates wall times; the minimum is the least disturbed, and the thread's CPU time is "
      "what planning costs a free core).", "",
      "| servers | docs | moves | imbalance before -> after (worst) | plan ms min | median | "
      "p90 | max | CPU ms median | target | metadata, one rank (ms) |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['servers']} | {r['docs_mean']:.0f} | {r['moves_mean']:.0f} | "
        f"{r['imbalance_before_mean']:.2f} -> {r['imbalance_after_max']:.3f} | "
        f"{r['plan_ms_min']:.1f} | {r['plan_ms_median']:.1f} | {r['plan_ms_p90']:.1f} | "
        f"{r['plan_ms_max']:.1f} | {r['plan_cpu_ms_median']:.1f} | {r['target_ms'] or '-'} | "
        f"{r['metadata_one_rank_ms_median']:.1f} |")
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  main()
