"""How much of the balance ceiling any per-batch choice between CAD and no balancing could take.

  python -m experiments.per_batch_bound results/e2e_2gpu_64k.json \
      results/e2e_2gpu_prolong_128k.json results/e2e_2gpu_128k.json \
      --fixed-cost 0.004 --out results/per_batch_bound

Reads `experiments/e2e_bench.py` result files (step times of every timed batch of `packed_dp` and
`distca`, run on the same batches), rebuilds each run's batches on the host from its recorded
config overrides (the data source is a pure function of config, seed and step), and reports per
(workload, tokens per GPU):

  * per batch: both step times, their ratio, and the batch's own ceiling (max over ranks of
    step work over the mean, work = `metrics.step_work` (6 N tokens + the kernel's forward +
    backward per causal pair, 3.5x forward): `e2e_bench.ceiling` of
    that batch alone);
  * `measured`: the tokens/s ratio distca / packed_dp (total time over the batches);
  * `best of both`: the ratio if every batch had run the faster of (distca's step, packed_dp's
    step x (1 + fixed cost)), where the fixed cost is what CAD costs when it moves nothing
    (`--fixed-cost`, measured on one GPU: one attention server, nothing on the wire). No
    policy that chooses per batch between CAD's plan and keeping every document at home beats it
    (on these kernels and this exchange);
  * `gate`: the ratio if the CAD planner's gate (`attention.distca.min_gain`, `--min-gain`)
    had run: a `distca` backend built from the distca run's overrides (with `--min-gain`, or
    the config's default) plans every batch again (`host_plans`), and a batch whose plans are
    all gated (nothing moves) costs packed_dp's step x (1 + fixed cost), any other batch
    distca's measured step (a batch gated in one nano-batch only keeps that measured step). A
    prediction from measured steps, not a measurement of the gate;
  * each ratio as a share of the ceiling's gain ((ratio - 1) / (ceiling - 1)).

It runs on the host only (no device, no JAX computation). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from experiments import e2e_bench
import experiments


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("results", nargs="+", help="e2e_bench JSON files")
  p.add_argument("--fixed-cost", type=float, default=0.004,
                 help="CAD's step-time overhead when nothing moves, as a fraction (default 0.004: "
                      "distca over packed_dp on 1 x H200, Pretrain and ProLong 64K, "
                      "results/e2e_1gpu_64k.md)")
  p.add_argument("--min-gain", type=float, default=None,
                 help="the gate's threshold for the `gate` column (default: the config's "
                      "attention.distca.min_gain)")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed batches")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--out", default=os.path.join(ROOT, "results", "per_batch_bound"))
  return p.parse_args(argv)


def batch_doclens(config_path: str, overrides, devices: int, warmup: int, steps: int):
  """Per timed batch: the document lengths of each data rank's rows (as e2e_bench saw them)."""
  from distca_jax import configs_io
  from distca_jax.data import run_source
  c = configs_io.load_config(config_path, list(overrides))
  r = int(c.rows_per_rank)
  src = run_source(c, devices)
  return c, [e2e_bench.rows_by_rank(src.doclens(step), devices, r)
             for step in range(warmup, warmup + steps)]


def gated_batches(c, doclens, min_gain) -> list[bool]:
  """Per batch: whether the distca backend of the distca run's config ``c`` moves nothing in
  any of its plans (one per nano-batch). A ``min_gain`` given is the only gate: the local
  branch's ``local_gain`` is set to 0."""
  from distca_jax import trainer
  c = c.copy_and_resolve_references()
  c.mesh.data = len(doclens[0])  # the run's data ranks (its startup caps are planned for them)
  if min_gain is not None:
    c.attention.distca.min_gain = float(min_gain)
    c.attention.distca.local_gain = 0.0
  backend = trainer.make_backend(c)
  out = []
  for per_rank in doclens:
    rows = [row for rank_rows in per_rank for row in rank_rows]
    out.append(all(hp.plan.gated for hp in backend.host_plans(rows, c.tokens_per_rank)))
  return out


def check_rebuilt(run, model_cfg, doclens, ceiling) -> None:
  """Raises unless the rebuilt batches are the ones the run timed: their MFU FLOPs must give the
  run's recorded MFU (a convention that does not change), or, for a record without MFU, their
  ceiling the recorded one."""
  from distca_jax import metrics  # pylint: disable=import-outside-toplevel
  peak = next((tf for name, tf in metrics.PEAK_TFLOPS.items() if name in run.get("device", "")),
              None)
  if "mfu" in run and peak:
    flops = sum(metrics.step_flops(model_cfg, [row for rank in step for row in rank])
                for step in doclens)
    mfu = flops / (sum(run["step_ms_all"]) / 1e3) / (peak * 1e12 * run["devices"])
    if abs(mfu / run["mfu"] - 1.0) > 1e-6:
      raise ValueError(f"rebuilt batches give MFU {mfu:.6f}, the run recorded {run['mfu']:.6f}: "
                       "the data source or config changed since the run")
  elif abs(ceiling - run["ceiling"]) > 1e-6:
    raise ValueError(f"rebuilt batches give ceiling {ceiling:.6f}, the run recorded "
                     f"{run['ceiling']:.6f}: the data source or config changed since the run")


