"""Exchange buffer bytes per pass with capacity buckets, on sampled Pretrain and ProLong plans.

  python -m experiments.bucket_table --out results/buckets

For each workload and each of ``--devices`` data ranks, plans a run's batches as the ``distca``
backend does (``configs/gpu_bench.py``: Llama-3-8B layer shapes, bf16; ``--tokens`` per device;
caps sized at startup from the run's first 32 batches x 1.1, as in training), then for batches
after those (``--batches``) reports per device and pass: the exchange's useful bytes (the
routed rows, mean over devices: Q, K, V out and O back) against the bytes of the send and
receive buffers the step passes over: one capacity (``buckets=1``, the step before buckets) or
the smallest of ``n`` buckets the batch's plans fit (``plan.buckets``: bucket ``i`` of ``n``
holds ``(i + 1) / n`` of the caps). Also the attention buffers (Q, O, K, V inputs of the
kernel), which every bucket keeps at the caps'. Host only (NumPy planning), no devices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANDIDATES = (1, 2, 3, 4, 6, 8)


def _exchange_mb(cap, bq: int, bkv: int) -> float:
  """Send + receive buffers of one pass (Q, K, V dispatch; O return), MB per device."""
  return ((cap.q_send + cap.q_recv) * bq * 2 + (cap.kv_send + cap.kv_recv) * bkv) / 1e6


def workload_table(workload: str, devices: int, tokens: int, batches: int) -> dict:
  from distca_jax import configs_io, trainer
  from distca_jax.data import run_source
  from distca_jax.plan.buckets import bucket_specs
  c = configs_io.load_config(os.path.join(ROOT, "configs", "gpu_bench.py"),
                             ["attention.backend=distca", f"tokens_per_rank={tokens}",
                              f"data.workload={workload}", "attention.distca.buckets=1"])
  c.mesh.data = devices
  t0 = time.time()
  backend = trainer.make_backend(c)
  m = c.model
  bq = m.n_heads * m.head_dim * 2
  bkv = 2 * m.n_kv_heads * m.head_dim * 2
  src = run_source(c, devices)
  first = int(c.attention.distca.caps_from_batches)
  rows = []
  for step in range(first, first + batches):
    plans = backend.host_plans(src.doclens(step), c.tokens_per_rank)
    spec = plans[0].spec
    useful = sum((float(hp.meta.q_send_len.sum()) * bq * 2 + float(hp.meta.kv_send_len.sum())
                  * bkv) / devices for hp in plans) / len(plans) / 1e6
    row = {"step": step, "crosses": any(hp.plan.crosses for hp in plans), "useful_mb": useful}
    for n in CANDIDATES:
      bs = bucket_specs(spec, n)
      k = bs.choose(*[hp.plan for hp in plans])
      row[str(n)] = {"bucket": k, "buffer_mb": _exchange_mb(bs.specs[k].capacity, bq, bkv)}
    rows.append(row)
  cap = spec.capacity
  mem = cap.memory_bytes(devices, q_heads=m.n_heads, kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                         dtype_bytes=2)
  cad = [x for x in rows if x["crosses"]]
  summary = {}
  for n in CANDIDATES:
    key = str(n)
    buf = [x[key]["buffer_mb"] for x in cad]
    summary[key] = {
        "buckets": n,
        "bucket_capacities": [dict(q_send=s.capacity.q_send, kv_send=s.capacity.kv_send,
                                   q_recv=s.capacity.q_recv, kv_recv=s.capacity.kv_recv)
                              for s in bucket_specs(spec, n).specs],
        "buffer_mb_mean": float(np.mean(buf)) if buf else 0.0,
        "buffer_over_useful": (float(np.sum(buf)) / max(1e-9, sum(x["useful_mb"] for x in cad))
                               if cad else 0.0),
        # The batch that moves least for its buffers (e.g. a few rows in worst-case buffers).
        "worst_buffer_over_useful": max((x[key]["buffer_mb"] / max(1e-9, x["useful_mb"])
                                         for x in cad), default=0.0),
        "chosen": np.bincount([x[key]["bucket"] for x in cad], minlength=n).tolist(),
    }
  return {"workload": workload, "devices": devices, "tokens_per_device": tokens,
          "caps": backend.caps, "batches": len(rows), "cad_batches": len(cad),
          "useful_mb_mean": float(np.mean([x["useful_mb"] for x in cad])) if cad else 0.0,
          "attention_buffers_mb": (mem["attention_q_o"] + mem["attention_kv"]) / 1e6,
          "summary": summary, "rows": rows, "plan_s": time.time() - t0}


def _markdown(tables: list[dict], cmd: str, commit: str) -> str:
  out = ["# Exchange buffer bytes per pass with capacity buckets (sampled plans, host only)", "",
         f"- command: `{cmd}`; commit: `{commit}`; machine: host CPU (NumPy planning, no "
         "devices).",
         "- shapes: `configs/gpu_bench.py` (Llama-3-8B layers, bf16); caps sized at startup from "
         "the run's first 32 batches x 1.1 (as in training); the batches after those.",
         "- per device and pass: Q, K, V send + receive buffers and O's return buffers (MB); "
         "useful: the routed rows (mean over devices) of the batches whose plans move rows "
         "(the others run the local branch, no exchange). n buckets: bucket i holds (i + 1) / n of "
         "the caps (`plan.buckets`); 1 is the step without buckets.", ""]
  for t in tables:
    out += [f"## {t['workload']}, {t['devices']} devices x {t['tokens_per_device']} tokens",
            "", f"caps {t['caps']}; {t['cad_batches']} of {t['batches']} batches move rows; "
            f"useful {t['useful_mb_mean']:.1f} MB per pass (mean); attention buffers "
            f"{t['attention_buffers_mb']:.0f} MB in every bucket.", "",
            "| buckets | buffers MB per pass (mean) | vs 1 bucket | buffers / useful (all "
            "batches) | buffers / useful (worst batch) | calls per bucket (smallest first) |",
            "|---|---|---|---|---|---|"]
    one = t["summary"]["1"]["buffer_mb_mean"]
    for key, s in t["summary"].items():
      out.append(f"| {key} | {s['buffer_mb_mean']:.0f} | {s['buffer_mb_mean'] / one:.2f} | "
                 f"{s['buffer_over_useful']:.1f}x | {s['worst_buffer_over_useful']:.1f}x | "
                 f"{s['chosen']} |")
    out.append("")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", default="2,4", help="comma-separated data ranks")
  p.add_argument("--tokens", type=int, default=131072)
  p.add_argument("--batches", type=int, default=32)
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--out", default="", help="write OUT.md and OUT.json")
  a = p.parse_args(argv)
  tables = [workload_table(w, int(d), a.tokens, a.batches) for w in a.workloads.split(",")
            for d in a.devices.split(",")]
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  cmd = "python -m experiments.bucket_table " + " ".join(sys.argv[1:] if argv is None else argv)
  md = _markdown(tables, cmd.strip(), commit)
  print(md)
  if a.out:
    with open(a.out + ".md", "w") as f:
      f.write(md + "\n")
    with open(a.out + ".json", "w") as f:
      json.dump({"command": cmd, "commit": commit, "tables": tables}, f, indent=1)


if __name__ == "__main__":
  main()
