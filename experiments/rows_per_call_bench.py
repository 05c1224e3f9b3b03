"""FlashAttention-3 on several rows of documents: one fused call against one call per row (one GPU).

With ``rows_per_rank = 2`` a single-stream step gives core attention both rows of a rank at
once, while ping-pong (``attention.nano_batches = 2``) calls it once per row. This benchmark
times FA3's forward+backward (``ops.core_attention``, what the layers run) on the same documents
three ways:

  per row        one call per row, summed, each with a slot-first table: the row's documents
                 in ``max_docs_per_row`` task slots, then its padding as two pseudo-tasks, so
                 the empty slots sit before the padding ones;
  fused          one call over both rows with the slot-first table (empty slots between the
                 rows too);
  fused, packed  one call over both rows with packed_dp's table
                 (``baselines.device.packed_dp_task_table``: the empty slots behind the used
                 ones, so FA3's launch buckets,
                 ``custom_ops.flash3_attention.flash3_grid_buckets``, trim them).

Rows are sampled from the workloads (``WorkloadSampler``), bf16, Llama-3-8B heads. Run on a GPU
machine with flash-attn3-jax:
  python -m experiments.rows_per_call_bench --out results/rows_per_call_bench
Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp
import numpy as np

from distca_jax import ops, profiling
from distca_jax.baselines import device, packing
from distca_jax.data.workloads import WorkloadSampler
from experiments.flash3_grid_bench import add_table_args
import experiments


def _args():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_table_args(p, "rows_per_call_bench")
  p.add_argument("--rows", type=int, default=2)
  p.add_argument("--max-docs", type=int, default=128, help="packed_dp's task slots per row")
  return p.parse_args()


def table_as_it_was(lens_RxN: np.ndarray, t: int):
  """packed_dp's (cu_q, cu_k) before its empty slots went last: each row's ``max_docs`` slots,
  then its padding as a query-only and a key-only pseudo-task, in row order."""
  pad = t - lens_RxN.sum(1, keepdims=True)
  zero = np.zeros_like(pad)
  cu = lambda x: jnp.asarray(np.concatenate([[0], np.cumsum(x.reshape(-1))]), jnp.int32)
  return (cu(np.concatenate([lens_RxN, pad, zero], 1)),
          cu(np.concatenate([lens_RxN, zero, pad], 1)))


def time_fwd_bwd(q, k, v, cu_q, cu_k, t, iters):
  def loss(q, k, v):
    o = ops.core_attention(q, k, v, cu_q, cu_k, kernel="flash3", max_seqlen_q=t,
                           max_seqlen_k=t)
    return jnp.sum(o.astype(jnp.float32) * 1e-3)

  f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return profiling.time_call(f, q, k, v, iters=iters)["median_s"]


def main():
  a = _args()
  t, r = a.tokens, a.rows
  key = jax.random.key(0)
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (r * t, a.heads, a.head_dim), jnp.bfloat16)
  k = jax.random.normal(kk, (r * t, a.kv_heads, a.head_dim), jnp.bfloat16)
  v = jax.random.normal(kv, (r * t, a.kv_heads, a.head_dim), jnp.bfloat16)
  res = []
  for wl in a.workloads.split(","):
    sampler = WorkloadSampler(wl, t, seed=0)
    for b in range(a.batches):
      rows = sampler.step_doclens(b, r)
      lens = packing.packed_doc_lens(rows, t, a.max_docs)
      per_row = 0.0
      for j in range(r):
        sl = slice(j * t, (j + 1) * t)
        per_row += time_fwd_bwd(q[sl], k[sl], v[sl], *table_as_it_was(lens[j:j + 1], t), t,
                                a.iters)
      fused = time_fwd_bwd(q, k, v, *table_as_it_was(lens, t), t, a.iters)
      fused_packed = time_fwd_bwd(q, k, v, *device.packed_dp_task_table(jnp.asarray(lens), t),
                                  t, a.iters)
      rec = dict(workload=wl, batch=b, docs=[len(x) for x in rows], per_row_ms=per_row * 1e3,
                 fused_ms=fused * 1e3, fused_packed_ms=fused_packed * 1e3)
      res.append(rec)
      print(f"{wl} batch {b} docs {rec['docs']}: per row {rec['per_row_ms']:.1f} ms, fused "
            f"{rec['fused_ms']:.1f} ms, fused+packed {rec['fused_packed_ms']:.1f} ms", flush=True)
  cmd = experiments.command_line(__file__)
  doc = dict(command=cmd, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
             device=f"{jax.devices()[0].device_kind} x 1", rows=r, tokens_per_row=t,
             max_docs=a.max_docs, results=res)
  with open(a.out + ".json", "w") as f:
    json.dump(doc, f, indent=1)
  lines = ["# FA3 forward+backward: one call per row vs one fused call over the rows", "",
           f"- command: `{cmd}`", f"- date: {doc['date']}", f"- device: {doc['device']}; "
           f"{r} rows of {t} tokens, bf16, {a.heads} / {a.kv_heads} heads, head dim "
           f"{a.head_dim}; median of {a.iters}", "",
           "| workload | batch | documents per row | per row (summed) ms | fused ms | fused, empty "
           "slots last ms |", "|---|---:|---|---:|---:|---:|"]
  for x in res:
    lines.append(f"| {x['workload']} | {x['batch']} | {x['docs']} | {x['per_row_ms']:.1f} | "
                 f"{x['fused_ms']:.1f} | {x['fused_packed_ms']:.1f} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
