"""Does each shipped config fit the hardware its docstring names? CPU AOT of the train step.

  python -m experiments.config_fit --out results/configs/aot_shipped_configs

Per config (`SHIPPED`: the devices and the allocator limit of the hardware it is written for),
the train step compiled ahead of time on that many fake CPU devices (`aot.compile_train_step`,
no parameters made): XLA's plan per device plus the kernels' workspace outside it (the memory
pre-flight's need) against the limit. A 'flash3' config is compiled twice: with FlashAttention-3's
shape-only stand-in (its outputs in XLA's plan, its backward workspace by
`memory.flash3_bwd_workspace_bytes`), which is the need row, and with the blockwise jnp kernel in
its place (`attention.kernel=blockwise`: the same shapes, XLA:CPU's own attention temporaries).
XLA:CPU's plan approximates the GPU's (results/micro/wlb_memory_choice.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from experiments.mfu_candidates import LIMIT_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  devices: int
  limit_bytes: int | None  # the allocator limit per device; None: no pre-flight (CPU)


H100_80GB = "H100 80GB (allocator limit 72.85 GiB at XLA_PYTHON_CLIENT_MEM_FRACTION=0.92)"
SHIPPED = {
    "configs/tiny_cpu.py": Hardware("CPU (8 fake devices)", 8, None),
    "configs/gpu_bench.py": Hardware(f"1 x {H100_80GB}", 1, LIMIT_BYTES),
    "configs/llama3_8b_4gpu.py": Hardware(f"4 x {H100_80GB}", 4, LIMIT_BYTES),
    "configs/llama3_8b_128k.py": Hardware(f"8 x {H100_80GB}", 8, LIMIT_BYTES),
}


def fit(path: str, overrides=(), devices=None) -> dict:
  """The AOT memory of config ``path`` (with ``overrides``, KEY=VALUE) on the first
  ``SHIPPED[path].devices`` of ``devices`` (default: all visible; a 'flash3' config compiles
  with the kernel's stand-in where it cannot run)."""
  import jax
  from distca_jax import aot, configs_io
  c = configs_io.load_config(os.path.join(ROOT, path), list(overrides))
  hw = SHIPPED[path]
  devices = list(devices if devices is not None else jax.devices())[:hw.devices]
  with aot.flash3_stand_in(c):
    _, info = aot.compile_train_step(c, devices=devices)
  need = info.get("need_per_device_bytes")
  fits = None if hw.limit_bytes is None or need is None else need <= hw.limit_bytes
  return {"config": path, "overrides": list(overrides), "hardware": hw.name,
          "devices": hw.devices, "limit_bytes": hw.limit_bytes, "fits": fits,
          "kernel": c.attention.kernel, "backend": c.attention.backend,
          "fsdp": bool(c.mesh.fsdp), **info}


def rows_of(path: str) -> list[tuple[str, ...]]:
  """The override sets each config is compiled with: as shipped, and for 'flash3' configs also
  with the blockwise kernel."""
  from distca_jax import configs_io
  c = configs_io.load_config(os.path.join(ROOT, path))
  return [()] + ([("attention.kernel=blockwise",)] if c.attention.kernel == "flash3" else [])


def _table(results: list[dict], commit: str) -> str:
  gib = lambda b: f"{b / 2**30:.2f}" if b is not None else "-"
  lines = [
      "# Shipped configs against their hardware: AOT memory per device (CPU AOT)", "",
      f"- command: `python -m experiments.config_fit --out results/configs/aot_shipped_configs`",
      f"- commit: `{commit}`; device: CPU AOT on fake devices (one process per config, as many "
      "devices as the hardware has). CPU numbers approximate the GPU's (same shapes and "
      "shardings, XLA:CPU's buffer assignment).",
      "- need = XLA's plan (arguments + outputs + temporaries - aliases) + kernel workspace "
      "outside it (FlashAttention-3's backward accumulators, by formula at the run's shapes); "
      "the 'flash3' rows use the kernel's shape-only stand-in, the 'blockwise' rows the jnp "
      "kernel in its place (no workspace outside XLA's plan).", "",
      "| config | hardware | mesh | kernel | arguments GiB | temporaries GiB | XLA plan GiB | "
      "workspace GiB | need GiB | limit GiB | fits |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items() if v > 1) or "1 device"
    fits = {None: "no check (CPU)", True: "yes", False: "no"}[r["fits"]]
    lines.append(
        f"| `{r['config']}` | {r['hardware']} | {mesh}{' fsdp' if r.get('fsdp') else ''} | "
        f"{r['kernel']} | {gib(r.get('argument_size_in_bytes'))} | "
        f"{gib(r.get('temp_size_in_bytes'))} | {gib(r.get('total_per_device_bytes'))} | "
        f"{gib(r.get('kernel_workspace_bytes'))} | {gib(r.get('need_per_device_bytes'))} | "
        f"{gib(r['limit_bytes'])} | {fits} |")
  return "\n".join(lines) + "\n"


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="", help="write OUT.md and OUT.json")
  p.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: one config's JSON
  p.add_argument("--override", action="append", default=[], help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one:
    print(json.dumps(fit(a.one, a.override)))
    return
  results = []
  for path, hw in SHIPPED.items():
    for over in rows_of(path):
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS=f"--xla_force_host_platform_device_count={hw.devices}")
      cmd = [sys.executable, "-m", "experiments.config_fit", "--one", path]
      cmd += [f"--override={o}" for o in over]
      out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
      r = json.loads(out.stdout.strip().splitlines()[-1])
      print(f"{path} {over}: need {r.get('need_per_device_bytes', 0) / 2**30:.2f} GiB, "
            f"fits {r['fits']}", flush=True)
      results.append(r)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  if a.out:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out + ".json", "w") as f:
      json.dump({"commit": commit, "results": results}, f, indent=2)
    with open(a.out + ".md", "w") as f:
      f.write(_table(results, commit))
  else:
    print(_table(results, commit))


if __name__ == "__main__":
  main()
