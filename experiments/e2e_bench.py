"""End-to-end step time of core-attention strategies, side by side, in one process.

  python experiments/e2e_bench.py --backends distca,packed_dp --workloads pretrain,prolong \
      --tokens 65536,131072 --layers 4 --steps 20 --out results/e2e_bench

For every (workload, tokens per GPU, backend, variant) it trains `--steps` real optimizer steps of
Llama-3-8B layer shapes (`configs/gpu_bench.py`, `--layers` of the 32 layers) on sampled batches
(the same batches for every backend), timing each step to completion, and reports the median and
spread of step time, tokens/s and MFU (document-masked FLOPs, see distca_jax/metrics.py).

It also computes, from the very same batches, the ceiling of any attention balancer over
`packed_dp`: E[max over ranks of step work] / E[mean over ranks], work = 6 N tokens +
6 layers Hq D sum(l^2), and reports each backend's measured speedup over packed_dp as a fraction of
that bound's gain ((speedup - 1) / (bound - 1)).

Variants: `--nano-batches 1,2` compares single stream with ping-pong; `--extra KEY=VALUE` passes
config overrides to every run (e.g. attention.kernel=flash3). `--tiny` shrinks everything for a
CPU smoke test. Writes OUT.json and OUT.md (the command at the top).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--backends", default="packed_dp,distca")
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--tokens", default="65536,131072", help="tokens per GPU (comma list)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--steps", type=int, default=20, help="timed steps (sampled batches) per run")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
  p.add_argument("--nano-batches", default="1", help="comma list: 1 single stream, 2 ping-pong")
  p.add_argument("--rows-per-rank", type=int, default=0, help="0: = nano-batches")
  p.add_argument("--extra", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME:KEY=VALUE[,KEY=VALUE] an extra run per backend with these overrides")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--tiny", action="store_true", help="CPU smoke test sizes")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "e2e_bench"))
  return p.parse_args(argv)


def ceiling(model_cfg, doclens_per_step):
  """E[max_r work_r] / E[mean_r work_r] over steps; rows of a step are grouped per data rank."""
  from distca_jax import metrics
  n = metrics.matmul_params(model_cfg)
  att = 6.0 * model_cfg.n_layers * model_cfg.n_heads * model_cfg.head_dim
  maxes, means = [], []
  for per_rank in doclens_per_step:
    work = [6.0 * n * sum(map(sum, rows)) + att * sum(l * l for r in rows for l in r)
            for rows in per_rank]
    maxes.append(max(work))
    means.append(sum(work) / len(work))
  return sum(maxes) / sum(means)


def run_one(c, steps, warmup, log):
  """Trains warmup + steps steps; returns per-step times and FLOP / token counts."""
  import jax
  from distca_jax import metrics, trainer
  from distca_jax import sharding as shard_lib
  from distca_jax.data import make_source

  mesh = shard_lib.make_mesh(data=c.mesh.data, tensor=c.mesh.tensor, pipe=c.mesh.pipe)
  rows = mesh.shape["data"] * c.rows_per_rank
  backend = trainer.make_backend(c)
  model = trainer.make_model(c, backend)
  tx = trainer.make_optimizer(c)
  source = make_source(c.data, rows=rows, tokens_per_row=c.tokens_per_rank,
                       vocab_size=model.cfg.vocab_size, seed=c.seed)
  _, state_sh = trainer.state_shardings(c, model, tx, mesh)
  state = trainer.create_train_state(c, model, tx, mesh)
  prefetch = trainer.Prefetcher(source, model.cfg, 0, warmup + steps, backend=backend)
  step_fn, times, flops, tokens, losses, doclens, waits = None, [], [], [], [], [], []
  for i in range(warmup + steps):
    t_wait = time.perf_counter()
    step, np_batch, fl, tok = prefetch.next()
    waited = time.perf_counter() - t_wait
    if step_fn is None:
      with trainer.mesh_context(mesh):
        step_fn = trainer.jit_train_step(c, model, tx, mesh, state_sh, tuple(np_batch))
    batch = trainer.device_batch(np_batch, mesh)
    jax.block_until_ready(batch)
    t0 = time.perf_counter()
    with trainer.mesh_context(mesh):
      state, m = step_fn(state, batch)
    jax.block_until_ready((state, m))
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
      flops.append(fl)
      tokens.append(tok)
      losses.append(float(m["loss"]))
      waits.append(waited)
      d = mesh.shape["data"]
      per_row = source.doclens(step)
      doclens.append([per_row[r * c.rows_per_rank:(r + 1) * c.rows_per_rank] for r in range(d)])
    log(f"    step {i + 1}/{warmup + steps}: {dt * 1e3:.1f} ms, loss {float(m['loss']):.3f}")
  peak = metrics.peak_flops_per_device(c.peak_tflops)
  return dict(times=times, flops=flops, tokens=tokens, losses=losses, doclens=doclens,
              input_wait_s=waits, devices=jax.device_count(), peak=peak,
              device_kind=jax.devices()[0].device_kind, model_cfg=model.cfg)


def summarize(r):
  med = statistics.median(r["times"])
  total_t = sum(r["times"])
  out = {
      "step_ms_median": med * 1e3,
      "step_ms_min": min(r["times"]) * 1e3,
      "step_ms_max": max(r["times"]) * 1e3,
      "step_ms_p10": sorted(r["times"])[len(r["times"]) // 10] * 1e3,
      "step_ms_p90": sorted(r["times"])[(9 * len(r["times"])) // 10] * 1e3,
      "tokens_per_s": sum(r["tokens"]) / total_t,
      "input_wait_ms_median": statistics.median(r["input_wait_s"]) * 1e3,
      "final_loss": r["losses"][-1],
  }
  if r["peak"]:
    out["mfu"] = sum(r["flops"]) / total_t / (r["peak"] * r["devices"])
  return out


def main(argv=None):
  a = parse_args(argv)
  if a.tiny:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  import jax  # noqa: F401  (after XLA_FLAGS)
  from distca_jax import configs_io
  from distca_jax.launch import configure_environment
  configure_environment()
  log = lambda m: print(m, flush=True)
  variants = [("", [])]
  for v in a.variant:
    name, _, kvs = v.partition(":")
    variants.append((name, [x for x in kvs.split(",") if x]))
  results = []
  for workload in a.workloads.split(","):
    for tokens in [int(t) for t in a.tokens.split(",")]:
      for nano in [int(n) for n in a.nano_batches.split(",")]:
        for backend in a.backends.split(","):
          for vname, vover in variants:
            over = [f"data.workload={workload}", f"tokens_per_rank={tokens}",
                    f"model.n_layers={a.layers}", f"attention.backend={backend}",
                    f"attention.nano_batches={nano}",
                    f"rows_per_rank={a.rows_per_rank or nano}", "checkpoint_every=0",
                    f"num_steps={a.warmup + a.steps}"] + a.extra + vover
            if a.tiny:
              over += ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
                       "model.mlp_dim=128", "model.vocab_size=256", "model.dtype=float32",
                       "model.loss_chunk=256", "attention.block_q=64", "attention.block_k=64"]
            name = backend + (f"+{vname}" if vname else "") + ("+pingpong" if nano == 2 else "")
            log(f"== {workload} {tokens} tokens/GPU {name}")
            c = configs_io.load_config(a.config, over)
            try:
              r = run_one(c, a.steps, a.warmup, log)
            except Exception as e:  # recorded, never silently dropped
              log(f"   FAILED: {type(e).__name__}: {e}")
              results.append(dict(workload=workload, tokens=tokens, backend=name, error=f"{type(e).__name__}: {e}"))
              continue
            s = summarize(r)
            s.update(workload=workload, tokens=tokens, backend=name, nano_batches=nano,
                     device=r["device_kind"], devices=r["devices"],
                     ceiling=ceiling(r["model_cfg"], r["doclens"]), overrides=over)
            results.append(s)
            log(f"   median {s['step_ms_median']:.1f} ms, {s['tokens_per_s']:,.0f} tok/s"
                + (f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else "")
                + f", ceiling {s['ceiling']:.3f}")
  # Speedups over packed_dp (same workload, tokens, nano-batches) and the fraction of the bound.
  for s in results:
    base = [b for b in results if b.get("backend") == "packed_dp" + ("+pingpong" if s.get("nano_batches") == 2 else "")
            and b["workload"] == s["workload"] and b["tokens"] == s["tokens"] and "error" not in b]
    if "error" not in s and base:
      sp = base[0]["step_ms_median"] / s["step_ms_median"]
      s["speedup_vs_packed_dp"] = sp
      s["fraction_of_bound_gain"] = (sp - 1) / (s["ceiling"] - 1) if s["ceiling"] > 1 else None
  write(a, results)


def write(a, results):
  cmd = "python experiments/e2e_bench.py " + " ".join(sys.argv[1:])
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump({"command": cmd, "date": stamp, "results": results}, f, indent=1)
  lines = [f"# End-to-end benchmark\n", f"- command: `{cmd}`", f"- date: {stamp}"]
  dev = next((r.get("device") for r in results if r.get("device")), "?")
  lines.append(f"- device: {dev} x {next((r.get('devices') for r in results if r.get('devices')), '?')}\n")
  lines.append("| workload | tokens/GPU | backend | step ms (median) | p10-p90 ms | tokens/s | MFU | speedup vs packed_dp | ceiling | fraction of bound gain | input wait ms |")
  lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    if "error" in r:
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | failed: {r['error'][:80]} | | | | | | | |")
      continue
    fr = r.get("fraction_of_bound_gain")
    lines.append(
        f"| {r['workload']} | {r['tokens']} | {r['backend']} | {r['step_ms_median']:.1f} | "
        f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f} | {r['tokens_per_s']:,.0f} | "
        f"{100 * r['mfu']:.1f}% | " if "mfu" in r else
        f"| {r['workload']} | {r['tokens']} | {r['backend']} | {r['step_ms_median']:.1f} | "
        f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f} | {r['tokens_per_s']:,.0f} | n/a | ")
    lines[-1] += (f"{r.get('speedup_vs_packed_dp', float('nan')):.3f} | {r['ceiling']:.3f} | "
                  f"{'n/a' if fr is None else f'{fr:.2f}'} | {r['input_wait_ms_median']:.2f} |")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  main()
