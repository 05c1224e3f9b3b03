"""distca's plans of an e2e_bench run's timed batches, made on the host without training.

  JAX_NUM_CPU_DEVICES=4 python -m experiments.replan --workloads pretrain,prolong \
      --tokens 32768 --rows-per-rank 2 --nano-batches 1,2 --warmup 2 --steps 6

For every (workload, tokens per GPU, nano-batches) it builds the run e2e_bench would build with
those arguments (`configs/gpu_bench.py` and `--extra` overrides, distca, the CPU kernel), takes the
same timed batches (steps `--warmup` .. `--warmup + --steps - 1`) and plans them again with the
run's own backend (`e2e_bench.plan_stats`: one plan per nano-batch or pipeline tick). It reports
the means over plans (imbalance before and after, share of plans that moved rows, useful and
buffer bytes per device, degraded plans) and per step the plans (nano-batches, or pipeline
ticks) and the useful bytes they carry. With `--nano-batches 1,2` this compares the single
stream's plans with ping-pong's, which plan each nano-batch alone. The mesh needs as many
devices as the GPU run had: on a CPU set `JAX_NUM_CPU_DEVICES` (or `--devices N`, which sets
it). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens", default="131072", help="tokens per GPU (comma list)")
  p.add_argument("--nano-batches", default="1", help="comma list: 1 single stream, 2 ping-pong")
  p.add_argument("--rows-per-rank", type=int, default=0,
                 help="0: nano-batches (x the pipeline's microbatches under mesh.pipe > 1)")
  p.add_argument("--steps", type=int, default=20, help="timed steps of the e2e_bench run")
  p.add_argument("--warmup", type=int, default=2, help="its untimed steps first")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--extra", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--devices", type=int, default=0,
                 help="CPU devices to make (sets JAX_NUM_CPU_DEVICES); 0: as the environment has")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "replan"))
  a = p.parse_args(argv)
  if a.devices < 0:
    p.error(f"--devices={a.devices} must be >= 0 (0 keeps the environment's devices)")
  return a


def replan(a) -> list[dict]:
  """One record per (workload, tokens, nano-batches): the plan means and per-step totals."""
  from distca_jax import trainer
  from experiments import e2e_bench
  out = []
  for workload in a.workloads.split(","):
    for tokens in [int(t) for t in a.tokens.split(",")]:
      for nano in [int(n) for n in a.nano_batches.split(",")]:
        over = e2e_bench.run_overrides(workload, tokens, a.layers, "distca", nano,
                                       a.rows_per_rank, a.warmup + a.steps)
        c, _ = e2e_bench.run_config(a.config, over + ["attention.kernel=blockwise"] + a.extra,
                                    a.rows_per_rank)
        run = trainer.setup_run(c)
        data = run.mesh.shape["data"]
        doclens = [e2e_bench.rows_by_rank(run.source.doclens(s), data, c.rows_per_rank)
                   for s in range(a.warmup, a.warmup + a.steps)]
        stats = e2e_bench.plan_stats(c, run.backend, doclens)
        per_step = stats["plan_count"] / a.steps
        out.append(dict(workload=workload, tokens=tokens, nano_batches=nano,
                        rows_per_rank=c.rows_per_rank, devices=int(run.mesh.size),
                        steps=a.steps, plans_per_step=per_step,
                        useful_mb_per_step=stats["plan_dispatch_useful_mb"] * per_step, **stats))
        print(f"{workload} {tokens} x{nano}: imbalance {stats['plan_imbalance_before']:.3f} -> "
              f"{stats['plan_imbalance_after']:.3f}, moved {stats['plan_moved']:.0%}", flush=True)
  return out


def write(a, records) -> None:
  cmd = experiments.command_line(__file__)
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump({"command": cmd, "date": stamp, "commit": experiments.git_commit(),
               "records": records}, f, indent=1)
  lines = ["# distca's plans of the timed batches, made on the host\n", f"- command: `{cmd}`",
           f"- date: {stamp}; commit: `{experiments.git_commit()}`; host CPU (planning only)\n",
           "| workload | tokens/GPU | nano-batches | rows per GPU | plans per step | imbalance "
           "before -> after | plans that moved rows | useful MB per device per plan | per step | "
           "buffers MB | degraded plans |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in records:
    lines.append(f"| {r['workload']} | {r['tokens']} | {r['nano_batches']} | "
                 f"{r['rows_per_rank']} | {r['plans_per_step']:g} | "
                 f"{r['plan_imbalance_before']:.3f} -> {r['plan_imbalance_after']:.3f} | "
                 f"{r['plan_moved']:.0%} | "
                 f"{r['plan_dispatch_useful_mb']:.1f} | {r['useful_mb_per_step']:.1f} | "
                 f"{r['plan_dispatch_buffer_mb']:.1f} | {r['plan_degraded']} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


def main(argv=None):
  a = parse_args(argv)
  if a.devices:
    os.environ["JAX_NUM_CPU_DEVICES"] = str(a.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  write(a, replan(a))


if __name__ == "__main__":
  main()
