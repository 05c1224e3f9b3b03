"""Simulated step time of packed_dp, cp, wlb (WLB-ideal) and distca at any GPU count (host only).

  python -m experiments.simulate --gpus 64 --model llama3_8b --workload pretrain --tokens 131072 \
      --tensor 4 --json /tmp/sim.json
  python -m experiments.simulate --validate --json results/simulator_validation.json
  python -m experiments.simulate --paper --out results/simulated_scale

The simulator (``distca_jax.sim``) runs the project's sampler, packers and CAD planner on sampled
batches and times them with costs calibrated on committed measurements (``--validate`` replays
those measurements: end-to-end steps on 1-4 GPUs, 4 x H100 runs of the current code for
packed_dp, wlb at its chosen CP size and alpha, cp, distca, a pipe 2 x data 2 pipeline with
pooled and per-stage CAD, and ping-pong, with speedups over packed_dp and memory per GPU; FA3
on task tables; the exchange alone; ``distca_jax.sim.validate`` lists every case and what is
fitted; the calibration used is printed): FA3 tasks by the measured cost table plus
a fitted fixed time per task, collectives by latency + bytes / bandwidth (distca's exchange as
built: 'remote' on the busiest device's useful bytes, 'dense' on its padded wire bytes, 'ragged'
on the largest (sender, server) group, the one its time follows; its dispatch by the capped
buffers' bytes / a rate fitted on 4 x H100 profiles). One config prints a table of step time,
the fraction of the balance bound (packed_dp's mean per-rank compute) each strategy reaches,
speedups, imbalance, bytes and memory per strategy and writes ``{"strategies": {name: {...}}}``
with per-rank breakdowns. Without ``--tensor`` / ``--pipe`` it picks the first layout (fewest
model-parallel GPUs: tensor 1-8 inside a node, pipe 1-4 with 2 x pipe micro-batches) where every
strategy fits memory, says which in one line, and says so in one line (exit 2) when none fits.
cp's and wlb's settings are chosen on other batches than the scored ones. distca's tolerance,
gates and local steps are the training config's defaults (``attention.distca.tolerance``,
``min_gain``, ``local_gain``, ``local_steps``) unless ``--tolerance`` / ``--min-gain`` /
``--no-local-steps`` say otherwise: without a pipeline a step whose plans all move nothing (or
whose every plan could gain less than ``local_gain``) is priced as packed_dp's (the train step's
local branch). ``--paper`` replays the DistCA paper's 3D (no pipeline) and 4D
(pipeline) experiments on Llama-3-8B at 16/32/64 GPUs and a 34B-class model at 128/256/512 GPUs,
contexts 128K-512K, both workloads, plus an epsilon sweep and per-rank imbalance; it writes
OUT.md, OUT.json and OUT.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
import time

import numpy as np

from distca_jax.data.batch import DataError
from distca_jax.data.workloads import check_workload
from distca_jax.sim import costs, step, validate
from experiments import command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The paper's ranges of distca's speedup over WLB-ideal (DistCA, arXiv 2510.18121, Sec. 6).
PAPER_RANGES = {("3d", "pretrain"): (1.07, 1.20), ("3d", "prolong"): (1.05, 1.12),
                ("4d", "pretrain"): (1.15, 1.35), ("4d", "prolong"): (1.15, 1.35)}
# Replay layouts: (model, GPU counts, 3D tensor size, 4D (tensor, pipe, micro-batches)).
PAPER_GRID = (("llama3_8b", (16, 32, 64), 4, (4, 2, 8)),
              ("llama3_34b", (128, 256, 512), 8, (8, 4, 8)))
CONTEXTS = (131072, 262144, 524288)
# cp's and wlb's settings are chosen on batches from this step on (never scored ones).
SELECT_FIRST_STEP = 100_000


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--validate", action="store_true", help="replay committed measurements")
  p.add_argument("--paper", action="store_true", help="the paper's 3D / 4D tables and plots")
  p.add_argument("--gpus", type=int, default=64)
  p.add_argument("--model", default="llama3_8b", choices=("llama3_8b", "llama3_34b"))
  p.add_argument("--workload", default="pretrain",
                 help="'pretrain', 'prolong', or the path of a document-length file of your own "
                 "data (a JSON list, a .npy array or one length a line; used as given)")
  p.add_argument("--tokens", type=int, default=131072, help="tokens per data rank per micro-batch")
  p.add_argument("--context", type=int, default=0,
                 help="the recipe's document scale (0 = --tokens); longer pieces are cut at rows")
  p.add_argument("--tensor", type=int, default=None,
                 help="tensor-parallel GPUs per rank (with --pipe unset: the layout picker's)")
  p.add_argument("--pipe", type=int, default=None, help="pipeline stages (default: picked)")
  p.add_argument("--micro-batches", type=int, default=None,
                 help="micro-batches per step (default: 1, or 2 x pipe under a pipeline)")
  p.add_argument("--collective", default="auto", choices=step.SIM_COLLECTIVES,
                 help="distca's exchange as built: 'auto' (the system's default: 'remote' for a "
                 "job within one node, one process; 'dense' across nodes, several processes), "
                 "'remote', 'dense' or 'ragged'")
  p.add_argument("--memory-mode", default="auto", choices=step.SIM_MEMORY_MODES,
                 help="distca's memory mode: 'auto' as the trainer's pre-flight ('keep' with "
                 "memory.AUTO_KEEP_SPARE of the device spare, else 'resend'), 'keep' or "
                 "'resend'")
  p.add_argument("--batches", type=int, default=3, help="sampled batches averaged")
  p.add_argument("--tolerance", type=float, default=None, help="CAD epsilon (default: config's)")
  p.add_argument("--min-gain", type=float, default=None,
                 help="CAD's gate, attention.distca.min_gain (default: config's; 0 = no gate)")
  p.add_argument("--no-local-steps", action="store_true",
                 help="price every distca step through the exchange (default: the config's "
                 "attention.distca.local_steps, a step whose plans move nothing runs without it)")
  p.add_argument("--nano-batches", type=int, default=2, help="2: CAD with ping-pong")
  p.add_argument("--remat", default="save_attention", choices=costs.REMAT_POLICIES,
                 help="model.remat: what the backward reruns and the layers keep")
  p.add_argument("--inter-node-gbps", type=float, default=50.0,
                 help="GB/s per GPU across nodes (stated, not measured here)")
  p.add_argument("--no-cp-overlap", action="store_true",
                 help="cp / wlb expose their K/V traffic (this project's all-gather)")
  p.add_argument("--json", default=None, help="write the result JSON here")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "simulated_scale"),
                 help="--paper: output stem")
  a = p.parse_args(argv)
  try:
    check_workload(a.workload)
  except DataError as e:
    p.error(f"--workload: {e}")
  if a.min_gain is not None and not 0.0 <= a.min_gain < float("inf"):
    p.error(f"--min-gain {a.min_gain} must be a finite number >= 0 (0: no gate)")
  return a


def calibration(a) -> tuple[costs.Calibration, costs.KernelModel]:
  km, _ = validate.kernel_model()
  cal = validate.calibrations(km)["current"]
  return dataclasses.replace(cal, inter_node_bw=a.inter_node_gbps * 1e9), km


def options(a, **kw) -> step.Options:
  """The strategies' options: CAD's tolerance, gate and local steps as the training config's
  defaults, unless ``--tolerance`` / ``--min-gain`` / ``--no-local-steps`` say otherwise."""
  from distca_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  ca = config_lib.base_config().attention.distca
  o = step.Options(tolerance=ca.tolerance, nano_batches=a.nano_batches,
                   collective=a.collective, memory_mode=a.memory_mode,
                   exchange_buckets=ca.exchange_buckets, buckets=ca.buckets,
                   caps_headroom=ca.caps_headroom, cp_overlap=not a.no_cp_overlap, remat=a.remat,
                   local_steps=step.DEFAULT_LOCAL_STEPS and not a.no_local_steps)
  if a.tolerance is not None:
    o = dataclasses.replace(o, tolerance=a.tolerance)
  if a.min_gain is not None:
    o = dataclasses.replace(o, min_gain=a.min_gain)
  return dataclasses.replace(o, **kw)


def run_config(model, workload, gpus, tokens, layout_kw, a, cal, km, context=0,
               opts=None) -> dict:
  """One configuration: every strategy, speedups, timing of the simulation itself."""
  spec = costs.model_spec(model)
  layout = step.Layout(gpus=gpus, **layout_kw)
  t0 = time.perf_counter()
  batches = step.sample_batches(workload, tokens, layout, a.batches, context=context)
  # cp's and wlb's settings are chosen on other batches of the same workload (no hindsight).
  select = step.sample_batches(workload, tokens, layout, a.batches, context=context,
                               first_step=SELECT_FIRST_STEP)
  res = step.simulate(batches, spec, layout, tokens, cal=cal, km=km, opts=opts or options(a),
                      select_batches=select)
  # WLB-ideal as this project's wlb backend runs it (the variant --validate checks on 2 and 4 GPUs):
  # K/V all-gather exposed, rows padded to Lmax = alpha T token slots; the same memory budget.
  as_run = step.simulate(batches, spec, layout, tokens, cal=cal, km=km,
                         strategies=("distca", "wlb"), select_batches=select,
                         opts=dataclasses.replace(opts or options(a), cp_overlap=False,
                                                  wlb_padded=True))["wlb"]
  sim_s = time.perf_counter() - t0
  dist = res["distca"]["step_s"]
  # The exchange's exposed seconds of a step: the same on every device per tick (every device
  # waits for the busiest), so the step without them is the step less their sum over the ticks.
  d = res["distca"]
  remote = d.get("priced_as_remote", d)
  before = d.get("host_blind_dense", d)
  ticks = layout.ticks if d["pooled_ticks"] else layout.micro_batches
  exposed = float(np.max(d["per_rank_s"]["exchange_exposed"])) * ticks
  exposed_before = float(np.max(before.get("exchange_exposed_s",
                                            d["per_rank_s"]["exchange_exposed"]))) * ticks
  return {"model": model, "workload": workload, "gpus": gpus, "tokens": tokens,
          "context": context or tokens, "layout": dataclasses.asdict(layout),
          "data_ranks": layout.data, "strategies": res,
          "speedup_vs_packed_dp": res["packed_dp"]["step_s"] / dist,
          "speedup_vs_wlb_ideal": res["wlb"]["step_s"] / dist,
          "speedup_vs_cp": res["cp"]["step_s"] / dist,
          "distca_collective": d["collective"], "distca_memory_mode": d["memory_mode"],
          "speedup_vs_wlb_ideal_if_remote": res["wlb"]["step_s"] / remote["step_s"],
          "speedup_vs_wlb_ideal_before": res["wlb"]["step_s"] / before["step_s"],
          "distca_exchange_exposed_s": exposed,
          "distca_exchange_share": exposed / dist,
          "distca_exchange_share_before": exposed_before / before["step_s"],
          "speedup_vs_wlb_ideal_exchange_free": res["wlb"]["step_s"] / (dist - exposed),
          "fits_every_strategy": all(x["fits_memory"] for x in res.values()),
          "wlb_ideal_as_implemented": {k: as_run[k] for k in ("step_s", "dp", "cp", "alpha",
                                                              "bound_fraction")},
          "speedup_vs_wlb_ideal_as_implemented": as_run["step_s"] / dist, "simulation_s": sim_s}


def layouts(gpus: int, a) -> list[dict]:
  """Layouts to try, fewest model-parallel GPUs first: the one given (``--tensor`` /
  ``--pipe``), else tensor 1-8 (inside a node) x pipe 1-4 (2 x pipe micro-batches)."""
  if a.tensor is not None or a.pipe is not None:
    pipe = a.pipe or 1
    return [dict(tensor=a.tensor or 1, pipe=pipe,
                 micro_batches=a.micro_batches or (2 * pipe if pipe > 1 else 1))]
  out = [dict(tensor=t, pipe=p, micro_batches=a.micro_batches or (2 * p if p > 1 else 1))
         for t in (1, 2, 4, 8) for p in (1, 2, 4) if gpus % (t * p) == 0]
  return sorted(out, key=lambda x: (x["tensor"] * x["pipe"], x["pipe"]))


class NoLayoutFits(ValueError):
  """No layout the picker tries fits every strategy in memory; ``main`` prints its one line on
  stderr and exits 2."""


def pick_layout(a, cal, km) -> dict:
  """The first of ``layouts`` where every strategy fits memory (``run_config``'s result), with a
  one-line ``layout_note``; ``NoLayoutFits`` (one line) when none does."""
  tried = []
  for lay in layouts(a.gpus, a):
    r = run_config(a.model, a.workload, a.gpus, a.tokens, lay, a, cal, km, context=a.context)
    need = max(s["memory_gb"]["total"] for s in r["strategies"].values())
    tried.append(f"{lay['tensor']}x{lay['pipe']}x{lay['micro_batches']} ({need:.0f} GB)")
    if r["fits_every_strategy"]:
      r["layout_note"] = (f"layout tensor {lay['tensor']} x pipe {lay['pipe']} x micro-batches "
                          f"{lay['micro_batches']}: the first of {len(tried)} tried where every "
                          f"strategy fits {cal.hbm_bytes / 1e9:.0f} GB per GPU")
      print(r["layout_note"])
      return r
  if a.tensor is not None or a.pipe is not None:  # the layout asked for, reported as it is
    r["layout_note"] = (f"not every strategy fits {cal.hbm_bytes / 1e9:.0f} GB per GPU in the "
                        f"layout given ({tried[0]}); see 'fits' per strategy")
    print(r["layout_note"])
    return r
  raise NoLayoutFits(f"no layout of {a.gpus} GPUs fits every strategy in "
                     f"{cal.hbm_bytes / 1e9:.0f} GB per GPU at --tokens {a.tokens} (tried tensor "
                     f"x pipe x micro-batches, largest need: {', '.join(tried)}); lower --tokens "
                     "or add GPUs")


def format_config(r) -> str:
  lines = [f"{r['model']} {r['workload']} {r['gpus']} GPUs {r['layout']} tokens/rank "
           f"{r['tokens']} (context {r['context']})",
           f"{'strategy':10s} {'step s':>8s} {'of bound':>8s} {'dp x cp':>8s} {'attn imb':>9s} "
           f"{'comp imb':>9s} {'tok imb':>8s} {'MB/layer':>9s} {'mem GB':>7s} fits"]
  for name, s in r["strategies"].items():
    lines.append(f"{name:10s} {s['step_s']:8.3f} {s['bound_fraction']:8.3f} "
                 f"{s['dp']:>3d} x {s['cp']:<3d} "
                 f"{s['attention_imbalance']:9.3f} {s['compute_imbalance']:9.3f} "
                 f"{s['token_imbalance']:8.3f} {s['bytes_per_layer_mean_mb']:9.1f} "
                 f"{s['memory_gb']['total']:7.1f} {s['fits_memory']}"
                 + (f" alpha {s['alpha']}" if "alpha" in s else ""))
  lines.append(f"distca speedup: {r['speedup_vs_packed_dp']:.3f}x packed_dp, "
               f"{r['speedup_vs_wlb_ideal']:.3f}x WLB-ideal "
               f"({r['speedup_vs_wlb_ideal_as_implemented']:.3f}x WLB-ideal as implemented here), "
               f"{r['speedup_vs_cp']:.3f}x cp "
               f"(simulated in {r['simulation_s']:.1f} s); balance bound "
               f"{r['strategies']['packed_dp']['balance_bound_s']:.3f} s")
  d = r["strategies"]["distca"]
  line = (f"distca exchange '{d['collective']}' (asked '{d['collective_asked']}'), memory mode "
          f"'{d['memory_mode']}', {d['wire_bytes_per_layer_mb']:.0f} MB per layer on the wire; "
          f"{d['local_batches']} of {len(d['step_s_per_batch'])} steps on the local branch (plans "
          "that move nothing)")
  line += f"; the exposed exchange is {r['distca_exchange_share']:.1%} of the step"
  if "priced_as_remote" in d:
    alt, old = d["priced_as_remote"], d["host_blind_dense"]
    line += (f"; the same plans with each device's useful bytes only, one call per exchange "
             f"('if exact'): {alt['step_s']:.3f} s, {r['speedup_vs_wlb_ideal_if_remote']:.3f}x "
             f"WLB-ideal; before (host-blind plans, 'dense'): {old['step_s']:.3f} s, "
             f"{r['speedup_vs_wlb_ideal_before']:.3f}x WLB-ideal, exchange "
             f"{r['distca_exchange_share_before']:.1%} of the step")
  lines.append(line)
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --validate
# ----------------------------------------------------------------------------------------------
def format_validation(v) -> str:
  lines = ["| kind | role | case | predicted (ms; speedup: ratio; memory: GB) | measured | error "
           "| why above 10% |", "|---|---|---|---|---|---|---|"]
  for c in v["cases"]:
    f = {"speedup": lambda x: f"{x:.3f}x", "memory": lambda x: f"{x:.1f} GB"}.get(
        c["kind"], lambda x: f"{x * 1e3:.2f}")
    lines.append(f"| {c['kind']} | {c['role']} | {c['name']} | {f(c['predicted_s'])} | "
                 f"{f(c['measured_s'])} | {100 * c['error']:+.1f}% | {c.get('note', '')} |")
  held = [c for c in v["cases"] if c["role"] == "held-out"]
  lines.append(f"\nmax |error| {100 * v['max_abs_error']:.1f}%; within 10%: {v['within_10pct']} "
               f"of {len(v['cases'])} cases; held-out: max |error| "
               f"{100 * v['max_abs_error_held_out']:.1f}%, {sum(c['within_10pct'] for c in held)} "
               f"of {len(held)} within 10%; {v['four_gpu_current_cases']} held-out cases of the "
               "current code on 4 GPUs; gate (every case within 10%): "
               + ("met" if v["gate_met"] else f"MISSED ({len(v['misses'])} cases above 10%, "
                  f"{len(v['unexplained'])} of them not explained)"))
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# --paper
# ----------------------------------------------------------------------------------------------
def fitting_tokens(model, context, layout_kw, cal, remat: str = "save_attention") -> int:
  """The largest power-of-two tokens per rank <= context whose packed_dp activations fit
  (``remat``: the model's policy)."""
  spec = costs.model_spec(model)
  t = context
  while t > 8192:
    lay = step.Layout(gpus=layout_kw.get("tensor", 1) * layout_kw.get("pipe", 1), **layout_kw)
    mem = costs.memory_bytes(spec, cal, tokens=t, layers=costs.ceil_div(
        spec.dims.n_layers, lay.pipe), tp=lay.tensor, pp=lay.pipe,
        in_flight=lay.in_flight, micro_batches=lay.micro_batches,
        extra_bytes=0.1 * cal.hbm_bytes, remat=remat)
    if mem["fits"]:
      return t
    t //= 2
  return t


def paper(a, cal, km) -> dict:
  rows = []
  for model, gpu_list, tp3, (tp4, pp4, mb4) in PAPER_GRID:
    for dim_name, lay in (("3d", dict(tensor=tp3)),
                          ("4d", dict(tensor=tp4, pipe=pp4, micro_batches=mb4))):
      for gpus in gpu_list:
        for context in CONTEXTS:
          tokens = fitting_tokens(model, context, lay, cal, a.remat)
          for wl in ("pretrain", "prolong"):
            r = run_config(model, wl, gpus, tokens, lay, a, cal, km, context=context)
            r["dims"] = dim_name
            rows.append(r)
            print(f"{dim_name} {model} {wl} {gpus} GPUs ctx {context} T {tokens}: "
                  f"{r['speedup_vs_wlb_ideal']:.3f}x WLB-ideal, "
                  f"{r['speedup_vs_packed_dp']:.3f}x packed_dp ({r['simulation_s']:.1f} s)",
                  flush=True)
  # Epsilon sweep (paper Fig. 12): bytes vs step time.
  sweep = []
  for eps in (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4):
    r = run_config("llama3_8b", "pretrain", 64, 131072, dict(tensor=4), a, cal, km,
                   opts=options(a, tolerance=eps))
    d = r["strategies"]["distca"]
    sweep.append({"tolerance": eps, "step_s": d["step_s"], "mb_per_layer": d[
        "bytes_per_layer_mean_mb"], "attention_imbalance": d["attention_imbalance"],
                  "exchange_s": float(np.max(d["per_rank_s"]["exchange"])),
                  "exchange_exposed_s": float(np.max(d["per_rank_s"]["exchange_exposed"]))})
    print(f"eps {eps}: step {d['step_s']:.3f} s, {d['bytes_per_layer_mean_mb']:.0f} MB/layer",
          flush=True)
  imb = run_config("llama3_8b", "pretrain", 64, 131072, dict(tensor=4), a, cal, km)
  return {"rows": rows, "eps_sweep": sweep, "imbalance_case": imb}


def _range(vals):
  return f"{min(vals):.2f}-{max(vals):.2f}" if vals else "n/a"


def write_paper(a, blob, cal, task_s: float) -> None:
  from distca_jax.trainer import AUTO_KEEP_SPARE  # pylint: disable=import-outside-toplevel
  cmd = command_line(__file__)
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  blob = dict(blob, command=cmd, date=stamp, calibration=dataclasses.asdict(cal),
              task_s=task_s)
  with open(a.out + ".json", "w") as f:
    json.dump(blob, f, indent=1)
  L = [f"# Simulated scale: the paper's 3D / 4D experiments replayed (SIMULATED, not measured)\n",
       f"- command: `{cmd}`", f"- date: {stamp}; host only (NumPy), {a.batches} sampled batches "
       "per configuration",
       f"- calibration (fitted on committed one-GPU steps and the 2-GPU collective bench; "
       f"`--validate`): matmul {cal.matmul_tflops:.0f} TF/s effective, attention "
       f"{cal.attention_scale:.3f} x the FA3 cost table (+ {task_s * 1e3:.2f} ms per task, "
       f"fitted), fixed {cal.step_fixed_s * 1e3:.0f} ms, "
       f"all_to_all {cal.a2a_latency_s * 1e3:.2f} ms + bytes / {cal.intra_node_bw / 1e9:.0f} GB/s "
       f"in a node; inter-node {cal.inter_node_bw / 1e9:.0f} GB/s per GPU (stated)",
       "- tokens/rank: the largest power of two <= the context whose packed_dp activations fit "
       f"one H200 (remat '{a.remat}', measured footprint); longer documents are cut at rows "
       "(the trainer's split rule), so every strategy sees the same batches",
       "- WLB-ideal: the (CP size, alpha) fastest on other sampled batches of the workload "
       "(never the scored ones) within distca's memory need (at most the GPU's), variable-length "
       "rows, K/V traffic hidden behind attention (ring), as the paper's baseline; 'as "
       "implemented here': the same search with this project's wlb backend (K/V all-gather "
       "exposed, rows padded to alpha T); cp: the CP size fastest on those other batches",
       f"- distca: collective '{a.collective}' as the system resolves it, here "
       f"{'/'.join(sorted({r['distca_collective'] for r in blob['rows']}))}: a job within one "
       f"node ({cal.gpus_per_node} GPUs) is one process and runs 'remote', a job across nodes "
       "runs one process per node and so the two-level exchange on host-aware plans (servers "
       f"per host: the {cal.gpus_per_node} GPUs of a node over a server's tensor-parallel "
       "GPUs; the planner balances inside nodes first and prices moves by link). 'two_level' as "
       "built: leg A between nodes in H - 1 ppermute rounds, leg B inside a node in L - 1 "
       "rounds, each round padded to the bucket that holds its largest group "
       f"(`dataplane.round_wire_rows`), {cal.a2a_latency_s * 1e3:.2f} ms a round, leg A at "
       f"{cal.inter_node_bw / 1e9:.0f} GB/s, leg B at {cal.intra_node_bw / 1e9:.0f} GB/s per GPU; "
       "its relay buffers (sampled plans x caps_headroom) in memory and in the dispatch passes. "
       "Beside it: 'before', the system before this (host-blind plans through 'dense': wire "
       "bytes of the data plane's own block choice, "
       f"{cal.dense_latency_s * 1e3:.2f} ms + wire bytes / {cal.dense_bw / 1e9:.0f} GB/s per "
       "exchange, scaled across nodes by inter / intra bandwidth, its S-sized blocks in memory); "
       "and 'if exact', the same host-aware plans priced with each device's useful bytes only, "
       f"one call per exchange ({cal.remote_latency_s * 1e3:.2f} ms + bytes / "
       f"{cal.remote_bw / 1e9:.0f} GB/s, scaled across nodes): what an inter-node leg without "
       "padding (an NCCL call with the host's counts, GPU measurement open) would give; "
       "'exchange share' is the exposed exchange over distca's step; "
       f"{100 * cal.exchange_hidden:.0f}% of the exchange hidden (no overlap measured on "
       "GPUs); memory per layer as compiled (server buffers kept per layer in 'keep', the "
       "kernel's outputs only in 'resend', one layer's exchange buffers, FlashAttention-3's "
       f"backward workspace); memory mode '{a.memory_mode}' (the pre-flight's rule: 'keep' "
       f"with {AUTO_KEEP_SPARE:.0%} of the GPU spare, else 'resend', whose backward sends Q and "
       "K/V once more); "
       f"tolerance {options(a).tolerance}, gate (min_gain) {options(a).min_gain}; without a "
       "pipeline a step whose plans all move nothing (every micro-batch's predicted gain below "
       f"local_gain {options(a).local_gain}, or balanced as it lies) runs the step's local "
       "branch, priced as packed_dp's step (no exchange, no dispatch): "
       + ("on" if options(a).local_steps else "off (--no-local-steps)"),
       "- 4D: the GPipe scan the system runs (M + S - 1 ticks in lockstep, every tick's "
       "activations kept), distca planned once per tick over every stage's rows (pipe x data "
       "servers, bubble slots serve the others); LM head after the pipeline over pipe x data",
       "- bound: the balance bound, packed_dp's mean per-rank compute in the same schedule "
       "(no communication); 'of bound' = bound / step (1 = perfect balance, free communication)"
       "\n"]
  for dim_name in ("3d", "4d"):
    sub = [r for r in blob["rows"] if r["dims"] == dim_name]
    L += [f"## {dim_name.upper()}\n",
          "| model | workload | GPUs | layout (TP x PP x M) | data ranks | context | tokens/rank | "
          "packed_dp s | cp s | WLB-ideal s (dp x cp, alpha) | distca s | bound s | "
          "of bound (p/c/w/d) | distca / WLB-ideal | "
          "distca / WLB-ideal as implemented here | distca / packed_dp | "
          "exchange share (before) | distca before / WLB-ideal | "
          "distca if exact / WLB-ideal | distca memory mode | "
          "paper range vs WLB-ideal | fits (p/c/w/d) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sub:
      s = r["strategies"]
      lay = r["layout"]
      lo, hi = PAPER_RANGES[(dim_name, r["workload"])]
      fits = "/".join("y" if s[k]["fits_memory"] else "n" for k in step.STRATEGIES)
      L.append(f"| {r['model']} | {r['workload']} | {r['gpus']} | {lay['tensor']} x "
               f"{lay['pipe']} x {lay['micro_batches']} | {r['data_ranks']} | "
               f"{r['context'] // 1024}K | {r['tokens'] // 1024}K | "
               f"{s['packed_dp']['step_s']:.2f} | {s['cp']['step_s']:.2f} | "
               f"{s['wlb']['step_s']:.2f} ({s['wlb']['dp']} x {s['wlb']['cp']}, "
               f"{s['wlb']['alpha']}) | {s['distca']['step_s']:.2f} | "
               f"{s['packed_dp']['balance_bound_s']:.2f} | "
               + "/".join(f"{s[k]['bound_fraction']:.2f}" for k in step.STRATEGIES) + " | "
               f"**{r['speedup_vs_wlb_ideal']:.3f}** | "
               f"{r['speedup_vs_wlb_ideal_as_implemented']:.3f} | "
               f"{r['speedup_vs_packed_dp']:.3f} | "
               f"{r['distca_exchange_share']:.2f} ({r['distca_exchange_share_before']:.2f}) | "
               f"{r['speedup_vs_wlb_ideal_before']:.3f} | "
               f"{r['speedup_vs_wlb_ideal_if_remote']:.3f} | {r['distca_memory_mode']} | "
               f"{lo:.2f}-{hi:.2f} | {fits} |")
    for wl in ("pretrain", "prolong"):
      w = [r["speedup_vs_wlb_ideal"] for r in sub if r["workload"] == wl]
      we = [r["speedup_vs_wlb_ideal_as_implemented"] for r in sub if r["workload"] == wl]
      p = [r["speedup_vs_packed_dp"] for r in sub if r["workload"] == wl]
      lo, hi = PAPER_RANGES[(dim_name, wl)]
      free = [r["speedup_vs_wlb_ideal_exchange_free"] for r in sub if r["workload"] == wl]
      rem = [r["speedup_vs_wlb_ideal_if_remote"] for r in sub if r["workload"] == wl]
      share = [r["distca_exchange_share"] for r in sub if r["workload"] == wl]
      share0 = [r["distca_exchange_share_before"] for r in sub if r["workload"] == wl]
      old_w = [r["speedup_vs_wlb_ideal_before"] for r in sub if r["workload"] == wl]
      L.append(f"\n{dim_name.upper()} {wl}: distca over WLB-ideal {_range(w)}x (paper "
               f"{lo:.2f}-{hi:.2f}x; {_range(we)}x over WLB-ideal as implemented here; before "
               f"{_range(old_w)}x), over packed_dp {_range(p)}x; its exchange is "
               f"{_range(share)} of its step (before {_range(share0)}), and without it distca "
               f"would run {_range(free)}x WLB-ideal; with an exact inter-node leg "
               f"{_range(rem)}x WLB-ideal.")
    L.append("")
  L += ["## Epsilon sweep (Llama-3-8B, 64 GPUs, TP 4, Pretrain 128K; paper Fig. 12)\n",
        "| tolerance | distca step s | MB per layer per rank (fwd) | exchange s (all layers) | "
        "exposed s | attention imbalance |", "|---|---|---|---|---|---|"]
  for e in blob["eps_sweep"]:
    L.append(f"| {e['tolerance']} | {e['step_s']:.3f} | {e['mb_per_layer']:.0f} | "
             f"{e['exchange_s']:.3f} | {e['exchange_exposed_s']:.3f} | "
             f"{e['attention_imbalance']:.3f} |")
  imb = blob["imbalance_case"]
  L += ["\n## Compute and memory per rank (Llama-3-8B, 64 GPUs, TP 4, Pretrain 128K)\n",
        "| strategy | step s | compute max/mean (per-rank s) | tokens max/mean | "
        "memory GB (max rank) |",
        "|---|---|---|---|---|"]
  for name, s in imb["strategies"].items():
    rs = np.asarray(s["per_rank_step_s"])
    L.append(f"| {name} | {s['step_s']:.3f} | {rs.max() / rs.mean():.3f} | "
             f"{s['token_imbalance']:.3f} | {s['memory_gb']['total']:.1f} |")
  stem = os.path.basename(a.out)
  L.append(f"\nPlot: `{stem}.png` (speedups, epsilon sweep, per-rank compute and tokens).")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(L) + "\n")
  plot_paper(a.out, blob)
  print("\n".join(L))


def plot_paper(stem, blob) -> None:
  """One figure, ``stem.png``: distca's speedups (3D, 4D), the epsilon sweep and per-rank
  compute and tokens."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig = plt.figure(figsize=(15, 12))
  grid = fig.add_gridspec(3, 3, height_ratios=(1, 1, 0.9))
  speed_axes = [fig.add_subplot(grid[0, :])]
  speed_axes.append(fig.add_subplot(grid[1, :], sharey=speed_axes[0]))
  for ax, dim_name in zip(speed_axes, ("3d", "4d")):
    sub = [r for r in blob["rows"] if r["dims"] == dim_name]
    labels = [f"{r['model'][7:]} {r['gpus']}g {r['context'] // 1024}K {r['workload'][:3]}"
              for r in sub]
    x = np.arange(len(sub))
    ax.bar(x - 0.27, [r["speedup_vs_wlb_ideal"] for r in sub], 0.27, label="distca / WLB-ideal")
    ax.bar(x, [r["speedup_vs_wlb_ideal_as_implemented"] for r in sub], 0.27,
           label="distca / WLB-ideal as implemented here")
    ax.bar(x + 0.27, [r["speedup_vs_packed_dp"] for r in sub], 0.27, label="distca / packed_dp")
    for wl in ("pretrain", "prolong"):
      lo, hi = PAPER_RANGES[(dim_name, wl)]
      ax.axhspan(lo, hi, alpha=0.08, color="green" if wl == "pretrain" else "purple",
                 label=f"paper vs WLB-ideal ({wl})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(0.9, None)
    ax.set_xticks(x, labels, rotation=90, fontsize=6)
    ax.set_title(f"{dim_name.upper()} (simulated)")
    ax.set_ylabel("speedup of distca")
  speed_axes[0].legend(fontsize=7)

  sw = blob["eps_sweep"]
  ax = fig.add_subplot(grid[2, 0])
  ax.plot([e["mb_per_layer"] for e in sw], [e["step_s"] for e in sw], "o-")
  for e in sw:
    ax.annotate(f"eps {e['tolerance']}", (e["mb_per_layer"], e["step_s"]), fontsize=7)
  ax.set_xlabel("CAD bytes received per rank per layer (MB, forward)")
  ax.set_ylabel("simulated step s")
  ax.set_title("epsilon sweep, 8B, 64 GPUs, Pretrain 128K", fontsize=9)

  imb = blob["imbalance_case"]["strategies"]
  rank_axes = [fig.add_subplot(grid[2, 1]), fig.add_subplot(grid[2, 2])]
  for name in ("packed_dp", "wlb", "distca"):
    s = imb[name]
    rank_axes[0].plot(s["per_rank_step_s"], ".-", label=name)
    rank_axes[1].plot(np.asarray(s["per_rank_s"]["linear"]) / max(s["per_rank_s"]["linear"]),
                      ".-", label=name)
  rank_axes[0].set_title("per-rank compute of a step (s, simulated)", fontsize=9)
  rank_axes[1].set_title("per-rank tokens held (activation memory), / max", fontsize=9)
  for ax in rank_axes:
    ax.set_xlabel("data rank")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(stem + ".png", dpi=110)
  plt.close(fig)


def main(argv=None):
  a = parse_args(argv)
  if a.validate:
    v = validate.validate()
    v["command"] = command_line(__file__)
    table = format_validation(v)
    print(table)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(v, f, indent=1)
      cals = "\n".join(f"- era `{k}`: " + ", ".join(f"{f} {c[f]:.4g}" for f in (
          "matmul_tflops", "attention_scale", "step_fixed_s", "a2a_latency_s", "intra_node_bw",
          "remote_latency_s", "remote_bw", "dense_latency_s", "dense_bw", "ragged_latency_s",
          "ragged_bw", "dispatch_bw"))
                       for k, c in v["calibrations"].items())
      with open(os.path.splitext(a.json)[0] + ".md", "w") as f:
        f.write(f"# Simulator validation: predicted vs measured\n\n- command: `{v['command']}`\n"
                f"- roles: `fit` cases calibrate (see distca_jax/sim/validate.py), `held-out` "
                f"cases do not\n- calibrations:\n{cals}\n\n{table}\n")
    return v
  cal, km = calibration(a)
  if a.paper:
    blob = paper(a, cal, km)
    write_paper(a, blob, cal, km.task_s)
    return blob
  try:
    r = pick_layout(a, cal, km)
  except NoLayoutFits as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)
  print(format_config(r))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(r, calibration=dataclasses.asdict(cal)), f, indent=1)
  return r


if __name__ == "__main__":
  main()
