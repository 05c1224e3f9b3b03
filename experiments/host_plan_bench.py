"""Host-aware vs host-blind planning: bytes between hosts, balance and planning time (host only).

Plans seeded batches of the Pretrain and ProLong workloads (flat layouts, documents span ranks)
at 128K tokens per GPU over 64 servers in 8 hosts of 8 with the host-blind planner
(``servers_per_host=None``) and the host-aware one (``servers_per_host=8``), default tolerance
and byte model (Llama-3-8B attention, bf16), no caps. Per workload: dispatch bytes between hosts
and inside hosts (both plans counted on the same 8 hosts), the final imbalance, the work that
crosses hosts (pairs computed on another host than their query rows' owner) against the least
that must (each host's load above 8 x the final limit), and the planning time. Then the planning
time at 512 servers (64 hosts of 8). Gates: inter-host bytes host-aware / host-blind <= 0.4
(summed over the batches), final imbalance within 0.01 of the host-blind plan's (every batch),
planning <= 200 ms per plan at 512 servers (median). The process pins itself to one core; the
machine's load average is recorded (other processes sharing the core inflate the times; the
thread's CPU time is what planning costs a free core).

Run:
  python -m experiments.host_plan_bench            # writes results/host_plan_bench.{json,md}
  python -m experiments.host_plan_bench --steps 2 --timing-steps 2   # quicker
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

GiB = 2.0**30
_GATES = {"inter_ratio": 0.4, "imbalance_gap": 0.01, "plan_ms_512": 200.0}


def cross_host_work(plan: plan_lib.Plan, per_host: int) -> int:
  """Pairs computed on a host other than the one owning their query rows."""
  t, host_tokens = plan.tokens_per_rank, per_host * plan.tokens_per_rank
  out = 0
  for doc, a, b, srv in plan.tasks.tolist():
    g = int(plan.doc_starts[doc])
    lo = a
    while lo < b:  # the task's query rows, cut where their owning host changes
      hi = min(b, (g + lo) // host_tokens * host_tokens + host_tokens - g)
      if (g + lo) // t // per_host != srv // per_host:
        out += int(plan_lib.pairs(lo, hi))
      lo = hi
  return out


def least_cross_host_work(plan: plan_lib.Plan, per_host: int) -> float:
  """Work that must leave its host for every server to end within the plan's final maximum:
  each host's load above ``per_host`` times that maximum."""
  host_loads = plan.loads_before.reshape(-1, per_host).sum(1)
  return float(np.maximum(host_loads - per_host * plan.loads_after.max(), 0).sum())


