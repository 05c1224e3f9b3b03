"""Our core-attention kernel (Mosaic GPU) against FlashAttention-3: a per-kernel profile.

For each workload and backend (one GPU, bf16, 32 query heads, 8 KV heads, head dim 128; "ours"
is the first of ``--kernels``, ``mosaic`` by default):
  1. times forward and forward+backward (``profiling.time_call``: median of trials of back-to-back
     calls; backward = forward+backward - forward);
  2. captures one jax.profiler trace (``distca_jax.profiling.capture``) of ``--trace-calls``
     forward+backward calls, each synced and followed by ``--trace-gap-s`` of idle time so the calls
     separate on the device timeline, and breaks one call's device time down per kernel (name,
     count, microseconds, share) with each kernel's role and phase, its achieved TFLOP/s and
     where obtainable its registers / shared memory / occupancy (see "Resources" below);
  3. writes OUT.json and OUT.md (same stem; command and device at the top) with a "where the gap
     is" table: per phase, our time against flash3's and the ratio.

Workloads (names as in kernel_bench.py, whose builders are imported, not copied): dense-16384 (one
causal sequence), ca-s512 / ca-s128 (fused CA-task batches of 16K query tokens, tail shards of 512
/ 128 tokens with their key prefixes) and sched-prolong-m512 / -m128 (the most loaded attention
server's task table under the real scheduler, min_shard 512 / 128, 8 ranks x 16K tokens).

FLOP convention (exact, from the task table; padding rows count none):
  forward F = 4 * H * D * pairs (``plan.cost.core_attention_flops``); backward B = 2.5 F
  (``plan.cost.BWD_FWD_RATIO``: the 5 useful matmuls S, dP, dV, dK, dQ against the forward's 2).
  A phase's FLOPs are split among that phase's attention kernels (ours: mosaic_attention_fwd;
  mosaic_attention_bwd, or mosaic_attention_dq and _dkv with the two-kernel backward; flash3:
  FlashAttnFwd; FlashAttnBwd) in proportion to their device time, so every attention kernel of a
  phase shows the phase's achieved rate over attention kernels. Other kernels (XLA glue: work
  lists, delta, padding; flash3's bwd pre/post-processing and scheduler) get no FLOPs; a phase's
  "TFLOP/s incl. glue" divides its FLOPs by all its kernels' time.

Phases: a kernel's phase comes from its name (attention kernels, FA3 pre/post-processing); other
kernels of a call are 'forward' if they start before the call's last forward attention kernel
ends, else 'backward' ('unknown' when a call has no forward attention kernel, as on CPU).

Resources (registers, shared memory, occupancy): CUPTI's per-launch "kernel_details" in the
trace's xplane.pb (read with ``jax.profiler.ProfileData``; ``profiling.load_events`` reads the
trace JSON, where the profiler leaves this stat out), for every backend's kernels.

Each backend runs in its own subprocess (a crash or a missing package costs only its entries).
flash3 runs only if ``flash_attn3_jax`` imports; otherwise its entries say why.
Run (on a GPU machine):
  python -m experiments.kernel_profile --out results/kernel_profile.json
CPU smoke test (tiny shapes, the blockwise jnp kernel as ours against the jnp reference; rows
are XLA:CPU thunks, not kernels):
  python -m experiments.kernel_profile --tiny --out /tmp/kernel_profile_tiny.json

``--kernels`` names the kernels to run (``--backends``, its old name, stops with a line naming
it). The JSON keeps the field names ``backends``, ``backend`` (per entry), ``backend_wall_s`` and
``backend_status``: ``kernel_profile_report`` (``gap_table``, ``write_markdown``) and the results already written read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

import experiments
from distca_jax.plan import cost as plan_cost
from experiments import kernel_bench as kb
from experiments.kernel_profile_report import gap_table, write_markdown
from experiments.kernel_profile_trace import (kernel_breakdown, kernel_details_from_xplane,
                                              match_details, split_calls)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# mosaic:<preset>: the Mosaic kernels with a named tiling of kernel_bench.MOSAIC_PRESETS (e.g.
# mosaic:two-kernel, a dQ kernel beside the dK/dV kernel); mosaic: the default.
BACKENDS = ("mosaic", *(f"mosaic:{p}" for p in kb.MOSAIC_PRESETS if p != "default"), "flash3",
            "blockwise", "reference")
FULL = dict(heads=kb.NUM_HEADS, kv_heads=kb.NUM_KV_HEADS, head_dim=kb.HEAD_DIM, dtype="bfloat16",
            tokens=16384, max_doc=16384, sched_tokens=16384, sched_servers=8, trials=5,
            min_trial_s=0.05, kernels="mosaic,flash3",
            workloads="dense-16384,ca-s512,ca-s128,sched-prolong-m512,sched-prolong-m128",
            trace_calls=3, trace_gap_s=0.02, row_multiple=128)
# CPU smoke test: ~256 tokens, 2 query heads / 1 KV head, head dim 16; ours: the blockwise kernel.
TINY = dict(heads=2, kv_heads=1, head_dim=16, tokens=256, max_doc=256, sched_tokens=256,
            sched_servers=4, trials=2, min_trial_s=0.0,
            kernels="blockwise,reference", workloads="dense-256,ca-s64,sched-prolong-m64",
            trace_calls=2, trace_gap_s=0.05, row_multiple=16)


# ------------------------------------------------------------------------------------------------
# Child: one backend, every workload
# ------------------------------------------------------------------------------------------------


def _attention_fn(backend: str, wl):
  """attn(q, k, v, cu_q, cu_k) -> o for a backend, as kernel_bench calls them."""
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  if backend == "flash3":
    return lambda q, k, v, cu_q, cu_k: ops.core_attention(
        q, k, v, cu_q, cu_k, kernel="flash3", max_seqlen_q=wl.max_q, max_seqlen_k=wl.max_k)
  if backend in ("reference", "blockwise", "mosaic"):
    return lambda q, k, v, cu_q, cu_k: ops.core_attention(q, k, v, cu_q, cu_k, kernel=backend)
  if backend.startswith("mosaic:") and backend in BACKENDS:
    from custom_ops import mosaic_attention  # pylint: disable=import-outside-toplevel
    mbs = mosaic_attention.BlockSizes(**kb.MOSAIC_PRESETS[backend.partition(":")[2]])
    return lambda q, k, v, cu_q, cu_k: mosaic_attention.mosaic_attention(
        q, k, v, cu_q, cu_k, block_sizes=mbs)[0]
  raise ValueError(f"unknown {backend=}; choose from {BACKENDS}")


def _fwd_bwd_fn(attn):
  """fwd_bwd(q, k, v, cu_q, cu_k, do) -> (o, (dq, dk, dv))."""
  import jax  # pylint: disable=import-outside-toplevel

  def fwd_bwd(q, k, v, cu_q, cu_k, do):
    o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, cu_q, cu_k), q, k, v)
    return o, vjp(do)
  return fwd_bwd


def run_backend(backend: str, workloads: list, args, save) -> list[dict]:
  """Times, traces and breaks down one backend on every workload; ``save(entries)`` after each."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from custom_ops import flash3_attention as fa3  # pylint: disable=import-outside-toplevel
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel

  dt = jnp.dtype(args.dtype)
  heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
  device = jax.devices()[0]
  unavailable = None
  if backend == "flash3":
    try:
      fa3.import_flash3()
    except ops.KernelUnavailableError as e:
      unavailable = str(e)
  entries = []
  for wl in workloads:
    t_entry = time.perf_counter()
    flops_fwd = plan_cost.core_attention_flops(wl.cu_q, wl.cu_k, num_q_heads=heads,
                                               head_dim=head_dim)
    entry = dict(workload=wl.name, kind=wl.kind, backend=backend, device=device.device_kind,
                 tasks=wl.num_tasks, task_slots=len(wl.cu_q) - 1, q_tokens=wl.cu_q[-1],
                 kv_tokens=wl.cu_k[-1], q_rows=wl.q_rows, kv_rows=wl.kv_rows,
                 pairs=plan_cost.attention_pairs(wl.cu_q, wl.cu_k), flops_fwd=flops_fwd,
                 flops_bwd=flops_fwd * plan_cost.BWD_FWD_RATIO,
                 **(dict(sched=wl.info) if wl.info else {}))
    entries.append(entry)
    if unavailable is not None:
      entry.update(status="unavailable", error=unavailable)
      save(entries)
      continue
    try:
      kq, kk, kv, kd = jax.random.split(jax.random.key(args.seed), 4)
      q = jax.random.normal(kq, (wl.q_rows, heads, head_dim), dt)
      k = jax.random.normal(kk, (wl.kv_rows, kv_heads, head_dim), dt)
      v = jax.random.normal(kv, (wl.kv_rows, kv_heads, head_dim), dt)
      do = jax.random.normal(kd, q.shape, dt)
      cu_q = jnp.asarray(wl.cu_q, jnp.int32)
      cu_k = jnp.asarray(wl.cu_k, jnp.int32)
      attn = _attention_fn(backend, wl)
      fwd = jax.jit(attn)
      fwd_bwd = jax.jit(_fwd_bwd_fn(attn))
      inputs = (q, k, v, cu_q, cu_k)

      # 1. Timing (profiling.time_call: warm-up, then trials of back-to-back calls).
      tm = profiling.time_call(fwd, *inputs, iters=args.trials, min_trial_s=args.min_trial_s)
      t_fwd, fwd_trials, fwd_reps = tm["median_s"], tm["trials_s"], tm["reps"]
      tm = profiling.time_call(fwd_bwd, *inputs, do, iters=args.trials,
                               min_trial_s=args.min_trial_s)
      t_fb, fb_trials, fb_reps = tm["median_s"], tm["trials_s"], tm["reps"]
      entry["timing"] = dict(
          fwd_ms=t_fwd * 1e3, fwd_bwd_ms=t_fb * 1e3, bwd_ms=(t_fb - t_fwd) * 1e3,
          fwd_trials_ms=[t * 1e3 for t in fwd_trials], fwd_reps=fwd_reps,
          fwd_bwd_trials_ms=[t * 1e3 for t in fb_trials], fwd_bwd_reps=fb_reps,
          fwd_tflops=flops_fwd / t_fwd / 1e12,
          bwd_tflops=(entry["flops_bwd"] / (t_fb - t_fwd) / 1e12) if t_fb > t_fwd else None,
          fwd_bwd_tflops=(flops_fwd + entry["flops_bwd"]) / t_fb / 1e12)

      # 2. One trace of --trace-calls forward+backward calls, idle gaps between them.
      def calls(*a):
        out = None
        for _ in range(args.trace_calls):
          out = jax.block_until_ready(fwd_bwd(*a))
          time.sleep(args.trace_gap_s)
        return out

      logdir = os.path.join(args.trace_dir, f"{wl.name}.{backend}")
      _, trace_path = profiling.capture(calls, *inputs, do, logdir=logdir)
      events = [e for e in profiling.load_events(trace_path) if e.device == device.id]
      if not events:
        raise RuntimeError(f"no device events for device {device.id} in {trace_path}")
      split = split_calls(events, gap_us=args.trace_gap_s * 1e6 / 2)
      trace = dict(path=os.path.relpath(trace_path, os.path.dirname(os.path.abspath(args.out))),
                   events=len(events), calls_found=len(split))
      if len(split) != args.trace_calls:
        # Calls did not separate cleanly: average the whole trace over the calls made instead.
        trace["call_split_note"] = (f"found {len(split)} idle-separated groups for "
                                    f"{args.trace_calls} calls; per-call numbers are the whole "
                                    "trace / calls and phases of glue kernels are approximate")
        split = [events]
      breakdown = kernel_breakdown(split, flops_fwd, entry["flops_bwd"],
                                   num_calls=args.trace_calls)
      details, note = kernel_details_from_xplane(trace_path)
      trace["kernel_details_note"] = note
      for row in breakdown["kernels"]:
        row["details"] = match_details(details, row["name"], row["long_name"])
      trace.update(breakdown)
      if device.platform != "cpu" and not any(r["attention"] and r["phase"] == "forward"
                                              for r in breakdown["kernels"]):
        trace["attention_note"] = (
            "no forward attention kernel recognized in the trace (see ROLE_PATTERNS): new kernel "
            "names, or kernels hidden inside CUDA graphs (rerun with --no-command-buffers)")
      entry["trace"] = trace
      entry["status"] = "ok"
    except Exception as e:  # pylint: disable=broad-except
      entry["status"] = "error"
      entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
      entry["traceback_tail"] = traceback.format_exc()[-2000:]
    entry["wall_s"] = time.perf_counter() - t_entry
    summary = {k: entry.get(k) for k in ("workload", "backend", "status", "error", "wall_s")}
    summary.update({k: entry.get("timing", {}).get(k) for k in ("fwd_ms", "fwd_bwd_ms")})
    print(json.dumps(summary), flush=True)
    save(entries)
  return entries