def analyse(packed: dict, distca: dict, fixed: float, config_path: str, warmup: int,
            min_gain) -> dict:
  from distca_jax import config as config_lib
  p_ms, d_ms = packed["step_ms_all"], distca["step_ms_all"]
  if len(p_ms) != len(d_ms):
    raise ValueError(f"{packed['workload']} {packed['tokens']}: packed_dp timed {len(p_ms)} "
                     f"batches, distca {len(d_ms)}; they must run the same batches")
  c, doclens = batch_doclens(config_path, packed["overrides"], packed["devices"], warmup,
                             len(p_ms))
  c_ca, doclens_ca = batch_doclens(config_path, distca["overrides"], distca["devices"], warmup,
                                   len(d_ms))
  if doclens_ca != doclens:
    raise ValueError(f"{packed['workload']} {packed['tokens']}: the packed_dp and distca runs' "
                     "overrides give different batches; compare runs of the same data")
  model_cfg = config_lib.model_config(c)
  ceiling = e2e_bench.ceiling(model_cfg, doclens)
  check_rebuilt(packed, model_cfg, doclens, ceiling)
  best = [min(d, p * (1.0 + fixed)) for p, d in zip(p_ms, d_ms)]
  gated = gated_batches(c_ca, doclens, min_gain)
  gate = [p * (1.0 + fixed) if g else d for p, d, g in zip(p_ms, d_ms, gated)]
  share = lambda r: (r - 1.0) / (ceiling - 1.0) if ceiling > 1.0 else None
  measured = sum(p_ms) / sum(d_ms)
  best_ratio = sum(p_ms) / sum(best)
  gate_ratio = sum(p_ms) / sum(gate)
  rows = [dict(batch=i, packed_dp_ms=p, distca_ms=d, ratio=p / d,
               ceiling=e2e_bench.ceiling(model_cfg, [doclens[i]]), gated=g)
          for i, (p, d, g) in enumerate(zip(p_ms, d_ms, gated))]
  return dict(workload=packed["workload"], tokens=packed["tokens"], devices=packed["devices"],
              ceiling=ceiling, measured_ratio=measured, measured_share=share(measured),
              best_of_both_ratio=best_ratio, best_of_both_share=share(best_ratio),
              gate_ratio=gate_ratio, gate_share=share(gate_ratio), gated_batches=sum(gated),
              batches_distca_faster=sum(d < p for p, d in zip(p_ms, d_ms)), batches=rows)


def main(argv=None):
  a = parse_args(argv)
  out = []
  for path in a.results:
    with open(path) as f:
      res = json.load(f)["results"]
    keys = sorted({(r["workload"], r["tokens"]) for r in res if "error" not in r})
    for wl, tok in keys:
      like = {"workload": wl, "tokens": tok}
      packed, distca = (e2e_bench.find_run(res, name, like) for name in ("packed_dp", "distca"))
      if packed and distca:
        rec = analyse(packed, distca, a.fixed_cost, a.config, a.warmup, a.min_gain)
        rec["source"] = os.path.relpath(path, ROOT)
        out.append(rec)
        print(f"{wl} {tok}: ceiling {rec['ceiling']:.3f}, measured {rec['measured_ratio']:.3f} "
              f"(share {rec['measured_share']:.2f}), best of both "
              f"{rec['best_of_both_ratio']:.3f} (share {rec['best_of_both_share']:.2f}), gate "
              f"{rec['gate_ratio']:.3f} (share {rec['gate_share']:.2f}; "
              f"{rec['gated_batches']} of {len(rec['batches'])} batches gated)")
  cmd = experiments.command_line(__file__)
  doc = dict(command=cmd, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
             fixed_cost=a.fixed_cost, results=out)
  with open(a.out + ".json", "w") as f:
    json.dump(doc, f, indent=1)
  with open(a.out + ".md", "w") as f:
    f.write(markdown(doc))


def markdown(doc: dict) -> str:
  lines = ["# Per-batch bound: the best any per-batch choice between CAD and packed_dp could do",
           "", f"- command: `{doc['command']}`", f"- date: {doc['date']}",
           f"- fixed cost of CAD when nothing moves: {100 * doc['fixed_cost']:.1f}% of the step",
           "", "| source | workload | tokens/GPU | GPUs | ceiling | measured tokens/s ratio "
           "(share of gain) | best of both per batch (share of gain) | with the gate, predicted "
           "(share of gain) | batches gated | batches distca faster |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in doc["results"]:
    lines.append(f"| `{r['source']}` | {r['workload']} | {r['tokens']} | {r['devices']} | "
                 f"{r['ceiling']:.3f} | {r['measured_ratio']:.3f} ({r['measured_share']:.2f}) | "
                 f"{r['best_of_both_ratio']:.3f} ({r['best_of_both_share']:.2f}) | "
                 f"{r['gate_ratio']:.3f} ({r['gate_share']:.2f}) | "
                 f"{r['gated_batches']} of {len(r['batches'])} | "
                 f"{r['batches_distca_faster']} of {len(r['batches'])} |")
  for r in doc["results"]:
    lines += ["", f"## {r['workload']} {r['tokens']} tokens/GPU ({r['source']})", "",
              "| batch | packed_dp ms | distca ms | packed / distca | batch ceiling | gated |",
              "|---:|---:|---:|---:|---:|---|"]
    for b in r["batches"]:
      lines.append(f"| {b['batch']} | {b['packed_dp_ms']:.1f} | {b['distca_ms']:.1f} | "
                   f"{b['ratio']:.3f} | {b['ceiling']:.3f} | {'yes' if b['gated'] else ''} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
