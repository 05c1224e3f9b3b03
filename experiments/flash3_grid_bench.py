"""What FlashAttention-3's launch grid costs on the data plane's task tables (one GPU).

FA3's varlen kernels launch ``task slots x ceil(max_seqlen / block) x heads`` thread blocks; a
block of an empty task slot (or beyond its task's length) exits at once but still costs a launch
slot. The data plane calls FA3 with a fixed table (``capacity.tasks`` slots, most of them empty
on a typical batch) and ``max_seqlen = tokens per row``. This benchmark takes each server's real
table from ``plan_lib.host_plan`` (2 servers, workloads Pretrain and ProLong; the busiest
server) and the own-documents table of the busiest rank (no CAD: packed_dp's call, 128 slots),
and times FA3's forward and forward+backward (``ops.core_attention``) on the same tasks as

  full/row          every task slot, max_seqlen = row length, ``grid_levels=1``: one launch
                    shape (the data plane before launch buckets)
  buckets           the same call with the default ``grid_levels`` (what the data plane runs:
                    the cheapest of the compiled launch shapes that holds the table)
  used/tight/exact  only the used slots, max_seqlen = the longest task (rounded up to 128), and
                    Q/KV buffers cut to the used rows: the floor of what launch shapes can give
Run on a GPU machine with flash-attn3-jax installed:
  python -m experiments.flash3_grid_bench --out results/micro/flash3_grid_bench
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np

from custom_ops import flash3_attention as fa3
from distca_jax import ops, profiling
from distca_jax import plan as plan_lib
from distca_jax.baselines import packing
from distca_jax.data.workloads import WorkloadSampler
import experiments


def add_table_args(p: argparse.ArgumentParser, out_stem: str) -> None:
  """The options of this benchmark: workloads, row length, sampled batches, timed iterations,
  attention shapes, output stem."""
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens", type=int, default=65536, help="tokens per rank (row length)")
  p.add_argument("--batches", type=int, default=2)
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--out", default=os.path.join(ROOT, "results", out_stem))


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_table_args(p, os.path.join("micro", "flash3_grid_bench"))
  p.add_argument("--servers", type=int, default=2)
  return p.parse_args()


def _up(x: int, m: int = 128) -> int:
  return max(m, -(-int(x) // m) * m)


def _cases(cu_q: np.ndarray, cu_k: np.ndarray, nq: int, nk: int, row: int):
  """(name, cu_q, cu_k, Nq, Nkv, max_seqlen_q, max_seqlen_k, grid_levels) of the shapes."""
  lq, lk = np.diff(cu_q), np.diff(cu_k)
  used = int(np.flatnonzero((lq > 0) | (lk > 0)).max(initial=-1)) + 1
  mq, mk = _up(lq.max(initial=1)), _up(lk.max(initial=1))
  uq, uk = cu_q[:used + 1], cu_k[:used + 1]
  eq, ek = _up(int(cu_q[used]), 8), _up(int(cu_k[used]), 8)
  return [("full/row", cu_q, cu_k, nq, nk, row, row, 1),
          ("buckets", cu_q, cu_k, nq, nk, row, row, fa3.FLASH3_GRID_LEVELS),
          ("used/tight/exact", uq, uk, eq, ek, mq, mk, 1)]


def _timed(a, cu_q, cu_k, nq, nk, msq, msk, levels, key):
  h, kh, d = a.heads, a.kv_heads, a.head_dim
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (nq, h, d), jnp.bfloat16)
  k = jax.random.normal(kk, (nk, kh, d), jnp.bfloat16)
  v = jax.random.normal(kv, (nk, kh, d), jnp.bfloat16)
  cq, ck = jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32)
  fns = _jitted(int(msq), int(msk), int(levels))
  return {name: profiling.time_call(f, q, k, v, cq, ck, iters=a.iters, warmup=1)
          for name, f in fns.items()}


@functools.lru_cache(maxsize=None)
def _jitted(msq: int, msk: int, levels: int) -> dict:
  """fwd and fwd+bwd of one launch setting, jitted once (jit caches per buffer shape)."""
  opts = dict(kernel="flash3", max_seqlen_q=msq, max_seqlen_k=msk, grid_levels=levels)

  def fwd(q, k, v, cq, ck):
    return ops.core_attention(q, k, v, cq, ck, **opts)

  def fwd_bwd(q, k, v, cq, ck):
    o, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, cq, ck), q, k, v)
    return vjp(o)

  return {"fwd": jax.jit(fwd), "fwd_bwd": jax.jit(fwd_bwd)}


def main(a):
  t, s = a.tokens, a.servers
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1,
                           capacity=plan_lib.default_capacity(t))
  res = {"command": experiments.command_line(__file__), "device": jax.devices()[0].device_kind,
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "capacity": dataclasses.asdict(spec.capacity), "rows": []}
  key = jax.random.key(0)
  for wl in a.workloads.split(","):
    sampler = WorkloadSampler(wl, t, seed=0)
    for b in range(a.batches):
      doc_lens = sampler.step_doclens(b, s)
      hp = plan_lib.host_plan(doc_lens, spec,
                              options=plan_lib.PlanOptions(q_heads=a.heads, kv_heads=a.kv_heads,
                                                           head_dim=a.head_dim, dtype_bytes=2,
                                                           min_shard=None))
      loads = [plan_lib.attention_pairs(hp.meta.cu_seqlens_q[d], hp.meta.cu_seqlens_k[d])
               for d in range(s)]
      d = int(np.argmax(loads))  # the busiest server sets the step
      tables = {"cad": (np.asarray(hp.meta.cu_seqlens_q[d]), np.asarray(hp.meta.cu_seqlens_k[d]),
                        spec.capacity.q_tokens, spec.capacity.kv_tokens)}
      own = packing.task_tables(packing.natural_placement(doc_lens, t), max_tasks=128)
      r = int(np.argmax([plan_lib.attention_pairs(c, c) for c in own["cu_seqlens_q"]]))
      cu = np.asarray(own["cu_seqlens_q"][r])
      tables["own"] = (cu, cu, t, t)
      for tname, (cq, ck, nq, nk) in tables.items():
        flops = plan_lib.core_attention_flops(cq, ck, num_q_heads=a.heads, head_dim=a.head_dim)
        flops_fb = plan_lib.core_attention_flops(cq, ck, num_q_heads=a.heads, head_dim=a.head_dim,
                                            include_backward=True)
        for case in _cases(cq, ck, nq, nk, t):
          name, ccq, cck, cnq, cnk, msq, msk, levels = case
          key, sub = jax.random.split(key)
          tm = _timed(a, ccq, cck, cnq, cnk, msq, msk, levels, sub)
          row = {"workload": wl, "batch": b, "table": tname, "case": name,
                 "slots": len(ccq) - 1, "q_rows": cnq, "kv_rows": cnk, "max_seqlen_q": msq,
                 "max_seqlen_k": msk, "fwd_ms": tm["fwd"]["median_s"] * 1e3,
                 "fwd_bwd_ms": tm["fwd_bwd"]["median_s"] * 1e3,
                 "fwd_TFLOPs": flops / tm["fwd"]["median_s"] / 1e12,
                 "fwd_bwd_TFLOPs": flops_fb / tm["fwd_bwd"]["median_s"] / 1e12}
          res["rows"].append(row)
          print(f"{wl} b{b} {tname:3s} {name:17s} slots {row['slots']:4d} msk {msk:6d}: fwd "
                f"{row['fwd_ms']:7.2f} ms  fwd+bwd {row['fwd_bwd_ms']:7.2f} ms "
                f"({row['fwd_bwd_TFLOPs']:.0f} TF/s)", flush=True)
          _write(a.out, res)


def _write(stem, res):
  os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
  with open(stem + ".json", "w") as f:
    json.dump(res, f, indent=1)
  lines = [f"# FA3 launch grid on the data plane's task tables ({res['date']})", "",
           f"Command: `{res['command']}`", "", f"Device: 1 x {res['device']}; capacity "
           f"{res['capacity']}. Times: median ms.", "",
           "| workload | batch | table | case | slots | Q rows | KV rows | max_seqlen q/k | fwd ms "
           "| fwd+bwd ms | fwd+bwd TF/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    lines.append(f"| {r['workload']} | {r['batch']} | {r['table']} | {r['case']} | {r['slots']} | "
                 f"{r['q_rows']} | {r['kv_rows']} | {r['max_seqlen_q']}/{r['max_seqlen_k']} | "
                 f"{r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_TFLOPs']:.0f} |")
  with open(stem + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main(_args())
