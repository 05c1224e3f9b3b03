"""Core-attention kernel benchmark: ours (Pallas), FlashAttention-3, cuDNN and Pallas-Triton `mha`.

Workloads (32 query heads, 8 KV heads, head dim 128, bf16, one GPU):
  dense-L   one causal sequence of L tokens (L = 4K, 16K, 64K);
  ca-sS     a fused CA-task batch of 16K query tokens: tasks are tail shards [b - S, b) of
            documents with b uniform in [S, 16K], each with its own key prefix [0, b)
            (S = 64 ... 4096), as a DistCA attention server receives them.
cuDNN (top-left causal alignment, no per-task key ranges) and `mha` (no varlen) run the dense
workloads only; on CA batches they are recorded as not applicable. FLOPs come from the task table
(distca_jax.ops.core_attention_flops: forward 4*H*D*pairs, forward+backward 3.5x forward).

Each backend runs in its own subprocess, so a crash or a missing package costs only its own
entries, which are recorded with the error. Run (on a GPU machine):
  python experiments/kernel_bench.py --out results/kernel_bench.json
Writes <out>.json and <out>.md (same stem) with the command, device and every entry.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DENSE_LENGTHS = (4096, 16384, 65536)
SHARD_LENGTHS = (4096, 2048, 1024, 512, 256, 128, 64)
BACKENDS = ("pallas", "flash3", "cudnn", "mha")
# Named tilings of our kernel; "pallas" means "pallas:default".
PALLAS_PRESETS = {
    "default": {},  # BlockSizes.default_for(bf16, 128): forward 128 x 128 / 8 warps, bwd 64 x 64
    # The previous default forward (64 x 64, 4 warps), better for 64-token shards.
    "q64": dict(block_q=64, block_k=64, num_warps=4, num_stages=3),
    # Alternatives for sweeps, each one forward tiling (f<q>x<k>w<warps>s<stages>) paired with
    # one backward change, so one run measures both.
    "f128x64w8s3-bs3": dict(block_q=128, block_k=64, num_warps=8, num_stages=3,
                            num_stages_dq=3, num_stages_dkv=3),
    "f128x128w8s3-dq128": dict(block_q=128, block_k=128, num_warps=8, num_stages=3,
                               block_q_dq=128, block_k_dq=64, num_warps_dq=8),
    "f64x128w4s3-dkv128": dict(block_k=128, block_k_dkv=128, num_warps_dkv=8),
    "f64x64w4s4-b32s3": dict(num_stages=4, block_k_dq=32, block_q_dkv=32, num_stages_dq=3,
                             num_stages_dkv=3),
    "f128x64w8s2-b128w8": dict(block_q=128, block_k=64, num_warps=8, num_stages=2,
                               block_k_dq=128, num_warps_dq=8, block_q_dkv=128,
                               num_warps_dkv=8),
    "f64x64w8s3-bw8": dict(num_warps=8, num_warps_dq=8, num_warps_dkv=8),
}


@dataclasses.dataclass
class Workload:
  name: str
  kind: str  # "dense" or "ca"
  cu_q: list[int]
  cu_k: list[int]
  max_q: int
  max_k: int


def make_workloads(names: list[str], tokens: int, max_doc: int, seed: int) -> list[Workload]:
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = []
  for name in names:
    if name.startswith("dense-"):
      length = int(name.split("-")[1])
      out.append(Workload(name, "dense", [0, length], [0, length], length, length))
    elif name.startswith("ca-s"):
      shard = int(name[4:])
      rng = np.random.default_rng([seed, shard])
      n = tokens // shard
      ends = rng.integers(shard, max_doc + 1, size=n)  # document length b >= shard
      cu_q = [0] + np.cumsum(np.full(n, shard)).tolist()
      cu_k = [0] + np.cumsum(ends).tolist()
      out.append(Workload(name, "ca", cu_q, cu_k, shard, int(ends.max())))
    else:
      raise ValueError(f"unknown workload {name=}; use dense-<L> or ca-s<S>")
  return out


# ------------------------------------------------------------------------------------------------
# Child: one backend, every workload
# ------------------------------------------------------------------------------------------------


def _time(fn, args, min_trial_s: float, trials: int):
  """Median seconds per call: warm-up, then trials of back-to-back calls synced at the end."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.block_until_ready(fn(*args))  # compile
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = max(time.perf_counter() - t0, 1e-6)
  reps = max(1, min(50, math.ceil(min_trial_s / one)))
  times = []
  for _ in range(trials):
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times), times, reps


