"""The pipeline's schedule: bubble fraction, and core-attention balance per tick with and without
CAD pooling across stages (host tables; no device work beyond tracing the tiny model).

Two parts:
  1. Bubble: the pipelined tiny model is traced (`jax.make_jaxpr`, fake CPU devices) for each
     (pipe, data, microbatches); the tick scan's length in the traced program gives the compiled
     schedule's bubble, 1 - M / ticks, printed next to (S - 1) / (M + S - 1) and the host
     `plan.ticks.schedule_table`.
  2. Attention balance per tick: every data rank holds one row of T tokens per microbatch (the
     trainer's Pretrain / ProLong batches, `WorkloadSampler.step_doclens`, rows_per_rank = M);
     at tick t stage s holds microbatch t - s (`schedule_table`; none in bubble slots). Per tick,
     the pairs of causal attention each of the S x D ranks computes under three placements:
       local       each rank its own row (packed_dp; no CAD);
       CAD/stage   CAD within each stage's D data ranks (`plan.schedule` over D servers);
                   bubble stages idle;
       CAD pooled  one plan over all S x D ranks for the tick's documents of every stage
                   (bubble ranks serve too).
     Reported: the tick's max / mean over all S x D ranks (mean over ticks and worst tick), and
     the attention critical path: sum over ticks of the slowest rank's pairs (every tick waits for
     it), divided by the ideal sum of pairs / (S x D).

Run:
  python -m experiments.pipeline_schedule   # writes results/pipeline/pipeline_schedule.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os

MAX_DEVICES = 64
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={MAX_DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from distca_jax import configs_io, pipeline, trainer  # noqa: E402
from distca_jax import plan as plan_lib  # noqa: E402
from distca_jax.plan import ticks as ticks_lib  # noqa: E402
from distca_jax import sharding as shard_lib  # noqa: E402
from distca_jax.data.workloads import WorkloadSampler  # noqa: E402
import experiments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traced_ticks(stages: int, data: int, microbatches: int) -> int:
  """Length of the tick scan in the traced pipelined loss of the tiny model."""
  c = configs_io.load_config(os.path.join(ROOT, "configs", "tiny_cpu.py"), [
      f"mesh.pipe={stages}", f"mesh.data={data}", f"pipeline.microbatches={microbatches}",
      f"rows_per_rank={microbatches}", f"model.n_layers={stages}", "tokens_per_rank=64",
      "attention.block_q=64", "attention.block_k=64", "model.loss_chunk=64"])
  mesh = shard_lib.make_mesh(data=data, tensor=1, pipe=stages,
                             devices=jax.devices()[:stages * data])
  model, tx = trainer.make_model(c), trainer.make_optimizer(c)
  abstract, _ = trainer.state_shardings(c, model, tx, mesh)
  rows, t = data * microbatches, c.tokens_per_rank
  ints = jax.ShapeDtypeStruct((rows, t), np.int32)
  batch = {k: ints for k in ("inputs", "targets", "segment_ids", "positions")}
  batch["loss_mask"] = jax.ShapeDtypeStruct((rows, t), np.bool_)

  def loss(params, b):
    return model.apply({"params": params}, b["inputs"], b["targets"], b["loss_mask"],
                       trainer.layout_of(b), method=model.loss)[0]

  with trainer.mesh_context(mesh):
    jaxpr = jax.make_jaxpr(loss)(abstract.params, batch).jaxpr
  # The tick scan: the outermost scan traced under pipeline.TICKS_SCOPE.
  ticks = [e.params["length"] for e in _scans(jaxpr)
           if pipeline.TICKS_SCOPE in str(e.source_info.name_stack)]
  if not ticks:
    raise RuntimeError(f"no scan under the named scope {pipeline.TICKS_SCOPE!r} in the jaxpr")
  return ticks[0]


def _scans(jaxpr):
  """Every scan eqn of a jaxpr, outer before inner (pre-order over nested jaxprs)."""
  for e in jaxpr.eqns:
    if e.primitive.name == "scan":
      yield e
    for v in e.params.values():
      for x in v if isinstance(v, (tuple, list)) else (v,):
        inner = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          yield from _scans(inner)


def pairs(doc_lens) -> int:
  return int(sum(n * (n + 1) // 2 for n in doc_lens))


def tick_loads(doclens, stages: int, data: int, microbatches: int, t: int, tolerance: float):
  """{placement: [ticks, S x D] pairs}: what every rank computes in every tick (one row per
  rank and microbatch)."""
  per_tick = ticks_lib.tick_rows(doclens, stages=stages, rows_per_rank=microbatches,
                                microbatches=microbatches)
  out = {k: np.zeros((len(per_tick), stages * data)) for k in ("local", "cad_stage", "cad_pooled")}
  for tick, rows in enumerate(per_tick):  # rows ordered (stage, data rank)
    out["local"][tick] = [pairs(r) for r in rows]
    for s in range(stages):
      stage_rows = rows[s * data:(s + 1) * data]
      if any(stage_rows):  # a bubble stage computes nothing without pooling
        plan = plan_lib.schedule(stage_rows, data, tokens_per_rank=t,
                                 options=plan_lib.PlanOptions(tolerance=tolerance))
        out["cad_stage"][tick, s * data:(s + 1) * data] = plan.loads_after
    plan = plan_lib.schedule(rows, stages * data, tokens_per_rank=t,
                             options=plan_lib.PlanOptions(tolerance=tolerance))
    out["cad_pooled"][tick] = plan.loads_after
    np.testing.assert_allclose(plan.loads_after.sum(), out["local"][tick].sum(), rtol=1e-9)
  return out


def summarize(loads, stages: int):
  """Per-tick max/mean over all ranks, and the critical path over the ideal."""
  mean = loads.mean(axis=1)
  busy = mean > 0
  ratio = loads.max(axis=1)[busy] / mean[busy]
  full = slice(stages - 1, loads.shape[0] - (stages - 1))  # ticks with every stage busy
  return {"imbalance_mean": float(ratio.mean()), "imbalance_max": float(ratio.max()),
          "imbalance_steady": float((loads.max(axis=1)[full] / mean[full]).mean()),
          "critical_path_over_ideal": float(loads.max(axis=1).sum() / mean.sum())}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--meshes", default="4x2,8x8", help="pipe x data, comma-separated")
  p.add_argument("--budgets", default="131072,524288", help="tokens per rank (one row)")
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--steps", type=int, default=2, help="batches per configuration")
  p.add_argument("--tolerance", type=float, default=plan_lib.DEFAULT_TOLERANCE)
  p.add_argument("--out", default="results/pipeline/pipeline_schedule")
  args = p.parse_args()
  command = experiments.command_line(__file__)
  meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]

  bubbles = []
  for s, d in meshes:
    for m in sorted({s, 2 * s, 4 * s}):
      ticks = traced_ticks(s, d, m)
      table = ticks_lib.schedule_table(s, m)
      bubbles.append({"pipe": s, "data": d, "microbatches": m, "traced_ticks": ticks,
                      "bubble_traced": 1 - m / ticks,
                      "bubble_table": ticks_lib.bubble_fraction(table),
                      "bubble_formula": (s - 1) / (m + s - 1)})
      print(f"pipe={s} data={d} M={m}: {ticks} ticks, bubble {1 - m / ticks:.3f} "
            f"(formula {(s - 1) / (m + s - 1):.3f})", flush=True)

  rows = []
  for name in args.workloads.split(","):
    for t in [int(v) for v in args.budgets.split(",")]:
      sampler = WorkloadSampler(name, t, seed=0)
      for s, d in meshes:
        m = 2 * s
        per = {k: [] for k in ("local", "cad_stage", "cad_pooled")}
        for step in range(args.steps):
          doclens = sampler.step_doclens(step, d * m)  # rank r's rows: [r M, (r + 1) M)
          for k, v in tick_loads(doclens, s, d, m, t, args.tolerance).items():
            per[k].append(summarize(v, s))
        agg = {"workload": name, "tokens_per_rank": t, "pipe": s, "data": d,
               "microbatches": m, "batches": args.steps}
        for k, v in per.items():
          for f in v[0]:
            agg[f"{k}_{f}"] = float(np.mean([x[f] for x in v]))
        rows.append(agg)
        print(f"{name:8s} T={t // 1024}K pipe={s} data={d} M={m}: critical path / ideal "
              f"local {agg['local_critical_path_over_ideal']:.2f}, CAD/stage "
              f"{agg['cad_stage_critical_path_over_ideal']:.2f}, pooled "
              f"{agg['cad_pooled_critical_path_over_ideal']:.2f}", flush=True)

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"command": command, "tolerance": args.tolerance, "bubble": bubbles,
               "balance": rows}, f, indent=1)
  lines = [
      "# Pipeline schedule: bubble and core-attention balance per tick", "",
      f"Command: `{command}` (host only; the bubble column traces the tiny model on fake CPU "
      "devices)", "",
      "## Bubble of the traced schedule", "",
      "GPipe as one scan over M + S - 1 ticks (`distca_jax/pipeline.py`). 'traced' = 1 - M / "
      "(the tick scan's length in the traced pipelined loss); 'table' = idle share of "
      "`plan.ticks.schedule_table`; formula = (S - 1) / (M + S - 1).", "",
      "| pipe | data | microbatches | ticks | bubble traced | table | formula |",
      "|---|---|---|---|---|---|---|",
  ]
  for b in bubbles:
    lines.append(f"| {b['pipe']} | {b['data']} | {b['microbatches']} | {b['traced_ticks']} | "
                 f"{b['bubble_traced']:.3f} | {b['bubble_table']:.3f} | "
                 f"{b['bubble_formula']:.3f} |")
  lines += [
      "", "## Core-attention balance per tick", "",
      f"{args.steps} batches per row (seeded `WorkloadSampler`, one row of T tokens per rank and "
      f"microbatch, M = 2 x pipe), tolerance {args.tolerance}, unbounded caps. Per tick: "
      "pairs each of the pipe x data ranks computes; 'max/mean' is over all ranks of a tick "
      "(bubble ranks count, at 0 unless pooled): mean over ticks / worst tick / mean over the "
      "steady ticks (every stage holds a microbatch); 'path' = sum "
      "over ticks of the slowest rank's pairs / (all pairs / ranks), the attention share of "
      "the step's critical path against perfect pooling (1.00). local = each rank its own "
      "row (packed_dp); CAD/stage = CAD over each stage's data ranks; pooled = CAD over all "
      "pipe x data ranks per tick. The synthetic recipe scales document lengths with the "
      "context (T), so 128K and 512K rows have the same shape and the same ratios.", "",
      "| workload | tokens/rank | pipe x data | M | local max/mean | local path | "
      "CAD/stage max/mean | CAD/stage path | pooled max/mean | pooled path |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    cell = lambda k: (f"{r[k + '_imbalance_mean']:.2f} / {r[k + '_imbalance_max']:.2f} / "
                      f"{r[k + '_imbalance_steady']:.2f} | {r[k + '_critical_path_over_ideal']:.2f}")
    lines.append(f"| {r['workload']} | {r['tokens_per_rank'] // 1024}K | {r['pipe']} x "
                 f"{r['data']} | {r['microbatches']} | {cell('local')} | {cell('cad_stage')} | "
                 f"{cell('cad_pooled')} |")
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  main()
