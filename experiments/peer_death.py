"""A lost peer: launch N local processes of one training job, SIGKILL one mid-run, and measure
how every survivor ends (exit status, seconds from the kill to its exit, its last stderr line).

CPU (gloo; each process JAX_NUM_CPU_DEVICES devices):
  .venv/bin/python -m experiments.peer_death --procs 2 --cpu-devices 4 --victims 1 0 --out DIR
GPU (NCCL; process i sees GPU i):
  .venv/bin/python -m experiments.peer_death --procs 4 --gpu --victims 1 0 \\
      --config configs/gpu_bench.py --out results/peer_death_4gpu

Each victim is one job in a fresh workdir: it waits for `--kill-after` logged steps, kills the
victim (its supervisor, which takes the training process down with it), and waits up to
`--timeout` seconds for the others. Writes DIR/peer_death.json and DIR/peer_death.md, and the
processes' logs as DIR/<victim>_<process>.log. Extra arguments after `--` go to every process
(e.g. `-- --heartbeat_timeout_s=20 --config.model.n_layers=2`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny job on CPU: 1 row per device, 2 layers, a progress line every step.
CPU_OVERRIDES = ["--config.rows_per_rank=1", "--config.model.n_layers=2",
                 "--config.optim.warmup_steps=1", "--config.log_every=1",
                 "--config.tensorboard=False", "--config.num_steps=100000",
                 "--config.checkpoint_every=0"]
GPU_OVERRIDES = ["--config.log_every=1", "--config.tensorboard=False",
                 "--config.num_steps=100000", "--config.checkpoint_every=0",
                 "--config.attention.backend=packed_dp"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_one(args, victim: int, extra: list[str]) -> dict:
  workdir = tempfile.mkdtemp(prefix=f"peer_death_{victim}_")
  port = _free_port()
  overrides = GPU_OVERRIDES if args.gpu else CPU_OVERRIDES + [
      f"--config.mesh.data={args.procs * args.cpu_devices}"]
  cmd = [sys.executable, "-m", "distca_jax.train", "--config", args.config,
         f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}",
         f"--num_processes={args.procs}"] + overrides + extra
  procs, logs = [], []
  for i in range(args.procs):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    if args.gpu:
      env["CUDA_VISIBLE_DEVICES"] = str(i)
    else:
      env.pop("XLA_FLAGS", None)
      env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.cpu_devices))
    log = os.path.join(args.out, f"{victim}_{i}.log")
    logs.append(log)
    with open(log + ".err", "w") as err, open(log, "w") as out:
      procs.append(subprocess.Popen(cmd + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=out,
                                    stderr=err))
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + args.start_timeout
  try:
    while not (os.path.exists(metrics) and
               len(open(metrics).read().splitlines()) >= args.kill_after):
      if time.time() > deadline or any(p.poll() is not None for p in procs):
        raise RuntimeError(f"victim {victim}: the job did not reach {args.kill_after} steps "
                           f"(exits {[p.poll() for p in procs]}); logs in {args.out}")
      time.sleep(0.2)
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.time()
    rows = []
    for i, p in enumerate(procs):
      if i == victim:
        continue
      try:
        rc = p.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
        took = time.time() - t0
      except subprocess.TimeoutExpired:
        rc, took = "still running", None
      err = open(logs[i] + ".err").read().splitlines()
      rows.append({"victim": victim, "process": i, "exit": rc,
                   "seconds": None if took is None else round(took, 1),
                   "stderr_lines": len(err), "last_line": err[-1] if err else ""})
    return {"victim": victim, "survivors": rows}
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--procs", type=int, default=2)
  ap.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process")
  ap.add_argument("--gpu", action="store_true", help="process i uses GPU i (NCCL)")
  ap.add_argument("--config", default="configs/tiny_cpu.py")
  ap.add_argument("--victims", type=int, nargs="+", default=[1, 0])
  ap.add_argument("--kill-after", type=int, default=2, help="logged steps before the kill")
  ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for survivors")
  ap.add_argument("--start-timeout", type=float, default=900)
  ap.add_argument("--out", required=True)
  args, extra = ap.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  os.makedirs(args.out, exist_ok=True)
  results = [run_one(args, v, extra) for v in args.victims]
  kind = "GPU (NCCL)" if args.gpu else f"CPU (gloo, {args.cpu_devices} devices each)"
  with open(os.path.join(args.out, "peer_death.json"), "w") as f:
    json.dump({"procs": args.procs, "kind": kind, "config": args.config, "extra": extra,
               "results": results}, f, indent=2)
  lines = [f"# Lost peer: {args.procs} processes, {kind}, `{args.config}` {' '.join(extra)}", "",
           "| killed | survivor | exit | seconds to exit | stderr lines | last stderr line |",
           "|---|---|---|---|---|---|"]
  for r in results:
    for s in r["survivors"]:
      lines.append(f"| {r['victim']} | {s['process']} | {s['exit']} | {s['seconds']} | "
                   f"{s['stderr_lines']} | `{s['last_line']}` |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(args.out, "peer_death.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
