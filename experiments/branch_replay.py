"""The price rule (``plan.choice``) replayed step by step over committed runs that timed both
branches on the same batches.

  python -m experiments.branch_replay --out results/skip/branch_replay

A replayed run is a distca run without a pipeline and a packed_dp run (packed_dp+pingpong for a
ping-pong run) of the same call or session, on the same batches (``e2e_bench`` samples them from
the workload, seed 0, and the step index): per timed step, the measured distca step is CAD's
time and the measured packed_dp step the local branch's. A distca step that the run's own gates
sent to the local branch (replanned on the host: ``sim.validate.predict_branches``'
``ran_local``; its count checked against the run's recorded ``local_steps``) has no CAD time:
it is left out of the replay (the rule sees the run's other steps, in order). The runs: every
such pair of the simulator's eras (``sim.eras``, priced with their era's calibration as
``sim.validate`` prices them) and the runs outside them listed in ``EXTRA`` (the whole
Llama-3-8B with FSDP, 4 x H100 and 4 x H200; ProLong 128K on 4 x H100 at s3 and s5; 2 x H200
'keep' / 'resend'), priced with the calibration of the device and code named there. The
simulator does not model FSDP's weight gathers (the same for both branches) or how they meet
the exchange: those runs lean on the rule's correction.

For each run a fresh ``plan.choice.BranchChooser`` sees, per step in order, the model's prices
of both branches (``predict_branches``), chooses, and is told the measured time of the branch it
chose (nothing of the other). Reported per run and in total (per workload): the rule's time, the
oracle's (the faster measured branch of every step), always-CAD, always-local, today's gate
(``attention.distca.local_gain`` / ``min_gain`` at the config's defaults: the local branch's
measured time where the gate sends the step there, else CAD's), the regret ``(rule - oracle) /
oracle``, and the share of the measured gain kept: ``(local - rule) / (local - oracle)``, the
gain of CAD on the steps where it wins. Gates: regret <= 1% in total and per workload; >= 95% of
Pretrain's gain kept.

Host CPU only (planning and the step model; no device). Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
from typing import Any

import numpy as np

from distca_jax.plan import choice
from distca_jax.sim import validate
from distca_jax.sim.eras import (CALIBRATION_RUNS, DISTCA_ONLY_VARIANTS, ERAS, HELD_OUT_RUNS,
                                 PAIRED_RUNS)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# distca runs whose local-branch partner lies in another file than ``PAIRED_RUNS`` names: the
# skip call's old tree (every batch through the exchange) against the new tree's packed_dp, one
# call, the same batches (results/skip/README.md).
OTHER_PARTNERS = {f"skip/raw/step_cond/e2e_2gpu_skip_old_{w}":
                  f"skip/raw/step_cond/e2e_2gpu_skip_new_{w}" for w in ("pretrain", "prolong")}
# Runs outside the simulator's eras: (distca stem, its partner's stem, era whose calibration and
# gates price it, overrides put before the run's own: what its config or 'auto' ran, as logged).
EXTRA = [
    # The whole 8B with FSDP on 4 x H100 (results/fsdp/e2e_8b_4gpu.md, code of d6f7488: no
    # local branch): configs/llama3_8b_4gpu.py (remat 'full'); 'auto' ran 'remote' and 'keep'.
    *[(f"fsdp/raw/e2e_8b_{w}_distca", f"fsdp/raw/e2e_8b_{w}_packed_dp", "h100",
       ("model.remat=full", "attention.distca.collective=remote",
        "attention.distca.memory_mode=keep")) for w in ("pretrain", "prolong")],
    # The 8B with FSDP on 4 x H200, remat 'save_attention' at 16K (results/fsdp/
    # e2e_8b_mfu_h200.md, code of 231bdf7: the local branch at local_gain 0.05).
    ("fsdp/raw/mfu_h200/e2e_8b_mfu_sa16k_distca", "fsdp/raw/mfu_h200/e2e_8b_mfu_sa16k_packed_dp",
     "h200-s7", ("attention.distca.collective=remote", "attention.distca.memory_mode=keep")),
    # ProLong 128K on 4 x H100 (results/four/README.md s3, code of d6f7488: no local branch);
    # one process per backend; the memory mode as the simulator resolves 'auto' (not logged).
    ("four/raw/s3/e2e_4gpu_prolong_128k_distca", "four/raw/s3/e2e_4gpu_prolong_128k_packed_dp",
     "h100", ("attention.distca.collective=remote", "attention.distca.memory_mode=auto")),
    # 128K with the step's local branch on 4 x H100 (s5, code of 0458125: min_gain 0.05 was
    # the default, no local_gain); 'auto' ran 'resend' (logged).
    ("four/raw/s5/e2e_4gpu_128k_local", "four/raw/s5/e2e_4gpu_128k_local", "h100-local",
     ("attention.distca.min_gain=0.05", "attention.distca.collective=remote",
      "attention.distca.memory_mode=resend")),
    # 2 x H200, Pretrain 64K, 'keep' and 'resend' (s6, code of 63a9720; 'auto' ran 'keep').
    ("four/raw/s6/two_h200_keep_resend/e2e_2gpu_keep_resend_64k",
     "four/raw/s6/two_h200_keep_resend/e2e_2gpu_keep_resend_64k", "h200",
     ("attention.distca.collective=remote", "attention.distca.memory_mode=keep")),
]
# Committed files with distca and packed_dp steps that are not replayed, and why.
NOT_REPLAYED = {
    "four/raw/e2e_4gpu_{pretrain,prolong}_64k_{distca,packed_dp}": "the code that ran them is "
    "not recorded (results/four/README.md names the e2e_bk_* runs of the same shapes, which are "
    "replayed)",
    "four/raw/s{4,6,7}/e2e_4gpu_4d_pretrain": "pipe 2 x data 2: a pipelined step has no local "
    "branch (every tick runs the exchange)",
    "skip/raw/{layer_cond,host_switch}": "designs of the local branch that were replaced; the "
    "old tree's distca of those calls repeats step_cond's",
    "fsdp/raw/mfu_h200 (full16k, full64k)": "no packed_dp run on those batches",
    "four/raw/h200_e2e_pretrain_128k_distca_resend, e2e_128k_vmm": "no packed_dp run in that "
    "call",
}


@dataclasses.dataclass
class Pair:
  """A distca run and its local-branch partner (same batches), with the era that prices it."""
  cad: validate.E2eRun
  local: validate.E2eRun
  era: str


def measured(run: validate.E2eRun) -> dict[int, float]:
  """Step index -> measured seconds of ``run`` (its JSON's ``step_ms_all``)."""
  with open(validate.results_path(run.stem)) as f:
    blob = json.load(f)
  (r,) = [r for r in blob["results"] if "error" not in r and r["backend"] == run.backend
          and r["workload"] == run.workload]
  return {s: ms / 1e3 for s, ms in zip(run.steps, r["step_ms_all"])}


def recorded_local(run: validate.E2eRun) -> float | None:
  """The run's recorded share of steps on the local branch (None where not recorded)."""
  with open(validate.results_path(run.stem)) as f:
    blob = json.load(f)
  (r,) = [r for r in blob["results"] if "error" not in r and r["backend"] == run.backend
          and r["workload"] == run.workload]
  return r.get("local_steps")


def _partner_backend(backend: str) -> str:
  """packed_dp's backend a distca backend is paired with: the same ping-pong variant."""
  return "packed_dp+pingpong" if backend.endswith("+pingpong") else "packed_dp"


def _find_partner(run, stems, loaded):
  for stem in stems:
    for r in loaded(stem):
      if (r.backend == _partner_backend(run.backend) and r.workload == run.workload
          and (r.tokens, r.rows_per_rank, r.layers, r.devices) == (run.tokens, run.rows_per_rank,
                                                                   run.layers, run.devices)):
        return r
  return None


def pairs() -> tuple[list[Pair], list[str]]:
  """Every replayable pair (``Pair``) and a line per distca run left out, with the reason."""
  cache: dict[str, list] = {}
  loaded = lambda stem: cache.setdefault(stem, validate.load_runs(stem))
  out, skipped = [], []
  seen = set()
  cands = [(stem, b, era, ()) for era in ERAS for table in (CALIBRATION_RUNS, HELD_OUT_RUNS)
           for stem, b in table.get(era, ())]
  cands += [(stem, None, era, ov) for stem, _, era, ov in EXTRA]
  partners = {stem: p for stem, p, _, _ in EXTRA}
  for stem, backend, era, ov in cands:
    for run in loaded(stem):
      if run.strategy != "distca" or (backend is not None and run.backend != backend):
        continue
      key = (stem, run.backend, run.workload)
      if key in seen:
        continue
      seen.add(key)
      name = f"{stem} {run.backend} {run.workload}"
      if run.pipe != 1:
        skipped.append(f"{name}: pipeline (no local branch)")
        continue
      if "+signal" in run.backend:
        skipped.append(f"{name}: signal-only twin (its exchange carries no rows)")
        continue
      stems = [stem, PAIRED_RUNS.get(stem), OTHER_PARTNERS.get(stem), partners.get(stem)]
      local = _find_partner(run, [s for s in stems if s], loaded)
      if local is None:
        skipped.append(f"{name}: no packed_dp run on the same batches")
        continue
      common = tuple(s for s in run.steps if s in set(local.steps))
      if not common:
        skipped.append(f"{name}: its packed_dp partner timed other steps")
        continue
      if ov:
        run = dataclasses.replace(run, overrides=tuple(ov) + run.overrides)
        local = dataclasses.replace(local, overrides=tuple(ov) + local.overrides)
      out.append(Pair(run, local, era))
  return out, skipped


def replay_run(cad_t, local_t, p_cad, p_local, options: choice.ChoiceOptions
               ) -> dict[str, Any]:
  """The rule over one run's steps (lists in step order: measured CAD and local seconds, their
  predictions): each step chooses from the predictions and observes only the chosen branch's
  measured time. Returns the branches chosen, the reasons and the totals."""
  chooser = choice.BranchChooser(options)
  chosen, reasons, rule = [], [], 0.0
  for tc, tl, pc, pl in zip(cad_t, local_t, p_cad, p_local):
    c = chooser.choose(pc, pl)
    t = tc if c.branch == "cad" else tl
    chooser.observe(c, t)
    chosen.append(c.branch)
    reasons.append(c.reason)
    rule += t
  return {"chosen": chosen, "reasons": reasons, **totals(cad_t, local_t, rule),
          "guard": chooser.state()}


def totals(cad_t, local_t, rule_s: float) -> dict[str, float]:
  """Sums over a run's steps: rule, oracle (the faster measured branch per step), always-CAD,
  always-local; regret ``(rule - oracle) / oracle`` and the gain kept ``(local - rule) / (local -
  oracle)`` (None where CAD wins no step)."""
  cad, local = np.asarray(cad_t, np.float64), np.asarray(local_t, np.float64)
  oracle = float(np.minimum(cad, local).sum())
  avail = float(local.sum()) - oracle
  return {"rule_s": float(rule_s), "oracle_s": oracle, "cad_s": float(cad.sum()),
          "local_s": float(local.sum()), "regret": (float(rule_s) - oracle) / oracle,
          "gain_available_s": avail,
          "gain_kept": (float(local.sum()) - float(rule_s)) / avail if avail > 0 else None}


def aggregate(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Totals over runs (sums of seconds; regret and gain kept of the sums)."""
  s = {k: float(sum(r[k] for r in rows)) for k in ("rule_s", "oracle_s", "cad_s", "local_s",
                                                   "gate_s", "gain_available_s")}
  s["regret"] = (s["rule_s"] - s["oracle_s"]) / s["oracle_s"]
  s["gate_regret"] = (s["gate_s"] - s["oracle_s"]) / s["oracle_s"]
  avail = s["gain_available_s"]
  s["gain_kept"] = (s["local_s"] - s["rule_s"]) / avail if avail > 0 else None
  s["gate_gain_kept"] = (s["local_s"] - s["gate_s"]) / avail if avail > 0 else None
  s["rule_over_local"] = s["rule_s"] / s["local_s"]
  s["gate_over_local"] = s["gate_s"] / s["local_s"]
  # The runs the rule made slower than always-local, and the worst ratio.
  s["runs_slower_than_local"] = sum(r["rule_s"] > r["local_s"] for r in rows)
  s["max_rule_over_local"] = max(r["rule_s"] / r["local_s"] for r in rows)
  s["max_gate_over_local"] = max(r["gate_s"] / r["local_s"] for r in rows)
  s["runs"] = len(rows)
  s["steps"] = int(sum(len(r["steps"]) for r in rows))
  s["cad_steps"] = int(sum(r["chosen"].count("cad") for r in rows))
  return s


def priced_runs() -> list[dict[str, Any]]:
  """Every replayed run's steps (the pairs of ``pairs``, steps the run's gates sent to the local
  branch left out): measured CAD and local seconds, both predictions, today's gate's branch."""
  km, _ = validate.kernel_model()
  cals = validate.calibrations(km)
  prs, _ = pairs()
  out = []
  for p in prs:
    pred = validate.predict_branches(p.cad, p.local, cals[p.era], km, p.era)
    mc, ml = measured(p.cad), measured(p.local)
    steps = [s for s in p.cad.steps if s in ml]
    idx = {s: i for i, s in enumerate(p.cad.steps)}
    ran_local = [pred["ran_local"][idx[s]] for s in steps]
    rec = recorded_local(p.cad)
    check = None
    if rec is not None and len(steps) == len(p.cad.steps):
      check = round(rec * len(steps)) == sum(ran_local)
      if not check:
        raise ValueError(f"{p.cad.stem} {p.cad.backend} {p.cad.workload}: replanned "
                         f"{sum(ran_local)} local steps of {len(steps)}, the run recorded "
                         f"{rec:.3f}; the host no longer plans what the run planned")
    use = [s for s, loc in zip(steps, ran_local) if not loc]
    if not use:
      continue
    ci = [idx[s] for s in use]
    rows = p.cad.rows_per_rank
    out.append(dict(
        name=f"{p.cad.stem}: {p.cad.workload} {p.cad.tokens // 1024}K"
        f"{f' x{rows}' if rows > 1 else ''} {p.cad.backend} vs {p.local.backend}, "
        f"{p.cad.layers} layers, {p.cad.devices} GPU",
        stem=p.cad.stem, era=p.era, workload=p.cad.workload, devices=p.cad.devices,
        layers=p.cad.layers, steps=use, left_out=[s for s in steps if s not in use],
        local_count_checked=check, measured_cad_s=[mc[s] for s in use],
        measured_local_s=[ml[s] for s in use],
        predicted_cad_s=[pred["cad_s"][i] for i in ci],
        predicted_local_s=[pred["local_s"][i] for i in ci],
        gate_local=[pred["gate_local"][i] for i in ci],
        collective=pred["collective"], memory_mode=pred["memory_mode"]))
  return out


def replay(priced: list[dict[str, Any]], options: choice.ChoiceOptions) -> dict[str, Any]:
  """The rule (``replay_run``) and today's gate over every priced run; totals per workload."""
  rows = []
  for r in priced:
    res = replay_run(r["measured_cad_s"], r["measured_local_s"], r["predicted_cad_s"],
                     r["predicted_local_s"], options)
    res["gate_s"] = float(sum(tl if g else tc for tc, tl, g in zip(
        r["measured_cad_s"], r["measured_local_s"], r["gate_local"])))
    rows.append(dict(r, **res))
  return {"options": dataclasses.asdict(options), "runs": rows,
          "by_workload": {w: aggregate([r for r in rows if r["workload"] == w])
                          for w in sorted({r["workload"] for r in rows})},
          "total": aggregate(rows)}


# The sensitivity grid: the rule's totals with other constants (the defaults' row included).
SENSITIVITY = [dict(margin=m, sigma0=s, budget=b) for m in (0.0, 0.01, 0.02)
               for s in (0.02, 0.05, 0.1) for b in (0.005, 0.01)]


def run_replay(options: choice.ChoiceOptions) -> dict[str, Any]:
  priced = priced_runs()
  out = replay(priced, options)
  out["sensitivity"] = []
  for kw in SENSITIVITY:
    o = dataclasses.replace(options, **kw)
    res = replay(priced, o)
    out["sensitivity"].append(dict(kw, total=res["total"], by_workload=res["by_workload"]))
  _, out["skipped"] = pairs()
  out["not_replayed"] = NOT_REPLAYED
  return out


def _pct(x):
  return "" if x is None else f"{100 * x:.2f}%"


def markdown(blob: dict[str, Any]) -> str:
  o = blob["options"]
  t = blob["total"]
  pre = blob["by_workload"].get("pretrain", {})
  met_regret = t["regret"] <= 0.01 and all(a["regret"] <= 0.01
                                           for a in blob["by_workload"].values())
  met_gain = pre.get("gain_kept") is not None and pre["gain_kept"] >= 0.95
  lines = [
      "# The price rule replayed: CAD or the local branch, per step",
      "",
      f"- command: `{blob['command']}`",
      f"- commit: `{blob['commit']}` (the code that produced it); machine: {blob['machine']} "
      "(host CPU: planning and the step model, no device), replaying measured steps of the runs "
      "below (their devices in the names' folders: results/four/README.md, "
      "results/fsdp/, results/skip/README.md)",
      f"- rule: `distca_jax/plan/choice.py` (margin {o['margin']}, budget {o['budget']}, sigma0 "
      f"{o['sigma0']}, sigma_min {o['sigma_min']}, ema {o['ema']}); prices: "
      "`sim.validate.predict_branches` with each run's era calibration",
      "- regret = (rule - oracle) / oracle; gain kept = (always-local - rule) / (always-local - "
      "oracle); today's gate = `local_gain` 0.05 / `min_gain` 0.02 applied to the same steps",
      f"- gates: regret <= 1% in total and per workload: **{'met' if met_regret else 'NOT met'}**"
      f"; >= 95% of Pretrain's gain kept: **{'met' if met_gain else 'NOT met'}**",
      "",
      "| scope | runs | steps | CAD steps (rule) | rule s | oracle s | always-CAD s | "
      "always-local s | today's gate s | regret (rule) | regret (gate) | gain kept (rule) | "
      "gain kept (gate) | rule / local (worst run) | gate / local (worst run) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for scope, a in [*blob["by_workload"].items(), ("total", t)]:
    lines.append(f"| {scope} | {a['runs']} | {a['steps']} | {a['cad_steps']} | "
                 f"{a['rule_s']:.2f} | {a['oracle_s']:.2f} | {a['cad_s']:.2f} | "
                 f"{a['local_s']:.2f} | {a['gate_s']:.2f} | {_pct(a['regret'])} | "
                 f"{_pct(a['gate_regret'])} | {_pct(a['gain_kept'])} | "
                 f"{_pct(a['gate_gain_kept'])} | {a['rule_over_local']:.4f} "
                 f"({a['max_rule_over_local']:.4f}) | {a['gate_over_local']:.4f} "
                 f"({a['max_gate_over_local']:.4f}) |")
  lines += ["", "Sensitivity (the rule's constants; totals over the same runs):", "",
            "| margin | sigma0 | budget | regret total | regret pretrain | regret prolong | "
            "Pretrain gain kept | rule / local (worst run) |", "|---|---|---|---|---|---|---|---|"]
  for x in blob["sensitivity"]:
    a, w = x["total"], x["by_workload"]
    lines.append(f"| {x['margin']} | {x['sigma0']} | {x['budget']} | {_pct(a['regret'])} | "
                 f"{_pct(w['pretrain']['regret'])} | {_pct(w['prolong']['regret'])} | "
                 f"{_pct(w['pretrain']['gain_kept'])} | {a['rule_over_local']:.4f} "
                 f"({a['max_rule_over_local']:.4f}) |")
  lines += ["", "Per run (seconds summed over the replayed steps; branch per step: C = CAD, "
            "L = local; * = the faster measured branch was the other):", "",
            "| run | era | steps (left out) | rule's branches | rule | oracle | always-CAD | "
            "always-local | gate | regret | gain kept | rule / local | guard's regret / elapsed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in blob["runs"]:
    marks = " ".join(("C" if b == "cad" else "L")
                     + ("*" if (tc < tl) != (b == "cad") and tc != tl else "")
                     for b, tc, tl in zip(r["chosen"], r["measured_cad_s"],
                                          r["measured_local_s"]))
    lines.append(f"| {r['name']} | {r['era']} | {len(r['steps'])} ({len(r['left_out'])}) | "
                 f"{marks} | {r['rule_s']:.3f} | {r['oracle_s']:.3f} | {r['cad_s']:.3f} | "
                 f"{r['local_s']:.3f} | {r['gate_s']:.3f} | {_pct(r['regret'])} | "
                 f"{_pct(r['gain_kept'])} | {r['rule_s'] / r['local_s']:.4f} | "
                 f"{_pct(r['guard']['regret_fraction'])} |")
  lines += ["", "Left out (steps): a distca step that the run's own gates sent to the local "
            "branch has no CAD time.", "", "Distca runs not replayed:", ""]
  lines += [f"- {s}" for s in blob["skipped"]]
  lines += [f"- {k}: {v}" for k, v in blob["not_replayed"].items()]
  return "\n".join(lines) + "\n"


def _commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  d = choice.ChoiceOptions()
  for f in dataclasses.fields(d):
    p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=getattr(d, f.name),
                   help=f"ChoiceOptions.{f.name} (default {getattr(d, f.name)})")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "skip", "branch_replay"))
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  options = choice.ChoiceOptions(**{f.name: getattr(args, f.name)
                                    for f in dataclasses.fields(choice.ChoiceOptions)})
  blob = run_replay(options)
  blob.update(command="python -m experiments.branch_replay " + " ".join(sys.argv[1:] if argv is
                                                                         None else argv),
              commit=_commit(), machine=f"{platform.machine()} host CPU, {os.cpu_count()} cores",
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
  with open(args.out + ".json", "w") as f:
    json.dump(blob, f, indent=1)
  with open(args.out + ".md", "w") as f:
    f.write(markdown(blob))
  print(markdown(blob))


if __name__ == "__main__":
  main()
