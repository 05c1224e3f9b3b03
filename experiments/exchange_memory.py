"""CAD's compiled memory over packed_dp as the number of servers grows (CPU AOT, fake devices).

  python -m experiments.exchange_memory --devices 4,16,64 --out results/exchange_memory

For each device count, compiles the train step of ``configs/gpu_bench.py`` (Llama-3-8B layer
shapes, every device on ``data``) with ``packed_dp`` and with ``distca`` ahead of time on fake
CPU devices (``experiments.aot_memory`` in a subprocess each: the device count is fixed when JAX
starts) and reports XLA's per-device total and distca's excess over packed_dp. distca's caps
are sized at startup from the run's first batches, as in training. ``--tree DIR`` compiles
another checkout of the project (e.g. an older commit) with the same command, for a before/after
table. Also plans the run's first batches and reports the exchange's bytes per device: useful
(the routed rows; what the ragged exchange moves) and buffers (send + receive caps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def _aot(tree: str, devices: int, backend: str, overrides: list[str], timeout: float) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "aot.json")
    cmd = [sys.executable, "-m", "experiments.aot_memory", "--config", "configs/gpu_bench.py",
           "--devices", str(devices), "--out", out,
           "--override", f"attention.backend={backend}"]
    for o in overrides:
      cmd += ["--override", o]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=tree)
    env.pop("XLA_FLAGS", None)
    t0 = time.time()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode:
      tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
      raise RuntimeError(f"aot_memory for {backend} on {devices} devices failed: {tail}")
    with open(out) as f:
      info = json.load(f)
  info["wall_s"] = time.time() - t0
  return info


def _plan_bytes(devices: int, overrides: list[str], batches: int) -> dict:
  """Exchange bytes per device of the run's first batches, planned by its own backend."""
  from distca_jax import configs_io, trainer
  from distca_jax import plan as plan_lib
  from distca_jax.data import run_source
  c = configs_io.load_config(os.path.join(ROOT, "configs", "gpu_bench.py"),
                             [f"attention.backend=distca", *overrides])
  c.mesh.data = devices
  backend = trainer.make_backend(c)
  src = run_source(c, devices)
  useful, busiest, buf = [], [], 0.0
  for step in range(batches):
    for hp in backend.host_plans(src.doclens(step), c.tokens_per_rank):
      p = hp.plan
      eb = plan_lib.exchange_bytes(hp.meta, q_heads=p.q_heads, kv_heads=p.kv_heads,
                                   head_dim=p.head_dim, dtype_bytes=p.dtype_bytes)
      useful.append(eb["dispatch_useful"])
      busiest.append(max(eb["dispatch_useful_busiest_device"],
                         eb["dispatch_recv_busiest_device"]))
      buf = eb["dispatch_buffer"]
  return {"dispatch_useful_mean_mb": sum(useful) / len(useful) / 1e6,
          "dispatch_busiest_mb": max(busiest) / 1e6,
          "dispatch_buffer_mb": buf / 1e6, "caps": backend.caps}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--devices", default="4,16,64", help="comma-separated fake device counts")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--tokens", type=int, default=16384, help="tokens per device")
  p.add_argument("--tree", default=ROOT, help="checkout to compile (default: this one)")
  p.add_argument("--label", default="", help="name of the tree in the table (default: its path)")
  p.add_argument("--plan-batches", type=int, default=8,
                 help="batches to plan for the exchange bytes (0: skip)")
  p.add_argument("--timeout-s", type=float, default=1800)
  p.add_argument("--out", default="", help="write OUT.json and OUT.md")
  a = p.parse_args(argv)
  devices = [int(x) for x in a.devices.split(",")]
  over = [f"model.n_layers={a.layers}", f"tokens_per_rank={a.tokens}", "attention.kernel=blockwise"]
  rows = []
  for n in devices:
    got = {b: _aot(a.tree, n, b, over + [f"mesh.data={n}"], a.timeout_s)
           for b in ("packed_dp", "distca")}
    row = {"devices": n, **{f"{b}_gib": got[b]["total_per_device_bytes"] / GIB for b in got},
           "compile_s": {b: round(got[b]["wall_s"], 1) for b in got}}
    row["excess_gib"] = row["distca_gib"] - row["packed_dp_gib"]
    if a.plan_batches and a.tree == ROOT:
      row.update(_plan_bytes(n, over, a.plan_batches))
    rows.append(row)
    print(json.dumps(row), flush=True)
  out = {"command": experiments.command_line(__file__, argv),
         "tree": a.label or a.tree, "layers": a.layers, "tokens_per_device": a.tokens,
         "rows": rows}
  if a.out:
    with open(a.out + ".json", "w") as f:
      json.dump(out, f, indent=2)
  return out


if __name__ == "__main__":
  main()
