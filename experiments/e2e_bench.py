"""End-to-end step time of core-attention strategies, side by side, in one process.

  python -m experiments.e2e_bench --backends distca,packed_dp --workloads pretrain,prolong \
      --tokens 65536,131072 --layers 4 --steps 20 --out results/e2e_bench

For every (workload, tokens per GPU, backend, variant) it trains `--steps` real optimizer steps of
Llama-3-8B layer shapes (`configs/gpu_bench.py`, `--layers` of the 32 layers) on sampled batches
(the same batches for every backend), timing each step to completion, and reports the median and
spread of step time, tokens/s and MFU (document-masked FLOPs, see distca_jax/metrics.py).

It also computes, from the very same batches, the ceiling of any attention balancer over
`packed_dp`: E[max over ranks of step work] / E[mean over ranks], work = the shared work model
(`metrics.step_work`: 6 N tokens + the kernel's forward + backward, 3.5x forward, per causal
pair; a speedup above it is flagged in the table), and reports each backend's measured speedup over packed_dp as a fraction of
that bound's gain ((speedup - 1) / (bound - 1)), twice: with the speedup as the ratio of median
steps, and as the ratio of tokens/s (total time over the same batches). The bound is a ratio of
expectations, so the tokens/s form is the like-for-like one; the median form is less sensitive
to a few slow steps.

Variants and ablations (paper Sec. 6 style), all in the same process on the same batches:
  `--nano-batches 1,2`          single stream vs ping-pong ('+pingpong' rows and their speedup);
  `--variant NAME[@BACKEND]:KEY=VALUE[,KEY=VALUE]`  an extra run (of BACKEND only, if given)
                                with config overrides (``backend.KEY=VALUE``: an option of the
                                backend, ``backends.build(c, KEY=VALUE)``), named BACKEND+NAME;
                                e.g. `--variant signal@distca:backend.signal_only=true` is the
                                signal-only twin (all-to-alls carry tiny buffers: the step time
                                without exposed communication), reported as step / twin;
                                `--variant eps0@distca:attention.distca.tolerance=0` an epsilon point
                                (add `--plan-stats` for each run's imbalance and bytes);
                                under a pipeline (`mesh.pipe > 1`)
                                `--variant perstage@distca:attention.distca.pool_stages=false`
                                is per-stage CAD (each stage's data ranks its own servers; its
                                `--plan-stats` are per tick and stage); the ceiling column then
                                also shows the per-stage bound (`ceiling(pool_stages=False)`);
  `--extra KEY=VALUE`           overrides for every run (e.g. attention.kernel=flash3);
  `--profile`                   one more jax.profiler-traced step per run: per-rank attention,
                                matmul, communication and exposed-communication time (stragglers).
Planning runs on the input thread (trainer.Prefetcher): the table shows host planning ms per batch
next to the main thread's wait for its batch (planning off the critical path = wait ~ 0).
`wlb` runs take their CP size and alpha from `baselines.ideal.choose_wlb` (CP 1-8 dividing the
data ranks, alpha from 1.0), and `cp` runs their CP size from `ideal.choose_cp` (CP 1-8 dividing
the data ranks), both on batches the run never trains or times (`ideal.choice_steps`) with the
same layer-time model (`ideal.slowest_layer_seconds`): the fastest predicted configuration whose
train step fits the device (each candidate compiled ahead of time, fastest first, until one fits:
`aot.baseline_need_bytes`, the pre-flight's count), unless `--extra
attention.baselines.cp_size=N` (both) / `wlb_alpha=A` (wlb) fix them; wlb's task slots are
sized from sampled batches (`ideal.wlb_tasks_needed`), cp's are `max_docs_per_row`. The table
("Baselines' configuration") shows each configuration, how it was chosen (predicted time, memory
need, the faster ones excluded for memory) and the linear work wlb's padded rows cost.
`--tiny` shrinks everything for a CPU smoke test. Writes OUT.json and OUT.md (the command at the
top); `experiments/plot_e2e.py OUT.json` draws OUT.png.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import statistics
import time

import experiments
from distca_jax.plan import ticks  # NumPy only: safe before XLA_FLAGS is set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--backends", default="packed_dp,distca")
  p.add_argument("--workloads", default="pretrain,prolong",
                 help="comma-separated: 'pretrain', 'prolong', or paths of document-length files "
                 "of your own data (a JSON list, a .npy array or one length a line)")
  p.add_argument("--tokens", default=None,
                 help="tokens per GPU (comma list; default 65536,131072, with --tiny 1024)")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--steps", type=int, default=20, help="timed steps (sampled batches) per run")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
  p.add_argument("--nano-batches", default="1", help="comma list: 1 single stream, 2 ping-pong")
  p.add_argument("--rows-per-rank", type=int, default=0, help="0: nano-batches (x the pipeline's microbatches "
                      "under mesh.pipe > 1: one row per microbatch)")
  p.add_argument("--extra", action="append", default=[], help="KEY=VALUE config override")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME:KEY=VALUE[,KEY=VALUE] an extra run per backend with these overrides")
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpu_bench.py"))
  p.add_argument("--profile", action="store_true",
                 help="after the timed steps, profile one more step (jax.profiler) and add its "
                      "per-rank report (attention / matmul / exposed communication, stragglers)")
  p.add_argument("--plan-stats", action="store_true",
                 help="distca runs: replan the timed batches on the host and report imbalance "
                      "before/after and bytes per step (for the epsilon ablation)")
  p.add_argument("--tiny", action="store_true",
                 help="CPU smoke test sizes (a 64-wide model; 1024 tokens unless --tokens)")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "e2e_bench"))
  a = p.parse_args(argv)
  if a.tokens is None:  # the GPU sizes need ~0.3-3.6 TB on a CPU with the dense tiny kernel
    a.tokens = "1024" if a.tiny else "65536,131072"
  return a


def ceiling(model_cfg, doclens_per_step, *, stages: int = 1, microbatches: int = 1,
            tokens_per_row: int | None = None, pool_stages: bool = True):
  """E[max_r work_r] / E[mean_r work_r] over steps; rows of a step are grouped per data rank.
  Work is the shared work model (``metrics.step_work``: attention at the kernel's 3.5x forward).

  Under a pipeline (``stages`` > 1, ``microbatches`` M) the step is M + stages - 1 ticks, each as
  slow as its slowest (stage, data rank) slot, and a balancer can only even out attention within
  a tick (pooled CAD: over every slot of the tick, bubble slots included). A slot's work is its
  microbatch rows' attention plus the linear work of ``tokens_per_row`` tokens per row, which
  every slot computes, bubble slots too (static shapes). The bound is then
  E[sum_t max_slot] / E[sum_t mean_slot]: the schedule's bubble is in both terms. With
  ``pool_stages=False`` (per-stage CAD) a balancer evens out attention only within each stage's
  data ranks, so a balanced tick takes its slowest stage's mean slot:
  E[sum_t max_slot] / E[sum_t max_stage mean_(stage's slots)]."""
  from distca_jax import metrics
  maxes, means = [], []
  for per_rank in doclens_per_step:
    if stages == 1:
      work = [metrics.step_work(model_cfg, rows) for rows in per_rank]
      maxes.append(max(work))
      means.append(sum(work) / len(work))
      continue
    if tokens_per_row is None:
      raise ValueError("ceiling: a pipeline needs tokens_per_row (the linear work of every slot)")
    rows_per_rank = len(per_rank[0])
    rows = [row for rank_rows in per_rank for row in rank_rows]
    r = rows_per_rank // ticks.resolve_microbatches(microbatches, stages)
    for tick in ticks.tick_rows(rows, stages=stages, rows_per_rank=rows_per_rank,
                                microbatches=microbatches):
      slots = [tick[i:i + r] for i in range(0, len(tick), r)]
      work = [float(metrics.work_flops(
          metrics.matmul_params(model_cfg), model_cfg.n_layers, model_cfg.n_heads,
          model_cfg.head_dim, r * tokens_per_row,
          sum(l * (l + 1) / 2 for row in slot for l in row))) for slot in slots]
      maxes.append(max(work))
      groups = [work] if pool_stages else [work[i:i + len(work) // stages]
                                           for i in range(0, len(work), len(work) // stages)]
      means.append(max(sum(g) / len(g) for g in groups))
  return sum(maxes) / sum(means)


def lm_head_share(model_cfg, doclens_per_step) -> float:
  """The LM head's share of the FLOPs MFU counts over the timed batches (``metrics``)."""
  from distca_jax import metrics
  return metrics.lm_head_share(model_cfg, [row for step in doclens_per_step for rank in step
                                           for row in rank])


def rows_by_rank(rows, data: int, rows_per_rank: int):
  """A batch's per-row document lengths grouped per data rank (rank r holds a block of rows)."""
  return [rows[r * rows_per_rank:(r + 1) * rows_per_rank] for r in range(data)]


def backend_overrides(over):
  """``backend.KEY=VALUE`` items of ``over`` as backend options (bools, ints, floats parsed)."""
  out = {}
  for item in over:
    if not item.startswith("backend."):
      continue
    key, _, val = item[len("backend."):].partition("=")
    if val.lower() in ("true", "false"):
      out[key] = val.lower() == "true"
      continue
    for cast in (int, float):
      try:
        out[key] = cast(val)
        break
      except ValueError:
        pass
    else:
      out[key] = val
  return out


CHOSEN_KEYS = {"wlb": ("attention.baselines.cp_size", "attention.baselines.wlb_alpha"),
               "cp": ("attention.baselines.cp_size",)}


def choice_overrides(backend: str, over) -> list[str]:
  """``over`` plus, for each key the ``backend`` chooses (``CHOSEN_KEYS``: wlb's CP size and
  alpha, cp's CP size) not given there, 0 = the backend's pick (``baselines.ideal``)."""
  given = {o.partition("=")[0] for o in over}
  return list(over) + [f"{k}=0" for k in CHOSEN_KEYS.get(backend, ()) if k not in given]


def baseline_config(c, over) -> dict:
  """The configuration of run config ``c``'s baseline (``attention.backend`` 'wlb' or 'cp') and
  how it was chosen (``over``: the overrides): the run's choice (``choose.resolve`` before
  ``run_one``; ``baselines.baseline_choice``, memoized), its task slots, and the memory need of
  every candidate checked (those faster than the choice did not fit)."""
  from distca_jax import baselines
  from distca_jax.baselines import ideal
  backend = c.attention.backend
  given = {o.partition("=")[0]: o.partition("=")[2] for o in over}
  choice = baselines.baseline_choice(c, backend)
  steps = ideal.choice_steps(c)
  fixed = [k.rsplit(".", 1)[1] for k in CHOSEN_KEYS[backend]
           if given.get(k, "0") not in ("0", "0.0")]
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  if choice.capacity_bytes is None:
    fit = ("memory not checked before the pre-flight (configuration given, or no device limit: "
           "attention.baselines.memory_gib sets one)")
  else:
    fit = f"fits {gib(choice.capacity_bytes)}: needs {gib(choice.memory[-1][3])}"
    out = choice.excluded_for_memory()
    if out:
      fit += "; faster but over it: " + ", ".join(
          f"{choice.label(cp, a)} ({gib(n)})" for cp, a, _, n in out)
  if backend == "cp":  # few candidates: each one's prediction
    scored = "CP " + ", ".join(f"{x[0]}: {1e3 * x[2]:.3g} ms" for x in choice.candidates)
  else:
    scored = f"{len(choice.candidates)} candidates"
  how = (f"choose_{backend} on steps {steps.start}-{steps.stop - 1} (never trained or timed) "
         f"over {scored}, predicted {1e3 * choice.layer_seconds:.3g} ms per layer; {fit}"
         + (f"; {' and '.join(fixed)} given" if fixed else ""))
  return {"cp_size": choice.cp_size, "alpha": choice.alpha, "how": how,
          "tasks_per_row": choice.tasks_per_row, "layer_seconds": choice.layer_seconds,
          "capacity_bytes": choice.capacity_bytes,
          "memory_checked": [list(x) for x in choice.memory],
          "padding_linear_fraction": choice.alpha - 1.0,
          "candidates": [list(x) for x in choice.candidates]}


def run_one(c, steps, warmup, log, profile_dir=None, backend_options=None):
  """Trains warmup + steps steps; returns per-step times and FLOP / token counts."""
  import jax
  from distca_jax import choose, metrics, trainer

  c = choose.resolve(c)  # a baseline's configuration left to the run, as the launcher chooses it
  run = trainer.setup_run(c, **(backend_options or {}))
  mesh, backend, model, tx, source = run.mesh, run.backend, run.model, run.tx, run.source
  state = trainer.create_train_state(c, model, tx, mesh)
  prefetch = trainer.Prefetcher(source, model.cfg, 0, warmup + steps, backend=backend)
  step_fn, times, flops, tokens, losses, doclens, waits = None, [], [], [], [], [], []
  local = []  # per timed step: took distca's branch without the exchange (trainer.runs_local)
  for i in range(warmup + steps):
    t_wait = time.perf_counter()
    step, np_batch, fl, tok = prefetch.next()
    waited = time.perf_counter() - t_wait
    batch = trainer.device_batch(np_batch, mesh)
    jax.block_until_ready(batch)
    if step_fn is None:  # compiled once: the steps run it, and memory / HLO are read from it
      # The memory pre-flight of training (distca's 'auto' memory mode included): a step that
      # cannot fit stops here with its one line.
      step_fn, workspace, _, run = trainer.preflight(c, run, state, batch, log=log)
      model = run.model
    t0 = time.perf_counter()
    with trainer.mesh_context(mesh, c.mesh.fsdp):
      state, m = step_fn(state, batch)
    jax.block_until_ready((state, m))
    dt = time.perf_counter() - t0
    if i >= warmup:
      times.append(dt)
      flops.append(fl)
      tokens.append(tok)
      losses.append(float(m["loss"]))
      waits.append(waited)
      local.append(trainer.runs_local(np_batch))
      doclens.append(rows_by_rank(source.doclens(step), mesh.shape["data"], c.rows_per_rank))
    log(f"    step {i + 1}/{warmup + steps}: {dt * 1e3:.1f} ms, loss {float(m['loss']):.3f}")
  report = None
  if profile_dir is not None:  # one more step (a batch seen before), traced
    from distca_jax import profiling
    batch = trainer.device_batch(np_batch, mesh)
    with trainer.mesh_context(mesh, c.mesh.fsdp):
      state, m, report = profiling.profile_train_step(
          step_fn, state, batch, profile_dir,
          step_time_s=statistics.median(times) if times else None)
    log("    profiled step:\n" + profiling.format_report(report))
  peak = metrics.peak_flops_per_device(c.peak_tflops)
  plan_s = prefetch.host_plan_s[warmup:warmup + steps]
  if profile_dir is not None:  # most of the report's HLO op names are instructions of this text
    with gzip.open(os.path.join(profile_dir, "step_hlo.txt.gz"), "wt") as f:
      f.write(step_fn.as_text())
  mem = step_memory_gb(step_fn)
  if mem:
    mem["kernel_workspace"] = workspace * 1e-9
  peak_gb = allocator_peak_gb()
  if peak_gb is not None:
    mem["allocator_peak"] = peak_gb
  if mem:
    log("    memory per device (XLA's plan of the step; allocator_peak: the most any device's "
        "allocator held so far in this process): " +
        ", ".join(f"{k} {v:.1f} GB" for k, v in mem.items()))
  return dict(times=times, flops=flops, tokens=tokens, losses=losses, doclens=doclens,
              input_wait_s=waits, host_plan_s=plan_s, devices=jax.device_count(), peak=peak,
              device_kind=jax.devices()[0].device_kind, model_cfg=model.cfg, profile=report,
              backend=backend, memory_gb=mem, local_steps=local)


def allocator_peak_gb() -> float | None:
  """The largest ``peak_bytes_in_use`` of this process's devices (GB): what the allocator really
  handed out, kernel workspaces outside XLA's plan included, since the process started (run one
  configuration per process to read it per configuration); None where devices report none."""
  import jax
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p]
  return max(peaks) * 1e-9 if peaks else None


def step_memory_gb(compiled) -> dict[str, float]:
  """Per-device GB of the compiled step (``aot.memory_fields``: arguments, outputs, temporaries
  and their sum less donated aliases), or {} where the backend reports none."""
  from distca_jax import aot
  mem = aot.memory_fields(compiled)
  if not mem:
    return {}
  keys = {"arguments": "argument_size_in_bytes", "outputs": "output_size_in_bytes",
          "temporaries": "temp_size_in_bytes", "total": "total_per_device_bytes"}
  return {k: mem[f] * 1e-9 for k, f in keys.items()}


def summarize(r):
  med = statistics.median(r["times"])
  total_t = sum(r["times"])
  out = {
      "step_ms_median": med * 1e3,
      "step_ms_min": min(r["times"]) * 1e3,
      "step_ms_max": max(r["times"]) * 1e3,
      "step_ms_p10": sorted(r["times"])[len(r["times"]) // 10] * 1e3,
      "step_ms_p90": sorted(r["times"])[(9 * len(r["times"])) // 10] * 1e3,
      "tokens_per_s": sum(r["tokens"]) / total_t,
      "input_wait_ms_median": statistics.median(r["input_wait_s"]) * 1e3,
      "input_wait_ms_max": max(r["input_wait_s"]) * 1e3,
      "host_plan_ms_median": (statistics.median(r["host_plan_s"]) * 1e3
                              if r["host_plan_s"] else 0.0),
      "step_ms_all": [t * 1e3 for t in r["times"]],
      "losses": r["losses"],
      "final_loss": r["losses"][-1],
      # share of the timed steps that ran distca's step without the exchange (no plan moved)
      "local_steps": statistics.fmean(r["local_steps"]) if r.get("local_steps") else 0.0,
  }
  if r.get("memory_gb"):
    out["memory_gb"] = r["memory_gb"]
  if r["peak"]:
    out["mfu"] = sum(r["flops"]) / total_t / (r["peak"] * r["devices"])
  if r.get("profile") is not None:
    out["profile"] = r["profile"]
  return out


def run_overrides(workload: str, tokens: int, layers: int, backend: str, nano: int,
                  rows_per_rank: int, num_steps: int) -> list[str]:
  """The config overrides of one run (before ``--extra`` and a variant's): ``rows_per_rank`` 0
  is ``nano`` rows (``run_config`` sets it under a pipeline)."""
  return [f"data.workload={workload}", f"tokens_per_rank={tokens}", f"model.n_layers={layers}",
          f"attention.backend={backend}", f"attention.nano_batches={nano}",
          f"rows_per_rank={rows_per_rank or nano}", "checkpoint_every=0",
          f"num_steps={num_steps}"]


def run_config(path: str, over: list[str], rows_per_rank: int):
  """(config ``path`` with ``over``, ``over`` plus what the run then sets): a short run's
  schedule warmup fits it; under a pipeline, ``rows_per_rank`` 0 is one row per microbatch
  (and nano-batch). ``backend.*`` items are the backend's options, not config keys."""
  from distca_jax import configs_io
  over = list(over)
  c = configs_io.load_config(path, [x for x in over if not x.startswith("backend.")])
  if c.optim.warmup_steps > c.num_steps:  # a short run: the schedule's warmup fits it
    c.optim.warmup_steps = c.num_steps
    over.append(f"optim.warmup_steps={c.num_steps}")
  if c.mesh.pipe > 1 and not rows_per_rank:  # one row per microbatch by default
    c.rows_per_rank = c.attention.nano_batches * ticks.resolve_microbatches(
        c.pipeline.microbatches, c.mesh.pipe)
    over.append(f"rows_per_rank={c.rows_per_rank}")
  return c, over


def plan_stats(c, backend, doclens_per_step):
  """The timed batches planned again by the run's own `distca` backend (`host_plans`, one plan
  per nano-batch or pipeline tick): mean imbalance (pairs) before/after over the same plans (a
  plan that moves nothing counts the same value twice, so when no plan moves, after = before),
  the share of plans that moved rows, dispatch bytes per device (useful: what the ragged exchange
  moves; buffer: the send and receive buffers the caps allocate), degraded plans, the number of
  plans (``plan_count``). Per-stage CAD
  (``attention.distca.pool_stages=False``) plans each tick once per stage group, so its
  imbalances are within a stage (a bubble stage's empty plan counts 1.0), not over the tick."""
  from distca_jax import plan as plan_lib
  out = dict(imbalance_before=[], imbalance_after=[], dispatch_useful_mb=[], dispatch_buffer_mb=[],
             moved=[], degraded=0)
  calls = []
  for per_rank in doclens_per_step:
    rows = [row for rank_rows in per_rank for row in rank_rows]
    calls += ([rows] if c.mesh.pipe == 1 else ticks.tick_rows(
        rows, stages=c.mesh.pipe, rows_per_rank=c.rows_per_rank,
        microbatches=c.pipeline.microbatches))
  for rows in calls:
    for hp in backend.host_plans(rows, c.tokens_per_rank):
      p = hp.plan
      out["imbalance_before"].append(p.imbalance_before)
      out["imbalance_after"].append(p.imbalance_after)
      eb = plan_lib.exchange_bytes(hp.meta, q_heads=p.q_heads, kv_heads=p.kv_heads,
                                   head_dim=p.head_dim, dtype_bytes=p.dtype_bytes)
      out["dispatch_useful_mb"].append(eb["dispatch_useful"] / 1e6)
      out["dispatch_buffer_mb"].append(eb["dispatch_buffer"] / 1e6)
      out["moved"].append(float(eb["dispatch_useful"] > 0))
      out["degraded"] += int(p.degraded)
  out["tolerance"] = float(c.attention.distca.tolerance)
  out["count"] = len(out["moved"])
  return {"plan_" + k: (statistics.fmean(v) if isinstance(v, list) else v)
          for k, v in out.items()}


def main(argv=None):
  a = parse_args(argv)
  if a.tiny:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  import jax  # noqa: F401  (after XLA_FLAGS)
  from distca_jax.launch import configure_environment
  configure_environment()
  log = lambda m: print(m, flush=True)
  variants = [("", None, [])]
  for v in a.variant:
    name, _, kvs = v.partition(":")
    name, _, only = name.partition("@")
    if not name or not kvs:
      raise SystemExit(f"--variant {v!r}: expected NAME[@BACKEND]:KEY=VALUE[,KEY=VALUE]")
    variants.append((name, only or None, [x for x in kvs.split(",") if x]))
  results = []
  for workload in a.workloads.split(","):
    for tokens in [int(t) for t in a.tokens.split(",")]:
      for nano in [int(n) for n in a.nano_batches.split(",")]:
        for backend in a.backends.split(","):
          for vname, vonly, vover in variants:
            if vonly is not None and vonly != backend:
              continue
            over = run_overrides(workload, tokens, a.layers, backend, nano, a.rows_per_rank,
                                 a.warmup + a.steps) + a.extra + vover
            over = choice_overrides(backend, over)
            if a.tiny:
              over += ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=16",
                       "model.mlp_dim=128", "model.vocab_size=256", "model.dtype=float32",
                       "model.loss_chunk=256", "attention.block_q=64", "attention.block_k=64",
                       "attention.kernel=reference"]
            name = backend + (f"+{vname}" if vname else "") + ("+pingpong" if nano == 2 else "")
            log(f"== {workload} {tokens} tokens/GPU {name}")
            c, over = run_config(a.config, over, a.rows_per_rank)
            backend_options = backend_overrides(over)
            pdir = (os.path.join(a.out + "_profiles", f"{workload}_{tokens}_{name}")
                    if a.profile else None)
            try:
              r = run_one(c, a.steps, a.warmup, log, profile_dir=pdir,
                          backend_options=backend_options)
            except Exception as e:  # recorded, never silently dropped
              log(f"   FAILED: {type(e).__name__}: {e}")
              results.append(dict(workload=workload, tokens=tokens, backend=name, error=f"{type(e).__name__}: {e}"))
              continue
            s = summarize(r)
            if c.mesh.pipe > 1:  # the bound of a balancer within each stage (per-stage CAD)
              s["ceiling_per_stage"] = ceiling(
                  r["model_cfg"], r["doclens"], stages=c.mesh.pipe,
                  microbatches=c.pipeline.microbatches, tokens_per_row=c.tokens_per_rank,
                  pool_stages=False)
            if backend in CHOSEN_KEYS:  # wlb_config / cp_config
              s[f"{backend}_config"] = baseline_config(c, over)
            if a.plan_stats and backend == "distca":
              s.update(plan_stats(c, r["backend"], r["doclens"]))
            s.update(workload=workload, tokens=tokens, backend=name, nano_batches=nano,
                     device=r["device_kind"], devices=r["devices"], layers=a.layers,
                     lm_head_share=lm_head_share(r["model_cfg"], r["doclens"]),
                     ceiling=ceiling(r["model_cfg"], r["doclens"], stages=c.mesh.pipe,
                                     microbatches=c.pipeline.microbatches,
                                     tokens_per_row=c.tokens_per_rank), overrides=over)
            results.append(s)
            derive(results)
            write(a, results, quiet=True)  # after every run: a killed job keeps what finished
            log(f"   median {s['step_ms_median']:.1f} ms, {s['tokens_per_s']:,.0f} tok/s"
                + (f", MFU {100 * s['mfu']:.1f}%" if "mfu" in s else "")
                + f", ceiling {s['ceiling']:.3f}")
  derive(results)
  write(a, results)


def find_run(results, backend, like):
  """The run of ``backend`` with the workload and tokens of ``like`` (no failed run), or None."""
  for b in results:
    if (b.get("backend") == backend and b["workload"] == like["workload"]
        and b["tokens"] == like["tokens"] and "error" not in b):
      return b
  return None


def derive(results):
  """Ratios between runs of one (workload, tokens): speedup over packed_dp (same nano-batches)
  and the fraction of the bound's gain; twin ratios of variants ('+signal': step / its
  signal-only twin; '+pingpong': single-stream step / ping-pong step)."""
  for s in results:
    if "error" in s:
      continue
    pp = "+pingpong" if s.get("nano_batches") == 2 else ""
    base = find_run(results, "packed_dp" + pp, s)
    if base:
      # Same batches, same initial parameters: the loss curves must agree (bf16 noise only)
      # unless the run is a signal-only twin, whose attention is wrong by design.
      n = min(len(base["losses"]), len(s["losses"]))
      s["max_loss_diff_vs_packed_dp"] = max(abs(x - y) for x, y in
                                            zip(base["losses"][:n], s["losses"][:n]))
      sp = base["step_ms_median"] / s["step_ms_median"]
      s["speedup_vs_packed_dp"] = sp
      s["fraction_of_bound_gain"] = (sp - 1) / (s["ceiling"] - 1) if s["ceiling"] > 1 else None
      # The ceiling is a ratio of expectations (summed work over the batches), so the like-for-
      # like measure is the ratio of total time over the same batches: tokens/s.
      tr = s["tokens_per_s"] / base["tokens_per_s"]
      s["tokens_per_s_ratio"] = tr
      s["fraction_of_bound_gain_tokens"] = ((tr - 1) / (s["ceiling"] - 1) if s["ceiling"] > 1
                                            else None)
    name = s["backend"]
    if "+signal" in name:
      twin = find_run(results, name.replace("+signal", ""), s)
      if twin:
        twin["step_over_signal_only"] = twin["step_ms_median"] / s["step_ms_median"]
    if name.endswith("+pingpong"):
      single = find_run(results, name[:-len("+pingpong")], s)
      if single:
        s["pingpong_speedup"] = single["step_ms_median"] / s["step_ms_median"]
    prof = s.get("profile")
    if prof:
      s["attention_imbalance"] = prof["straggler"]["attention_us"]["max_over_mean"]


def above_ceiling(r) -> str:
  """A flag when the measured speedup exceeds its own ceiling: the ceiling counts work in the
  shared model, so a speedup above it means costs outside that model moved (e.g. packed_dp's
  own per-rank overheads); the table says so instead of hiding it."""
  sp = max(r.get("speedup_vs_packed_dp") or 0.0, r.get("tokens_per_s_ratio") or 0.0)
  return " (speedup above the ceiling: costs outside the work model)" if sp > r["ceiling"] else ""


def per_stage_ceiling(r) -> str:
  """Under a pipeline, the bound of a balancer within each stage next to the pooled one."""
  v = r.get("ceiling_per_stage")
  return "" if v is None else f" (per stage {v:.3f})"


def _fmt(v, spec=".3f"):
  return "n/a" if v is None else format(v, spec)


def write(a, results, quiet: bool = False):
  cmd = experiments.command_line(__file__)
  stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump({"command": cmd, "date": stamp, "results": results}, f, indent=1)
  dev = next((r.get("device") for r in results if r.get("device")), "?")
  ndev = next((r.get("devices") for r in results if r.get("devices")), "?")
  lines = ["# End-to-end benchmark\n", f"- command: `{cmd}`", f"- date: {stamp}",
           f"- device: {dev} x {ndev}; {a.steps} timed steps (distinct sampled batches) after "
           f"{a.warmup} warm-up steps; step time = dispatch to completion of one jitted step\n",
           "| workload | tokens/GPU | backend | step ms (median) | p10-p90 ms | tokens/s | MFU | "
           "layers | LM-head share of MFU FLOPs | "
           "speedup vs packed_dp (median step) | tokens/s ratio | ceiling | fraction of bound gain "
           "(median step / tokens/s) | host plan ms | input wait ms | max loss diff vs packed_dp |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    if "error" in r:
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | failed: "
                   f"{r['error'][:80]} | | | | | | | | | | | | |")
      continue
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
    lines.append(
        f"| {r['workload']} | {r['tokens']} | {r['backend']} | {r['step_ms_median']:.1f} | "
        f"{r['step_ms_p10']:.1f}-{r['step_ms_p90']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | "
        f"{r.get('layers', 'n/a')} | {_fmt(r.get('lm_head_share'), '.0%')} | "
        f"{_fmt(r.get('speedup_vs_packed_dp'))} | {_fmt(r.get('tokens_per_s_ratio'))} | "
        f"{r['ceiling']:.3f}{above_ceiling(r)}{per_stage_ceiling(r)} | {_fmt(r.get('fraction_of_bound_gain'), '.2f')} / "
        f"{_fmt(r.get('fraction_of_bound_gain_tokens'), '.2f')} | {r['host_plan_ms_median']:.1f} | "
        f"{r['input_wait_ms_median']:.2f} (max {r['input_wait_ms_max']:.2f}) | "
        f"{_fmt(r.get('max_loss_diff_vs_packed_dp'), '.4f')} |")
  twins = [r for r in results if "step_over_signal_only" in r or "pingpong_speedup" in r]
  if twins:
    lines += ["\n## Ablations\n", "| workload | tokens/GPU | backend | step / signal-only twin | "
              "ping-pong speedup over single stream |", "|---|---|---|---|---|"]
    for r in twins:
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | "
                   f"{_fmt(r.get('step_over_signal_only'))} | {_fmt(r.get('pingpong_speedup'))} |")
  chosen = [(r, r[f"{b}_config"]) for r in results for b in CHOSEN_KEYS if f"{b}_config" in r]
  if chosen:
    lines += ["\n## Baselines' configuration (wlb, cp)\n",
              "| workload | tokens/GPU | backend | CP size | alpha | task slots per row | how chosen "
              "| linear work on padding (rows of alpha x T slots) |",
              "|---|---|---|---|---|---|---|---|"]
    for r, w in chosen:
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | {w['cp_size']} | "
                   f"{w['alpha']:g} | {w.get('tasks_per_row', 'n/a')} | {w['how']} | "
                   f"{100 * w['padding_linear_fraction']:.0f}% of T per rank |")
  planned = [r for r in results if "plan_imbalance_after" in r]
  if planned:
    lines += ["\n## distca plans of the timed batches (host replan; means over plans)\n",
              "| workload | tokens/GPU | backend | tolerance | imbalance before | after | "
              "plans that moved rows | steps without the exchange | dispatch MB/device useful "
              "(= ragged wire) | buffers | degraded plans | step ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in planned:
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | {r['plan_tolerance']} | "
                   f"{r['plan_imbalance_before']:.3f} | {r['plan_imbalance_after']:.3f} | "
                   f"{r.get('plan_moved', float('nan')):.0%} | {r.get('local_steps', 0.0):.0%} | "
                   f"{r['plan_dispatch_useful_mb']:.1f} | {r['plan_dispatch_buffer_mb']:.1f} | "
                   f"{r['plan_degraded']} | "
                   f"{r['step_ms_median']:.1f} |")
  mem = [r for r in results if r.get("memory_gb")]
  if mem:
    lines += ["\n## Memory per device (XLA's plan of the compiled step; allocator peak since "
              "the process started, kernel workspaces included; GB)\n",
              "| workload | tokens/GPU | backend | arguments | temporaries | total | "
              "allocator peak |", "|---|---|---|---|---|---|---|"]
    for r in mem:
      m = r["memory_gb"]
      lines.append(f"| {r['workload']} | {r['tokens']} | {r['backend']} | {m['arguments']:.1f} | "
                   f"{m['temporaries']:.1f} | {m['total']:.1f} | "
                   f"{_fmt(m.get('allocator_peak'))} |")
  profiled = [r for r in results if r.get("profile")]
  if profiled:
    from distca_jax import profiling
    lines.append("\n## Profiled step (one extra step per run, jax.profiler; per rank)\n")
    for r in profiled:
      lines.append(f"### {r['workload']} {r['tokens']} {r['backend']}\n")
      lines.append(profiling.format_report(r["profile"]) + "\n")
  with open(a.out + ".md", "w") as f:
    f.write("\n".join(lines) + "\n")
  if not quiet:
    print("\n".join(lines))


if __name__ == "__main__":
  main()
