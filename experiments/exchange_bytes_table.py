"""Bytes the CAD exchange puts on the wire: one joint bucket vs Q and K/V buckets apart (host only).

For each workload, tokens per device and server count, batches are planned the way training
plans them (``WorkloadSampler.step_doclens``, one row per device): caps from the first
``--cap-batches`` batches x ``--headroom`` (what ``config.attention.distca.caps_from_batches`` /
``caps_headroom`` do at startup), then the next ``--batches`` batches are planned under those
caps and their exchange is accounted by ``plan_lib.exchange_bytes`` twice: with the joint bucket
(one fraction sizes both parts of a slot) and with ``split_exchange`` (each part its own bucket).

Reported per configuration, summed over the planned batches that move anything:
  useful   the busiest (sender, server) slot's rows, the least any bucket must carry per slot
           (``exchange_rows`` x row bytes, times S - 1 peers);
  moved    what the chosen buckets carry off-device per device;
and moved / useful for both modes (1.0 = no padding). No device runs: this is the plan's
arithmetic; the time of the two modes needs ``experiments/dispatch_bench.py --split-exchange``
on GPUs.

Run:
  python experiments/exchange_bytes_table.py     # writes results/split_exchange_bytes.{json,md}
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shlex
import sys


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from distca_jax import profiling  # noqa: E402
from distca_jax import plan as plan_lib  # noqa: E402
from distca_jax.data.workloads import WorkloadSampler  # noqa: E402


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens-per-rank", default="65536,131072")
  p.add_argument("--servers", default="2,4,8")
  p.add_argument("--cap-batches", type=int, default=8,
                 help="batches whose envelope sets the caps (the trainer's caps_from_batches)")
  p.add_argument("--headroom", type=float, default=1.1, help="caps = envelope x this")
  p.add_argument("--batches", type=int, default=16, help="batches accounted after those")
  p.add_argument("--exchange-buckets", type=int, default=plan_lib.DEFAULT_EXCHANGE_BUCKETS)
  p.add_argument("--tolerance", type=float, default=0.05)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype-bytes", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=os.path.join(REPO, "results", "split_exchange_bytes"))
  a = p.parse_args()
  for name in ("cap_batches", "batches", "exchange_buckets"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
  if a.headroom < 1:
    p.error(f"--headroom={a.headroom} must be >= 1 (a margin over the sampled batches)")
  return a


def _caps(layouts, s: int, t: int, a, byte_model) -> plan_lib.Capacity:
  """The trainer's startup caps: the envelope of ``layouts`` x headroom, whole row multiples,
  at least a device's rows (``plan.sizing.startup_capacity``)."""
  env = plan_lib.suggest_capacity(layouts, s, t, tolerance=a.tolerance,
                                  min_shard=plan_lib.auto_min_shard(t),
                                  multiple=plan_lib.row_multiple(t), **byte_model)
  caps = plan_lib.caps_with_headroom(dataclasses.asdict(env), t, a.headroom)
  return plan_lib.Capacity(**caps, tasks=env.tasks)


