"""Faults of a multi-process job: launch N local processes of one training job, inject one fault
per job, and measure how every process ends (exit status, seconds from the fault to its exit,
its stderr: line count and last line).

CPU (gloo; each process JAX_NUM_CPU_DEVICES devices):
  .venv/bin/python -m experiments.peer_death --procs 2 --cpu-devices 4 --victims 1 0 --out DIR
GPU (NCCL; process i sees GPU i), every fault:
  .venv/bin/python -m experiments.peer_death --procs 4 --gpu --config configs/gpu_bench.py \\
      --faults kill:1 kill:0 term:1 int:all diverge readonly --out results/faults_4gpu

Faults (``--faults``; ``--victims I ...`` is ``kill:I ...``), each one job in a fresh workdir:
  kill:I    SIGKILL process I (its supervisor, which takes the training process down with it)
            after ``--kill-after`` logged steps: a lost peer (I = 0: the coordinator).
  term:I    SIGTERM to process I after ``--kill-after`` steps: a scheduler's preemption notice to
            one task. Every process should save and verify a checkpoint of one step and exit 143
            (checkpointing is on for these jobs, with no periodic save).
  int:all   SIGINT to every process after ``--kill-after`` steps (Ctrl-C): exit 130 the same way.
  diverge   ``optim.lr=1e6`` with no warm-up: every process should stop with one line, exit 2.
  readonly  the workdir cannot be written (mode 555; as root, whose writes mode bits do not stop,
            a path below a regular file): one line, exit 2.
The clock starts at the signal (signal faults) or at the launch (the others). Writes
DIR/peer_death.json and DIR/peer_death.md, and the processes' logs as DIR/<fault>_<process>.log
(+ .err; a fault listed twice: DIR/<index>_<fault>_<process>.log). Extra arguments after ``--``
go to every process (e.g. ``-- --heartbeat_timeout_s=20 --config.model.n_layers=2``).
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


def _fault(spec: str, procs: int) -> tuple[str, object]:
  """``'kill:1'`` -> ``('kill', 1)``; ``'int:all'`` -> ``('int', 'all')``; one-line
  ``ValueError`` naming a bad spec."""
  kind, _, who = spec.partition(":")
  if kind in ("diverge", "readonly") and not who:
    return kind, None
  if kind in ("kill", "term", "int"):
    if who == "all" and kind != "kill":
      return kind, "all"
    if who.isdigit() and int(who) < procs:
      return kind, int(who)
  raise ValueError(f"--faults {spec!r} is not a fault of {procs} processes: use kill:I, "
                   f"term:I, int:I (I < {procs}; term/int also :all), diverge or readonly")


SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}


def _workdir(kind: str, name: str) -> tuple[str, str, str]:
  """(workdir to pass, directory to remove afterwards, how it was made unwritable)."""
  top = tempfile.mkdtemp(prefix=f"faults_{name}_")
  if kind != "readonly":
    return top, top, ""
  if os.geteuid() == 0:  # root writes through mode bits: a path below a regular file
    blocker = os.path.join(top, "file")
    open(blocker, "w").close()
    return os.path.join(blocker, "run"), top, "a path below a regular file (running as root)"
  ro = os.path.join(top, "ro")
  os.makedirs(ro)
  os.chmod(ro, 0o555)
  return ro, top, "mode 555"


def run_one(args, spec: str, extra: list[str], name: str | None = None) -> dict:
  kind, who = _fault(spec, args.procs)  # checked by main before any job started
  name = name or spec.replace(":", "_")
  workdir, top, how = _workdir(kind, name)
  port = _free_port()
  overrides = GPU_OVERRIDES if args.gpu else CPU_OVERRIDES + [
      f"--config.mesh.data={args.procs * args.cpu_devices}"]
  if kind == "diverge":
    overrides = overrides + ["--config.optim.lr=1e6", "--config.optim.warmup_steps=0"]
  if kind in ("term", "int"):  # checkpointing on (no periodic save): the interrupt saves one
    overrides = overrides + ["--config.checkpoint_every=100000"]
  cmd = [sys.executable, "-m", "distca_jax.train", "--config", args.config,
         f"--workdir={workdir}", f"--coordinator_address=127.0.0.1:{port}",
         f"--num_processes={args.procs}"] + overrides + extra
  procs, logs = [], []
  for i in range(args.procs):
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if args.gpu:
      env["CUDA_VISIBLE_DEVICES"] = str(i)
    else:
      env.pop("XLA_FLAGS", None)
      env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(args.cpu_devices))
    log = os.path.join(args.out, f"{name}_{i}.log")
    logs.append(log)
    with open(log + ".err", "w") as err, open(log, "w") as out:
      procs.append(subprocess.Popen(cmd + [f"--process_id={i}"], cwd=ROOT, env=env, stdout=out,
                                    stderr=err))
  t0 = time.time()
  try:
    if kind in SIGNALS:
      metrics = os.path.join(workdir, "metrics.jsonl")
      deadline = time.time() + args.start_timeout
      while not (os.path.exists(metrics) and
                 len(open(metrics).read().splitlines()) >= args.kill_after):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
          raise RuntimeError(f"{spec}: the job did not reach {args.kill_after} steps "
                             f"(exits {[p.poll() for p in procs]}); logs in {args.out}")
        time.sleep(0.2)
      targets = range(args.procs) if who == "all" else [who]
      for i in targets:
        procs[i].send_signal(SIGNALS[kind])
      t0 = time.time()
    limit = args.timeout if kind in SIGNALS else args.start_timeout
    rows = []
    for i, p in enumerate(procs):
      if kind == "kill" and i == who:
        continue
      try:
        rc = p.wait(timeout=max(1.0, limit - (time.time() - t0)))
        took = time.time() - t0
      except subprocess.TimeoutExpired:
        rc, took = "still running", None
      err = open(logs[i] + ".err").read().splitlines()
      rows.append({"fault": spec, "process": i, "exit": rc,
                   "seconds": None if took is None else round(took, 1),
                   "stderr_lines": len(err), "last_line": err[-1] if err else ""})
    return {"fault": spec, "victim": who, "unwritable_workdir": how or None, "processes": rows}
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for d, _, _ in os.walk(top):
      os.chmod(d, 0o755)
    shutil.rmtree(top, ignore_errors=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--procs", type=int, default=2)
  ap.add_argument("--cpu-devices", type=int, default=4, help="CPU devices per process")
  ap.add_argument("--gpu", action="store_true", help="process i uses GPU i (NCCL)")
  ap.add_argument("--config", default="configs/tiny_cpu.py")
  ap.add_argument("--victims", type=int, nargs="+", default=None,
                  help="processes to SIGKILL, one job each (the same as --faults kill:I ...)")
  ap.add_argument("--faults", nargs="+", default=None,
                  help="kill:I term:I term:all int:I int:all diverge readonly (docstring)")
  ap.add_argument("--kill-after", type=int, default=2, help="logged steps before a signal")
  ap.add_argument("--timeout", type=float, default=120,
                  help="seconds to wait for the processes after a signal")
  ap.add_argument("--start-timeout", type=float, default=900)
  ap.add_argument("--out", required=True)
  args, extra = ap.parse_known_args(argv)
  extra = [a for a in extra if a != "--"]
  os.makedirs(args.out, exist_ok=True)
  faults = (args.faults or []) + [f"kill:{v}" for v in args.victims or []]
  faults = faults or ["kill:1", "kill:0"]
  try:
    for spec in faults:
      _fault(spec, args.procs)  # every spec checked before the first job starts
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  results = []
  for i, spec in enumerate(faults):
    print(f"fault {spec} ...", flush=True)
    # Log names: the fault, with its place in the list when it repeats (kill_1 or 2_int_all).
    name = spec.replace(":", "_") if faults.count(spec) == 1 else f"{i}_{spec.replace(':', '_')}"
    try:
      results.append(run_one(args, spec, extra, name))
    except RuntimeError as e:  # the job ended before the fault: its row says so, the rest run
      results.append({"fault": spec, "error": str(e), "processes": []})
  kind = "GPU (NCCL)" if args.gpu else f"CPU (gloo, {args.cpu_devices} devices each)"
  with open(os.path.join(args.out, "peer_death.json"), "w") as f:
    json.dump({"procs": args.procs, "kind": kind, "config": args.config, "extra": extra,
               "results": results}, f, indent=2)
  lines = [f"# Faults: {args.procs} processes, {kind}, `{args.config}` {' '.join(extra)}", "",
           "| fault | process | exit | seconds to exit | stderr lines | last stderr line |",
           "|---|---|---|---|---|---|"]
  for r in results:
    if "error" in r:
      lines.append(f"| {r['fault']} | - | - | - | - | not injected: {r['error']} |")
    for s in r["processes"]:
      lines.append(f"| {r['fault']} | {s['process']} | {s['exit']} | {s['seconds']} | "
                   f"{s['stderr_lines']} | `{s['last_line']}` |")
  text = "\n".join(lines) + "\n"
  with open(os.path.join(args.out, "peer_death.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
