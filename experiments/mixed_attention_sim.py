"""Simulated distca gain with mixed local / global attention (host only; SIMULATED).

A Gemma-3-like 8B: Llama-3-8B's shapes with five sliding-window layers of 1024 keys per global
layer (``sim.windows``: ``ModelSpec.attention_layers = ((5, 1024), (1, 0))``), against the same
model with every layer global, at 4 GPUs (one node: 4 servers, 'remote') and 64 GPUs (TP 4, 16
servers, 2 per node: the two-level exchange on host-aware plans), Pretrain and ProLong at 128K
context (128K tokens per GPU: the 4-GPU rows as the project's 4-GPU runs; whether the whole
model's memory fits one GPU is reported, not required). The simulator and calibration of
``experiments.simulate`` (its default options: CAD's tolerance, gate and local branch as the
training config's); distca's gain is packed_dp's step over distca's on the same sampled batches.
Every strategy keeps its placement in every layer (distca one plan per batch, balanced on global
pairs); a window layer's task reads keys ``[max(0, a - w + 1), b)``, its kernel seconds scaled by
pairs from the measured causal table (window kernels are not measured), its exchange moves only
those keys; and distca with its window layers run on each rank's own rows, no exchange
(``Options.window_layers_local``). cp / WLB are left out: their K/V traffic under a window is not
modelled.

Run:
  python -m experiments.mixed_attention_sim          # writes results/mixed_attention_sim.{md,json}
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform

import numpy as np

from distca_jax.sim import costs, step
import experiments
from experiments import simulate

MIXED = ((5, 1024), (1, 0))
# (GPUs, tensor-parallel GPUs per server).
LAYOUTS = ((4, 1), (64, 4))


def run_row(model: str, workload: str, gpus: int, tensor: int, context: int, batches: int,
            cal, km, opts) -> dict:
  """packed_dp and distca of the all-global model and the mixed one on the same batches."""
  lay = step.Layout(gpus=gpus, tensor=tensor)
  tokens = context
  sampled = step.sample_batches(workload, tokens, lay, batches, context=context)
  row = {"model": model, "workload": workload, "gpus": gpus, "tensor": tensor,
         "servers": lay.data, "context": context, "tokens": tokens}
  for name, layers, local in (("global", (), False), ("mixed", MIXED, False),
                              ("mixed_local", MIXED, True)):
    spec = dataclasses.replace(costs.model_spec(model), attention_layers=layers)
    res = step.simulate(sampled, spec, lay, tokens, cal=cal, km=km,
                        opts=dataclasses.replace(opts, window_layers_local=local),
                        strategies=("packed_dp", "distca"))
    p, d = res["packed_dp"], res["distca"]
    attn = lambda r: float(np.max(r["per_rank_s"]["attention"]))
    row[name] = {
        "attention_layers": [list(x) for x in layers], "packed_dp_s": p["step_s"],
        "distca_s": d["step_s"], "gain": p["step_s"] / d["step_s"],
        "packed_dp_attention_s": attn(p), "distca_attention_s": attn(d),
        "distca_exchange_s": float(np.max(d["per_rank_s"]["exchange"])),
        "distca_exchange_share": float(np.max(d["per_rank_s"]["exchange_exposed"]))
                                 / d["step_s"],
        "collective": d["collective"], "local_batches": d["local_batches"],
        "bound_fraction_packed_dp": p["bound_fraction"],
        "fits_memory": bool(p["fits_memory"] and d["fits_memory"]),
    }
  return row


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batches", type=int, default=3)
  p.add_argument("--context", type=int, default=131072)
  p.add_argument("--model", default="llama3_8b")
  p.add_argument("--workloads", default="pretrain,prolong")
  p.add_argument("--out", default="results/mixed_attention_sim")
  args = p.parse_args(argv)
  sim_args = simulate.parse_args([])
  cal, km = simulate.calibration(sim_args)
  opts = simulate.options(sim_args)
  rows = []
  for gpus, tensor in LAYOUTS:
    for wl in args.workloads.split(","):
      r = run_row(args.model, wl, gpus, tensor, args.context, args.batches, cal, km, opts)
      rows.append(r)
      print(f"{wl} {gpus} GPUs: gain global {r['global']['gain']:.3f}x, mixed "
            f"{r['mixed']['gain']:.3f}x, window layers local {r['mixed_local']['gain']:.3f}x",
            flush=True)
  out = {"command": experiments.command_line(__file__), "commit": experiments.git_commit(),
         "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
         "machine": f"{platform.node()}: host only (NumPy), SIMULATED", "batches": args.batches,
         "mixed_layers": [list(x) for x in MIXED], "rows": rows}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump(out, f, indent=1)
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(_markdown(out)) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")
  return out


def _markdown(out) -> list[str]:
  lines = [
      "# Simulated distca gain with mixed local / global attention (SIMULATED, not measured)", "",
      f"Command: `{out['command']}`; commit `{out['commit']}`; {out['date']}; {out['machine']}; "
      f"{out['batches']} sampled batches per row.", "",
      "Gemma-3-like 8B: Llama-3-8B's shapes, five sliding-window layers of 1024 keys per global "
      "layer, against the same model all-global. Gain: packed_dp's step over distca's on the "
      "same batches. Every strategy keeps its placement in every layer (distca one plan per "
      "batch, balanced on global pairs); a window layer's query piece [a, b) reads keys "
      "[max(0, a - 1023), b), its kernel seconds are the measured causal table's for that "
      "shape scaled by its pairs (window kernels not measured), and distca's exchange moves "
      "only those keys; 'window local': distca runs the window layers on each rank's own "
      "rows without the exchange (`Options.window_layers_local`), the global layers through "
      "the plan. Attention s: the busiest rank's attention seconds over the step's "
      "layers. 'local' counts batches on the local branch (no plan moved a row). "
      "Calibration and options: `experiments.simulate`'s.", "",
      "| workload | GPUs (TP) | servers | tokens/rank | collective | packed_dp s global / mixed "
      "| distca s global / mixed / window local | distca gain global | distca gain mixed | "
      "distca gain mixed, window local | packed_dp attention s global / mixed | exchange share "
      "global / mixed / window local | local batches | fits |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in out["rows"]:
    g, m, w = r["global"], r["mixed"], r["mixed_local"]
    lines.append(
        f"| {r['workload']} | {r['gpus']} ({r['tensor']}) | {r['servers']} | "
        f"{r['tokens'] // 1024}K | {g['collective']} | {g['packed_dp_s']:.2f} / "
        f"{m['packed_dp_s']:.2f} | {g['distca_s']:.2f} / {m['distca_s']:.2f} / "
        f"{w['distca_s']:.2f} | **{g['gain']:.3f}** | **{m['gain']:.3f}** | "
        f"**{w['gain']:.3f}** | {g['packed_dp_attention_s']:.2f} / "
        f"{m['packed_dp_attention_s']:.2f} | {g['distca_exchange_share']:.2f} / "
        f"{m['distca_exchange_share']:.2f} / {w['distca_exchange_share']:.2f} | "
        f"{g['local_batches']} / {m['local_batches']} | "
        f"{'y' if g['fits_memory'] else 'n'} |")
  return lines


if __name__ == "__main__":
  main()
