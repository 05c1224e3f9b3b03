"""Compile a config's train step ahead of time and report per-device memory (no params made).

  python -m experiments.aot_memory --config configs/llama3_8b_128k.py --devices 8

--devices N fakes N CPU devices when no accelerator is present (must come before jax starts, so
this script sets XLA_FLAGS itself). On a GPU host the real devices are used and --devices must
match their count. A 'flash3' config compiles off a Hopper GPU with the kernel's shape-only
stand-in (``flash3_attention.shape_only``): its outputs in XLA's plan, FA3's backward workspace
counted by ``memory.kernel_workspace_bytes``; XLA:CPU's plan of the rest runs above the GPU's
(results/micro/wlb_memory_choice.md). Prints a table and writes JSON to --out if given.
"""

import argparse
import json
import os
import sys



def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True, help="config file, e.g. configs/llama3_8b_128k.py")
  p.add_argument("--devices", type=int, default=8, help="device count (faked on CPU)")
  p.add_argument("--override", action="append", default=[],
                 help="KEY=VALUE config overrides, e.g. mesh.tensor=8 (repeatable)")
  p.add_argument("--out", default="", help="write the report as JSON here")
  a = p.parse_args()
  if not any(d in os.environ.get("JAX_PLATFORMS", "") for d in ("cuda", "gpu")):
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={a.devices}"
  import jax
  from ml_collections import config_flags  # noqa: F401  (ensures ml_collections is present)
  from distca_jax import aot
  from distca_jax.launch import configure_environment
  from distca_jax import configs_io

  from distca_jax.errors import UserError

  configure_environment()
  devices = jax.devices()
  try:
    c = configs_io.load_config(a.config, a.override)
    if len(devices) < a.devices:
      raise UserError(f"--devices {a.devices} but only {len(devices)} {devices[0].platform} "
                      "devices are visible")
    devices = devices[:a.devices]
    print(f"compiling {a.config} for {a.devices} x {devices[0].device_kind} ...", flush=True)
    if aot.needs_flash3_stand_in(c):
      print("flash3 cannot run here: compiled with its shape-only stand-in (the kernel's outputs "
            "in XLA's plan, FA3's backward workspace by its formula)", flush=True)
    with aot.flash3_stand_in(c):
      _, info = aot.compile_train_step(c, devices=devices)
  except (UserError, FileNotFoundError) as e:  # bad config file, override, mesh or kernel: one line
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
    sys.exit(2)
  gib = lambda b: f"{b / 2**30:8.2f} GiB"
  print(f"mesh {info['mesh']}, {info['params'] / 1e9:.2f}B params, lowered in "
        f"{info['lower_s']:.1f}s, compiled in {info['compile_s']:.1f}s")
  for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "total_per_device_bytes", "peak_memory_in_bytes",
            "kernel_workspace_bytes", "need_per_device_bytes"):
    if k in info:
      print(f"  {k:28s} {gib(info[k])}")
  if info.get("peak_memory_in_bytes"):
    ratio = info["peak_memory_in_bytes"] / info["total_per_device_bytes"]
    print(f"  XLA's peak / total: {ratio:.3f}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"config": a.config, "overrides": a.override, "devices": a.devices, **info}, f, indent=2)


if __name__ == "__main__":
  main()