def inter_host_bytes_once_per_host(plan: plan_lib.Plan, per_host: int) -> int:
  """Dispatch bytes between hosts if each key/value row crossed once per destination host
  (relayed inside it to every server there that reads it) instead of once per server: the
  plan's query rows between hosts plus, per (document, host), the rows of the longest key range
  any server of that host reads that the host does not own. What a host-deduplicating leg A
  would send; the two-level exchange sends ``Plan.link_bytes``."""
  t = plan.tokens_per_rank
  qb = plan.q_heads * plan.head_dim * plan.dtype_bytes
  kvb = 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes
  host = np.arange(plan.num_servers) // per_host
  q_rows = int(plan.pair_q_rows[host[:, None] != host[None, :]].sum())
  reach: dict[tuple[int, int], int] = {}
  for doc, _, b, srv in plan.tasks.tolist():
    key = (doc, srv // per_host)
    reach[key] = max(reach.get(key, 0), b)
  kv_rows = 0
  for (doc, h), b in reach.items():
    g = int(plan.doc_starts[doc])
    lo, hi = h * per_host * t, (h + 1) * per_host * t
    kv_rows += b - max(0, min(g + b, hi) - max(g, lo))
  return q_rows * qb + kv_rows * kvb


def _kv_share(plan: plan_lib.Plan, per_host: int) -> float:
  """Key/value rows' share of the plan's dispatch bytes between hosts."""
  host = np.arange(plan.num_servers) // per_host
  cross = host[:, None] != host[None, :]
  kv = float(plan.pair_kv_rows[cross].sum()) * 2 * plan.kv_heads * plan.head_dim * plan.dtype_bytes
  return kv / max(plan.link_bytes(per_host)[1], 1)


def _timed(doc_lens, s, t, options):
  t0, c0 = time.perf_counter(), time.thread_time()
  plan = plan_lib.schedule(doc_lens, s, tokens_per_rank=t, options=options)
  return plan, (time.perf_counter() - t0) * 1e3, (time.thread_time() - c0) * 1e3


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens-per-rank", type=int, default=131072)
  p.add_argument("--servers", type=int, default=64)
  p.add_argument("--servers-per-host", type=int, default=8)
  p.add_argument("--steps", type=int, default=8, help="batches per workload")
  p.add_argument("--timing-servers", type=int, default=512)
  p.add_argument("--timing-steps", type=int, default=8, help="batches per workload, timing")
  p.add_argument("--tolerance", type=float, default=plan_lib.DEFAULT_TOLERANCE)
  p.add_argument("--out", default="results/host_plan_bench")
  args = p.parse_args()
  core = experiments.pin_to_one_core()
  command = experiments.command_line(__file__)
  t, L = args.tokens_per_rank, args.servers_per_host
  blind_opts = plan_lib.PlanOptions(tolerance=args.tolerance)
  aware_opts = plan_lib.PlanOptions(tolerance=args.tolerance, servers_per_host=L)
  load_before = os.getloadavg()
  rows, timing = [], []
  for name in args.workloads.split(","):
    sampler = WorkloadSampler(name, t, seed=0)
    s = args.servers
    per = []
    for step in range(args.steps):
      doc_lens = sampler.flat_doclens(step, s)
      blind, b_ms, b_cpu = _timed(doc_lens, s, t, blind_opts)
      aware, a_ms, a_cpu = _timed(doc_lens, s, t, aware_opts)
      total = float(blind.loads_before.sum())
      per.append({
          "step": step, "imbalance_before": blind.imbalance_before,
          "blind": {"intra": blind.link_bytes(L)[0], "inter": blind.link_bytes(L)[1],
                    "imbalance": blind.imbalance_after, "moves": blind.num_moves,
                    "cross_work": cross_host_work(blind, L) / total, "ms": b_ms, "cpu_ms": b_cpu,
                    "inter_once": inter_host_bytes_once_per_host(blind, L),
                    "degraded": blind.degraded},
          "aware": {"intra": aware.intra_host_bytes, "inter": aware.inter_host_bytes,
                    "imbalance": aware.imbalance_after, "moves": aware.num_moves,
                    "cross_work": cross_host_work(aware, L) / total, "ms": a_ms, "cpu_ms": a_cpu,
                    "inter_once": inter_host_bytes_once_per_host(aware, L),
                    "degraded": aware.degraded},
          "least_cross_work": least_cross_host_work(aware, L) / total,
          "host_load_max": float(aware.loads_before.reshape(-1, L).sum(1).max()) * s / L / total,
          "aware_kv_share": _kv_share(aware, L),
      })
    agg = {"workload": name, "servers": s, "servers_per_host": L, "tokens_per_rank": t,
           "batches": per}
    for k in ("blind", "aware"):
      agg[k] = {
          "inter_gib": sum(r[k]["inter"] for r in per) / GiB,
          "inter_once_gib": sum(r[k]["inter_once"] for r in per) / GiB,
          "intra_gib": sum(r[k]["intra"] for r in per) / GiB,
          "imbalance_max": max(r[k]["imbalance"] for r in per),
          "cross_work_mean": float(np.mean([r[k]["cross_work"] for r in per])),
          "moves_mean": float(np.mean([r[k]["moves"] for r in per])),
          "cpu_ms_median": float(np.median([r[k]["cpu_ms"] for r in per])),
          "ms_median": float(np.median([r[k]["ms"] for r in per])),
      }
    agg["host_load_max_median"] = float(np.median([r["host_load_max"] for r in per]))
    agg["aware_kv_share"] = float(np.mean([r["aware_kv_share"] for r in per]))
    agg["least_cross_work_mean"] = float(np.mean([r["least_cross_work"] for r in per]))
    agg["inter_ratio"] = agg["aware"]["inter_gib"] / agg["blind"]["inter_gib"]
    agg["inter_once_ratio"] = agg["aware"]["inter_once_gib"] / agg["blind"]["inter_gib"]
    agg["inter_ratio_per_batch_max"] = max(r["aware"]["inter"] / r["blind"]["inter"] for r in per)
    agg["imbalance_gap_max"] = max(r["aware"]["imbalance"] - r["blind"]["imbalance"] for r in per)
    agg["meets_inter_gate"] = agg["inter_ratio"] <= _GATES["inter_ratio"]
    agg["meets_imbalance_gate"] = agg["imbalance_gap_max"] <= _GATES["imbalance_gap"]
    rows.append(agg)
    print(json.dumps({k: v for k, v in agg.items() if k != "batches"}), flush=True)
  for name in args.workloads.split(","):
    s = args.timing_servers
    sampler = WorkloadSampler(name, t, seed=0)
    layouts = [sampler.flat_doclens(step, s) for step in range(args.timing_steps + 1)]
    _timed(layouts[-1], s, t, aware_opts)  # warm up
    row = {"workload": name, "servers": s, "servers_per_host": L, "plans": args.timing_steps}
    # Interleaved, so both planners see the same load on a shared machine.
    both = [(_timed(dl, s, t, blind_opts), _timed(dl, s, t, aware_opts)) for dl in layouts[:-1]]
    for i, k in enumerate(("blind", "aware")):
      res = [pair[i] for pair in both]
      ms = np.asarray([r[1] for r in res])
      cpu = np.asarray([r[2] for r in res])
      row[k] = {"ms_median": float(np.median(ms)), "ms_max": float(ms.max()),
                "cpu_ms_median": float(np.median(cpu)), "cpu_ms_max": float(cpu.max()),
                "imbalance_max": max(r[0].imbalance_after for r in res),
                "inter_gib": sum(r[0].link_bytes(L)[1] for r in res) / GiB}
    row["meets_time_gate"] = row["aware"]["cpu_ms_median"] <= _GATES["plan_ms_512"]
    timing.append(row)
    print(json.dumps(row), flush=True)
  out = {
      "command": command, "commit": experiments.git_commit(), "tolerance": args.tolerance,
      "gates": _GATES, "rows": rows, "timing": timing,
      "machine": f"{platform.node()}: {os.cpu_count()} CPU cores, "
                 f"{platform.processor() or platform.machine()}, no accelerator",
      "pinned_core": core, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
      "numpy": np.__version__, "python": platform.python_version(),
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(out, f, indent=1)
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(_markdown(out, args)) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


def _markdown(out, args) -> list[str]:
  t = args.tokens_per_rank
  lines = [
      "# Host-aware planning: bytes between hosts, balance, planning time", "",
      f"Command: `{out['command']}`; commit `{out['commit']}`; machine: {out['machine']}, "
      f"process pinned to core {out['pinned_core']}; load average {out['loadavg_before'][0]:.1f}"
      f" before, {out['loadavg_after'][0]:.1f} after (other processes on the core inflate the "
      "times; CPU ms is the planning thread's own time).", "",
      f"{args.steps} batches per workload, {t // 1024}K tokens per GPU, {args.servers} servers in "
      f"{args.servers // args.servers_per_host} hosts of {args.servers_per_host}, tolerance "
      f"{out['tolerance']}, no caps; both plans' bytes are counted on the same hosts. Bytes: "
      "forward dispatch (Q rows plus K and V rows), summed over the batches. Cross-host work: "
      "the share of all pairs computed on another host than their query rows' owner (mean over "
      "batches); 'least' is each host's load above 8 x the host-aware plan's final maximum, "
      "which no plan ending there can keep home.", ""]
  verdict = lambda ok: "meets" if ok else "misses"
  lines += _table(
      ["workload", "inter-host GiB blind -> aware", "ratio (gate <= 0.4)", "worst batch",
       "in-host GiB blind -> aware", "imbalance blind / aware (worst)",
       "cross-host work blind / aware / least", "moves blind / aware",
       "plan CPU ms blind / aware (median)"],
      [[r["workload"], f"{r['blind']['inter_gib']:.1f} -> {r['aware']['inter_gib']:.1f}",
        f"**{r['inter_ratio']:.2f}** ({verdict(r['meets_inter_gate'])})",
        f"{r['inter_ratio_per_batch_max']:.2f}",
        f"{r['blind']['intra_gib']:.1f} -> {r['aware']['intra_gib']:.1f}",
        f"{r['blind']['imbalance_max']:.3f} / {r['aware']['imbalance_max']:.3f} (gap <= "
        f"{r['imbalance_gap_max']:+.3f}: {verdict(r['meets_imbalance_gate'])})",
        f"{r['blind']['cross_work_mean']:.3f} / {r['aware']['cross_work_mean']:.3f} / "
        f"{r['least_cross_work_mean']:.3f}",
        f"{r['blind']['moves_mean']:.0f} / {r['aware']['moves_mean']:.0f}",
        f"{r['blind']['cpu_ms_median']:.1f} / {r['aware']['cpu_ms_median']:.1f}"]
       for r in out["rows"]])
  lines += [
      "", "Where the bytes between hosts come from: the largest host's load over the mean host's "
      "(median over batches), the key/value rows' share of the host-aware plan's bytes between "
      "hosts, and those bytes if each key/value row crossed once per destination host (relayed "
      "inside it) instead of once per destination server as the two-level exchange sends them "
      "(`inter_host_bytes_once_per_host`; against the host-blind plan as sent):", ""]
  lines += _table(
      ["workload", "largest host load / mean", "key/value share (aware)",
       "inter-host GiB once per host blind / aware", "aware once per host / blind as sent"],
      [[r["workload"], f"{r['host_load_max_median']:.2f}", f"{r['aware_kv_share']:.2f}",
        f"{r['blind']['inter_once_gib']:.1f} / {r['aware']['inter_once_gib']:.1f}",
        f"{r['inter_once_ratio']:.2f}"] for r in out["rows"]])
  lines += [
      "", f"Planning time at {args.timing_servers} servers "
      f"({args.timing_servers // args.servers_per_host} hosts of {args.servers_per_host}), "
      f"{t // 1024}K tokens per GPU, {args.timing_steps} batches per workload (gate: host-aware "
      "<= 200 ms per plan, median CPU time, on this machine):", ""]
  lines += _table(
      ["workload", "blind CPU ms median / max", "aware CPU ms median / max",
       "wall ms blind / aware (median)", "imbalance blind / aware (worst)",
       "inter-host GiB blind -> aware", "gate"],
      [[r["workload"], f"{r['blind']['cpu_ms_median']:.0f} / {r['blind']['cpu_ms_max']:.0f}",
        f"{r['aware']['cpu_ms_median']:.0f} / {r['aware']['cpu_ms_max']:.0f}",
        f"{r['blind']['ms_median']:.0f} / {r['aware']['ms_median']:.0f}",
        f"{r['blind']['imbalance_max']:.3f} / {r['aware']['imbalance_max']:.3f}",
        f"{r['blind']['inter_gib']:.0f} -> {r['aware']['inter_gib']:.0f}",
        verdict(r["meets_time_gate"])] for r in out["timing"]])
  return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
  """A markdown table's lines."""
  return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
      "| " + " | ".join(r) + " |" for r in rows]


if __name__ == "__main__":
  main()