def run_backend(backend: str, workloads: list[Workload], args, save) -> list[dict]:
  """Times one backend on every workload; ``save(entries)`` runs after each entry."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  from custom_ops import BlockSizes  # pylint: disable=import-outside-toplevel

  base, _, preset = backend.partition(":")
  scale = 1.0 / math.sqrt(HEAD_DIM)
  entries = []
  for wl in workloads:
    entry = dict(workload=wl.name, kind=wl.kind, backend=backend, tasks=len(wl.cu_q) - 1,
                 device=jax.devices()[0].device_kind,
                 q_tokens=wl.cu_q[-1], kv_tokens=wl.cu_k[-1],
                 pairs=ops.attention_pairs(wl.cu_q, wl.cu_k),
                 flops_fwd=ops.core_attention_flops(wl.cu_q, wl.cu_k, num_q_heads=NUM_HEADS,
                                                    head_dim=HEAD_DIM),
                 flops_fwd_bwd=ops.core_attention_flops(wl.cu_q, wl.cu_k, num_q_heads=NUM_HEADS,
                                                        head_dim=HEAD_DIM,
                                                        include_backward=True))
    entries.append(entry)
    if wl.kind == "ca" and base in ("cudnn", "mha"):
      entry["status"] = "n/a"
      entry["error"] = ("cannot express CA tasks: cuDNN aligns causal masks top-left when "
                        "q_len != kv_len" if base == "cudnn" else
                        "cannot express CA tasks: dense batch layout, no per-task key ranges")
      save(entries)
      continue
    try:
      key = jax.random.key(args.seed)
      kq, kk, kv, kd = jax.random.split(key, 4)
      t_q, t_k = wl.cu_q[-1], wl.cu_k[-1]
      dt = jnp.bfloat16
      q = jax.random.normal(kq, (t_q, NUM_HEADS, HEAD_DIM), dt)
      k = jax.random.normal(kk, (t_k, NUM_KV_HEADS, HEAD_DIM), dt)
      v = jax.random.normal(kv, (t_k, NUM_KV_HEADS, HEAD_DIM), dt)
      do = jax.random.normal(kd, q.shape, dt)
      cu_q = jnp.asarray(wl.cu_q, jnp.int32)
      cu_k = jnp.asarray(wl.cu_k, jnp.int32)

      if base == "pallas":
        preset = preset or "default"
        bs = (BlockSizes.default_for(jnp.bfloat16, HEAD_DIM) if preset == "default" else
              BlockSizes(**PALLAS_PRESETS[preset]))
        entry["block_sizes"] = dataclasses.asdict(bs)

        def attn(q, k, v, cu_q, cu_k, bs=bs):
          return ops.core_attention(q, k, v, cu_q, cu_k, backend="pallas", block_sizes=bs,
                                    interpret=False)
        inputs = (q, k, v, cu_q, cu_k)
      elif base == "flash3":
        def attn(q, k, v, cu_q, cu_k, wl=wl):
          return ops.core_attention(q, k, v, cu_q, cu_k, backend="flash3",
                                    max_seqlen_q=wl.max_q, max_seqlen_k=wl.max_k)
        inputs = (q, k, v, cu_q, cu_k)
      elif base == "cudnn":
        def attn(q, k, v):
          return jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                              scale=scale, implementation="cudnn")[0]
        inputs = (q, k, v)
      elif base == "mha":
        import warnings  # pylint: disable=import-outside-toplevel
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          # pylint: disable-next=import-outside-toplevel
          from jax.experimental.pallas.ops.gpu import attention as pallas_mha
        group = NUM_HEADS // NUM_KV_HEADS
        # `mha` has no GQA: give it KV already repeated to 32 heads (outside the timed region).
        k = jnp.repeat(k, group, axis=1)
        v = jnp.repeat(v, group, axis=1)

        def attn(q, k, v):
          return pallas_mha.mha(q[None], k[None], v[None], None, sm_scale=scale, causal=True)[0]
        inputs = (q, k, v)
      else:
        raise ValueError(f"unknown backend {backend!r}")

      fwd = jax.jit(attn)

      def fwd_bwd(*a, attn=attn):
        o, vjp = jax.vjp(lambda *x: attn(*x, *a[3:-1]), *a[:3])
        return o, vjp(a[-1])
      fwd_bwd = jax.jit(fwd_bwd)

      o = jax.block_until_ready(fwd(*inputs))
      # A fingerprint of the output for cross-backend agreement (same seed, same inputs).
      w = jnp.sin(jnp.arange(HEAD_DIM, dtype=jnp.float32))[None, None, :]
      entry["out_fingerprint"] = float(jnp.mean(o.astype(jnp.float32) * w))
      entry["out_mean_abs"] = float(jnp.mean(jnp.abs(o.astype(jnp.float32))))
      entry["out_finite"] = bool(jnp.isfinite(o.astype(jnp.float32)).all())
      del o
      t_fwd, trials, reps = _time(fwd, inputs, args.min_trial_s, args.trials)
      entry.update(fwd_ms=t_fwd * 1e3, fwd_trials_ms=[t * 1e3 for t in trials], fwd_reps=reps,
                   fwd_tflops=entry["flops_fwd"] / t_fwd / 1e12)
      t_fb, trials, reps = _time(fwd_bwd, (*inputs, do), args.min_trial_s, args.trials)
      entry.update(fwd_bwd_ms=t_fb * 1e3, fwd_bwd_trials_ms=[t * 1e3 for t in trials],
                   fwd_bwd_reps=reps, fwd_bwd_tflops=entry["flops_fwd_bwd"] / t_fb / 1e12)
      entry["status"] = "ok"
    except Exception as e:  # pylint: disable=broad-except
      entry["status"] = "error"
      entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
      entry["traceback_tail"] = traceback.format_exc()[-1500:]
    print(json.dumps({k: v for k, v in entry.items()
                      if not k.endswith("trials_ms") and k != "traceback_tail"}), flush=True)
    save(entries)
  return entries


# ------------------------------------------------------------------------------------------------
# Parent: one subprocess per backend, merge, write JSON + markdown
# ------------------------------------------------------------------------------------------------


def _fmt(x, digits=0):
  return "-" if x is None else f"{x:.{digits}f}"


def write_markdown(path: str, result: dict) -> None:
  backends = result["backends"]
  entries = {(e["workload"], e["backend"]): e for e in result["entries"]}
  lines = [
      "# Core-attention kernel benchmark",
      "",
      f"- command: `{result['command']}`",
      f"- device: {result['device']}; jax {result['jax_version']}; {result['date']}",
      f"- {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head dim {HEAD_DIM}, bf16; "
      f"CA batches: {result['config']['tokens']} query tokens of tail shards [b-s, b), "
      f"b uniform in [s, {result['config']['max_doc']}], seed {result['config']['seed']}",
      "- TFLOP/s from exact task-table FLOPs: forward 4*H*D*pairs; forward+backward 3.5x "
      "forward. Median of trials of back-to-back calls.",
      "",
      "TFLOP/s, forward / forward+backward:",
      "",
      "| workload | tasks | KV tokens | " + " | ".join(backends) + " |",
      "|---|---|---|" + "---|" * len(backends),
  ]
  notes = []
  for wl in result["workloads"]:
    first = next(e for e in result["entries"] if e["workload"] == wl)
    cells = []
    for b in backends:
      e = entries.get((wl, b))
      if e is None:
        cells.append("missing")
      elif e["status"] == "ok":
        cells.append(f"{_fmt(e.get('fwd_tflops'))} / {_fmt(e.get('fwd_bwd_tflops'))}")
      elif e["status"] == "n/a":
        cells.append("n/a")
      else:
        notes.append(f"- {wl} / {b}: {e.get('error', '')[:400]}")
        cells.append(f"error [{len(notes)}]")
    lines.append(f"| {wl} | {first['tasks']} | {first['kv_tokens']} | " + " | ".join(cells) + " |")
  lines += ["", "Milliseconds, forward / forward+backward:", "",
            "| workload | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
  for wl in result["workloads"]:
    cells = []
    for b in backends:
      e = entries.get((wl, b))
      ok = e is not None and e["status"] == "ok"
      cells.append(f"{_fmt(e.get('fwd_ms'), 3)} / {_fmt(e.get('fwd_bwd_ms'), 3)}" if ok else "-")
    lines.append(f"| {wl} | " + " | ".join(cells) + " |")
  lines += ["", "Output fingerprints (mean(o * w), same inputs across backends; should agree):", "",
            "| workload | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
  for wl in result["workloads"]:
    cells = []
    for b in backends:
      e = entries.get((wl, b))
      cells.append(f"{e['out_fingerprint']:.3e}" if e and "out_fingerprint" in e else "-")
    lines.append(f"| {wl} | " + " | ".join(cells) + " |")
  if notes:
    lines += ["", "Errors:", ""] + notes
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(REPO, "results", "kernel_bench.json"))
  parser.add_argument("--backends", default=",".join(BACKENDS),
                      help="comma list of pallas[:preset], flash3, cudnn, mha; presets: "
                      + ", ".join(PALLAS_PRESETS))
  parser.add_argument("--workloads", default=",".join(
      [f"dense-{n}" for n in DENSE_LENGTHS] + [f"ca-s{s}" for s in SHARD_LENGTHS]))
  parser.add_argument("--tokens", type=int, default=16384, help="query tokens per CA batch")
  parser.add_argument("--max-doc", type=int, default=16384, help="largest document length b")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trials", type=int, default=5)
  parser.add_argument("--min-trial-s", type=float, default=0.05)
  parser.add_argument("--child-timeout-s", type=float, default=1200)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)

  workloads = make_workloads(args.workloads.split(","), args.tokens, args.max_doc, args.seed)
  backends = args.backends.split(",")
  if args.child:
    [backend] = backends

    def save(entries):
      with open(args.out + ".tmp", "w") as f:
        json.dump(entries, f)
      os.replace(args.out + ".tmp", args.out)
    run_backend(backend, workloads, args, save)
    return 0

  # The parent never initializes a JAX backend: the children own the GPU's memory.
  import jax  # pylint: disable=import-outside-toplevel
  result = dict(command=" ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]
                                 if argv is None else argv),
                device="unknown",
                jax_version=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                config=dict(tokens=args.tokens, max_doc=args.max_doc, seed=args.seed,
                            trials=args.trials, min_trial_s=args.min_trial_s,
                            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                            dtype="bfloat16", pallas_presets=PALLAS_PRESETS),
                backends=backends, workloads=[w.name for w in workloads], entries=[])
  stem = os.path.splitext(args.out)[0]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for backend in backends:
    part = f"{stem}.{backend.replace(':', '_')}.part.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backends", backend,
           "--workloads", args.workloads, "--tokens", str(args.tokens), "--max-doc",
           str(args.max_doc), "--seed", str(args.seed), "--trials", str(args.trials),
           "--min-trial-s", str(args.min_trial_s), "--out", part]
    print(f"== {backend}", flush=True)
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, timeout=args.child_timeout_s, capture_output=True, text=True)
      sys.stdout.write(proc.stdout)
      failure = None if proc.returncode == 0 else (
          f"backend process exited with {proc.returncode}: {proc.stderr[-1500:]}")
    except subprocess.TimeoutExpired as e:
      failure = f"backend process timed out after {args.child_timeout_s} s"
      sys.stdout.write((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else
                       (e.stdout or ""))
    print(f"== {backend}: {time.time() - t0:.0f} s", flush=True)
    done = []
    if os.path.exists(part):
      with open(part) as f:
        done = json.load(f)
      os.remove(part)
    result["entries"].extend(done)
    have = {e["workload"] for e in done}
    for wl in workloads:
      if wl.name not in have:
        result["entries"].append(dict(workload=wl.name, kind=wl.kind, backend=backend,
                                      tasks=len(wl.cu_q) - 1, kv_tokens=wl.cu_k[-1],
                                      status="error", error=failure or "no result"))
    # Written after every backend, so a run cut short still leaves a table.
    devices = sorted({e["device"] for e in result["entries"] if "device" in e})
    result["device"] = ", ".join(devices) or "unknown (no backend process reported one)"
    with open(f"{stem}.json", "w") as f:
      json.dump(result, f, indent=1)
    write_markdown(f"{stem}.md", result)
  with open(f"{stem}.md") as f:
    print(f.read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