def run_config(name: str, t: int, s: int, a) -> dict:
  byte_model = dict(q_heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
                    dtype_bytes=a.dtype_bytes)
  sampler = WorkloadSampler(name, t, seed=a.seed)
  cap_layouts = [sampler.step_doclens(i, s) for i in range(a.cap_batches)]
  cap = _caps(cap_layouts, s, t, a, byte_model)
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1, capacity=cap)
  row_q = a.heads * a.head_dim * a.dtype_bytes
  row_kv = 2 * a.kv_heads * a.head_dim * a.dtype_bytes
  batches = []
  for i in range(a.cap_batches, a.cap_batches + a.batches):
    hp = plan_lib.host_plan(sampler.step_doclens(i, s), spec, tolerance=a.tolerance,
                            min_shard=plan_lib.auto_min_shard(t), **byte_model)
    rq, rkv = plan_lib.exchange_rows(hp.meta).tolist()
    rec = {"batch": i, "exchange_q_rows": rq, "exchange_kv_rows": rkv,
           "useful": float((s - 1) * (rq * row_q + rkv * row_kv)),
           "degraded": bool(hp.plan.degraded)}
    for mode, split in (("joint", False), ("split", True)):
      by = plan_lib.exchange_bytes(hp.meta, exchange_buckets=a.exchange_buckets,
                                   split_exchange=split, **byte_model)
      rec[mode] = {"moved": by["dispatch_moved"], "bucket_q_rows": by["bucket_q_rows"],
                   "bucket_kv_rows": by["bucket_kv_rows"]}
    batches.append(rec)
  moving = [b for b in batches if b["useful"] > 0]
  useful = sum(b["useful"] for b in moving)
  out = {"workload": name, "tokens_per_rank": t, "servers": s,
         "capacity": {f: getattr(cap, f) for f in plan_lib.CAP_FIELDS},
         "batches": batches, "moving_batches": len(moving), "useful": useful}
  for mode in ("joint", "split"):
    moved = sum(b[mode]["moved"] for b in moving)
    out[f"{mode}_moved"] = moved
    out[f"{mode}_over_useful"] = moved / useful if useful else float("nan")
  out["split_over_joint"] = (out["split_moved"] / out["joint_moved"] if out["joint_moved"]
                             else float("nan"))
  print(f"[{name} {t // 1024}K x {s}] {len(moving)}/{len(batches)} batches move; moved / useful "
        f"joint {out['joint_over_useful']:.3f}, split {out['split_over_useful']:.3f} "
        f"(split / joint {out['split_over_joint']:.3f})", flush=True)
  return out


def _markdown(res: dict) -> str:
  gb = 1e9
  lines = [f"# Exchange bytes: joint vs split buckets ({res['date']})", "",
           f"Command: `{res['command']}`", "",
           "Host arithmetic only (no device): per configuration, caps from the first "
           f"{res['cap_batches']} batches x {res['headroom']}, then {res['batches']} batches "
           f"planned under them (tolerance {res['tolerance']}, {res['exchange_buckets']} "
           f"buckets, heads {res['heads']}/{res['kv_heads']} x {res['head_dim']}, "
           f"{res['dtype_bytes']} bytes). Useful = the fullest slot's rows per part, the least a "
           "bucket can carry; moved = what the chosen buckets carry off-device per device, "
           "summed over the batches that move anything.", "",
           "| workload | tokens/device | servers | moving batches | useful GB | joint moved GB | "
           "split moved GB | joint / useful | split / useful | split / joint |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["configs"]:
    lines.append(f"| {r['workload']} | {r['tokens_per_rank']} | {r['servers']} | "
                 f"{r['moving_batches']}/{len(r['batches'])} | {r['useful'] / gb:.2f} | "
                 f"{r['joint_moved'] / gb:.2f} | {r['split_moved'] / gb:.2f} | "
                 f"{r['joint_over_useful']:.3f} | {r['split_over_useful']:.3f} | "
                 f"{r['split_over_joint']:.3f} |")
  return "\n".join(lines)


def main(a) -> None:
  res = {"command": "python " + " ".join(shlex.quote(x) for x in sys.argv),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         **{k: getattr(a, k) for k in ("cap_batches", "headroom", "batches", "exchange_buckets",
                                       "tolerance", "heads", "kv_heads", "head_dim",
                                       "dtype_bytes", "seed")},
         "configs": []}
  for name in a.workloads.split(","):
    for t in (int(x) for x in a.tokens_per_rank.split(",")):
      for s in (int(x) for x in a.servers.split(",")):
        res["configs"].append(run_config(name, t, s, a))
  profiling.write_tables(a.out, res, _markdown(res))


if __name__ == "__main__":
  main(_args())
