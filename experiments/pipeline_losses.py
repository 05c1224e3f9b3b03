"""The pipeline's loss curve against pipe=1: the real training job (`python -m distca_jax.train`)
on 8 fake CPU devices, the tiny config, the same global batch (4 data ranks x 8 rows of 256
tokens), pipe=2 x data=4 (M = 4) against pipe=1 x data=4 x tensor=2, per attention backend.

Every run is a child process of the train entry point (its own 8 fake devices); the table records
each run's command, its per-step losses (metrics.jsonl, every step logged), the largest relative
loss difference to the pipe=1 run of the same backend and to pipe=1 `local`, the mean step time
after the first (compile) step, the wall time and the peak resident memory (the child's
`ru_maxrss`, compilation included).

Run:
  python -m experiments.pipeline_losses   # writes results/pipeline/pipeline_losses.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {  # name -> mesh overrides; both keep 4 data ranks, so the same global batch
    "pipe=1 x data=4 x tensor=2": ["--config.mesh.data=4", "--config.mesh.tensor=2"],
    "pipe=2 x data=4 (M=4)": ["--config.mesh.pipe=2", "--config.mesh.data=4",
                              "--config.pipeline.microbatches=4"],
}
REFERENCE = "pipe=1 x data=4 x tensor=2"


def train_command(layout: str, backend: str, steps: int, workdir: str,
                  sets: list[str]) -> list[str]:
  warmup = [f"--config.optim.warmup_steps={steps}"] if steps < 20 else []  # the config's is 20
  return ["python", "-m", "distca_jax.train", "--config", "configs/tiny_cpu.py", *LAYOUTS[layout],
          f"--config.attention.backend={backend}", f"--config.num_steps={steps}", *warmup,
          *[f"--config.{kv}" for kv in sets],
          "--config.log_every=1", f"--workdir={workdir}"]


def run_one(argv: list[str], workdir: str) -> dict:
  """Runs the train job; returns its losses, step times, wall time and peak RSS."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  start = time.time()
  proc = subprocess.Popen([sys.executable, *argv[1:]], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  out = proc.stdout.read()
  _, status, usage = os.wait4(proc.pid, 0)
  proc.returncode = os.waitstatus_to_exitcode(status)
  wall = time.time() - start
  if proc.returncode:
    raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}):\n{out[-3000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  return {"losses": [r["loss"] for r in records if "loss" in r],
          "step_time_s": float(np.mean([r["step_time_s"] for r in records
                                        if "step_time_s" in r])),
          "wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20}  # ru_maxrss is in KiB


def max_rel(a, b) -> float:
  a, b = np.asarray(a), np.asarray(b)
  return float(np.max(np.abs(a - b) / np.abs(b)))


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
  p.add_argument("--backends", default="local,distca", help="comma-separated attention backends")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="a config override for every run, e.g. attention.baselines.cp_size=2")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "pipeline", "pipeline_losses"),
                 help="output prefix (.json and .md)")
  args = p.parse_args()
  command = experiments.command_line(__file__)
  commit = experiments.git_commit()

  runs = []
  with tempfile.TemporaryDirectory() as tmp:
    for backend in args.backends.split(","):
      for layout in LAYOUTS:
        workdir = os.path.join(tmp, f"{backend}-{len(runs)}")
        argv = train_command(layout, backend, args.steps, workdir, args.set)
        r = {"backend": backend, "layout": layout,
             "command": "XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                        + shlex.join(argv).replace(workdir, "WORKDIR"),
             **run_one(argv, workdir)}
        runs.append(r)
        print(f"{backend:8s} {layout:28s} losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
              f"{r['step_time_s']:.2f} s/step, peak RSS {r['peak_rss_gib']:.2f} GiB", flush=True)
  ref = {r["backend"]: r["losses"] for r in runs if r["layout"] == REFERENCE}
  for r in runs:
    r["max_rel_diff_vs_pipe1_same_backend"] = max_rel(r["losses"], ref[r["backend"]])
    if "local" in ref:
      r["max_rel_diff_vs_pipe1_local"] = max_rel(r["losses"], ref["local"])

  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".json", "w") as f:
    json.dump({"command": command, "commit": commit, "device": "CPU, 8 fake devices",
               "steps": args.steps, "runs": runs}, f, indent=1)
  show = [0, 1, 4, 9, 19, 29, args.steps - 1]
  show = sorted({s for s in show if s < args.steps})
  lines = [
      "# Pipeline losses: pipe=2 against pipe=1, the tiny config's training job", "",
      f"Command: `{command}` (commit {commit}; device: CPU, 8 fake devices, a 2-core host "
      "shared with other jobs, so times are inflated). `configs/tiny_cpu.py` as shipped (4 "
      "layers, f32, 4 data ranks x 8 rows x 256 tokens per step, warmup 20 steps) with "
      f"`--config.num_steps={args.steps}`; each run's command is in the JSON. 'max rel diff' is "
      "the largest |loss - loss at pipe=1| / loss at pipe=1 over every logged step "
      "(every step).", "",
      "| backend | layout | " + " | ".join(f"loss step {s + 1}" for s in show)
      + " | max rel diff vs pipe=1 (same backend) | vs pipe=1 local | s/step | peak RSS GiB |",
      "|---|---|" + "---|" * (len(show) + 4),
  ]
  for r in runs:
    lines.append(f"| {r['backend']} | {r['layout']} | "
                 + " | ".join(f"{r['losses'][s]:.4f}" for s in show)
                 + f" | {r['max_rel_diff_vs_pipe1_same_backend']:.1e} | "
                 + (f"{r['max_rel_diff_vs_pipe1_local']:.1e}"
                    if "max_rel_diff_vs_pipe1_local" in r else "-")
                 + f" | {r['step_time_s']:.2f} | {r['peak_rss_gib']:.2f} |")
  if any(r["backend"] == "wlb" for r in runs):
    lines += ["", "wlb differs from local at either layout by its packing: a document that fits "
              "in no lane whole is cut into pieces attended separately (`baselines.wlb_pack`); "
              "the pipeline arranges the step's batch as pipe=1 does, so the cuts and the "
              "losses are the same at pipe=2."]
  with open(args.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  print(f"wrote {args.out}.json and {args.out}.md")


if __name__ == "__main__":
  main()