# ------------------------------------------------------------------------------------------------
# Parent: one subprocess per backend, JSON + markdown
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
  """Parses flags and fills unset ones from FULL, overlaid by --tiny."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(REPO, "results", "kernel_profile.json"))
  parser.add_argument("--tiny", action="store_true",
                      help="CPU smoke test: tiny shapes, the blockwise kernel + the jnp reference")
  parser.add_argument("--kernels", help=f"comma list of {BACKENDS}, ours first; default "
                      f"{FULL['kernels']}")
  experiments.reject_renamed_flag(parser, "--backends", "--kernels")
  parser.add_argument("--workloads", help="comma list of kernel_bench names (dense-<L>, ca-s<S>, "
                      f"sched-<W>-m<S>); default {FULL['workloads']}")
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", type=int)
  parser.add_argument("--head-dim", type=int)
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--tokens", type=int, help="query tokens per ca-s batch")
  parser.add_argument("--max-doc", type=int, help="ca-s: largest document length")
  parser.add_argument("--sched-tokens", type=int, help="sched: tokens per rank")
  parser.add_argument("--sched-servers", type=int, help="sched: ranks = servers")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--row-multiple", type=int,
                      help="buffer rows rounded up to a multiple of this, as kernel_bench's flag "
                      "(default 128, 16 with --tiny: the data plane's buffers; 1 ends them at "
                      "the last task)")
  parser.add_argument("--trials", type=int)
  parser.add_argument("--min-trial-s", type=float)
  parser.add_argument("--trace-calls", type=int, help="forward+backward calls in the trace")
  parser.add_argument("--trace-gap-s", type=float, help="idle seconds after each traced call")
  parser.add_argument("--child-timeout-s", type=float, default=1500)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--trace-dir", help="where the traces go (default: <out stem>_traces; "
                      "each (workload, backend) gets a folder to open in Perfetto / XProf)")
  parser.add_argument("--command-buffers", action=argparse.BooleanOptionalAction, default=True,
                      help="leave XLA's CUDA-graph command buffers on (default, as in training); "
                      "--no-command-buffers turns them off in case the trace shows graphs "
                      "instead of kernels")
  args = parser.parse_args(argv)
  fill = dict(FULL)
  fill.update(TINY if args.tiny else {})
  for name, value in fill.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  kb.check_kernels(parser, args.kernels, BACKENDS)
  if args.trace_calls < 1 or args.trace_gap_s <= 0:
    parser.error(f"--trace-calls {args.trace_calls} must be >= 1 and --trace-gap-s "
                 f"{args.trace_gap_s} > 0 (the gap separates the calls on the timeline)")
  return args


def _sched_config(args) -> kb.SchedConfig:
  return kb.SchedConfig(tokens_per_rank=args.sched_tokens, servers=args.sched_servers, step=0,
                        tolerance=0.05, server="max", buffers="used", seed=args.seed,
                        q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)


def main(argv=None) -> int:
  t_main = time.time()
  args = parse_args(argv)
  names = kb.expand_workload_names(args.workloads)
  workloads = kb.make_workloads(names, args.tokens, args.max_doc, args.seed, _sched_config(args),
                                args.row_multiple)
  stem = os.path.splitext(os.path.abspath(args.out))[0]
  if args.child:
    return kb.run_child(run_backend, workloads, args)

  # The parent never initializes a JAX backend: the children own the GPU's memory.
  import jax  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  trace_dir = os.path.abspath(args.trace_dir or stem + "_traces")
  backends = args.kernels.split(",")
  command = experiments.command_line(__file__, argv)
  result = dict(
      command=command, device="unknown", jax_version=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      config=dict(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, tokens=args.tokens, max_doc=args.max_doc, seed=args.seed,
                  row_multiple=args.row_multiple, trials=args.trials,
                  min_trial_s=args.min_trial_s, trace_calls=args.trace_calls,
                  trace_gap_s=args.trace_gap_s, command_buffers=args.command_buffers,
                  tiny=args.tiny, sched=dataclasses.asdict(_sched_config(args)),
                  trace_dir=trace_dir),
      flops_convention=__doc__[__doc__.index("FLOP convention"):__doc__.index("Phases:")].strip(),
      backends=backends, workloads=names, entries=[], backend_status={}, backend_wall_s={})
  shared = ["--workloads", ",".join(names), "--tokens", str(args.tokens), "--max-doc",
            str(args.max_doc), "--seed", str(args.seed), "--row-multiple",
            str(args.row_multiple), "--trials", str(args.trials), "--min-trial-s",
            str(args.min_trial_s), "--heads", str(args.heads), "--kv-heads",
            str(args.kv_heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
            "--sched-tokens",
            str(args.sched_tokens), "--sched-servers", str(args.sched_servers),
            "--trace-calls", str(args.trace_calls), "--trace-gap-s", str(args.trace_gap_s),
            "--trace-dir", trace_dir]
  for backend in backends:
    part = f"{stem}.{backend.replace(':', '-')}.part.json"
    cmd = [*experiments.module_argv(__file__), "--child", "--kernels", backend,
           *shared, "--out", part]
    env = dict(os.environ)
    if not args.command_buffers:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    if args.tiny:
      # CPU smoke test: compiling dominates and the times mean nothing, so XLA:CPU skips its
      # backend optimizations.
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    print(f"== {backend}", flush=True)
    t0 = time.time()
    try:
      proc = subprocess.run(cmd, timeout=args.child_timeout_s, capture_output=True, text=True,
                            env=env, check=False)
      sys.stdout.write(proc.stdout)
      failure = None if proc.returncode == 0 else (
          f"backend process exited with {proc.returncode}: {proc.stderr[-1500:]}")
    except subprocess.TimeoutExpired:
      failure = f"backend process timed out after {args.child_timeout_s} s"
    result["backend_wall_s"][backend] = time.time() - t0
    kb.collect_entries(part, result, workloads, failure,
                       lambda wl: dict(workload=wl.name, kind=wl.kind, backend=backend))
    statuses = sorted({e["status"] for e in result["entries"] if e["backend"] == backend})
    unavailable = next((e["error"] for e in result["entries"]
                        if e["backend"] == backend and e["status"] == "unavailable"), None)
    result["backend_status"][backend] = (
        f"unavailable ({unavailable.split('. Import failed')[0]})" if unavailable else
        "ok" if statuses == ["ok"] else "/".join(statuses)) + (
        " (ours)" if backend == backends[0] else "")
    print(f"== {backend}: {time.time() - t0:.0f} s", flush=True)
    # Written after every backend, so a run cut short still leaves a report.
    result["gap"] = gap_table(result["entries"], names, ours=backends[0])
    kb.save_result(stem, result, t_main, write_markdown)
  with open(f"{stem}.md") as f:
    print(f.read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
