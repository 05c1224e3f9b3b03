"""Replays of committed measurements: predicted vs measured, and the calibration fit from them.

Cases (files under results/):

* end-to-end steps (``experiments/e2e_bench.py`` JSONs): the very batches the run timed are
  re-sampled (same workload, seed 0, rows, steps) and simulated with the run's strategy, layers,
  remat policy, GPU count and pipeline (``mesh.pipe``: its micro-batches, distca pooled per
  tick or per stage, ``attention.distca.pool_stages``); wlb at the CP size and alpha the run
  recorded (``wlb_config``: chosen by ``choose_wlb`` or fixed); the measured value is the mean
  step (the mean of the timed steps);
* kernel: the FA3 fwd+bwd of real task tables (``micro/flash3_grid_bench.json``, launch
  buckets) vs the cost table on the same tasks (the own-documents tables fit the fixed time per
  task, ``KernelModel.task_s``; the CAD tables are held out), and the wlb backend's calls on
  WLB-ideal packings (``micro/wlb_kernel_check.json``, held out);
* exchange: all_to_all on 2 GPUs vs the fitted latency + bandwidth, each case the mean of its
  runs (``COLLECTIVE_RUNS``: the default-flag and latency-hiding-scheduler runs time one
  program); distca's exchange alone on 4 x H100 vs its fitted line: 'remote' on useful bytes
  (and on 4 x H200, held out), 'dense' on wire bytes, 'ragged' on its largest (sender, server)
  group (real plans replanned on the host, and ``experiments/ragged_probe.py``'s group matrices
  held out);
* memory: the compiled step's per-device bytes (XLA's plan, plus the kernels' workspace where
  the run recorded it) vs the memory model, single-stream runs (activations fitted on one-GPU
  runs at 2, 4 and 16 layers, ``MEMORY_RUNS``);
* speedup: cp's, wlb's and distca's measured speedup over packed_dp, and distca's over wlb, in
  the same multi-GPU run, or in runs of one call on one machine (the 4-GPU runs: one process
  per backend, ``PAIRED_RUNS``), vs the predicted one (ratios in place of seconds).

The committed runs belong to code generations / devices ("eras"); ``sim.eras`` lists each era's
runs, how each is calibrated and how its distca runs are priced; ``role`` says whether a case
calibrates or is held out. distca's dispatch rate (``Calibration.dispatch_bw``, every era) is
fitted on the profiled extra step of the s4 128K distca and wlb runs (``DISPATCH_PROFILES``),
not on any case's timed steps. A case above 10% carries the note written for that very case in ``MISS_NOTES`` (by
its kind and full name), or "not explained"; the summary says whether the gate (every case within
10%) is met.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from distca_jax import plan as plan_lib
from distca_jax.data import order
from distca_jax.plan import ticks
from distca_jax.sim import costs, step
from distca_jax.sim.eras import (AUTO_RAN_AS, CALIBRATED_AS, CALIBRATION_RUNS, CURRENT_ERAS,
                                 DISTCA_ONLY_VARIANTS, ERA_LOCAL_GAIN, ERA_LOCAL_STEPS,
                                 ERA_MIN_GAIN, ERAS, HELD_OUT_RUNS, PAIRED_RUNS, RUNS_NANO_ROWS)

RESULTS = os.path.join(costs.ROOT, "results")
# The exchange alone on 4 x H100 (results/four/README.md): JSON lines of the default-flag run and
# the one-shot-flag run; they fit ``Calibration.dense_*`` and ``ragged_*``.
FOUR_EXCHANGE_LOG = os.path.join("four", "raw", "exchange_bench.log")
FOUR_EXCHANGE_ONESHOT = os.path.join("four", "raw", "exb_oneshot")
# The 'remote' exchange alone on 4 x H100 (results/four/README.md, code of 356931f): the
# default grid's Q and K+V times fit ``Calibration.remote_*``; the other grids of that call and
# the one-slot draft's run on another host (JSON lines) are held out.
FOUR_REMOTE_GRID = os.path.join("four", "raw", "exchange_bench_grid")
FOUR_REMOTE_SLOTS1 = os.path.join("four", "raw", "exchange_bench_remote_slots1.log")
# The same bench on 4 x H200 (results/four/raw/s6, code of 63a9720): default grid and one other,
# Pretrain 128K batch 0; held out (another device than the fit).
FOUR_REMOTE_H200 = os.path.join("four", "raw", "s6", "exchange_h200")
# The config ``experiments/exchange_bench.py`` plans with (``exchange_bench_groups``).
GPU_BENCH_CONFIG = os.path.join(costs.ROOT, "configs", "gpu_bench.py")
# ``experiments/ragged_probe.py`` on 4 x H100 (code of bc4c535): its call that moves no rows
# sets ``ragged_latency_s``; its other patterns are held out against the ragged line.
RAGGED_PROBE = os.path.join("micro", "ragged_probe")
# all_to_all alone on 2 GPUs (experiments/collective_bench.py), one process per run: 'fit' the
# 2 x H200 runs of ceec451, held out the 2 x H100 runs of bc4c535 (one host, alternating).
# Runs with the latency-hiding scheduler flag are samples of the same program: on one host,
# alternating, the flag moved the mean by at most 2% per size while runs with equal flags
# spread by up to 16% (results/collective_bench_h100/README.md); so each case is the mean of
# its runs.
COLLECTIVE_RUNS = {
    "fit": ["collective_bench", "collective_bench_lhs"],
    "held-out": [f"collective_bench_h100/{f}_{i}" for i in (1, 2, 3) for f in ("default", "lhs")],
}
# Memory is fitted on the current code's one-GPU compiled steps at 2, 4 and 16 layers (remat
# 'save_attention'; the 16-layer run sets the per-layer slope that 32-layer models extrapolate);
# the multi-GPU runs' memory and the 16-layer remat 'full' run are held out.
MEMORY_RUNS = [("e2e_1gpu_64k_v7", None), ("e2e_1gpu_pingpong_v6_final", "packed_dp"),
               ("e2e_1gpu_pingpong_v6_final", "distca"), ("e2e_1gpu_pingpong_v6_4l", "packed_dp"),
               ("e2e_1gpu_pingpong_v6_fixed_4l", "distca"), ("one_gpu/e2e_16l_64k", None)]
# Why a case above 10% misses, written for that case: (kind, full name) -> explanation (an
# e2e case and a memory case of one run share a name). A miss
# without an entry is "not explained"; an entry whose case is within 10% (or absent) is listed
# as stale by ``validate``.
MISS_NOTES: dict[tuple[str, str], str] = {}
UNEXPLAINED = "not explained"
# experiments/wlb_kernel_check.py's result under results/ (replayed once committed).
WLB_KERNEL_CHECK = os.path.join("micro", "wlb_kernel_check")
# Profiled steps (one more step of the same run, jax.profiler) of distca and wlb on 4 x H100,
# 128K (results/four/raw/s4/profiles): workload -> (distca run, distca profile, wlb profile).
# distca's elementwise kernels beyond wlb's fit ``Calibration.dispatch_bw``; the runs' timed
# steps stay held-out cases.
DISPATCH_PROFILES = {w: ("four/raw/s4/e2e_4gpu_128k_distca", f"four/raw/s4/profiles/{w}_128k_distca",
                         f"four/raw/s4/profiles/{w}_128k_wlb") for w in ("pretrain", "prolong")}

@dataclasses.dataclass(frozen=True)
class E2eRun:
  """One measured run of e2e_bench."""
  stem: str
  workload: str
  backend: str
  tokens: int
  layers: int
  rows_per_rank: int
  devices: int
  steps: tuple[int, ...]
  mean_step_s: float
  median_step_s: float
  overrides: tuple[str, ...]
  memory_gb: float | None = None
  workspace_gb: float | None = None
  # wlb's configuration as the run recorded it (``wlb_config``: chosen or fixed): CP size, alpha.
  wlb_cp: int | None = None
  wlb_alpha: float | None = None

  @property
  def strategy(self) -> str:
    return self.backend.split("+")[0]

  @property
  def remat(self) -> str:
    """The run's ``model.remat``: an override, else configs/gpu_bench.py's 'save_attention'."""
    return self.override("model.remat", "save_attention")

  @property
  def nano_batches(self) -> int:
    return 2 if self.backend.endswith("+pingpong") else 1

  @property
  def nano_rows(self) -> str:
    """Which rows form each nano-batch (``attention.distca.nano_rows``): an override, else
    ``RUNS_NANO_ROWS``."""
    return self.override("attention.distca.nano_rows", RUNS_NANO_ROWS)

  @property
  def pipe(self) -> int:
    """Pipeline stages (``mesh.pipe``)."""
    return int(self.override("mesh.pipe", "1"))

  @property
  def micro_batches(self) -> int:
    """Pipeline micro-batches per data rank (``plan.ticks.resolve_microbatches``); 1 without a
    pipeline."""
    if self.pipe == 1:
      return 1
    return ticks.resolve_microbatches(int(self.override("pipeline.microbatches", "0")), self.pipe)

  @property
  def data(self) -> int:
    """Data ranks (GPUs / pipe stages; no tensor parallelism in the replayed runs)."""
    return self.devices // self.pipe

  def override(self, key: str, default: str) -> str:
    """The run's value of ``key``: its last override (later overrides win, as the config
    loader applies them in order), else ``default``."""
    for o in reversed(self.overrides):
      k, _, v = o.partition("=")
      if k == key:
        return v
    return default


def results_path(stem: str, root: str | None = None) -> str:
  """``ROOT/STEM.json`` (ROOT: results/), or where ``ROOT/archive/moves.tsv`` (old path, new
  path) moved it when superseded runs were archived."""
  root = root or RESULTS
  path = os.path.join(root, stem + ".json")
  if os.path.exists(path):
    return path
  moves = os.path.join(root, "archive", "moves.tsv")
  if os.path.exists(moves):
    with open(moves) as f:
      for line in f:
        old, _, new = line.rstrip("\n").partition("\t")
        if os.path.basename(old) == stem + ".json":
          return os.path.join(os.path.dirname(root), new)
  raise FileNotFoundError(f"no measured run {stem}.json under {root} (nor in archive/moves.tsv)")


def load_runs(stem: str, backend: str | None = None) -> list[E2eRun]:
  """The runs of ``results/STEM.json`` (one backend, or all that did not fail). The timed steps
  are each run's own: as many as it timed, after the warm-up its ``num_steps`` override adds."""
  with open(results_path(stem)) as f:
    blob = json.load(f)
  out = []
  for r in blob["results"]:
    if "error" in r or (backend is not None and r["backend"] != backend):
      continue
    ov = tuple(r["overrides"])
    # The last override of a key wins (an --extra after e2e_bench's own, as the loader applies).
    get = lambda k: next(o.split("=", 1)[1] for o in reversed(ov) if o.startswith(k + "="))
    steps = len(r["step_ms_all"])
    warmup = int(get("num_steps")) - steps
    # The baselines' configuration as chosen by the run (runs of code whose cp_size default was 1
    # and chose nothing record neither).
    w = r.get("wlb_config") or r.get("cp_config") or {}
    out.append(E2eRun(stem, r["workload"], r["backend"], int(r["tokens"]),
                      int(get("model.n_layers")), int(get("rows_per_rank")), int(r["devices"]),
                      tuple(range(warmup, warmup + steps)),
                      sum(r["step_ms_all"]) / len(r["step_ms_all"]) / 1e3,
                      r["step_ms_median"] / 1e3, ov, r.get("memory_gb", {}).get("total"),
                      r.get("memory_gb", {}).get("kernel_workspace"),
                      w.get("cp_size"), w.get("alpha")))
  return out


def run_batches(run: E2eRun, steps=None, nano: bool = False) -> list[list[list[list[int]]]]:
  """The timed batches (or ``steps``): [step][micro-batch][data rank] -> lengths. Data rank
  ``k`` owns rows ``[k R, (k + 1) R)``; micro-batch ``i`` of a pipeline holds rows
  ``[i R / M, (i + 1) R / M)`` of every rank's block (``pipeline.to_microbatches``); without a
  pipeline there is one micro-batch and a rank's rows are concatenated (documents never span
  rows, so a rank's documents are its rows' documents).

  ``nano`` (a distca ping-pong run without a pipeline, ``nano_split``): the step's nano-batches
  in place of the one micro-batch, each planned on its own as the backend plans them (rows
  ``[i R / n, (i + 1) R / n)`` of every rank's block, after the run's ``nano_rows`` order)."""
  from distca_jax.data.synthetic import SyntheticSource  # pylint: disable=import-outside-toplevel
  src = SyntheticSource(run.workload, rows=run.data * run.rows_per_rank,
                        tokens_per_row=run.tokens, vocab_size=2, seed=0)
  split = nano and nano_split(run)
  m, r = (run.nano_batches if split else run.micro_batches), run.rows_per_rank
  if split and run.nano_rows == "heavy_first":
    src = order.HeavyFirst(src, r)  # the trainer's source for these runs (data.run_source)
  per = r // m
  out = []
  for s in (run.steps if steps is None else steps):
    rows = src.doclens(s)
    out.append([[[x for row in rows[k * r + i * per:k * r + (i + 1) * per] for x in row]
                 for k in range(run.data)] for i in range(m)])
  return out


def nano_split(run: E2eRun) -> bool:
  """Whether the simulator plans ``run``'s nano-batches apart: distca with ping-pong, no
  pipeline, each rank's rows dividing into the nano-batches."""
  return (run.strategy == "distca" and run.nano_batches > 1 and run.pipe == 1
          and run.rows_per_rank % run.nano_batches == 0)


# Batches whose plans size distca's caps in training (``attention.distca.caps_from_batches``).
CAPS_FROM_BATCHES = 32


def _options(run: E2eRun, era: str) -> step.Options:
  auto = AUTO_RAN_AS.get(run.stem, {})
  return step.Options(
      collective=run.override("attention.distca.collective", auto.get("collective", "dense")),
      memory_mode=run.override("attention.distca.memory_mode", auto.get("memory_mode", "keep")),
      exchange_buckets=int(run.override("attention.distca.exchange_buckets", "8")),
      buckets=int(run.override("attention.distca.buckets", "1")),
      tolerance=float(run.override("attention.distca.tolerance", str(plan_lib.DEFAULT_TOLERANCE))),
      min_gain=float(run.override("attention.distca.min_gain", str(ERA_MIN_GAIN[era]))),
      local_steps=run.override("attention.distca.local_steps",
                               str(ERA_LOCAL_STEPS[era])).lower() == "true",
      local_gain=float(run.override("attention.distca.local_gain", str(ERA_LOCAL_GAIN[era]))),
      nano_batches=2 if run.backend.endswith("+pingpong") else 1,
      wlb_alphas=(run.wlb_alpha or float(run.override("attention.baselines.wlb_alpha", "1.0")),),
      cp_sizes=(run.wlb_cp or int(run.override("attention.baselines.cp_size", "1")),),
      cp_overlap=False, wlb_padded=True, remat=run.remat,
      pool_stages=run.override("attention.distca.pool_stages", "true").lower() == "true")


def predict_run(run: E2eRun, cal: costs.Calibration, km: costs.KernelModel, era: str
                ) -> dict[str, Any]:
  """The simulator's mean step over the run's batches (its strategy, layers, GPUs)."""
  spec = costs.model_spec("llama3_8b", n_layers=run.layers)
  # A distca ping-pong step's nano-batches price as micro-batches that every device runs in
  # step (distca's sync group is every server): each plan's straggler, one after the other.
  batches = run_batches(run, nano=True)
  m = len(batches[0])
  layout = step.Layout(gpus=run.devices, pipe=run.pipe, micro_batches=m)
  tokens = run.tokens * run.rows_per_rank // m
  opts = _options(run, era)
  if "+signal" in run.backend:  # signal-only twin: the exchange carries no rows
    cal = dataclasses.replace(cal, exchange_hidden=1.0)
  caps = (run_batches(run, range(CAPS_FROM_BATCHES), nano=True) if run.strategy == "distca"
          else None)
  res = step.simulate(batches, spec, layout, tokens, cal=cal, km=km, opts=opts,
                      strategies=(run.strategy,), caps_batches=caps)[run.strategy]
  return res


def predict_branches(run: E2eRun, local_run: E2eRun, cal: costs.Calibration,
                     km: costs.KernelModel, era: str) -> dict[str, list]:
  """Per timed step of a distca run (no pipeline): the simulator's price of each branch the
  train step could run (``plan.choice``'s inputs) and what the run's own gates did.

  ``cad_s``: the step through the exchange (the run's plans at its ``min_gain``, no local
  branch: ``Options.local_steps`` False; its caps, collective and memory mode as
  ``predict_run``); ``local_s``: ``local_run``'s strategy (packed_dp, or packed_dp+pingpong for
  a ping-pong run) on the same batches, the local branch's price; ``ran_local``: whether the
  run's own gates (its era's ``local_steps``, ``local_gain``, ``min_gain``, or its overrides)
  sent the step to the local branch (``step.step_is_local``), so its measured time is not a
  CAD step's; ``gate_local``: whether today's gate (``local_steps`` with the config's
  ``local_gain`` and ``min_gain``, ``step.DEFAULT_*``) would send it there."""
  if run.strategy != "distca" or run.pipe != 1:
    raise ValueError(f"predict_branches prices distca runs without a pipeline; {run.stem} ran "
                     f"{run.backend} at pipe={run.pipe}")
  spec = costs.model_spec("llama3_8b", n_layers=run.layers)
  batches = run_batches(run, nano=True)
  m = len(batches[0])
  layout = step.Layout(gpus=run.devices, micro_batches=m)
  tokens = run.tokens * run.rows_per_rank // m
  opts = _options(run, era)
  cad = step.simulate(batches, spec, layout, tokens, cal=cal, km=km,
                      opts=dataclasses.replace(opts, local_steps=False), strategies=("distca",),
                      caps_batches=run_batches(run, range(CAPS_FROM_BATCHES), nano=True)
                      )["distca"]
  gate = dataclasses.replace(opts, local_steps=True, local_gain=step.DEFAULT_LOCAL_GAIN,
                             min_gain=step.DEFAULT_MIN_GAIN)
  local_of = lambda o: [bool(step.step_is_local(step.run_distca_step(b, tokens, spec, km, o,
                                                                     layout), layout, o))
                        for b in batches]
  lb = run_batches(local_run)
  ll = step.Layout(gpus=local_run.devices, micro_batches=len(lb[0]))
  local = step.simulate(lb, spec, ll, local_run.tokens * local_run.rows_per_rank // len(lb[0]),
                        cal=cal, km=km, opts=_options(local_run, era),
                        strategies=("packed_dp",))["packed_dp"]
  return {"cad_s": cad["step_s_per_batch"], "local_s": local["step_s_per_batch"],
          "ran_local": local_of(opts), "gate_local": local_of(gate),
          "collective": cad["collective"],
          "memory_mode": cad["memory_mode"]}


def features(run: E2eRun, km: costs.KernelModel) -> np.ndarray:
  """[3] (1, token-linear FLOPs, table attention seconds of the busiest rank) of a run's mean
  step: on one GPU, or under packed_dp (no communication, equal tokens per rank), the step
  model is linear in (fixed s, 1 / matmul rate, attention scale)."""
  if run.devices != 1 and run.backend != "packed_dp":
    raise ValueError(f"calibration runs must be one-GPU or packed_dp runs; {run.stem} ran "
                     f"{run.backend} on {run.devices}")
  spec = costs.model_spec("llama3_8b", n_layers=run.layers)
  d = spec.dims
  # Every token slot runs the linear layers and the LM head, padding included.
  slots = run.tokens * run.rows_per_rank
  lin = 6.0 * slots * (d.n_layers * d.layer_matmul_params * costs.Calibration.remat_factor
                       + spec.head_params)
  att = [d.n_layers * costs.attention_remat_factor(run.remat)
         * max(km.docs_seconds(r, d) for r in batch[0]) for batch in run_batches(run)]
  return np.array([1.0, lin, np.mean(att)])


def fit_calibration(runs: list[E2eRun], km: costs.KernelModel,
                    base: costs.Calibration | None = None) -> costs.Calibration:
  """Least squares of mean step = fixed + linear FLOPs / rate + scale x table attention."""
  x = np.stack([features(r, km) for r in runs]) / np.array([1.0, 1e12, 1.0])  # TFLOPs
  y = np.array([r.mean_step_s for r in runs])
  (fixed, inv_rate, scale), *_ = np.linalg.lstsq(x, y, rcond=None)
  return dataclasses.replace(base or costs.Calibration(), step_fixed_s=float(fixed),
                             matmul_tflops=float(1.0 / inv_rate),
                             attention_scale=float(scale))


def fit_memory(runs: list[E2eRun], base: costs.Calibration) -> costs.Calibration:
  """Activation bytes per token outside the layers and per layer (E = 4096, remat
  'save_attention') by least squares on the compiled steps' per-device totals less the state
  (``state_bytes_per_param`` x params)."""
  rows, y = [], []
  for r in runs:
    if r.memory_gb is None or r.devices != 1 or r.remat != "save_attention":
      continue
    spec = costs.model_spec("llama3_8b", n_layers=r.layers)
    slots = r.tokens * r.rows_per_rank
    rows.append([slots, slots * r.layers])
    y.append(r.memory_gb * 1e9 - spec.total_params * base.state_bytes_per_param)
  if len(rows) < 2:
    raise ValueError(f"fit_memory needs >= 2 one-GPU runs with memory; got {len(rows)}")
  (fixed, layer), *_ = np.linalg.lstsq(np.array(rows, np.float64), np.array(y), rcond=None)
  return dataclasses.replace(base, act_bytes_per_token_fixed=float(fixed),
                             act_bytes_per_token_layer=float(layer))


def collective_rows(role: str) -> list[dict[str, Any]]:
  """all_to_all on 2 GPUs (``COLLECTIVE_RUNS[role]``): per size, the median ms of every run (one
  process each) and their mean, the case's measured value."""
  runs = [_json(stem) for stem in COLLECTIVE_RUNS[role]]
  devices = {b["device"] for b in runs}
  if len(devices) != 1:
    raise ValueError(f"COLLECTIVE_RUNS[{role!r}] mixes devices {sorted(devices)}; one per role")
  flags = sorted({b["xla_flags"] or "default flags" for b in runs},
                 key=lambda f: f != "default flags")
  out = []
  for i, r in enumerate(runs[0]["rows"]):
    ms = [b["rows"][i]["a2a_ms"] for b in runs]
    if any(b["rows"][i]["mb_off_device"] != r["mb_off_device"] for b in runs):
      raise ValueError(f"COLLECTIVE_RUNS[{role!r}]: runs with other sizes; one size list per role")
    out.append(dict(name=f"all_to_all {r['mb_off_device']:.0f} MB on {runs[0]['device']}, "
                    f"mean of {len(ms)} runs ({'; '.join(flags)})", mb=r["mb_off_device"],
                    samples_ms=ms, mean_s=float(np.mean(ms)) / 1e3))
  return out


def collective_calibration(base: costs.Calibration | None = None) -> costs.Calibration:
  """Intra-node latency and bandwidth fitted on the 'fit' runs' means (``collective_rows``)."""
  rows = collective_rows("fit")
  lat, bw = costs.fit_alpha_beta([r["mb"] for r in rows], [r["mean_s"] * 1e3 for r in rows])
  return dataclasses.replace(base or costs.Calibration(), a2a_latency_s=lat, intra_node_bw=bw)


def exchange_bench_groups(row: dict[str, Any]) -> dict[str, np.ndarray]:
  """The [S, S] rows per (sender, server) of an ``experiments/exchange_bench.py`` row's plan,
  replanned on the host as the bench planned it (``configs/gpu_bench.py``, the row's workload,
  tokens, servers and batch, the caps it recorded): ``{'q': ..., 'kv': ...}``. Raises when the
  replanned busiest device's bytes differ from the ones the row recorded (another plan)."""
  from distca_jax import backends, configs_io  # pylint: disable=import-outside-toplevel
  from distca_jax.data import run_source  # pylint: disable=import-outside-toplevel
  c = configs_io.load_config(GPU_BENCH_CONFIG, [
      f"data.workload={row['workload']}", f"tokens_per_rank={row['tokens']}",
      f"mesh.data={row['servers']}",
      *[f"attention.distca.{k}={v}" for k, v in row["caps"].items()]])
  m = c.model
  src = run_source(c, row["servers"])
  (hp,) = backends.build(c).host_plans(src.doclens(row["step"]), row["tokens"])
  out = {"q": hp.plan.pair_q_rows, "kv": hp.plan.pair_kv_rows}
  for part, heads in (("q", m.n_heads), ("kv", 2 * m.n_kv_heads)):
    g = out[part]
    busiest = max(g.sum(0).max(), g.sum(1).max()) * heads * m.head_dim * 2 / 1e6
    if abs(busiest - row[f"{part}_busiest_mb"]) > 1e-6:
      raise ValueError(f"replanned {row['workload']} batch {row['step']} {part}: busiest "
                       f"{busiest} MB != the recorded {row[f'{part}_busiest_mb']} MB; the planner "
                       "no longer makes the plan the bench timed")
  return out


def four_exchange_rows() -> list[dict[str, Any]]:
  """The exchange alone on 4 x H100 (``FOUR_EXCHANGE_LOG``, ``FOUR_EXCHANGE_ONESHOT``), one row
  per (run, batch, part): wire bytes of the dense exchange as it ran then (every block the full
  ``min(send cap, recv cap)``: ``S`` blocks per device), the busiest device's useful bytes
  (the ragged exchange's wire), the largest (sender, server) group's bytes (replanned:
  ``exchange_bench_groups``) and both measured times."""
  blobs = []
  with open(os.path.join(RESULTS, FOUR_EXCHANGE_LOG)) as f:
    blobs += [("default flags", json.loads(x)) for x in f if x.startswith("{")]
  for flags, rows in _json(FOUR_EXCHANGE_ONESHOT)["results"].items():
    blobs += [("one-shot flag", r) for r in rows]
  dims = costs.model_spec("llama3_8b").dims
  bq = dims.q_heads * dims.head_dim * dims.dtype_bytes
  out = []
  for flags, r in blobs:
    c, s = r["caps"], r["servers"]
    groups = exchange_bench_groups(r)
    for part, full, row in (("q", min(c["q_send"], c["q_recv"]), bq),
                            ("kv", min(c["kv_send"], c["kv_recv"]), dims.kv_row_bytes)):
      out.append(dict(name=f"{r['workload']} {r['tokens'] // 1024}K batch {r['step']} "
                      f"{part.upper()} on {s} x H100 ({flags})", wire=float(s * full * row),
                      useful=r[f"{part}_busiest_mb"] * 1e6,
                      largest_group=float(groups[part].max()) * row,
                      dense_s=r[f"{part}_dense_ms"] / 1e3, ragged_s=r[f"{part}_ragged_ms"] / 1e3))
  return out


def ragged_probe_rows() -> list[dict[str, Any]]:
  """``experiments/ragged_probe.py``'s synthetic group matrices on 4 x H100 (``RAGGED_PROBE``):
  per pattern the largest group's bytes and the measured seconds; ``role`` 'fit' for the call
  that moves no rows (it sets ``ragged_latency_s``), 'held-out' for the others."""
  blob = _json(RAGGED_PROBE)
  out = []
  for r in blob["rows"]:
    largest = float(np.max(r["groups"])) * r["row_bytes"]
    out.append(dict(name=f"ragged exchange probe: {r['pattern']} on {blob['device']}",
                    largest_group=largest, ragged_s=r["ms"] / 1e3,
                    role="fit" if largest == 0 else "held-out"))
  return out


def remote_exchange_rows() -> list[dict[str, Any]]:
  """The 'remote' exchange alone on 4 GPUs: one row per (run, grid, part) with the busiest
  device's useful bytes (what 'remote' puts on the wire), the measured seconds, the device and
  era; ``role`` 'fit' for the default grid of ``FOUR_REMOTE_GRID`` (4 x H100), 'held-out' for
  its other grids, for ``FOUR_REMOTE_SLOTS1`` (another host, the one-slot draft of the kernel)
  and for every grid of ``FOUR_REMOTE_H200`` (4 x H200)."""
  def grids(stem, role, device, era):
    rows = [r for rows in _json(stem)["results"].values() for r in rows]
    out = [("default grid", role, r, "", device, era) for r in rows]
    return out + [(f"grid {g}", "held-out", r, f"_{g}", device, era) for r in rows
                  for g in sorted({k[len("q_remote_"):-len("_ms")] for k in r
                                   if k.startswith("q_remote_") and k.endswith("_ms")
                                   and k != "q_remote_ms"})]
  blobs = grids(FOUR_REMOTE_GRID, "fit", "H100", "h100")
  with open(os.path.join(RESULTS, FOUR_REMOTE_SLOTS1)) as f:
    blobs += [("one-slot draft, another host", "held-out", json.loads(x), "", "H100", "h100")
              for x in f if x.startswith("{")]
  blobs += grids(FOUR_REMOTE_H200, "held-out", "H200", "h200")
  out = []
  for label, role, r, grid, device, era in blobs:
    for part in ("q", "kv"):
      out.append(dict(name=f"remote exchange {r['workload']} {r['tokens'] // 1024}K batch "
                      f"{r['step']} {part.upper()} on {r['servers']} x {device} ({label})",
                      useful=r[f"{part}_busiest_mb"] * 1e6,
                      remote_s=r[f"{part}_remote{grid}_ms"] / 1e3, role=role, era=era,
                      devices=r["servers"]))
  return out


def ragged_fit(rows: list[dict[str, Any]], probe: list[dict[str, Any]]) -> tuple[float, float]:
  """(latency s, bytes/s) of XLA's ragged all-to-all: the latency is the measured time of a call
  that moves no rows (``probe``'s 'fit' rows, their mean); the per-group rate is least squares
  of ``time - latency = largest group's bytes / bw`` on ``rows`` (``four_exchange_rows``)."""
  empty = [r["ragged_s"] for r in probe if r["role"] == "fit"]
  if not empty:
    raise ValueError(f"{RAGGED_PROBE}.json has no call that moves no rows; it sets the ragged "
                     "latency (rerun experiments/ragged_probe.py)")
  lat = float(np.mean(empty))
  x = np.array([r["largest_group"] for r in rows])
  y = np.array([r["ragged_s"] for r in rows]) - lat
  return lat, float((x @ x) / (x @ y))


def exchange_calibration(base: costs.Calibration) -> costs.Calibration:
  """``dense_*`` (latency + wire bytes / bw) fitted on ``four_exchange_rows``, ``ragged_*``
  (latency + largest group's bytes / bw) by ``ragged_fit``, ``remote_*`` (latency + useful bytes
  / bw) on the fit rows of ``remote_exchange_rows``."""
  rows = four_exchange_rows()
  dl, dbw = costs.fit_alpha_beta([r["wire"] / 1e6 for r in rows],
                                 [r["dense_s"] * 1e3 for r in rows])
  rl, rbw = ragged_fit(rows, ragged_probe_rows())
  fit = [r for r in remote_exchange_rows() if r["role"] == "fit"]
  ml, mbw = costs.fit_alpha_beta([r["useful"] / 1e6 for r in fit],
                                 [r["remote_s"] * 1e3 for r in fit])
  return dataclasses.replace(base, dense_latency_s=dl, dense_bw=dbw, ragged_latency_s=rl,
                             ragged_bw=rbw, remote_latency_s=ml, remote_bw=mbw)


def dispatch_fit(base: costs.Calibration, km: costs.KernelModel) -> float:
  """``Calibration.dispatch_bw``: per workload of ``DISPATCH_PROFILES``, the distca run's
  exchange buffer bytes per layer (``step.dispatch_buffer_bytes`` of the caps it sized, in the
  memory mode it ran) over its profiled step's elementwise kernel time beyond the wlb run's on
  the same workload (means over devices, per layer); the ratio of the sums."""
  dims = costs.model_spec("llama3_8b").dims
  num = den = 0.0
  for workload, (stem, distca_prof, wlb_prof) in DISPATCH_PROFILES.items():
    (run,) = [r for r in load_runs(stem) if r.workload == workload]
    res = predict_run(run, base, km, "h100")
    caps = plan_lib.Capacity(**res["caps"])
    elementwise = lambda prof: float(np.mean([d["elementwise"] for d in _json(prof)["breakdown"]]))
    extra_s = (elementwise(distca_prof) - elementwise(wlb_prof)) / 1e3 / run.layers
    if extra_s <= 0:
      raise ValueError(f"{distca_prof}: distca's elementwise time is not above wlb's "
                       f"({wlb_prof}); the dispatch rate cannot be fitted from these profiles")
    num += step.dispatch_buffer_bytes(caps, dims, res["memory_mode"])
    den += extra_s
  return num / den


def calibrations(km: costs.KernelModel) -> dict[str, costs.Calibration]:
  """Per era: collectives from the collective bench and the 4-GPU exchange bench, distca's
  dispatch rate from the 4 x H100 profiles (``dispatch_fit``), compute from its own
  calibration runs."""
  base = fit_memory([r for stem, b in MEMORY_RUNS for r in load_runs(stem, b)],
                    exchange_calibration(collective_calibration()))
  base = dataclasses.replace(base, dispatch_bw=dispatch_fit(base, km))
  out = {era: fit_calibration([r for stem, b in runs for r in load_runs(stem, b)], km, base)
         for era, runs in CALIBRATION_RUNS.items()}
  return out | {era: out[src] for era, src in CALIBRATED_AS.items()}


def _json(stem: str) -> dict:
  with open(results_path(stem)) as f:
    return json.load(f)


def _case(kind, name, predicted, measured, role, **extra) -> dict[str, Any]:
  err = predicted / measured - 1.0
  return dict(kind=kind, name=name, predicted_s=float(predicted), measured_s=float(measured),
              error=float(err), within_10pct=bool(abs(err) <= 0.10), role=role, **extra)


def _capacity(fields: dict, num_servers: int) -> plan_lib.Capacity:
  """A stored run's capacity. Runs before the capped-totals exchange stored per-pair slots
  (``q_slot``, ``kv_slot``): a device then sent and received at most ``S - 1`` slots, the same
  caps on totals (exact at the 2 servers of those runs, where a device has one peer)."""
  fields = dict(fields)
  for part in ("q", "kv"):
    slot = fields.pop(f"{part}_slot", None)
    if slot is not None:
      fields[f"{part}_send"] = fields[f"{part}_recv"] = slot * max(1, num_servers - 1)
  return plan_lib.Capacity(**fields)


def kernel_tables() -> list[dict[str, Any]]:
  """The busiest rank's real task table of every ``flash3_grid_bench`` launch-bucket row (what
  the step runs): q / kv lengths of its tasks and the measured FA3 fwd+bwd seconds."""
  from distca_jax.baselines import packing  # pylint: disable=import-outside-toplevel
  from distca_jax.data.workloads import WorkloadSampler  # pylint: disable=import-outside-toplevel
  blob = _json("flash3_grid_bench")
  t, s = 65536, 2
  spec = plan_lib.PlanSpec(num_servers=s, tokens_per_row=t, rows_per_device=1,
                           capacity=_capacity(blob["capacity"], s))
  out = []
  for r in blob["rows"]:
    if r["case"] != "buckets":
      continue
    doc_lens = WorkloadSampler(r["workload"], t, seed=0).step_doclens(r["batch"], s)
    if r["table"] == "cad":
      hp = plan_lib.host_plan(doc_lens, spec,
                              options=plan_lib.PlanOptions(tolerance=0.1, q_heads=32, kv_heads=8,
                                                           head_dim=128, dtype_bytes=2,
                                                           min_shard=None))
      tabs = [(np.asarray(hp.meta.cu_seqlens_q[d]), np.asarray(hp.meta.cu_seqlens_k[d]))
              for d in range(s)]
    else:
      own = packing.task_tables(packing.natural_placement(doc_lens, t), max_tasks=128)
      tabs = [(np.asarray(c), np.asarray(c)) for c in own["cu_seqlens_q"]]
    d = int(np.argmax([plan_lib.attention_pairs(cq, ck) for cq, ck in tabs]))
    lq, lk = np.diff(tabs[d][0]), np.diff(tabs[d][1])
    keep = lq > 0
    out.append(dict(name=f"fa3 {r['workload']} batch {r['batch']} {r['table']} table",
                    table=r["table"], q=lq[keep], kv=lk[keep], measured_s=r["fwd_bwd_ms"] / 1e3))
  return out


def fit_task_seconds(tables: list[dict[str, Any]], km: costs.KernelModel) -> float:
  """Seconds per task beyond the cost table (``KernelModel.task_s``): the measured excess over
  the table on the own-documents tables, per task (the CAD tables are held out)."""
  dims = costs.model_spec("llama3_8b").dims
  bare = costs.KernelModel(km.table)
  fit = [x for x in tables if x["table"] == "own"]
  excess = sum(x["measured_s"] - bare.task_seconds(x["q"], x["kv"], dims).sum() for x in fit)
  tasks = sum(len(x["kv"]) for x in fit)
  return max(0.0, excess / tasks) if tasks else 0.0


def kernel_cases(km: costs.KernelModel, tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """FA3 fwd+bwd on real task tables vs the kernel model (own tables fit ``task_s``)."""
  dims = costs.model_spec("llama3_8b").dims
  return [_case("kernel", x["name"], float(km.task_seconds(x["q"], x["kv"], dims).sum()),
                x["measured_s"], "fit" if x["table"] == "own" else "held-out") for x in tables]


def kernel_model() -> tuple[costs.KernelModel, list[dict[str, Any]]]:
  """The cost table with its per-task time fitted on the real tables."""
  km = costs.KernelModel()
  tables = kernel_tables()
  return costs.KernelModel(km.table, fit_task_seconds(tables, km)), tables


def wlb_kernel_cases(km: costs.KernelModel, path: str | None = None) -> list[dict[str, Any]]:
  """The wlb backend's FA3 call on WLB-ideal packings (``experiments/wlb_kernel_check.py``, one
  GPU, every rank's real task table timed in turn), when its result is committed
  (``WLB_KERNEL_CHECK``; none before): per sampled batch, the busiest rank's forward + backward
  as the backend calls it vs the kernel model on the same tables (held out)."""
  path = path or os.path.join(RESULTS, WLB_KERNEL_CHECK + ".json")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    blob = json.load(f)
  base = costs.model_spec("llama3_8b").dims
  out = []
  for w in blob["workloads"]:
    dims = dataclasses.replace(base, q_heads=w["q_heads"], head_dim=w["head_dim"])
    for s in sorted({r["step"] for r in w["rows"]}):
      rows = [r for r in w["rows"] if r["step"] == s]
      pred = max(float(km.task_seconds(r["q_lens"], r["kv_lens"], dims).sum()) for r in rows)
      meas = max(r["measured_call_ms"] for r in rows) / 1e3
      out.append(_case("kernel", f"fa3 wlb-ideal {w['workload']} step {s}: busiest of "
                       f"{len(rows)} ranks (cp {w['cp_size']}, alpha {w['alpha']:g})", pred, meas,
                       "held-out"))
  return out


def exchange_cases(cal: costs.Calibration) -> list[dict[str, Any]]:
  """distca's exchange alone on 4 GPUs: 'remote' (``remote_exchange_rows``' roles), dense and
  ragged on real plans (fit: they set ``dense_*`` and ``ragged_*``), ragged on the probe's group
  matrices (``ragged_probe_rows``' roles); all_to_all of N MB per device on 2 GPUs, each case
  the mean of a role's runs (``COLLECTIVE_RUNS``: 2 x H200 fit, 2 x H100 held out)."""
  out = [_case("exchange", r["name"], cal.remote_latency_s + r["useful"] / cal.remote_bw,
                r["remote_s"], r["role"], era=r["era"], devices=r["devices"])
         for r in remote_exchange_rows()]
  for r in four_exchange_rows():
    out.append(_case("exchange", f"dense exchange {r['name']}", cal.dense_latency_s
                     + r["wire"] / cal.dense_bw, r["dense_s"], "fit", era="h100", devices=4))
    out.append(_case("exchange", f"ragged exchange {r['name']}", cal.ragged_latency_s
                     + r["largest_group"] / cal.ragged_bw, r["ragged_s"], "fit", era="h100",
                     devices=4))
  for r in ragged_probe_rows():
    out.append(_case("exchange", r["name"], cal.ragged_latency_s + r["largest_group"]
                     / cal.ragged_bw, r["ragged_s"], r["role"], era="h100", devices=4))
  for role in COLLECTIVE_RUNS:
    for r in collective_rows(role):
      out.append(_case("exchange", r["name"], float(cal.collective_s(r["mb"] * 1e6, 2)),
                       r["mean_s"], role, devices=2, samples_ms=r["samples_ms"]))
  return out


def e2e_cases(cals: dict[str, costs.Calibration], km: costs.KernelModel
              ) -> list[dict[str, Any]]:
  out = []
  for era in ERAS:
    for role, table in (("fit", CALIBRATION_RUNS), ("held-out", HELD_OUT_RUNS)):
      for stem, backend in table.get(era, ()):
        for run in load_runs(stem, backend):
          res = predict_run(run, cals[era], km, era)
          name = (f"{run.stem}: {run.workload} {run.tokens // 1024}K x{run.rows_per_rank} "
                  f"{run.backend}, {run.layers} layers, {run.devices} GPU")
          key = dict(era=era, stem=run.stem, workload=run.workload, tokens=run.tokens, rows=run.rows_per_rank,
                     layers=run.layers, devices=run.devices, backend=run.backend)
          out.append(_case("e2e", name, res["step_s"], run.mean_step_s, role, **key,
                           measured_median_s=run.median_step_s,
                           predicted_per_rank_s=res["per_rank_step_s"]))
          if run.memory_gb is not None and run.nano_batches == 1:
            fitted = any(run.stem == s and b in (None, run.backend) for s, b in MEMORY_RUNS)
            # With the kernels' workspace recorded, the device total; else XLA's plan alone.
            ws = run.workspace_gb
            pred = res["memory_gb"]["total" if ws is not None else "xla_plan"]
            out.append(_case("memory", name + (" + kernel workspace" if ws is not None else ""),
                             pred, run.memory_gb + (ws or 0.0),
                             "fit" if fitted else "held-out", era=era, unit="GB",
                             devices=run.devices))
  return out


def speedup_cases(e2e: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Speedups in multi-GPU runs of one era with the same workload, tokens, rows, layers and
  GPUs, measured in the same file or in the file ``PAIRED_RUNS`` names: cp's, wlb's and
  distca's over packed_dp, and distca's over wlb; predicted vs measured ratio (``predicted_s``
  / ``measured_s`` hold the ratios). A variant (``+pingpong``) is paired with the baseline's
  same variant; a distca-only variant (``DISTCA_ONLY_VARIANTS``) with the plain baseline."""
  out = []
  e2e = [c for c in e2e if c["kind"] == "e2e" and c["devices"] > 1]
  same = lambda a, b: all(a[k] == b[k] for k in ("era", "workload", "tokens", "rows", "layers",
                                                  "devices"))
  for c in e2e:
    strategy, variant = _split_backend(c["backend"])
    if strategy == "packed_dp":
      continue
    for base in ("packed_dp", "wlb") if strategy == "distca" else ("packed_dp",):
      want = base + ("" if variant in DISTCA_ONLY_VARIANTS else variant)
      b = next((x for x in e2e if same(x, c) and x["backend"] == want
                and x["stem"] in (c["stem"], PAIRED_RUNS.get(c["stem"]))), None)
      if b is None:
        continue
      out.append(_case("speedup", f"{c['name'].split(':')[0]}: {c['workload']} "
                       f"{c['tokens'] // 1024}K x{c['rows']}: {c['backend']} over {b['backend']}, "
                       f"{c['layers']} layers, {c['devices']} GPU",
                       b["predicted_s"] / c["predicted_s"], b["measured_s"] / c["measured_s"],
                       "held-out", era=c["era"], devices=c["devices"]))
  return out


def _split_backend(backend: str) -> tuple[str, str]:
  """('distca', '+pingpong') of 'distca+pingpong'."""
  head, sep, tail = backend.partition("+")
  return head, sep + tail


def validate() -> dict[str, Any]:
  """Every case; ``max_abs_error`` over all, and over held-out cases apart; every case above 10%
  carries a ``note`` (``MISS_NOTES``)."""
  km, tables = kernel_model()
  cals = calibrations(km)
  e2e = e2e_cases(cals, km)
  cases = (e2e + speedup_cases(e2e) + kernel_cases(km, tables) + wlb_kernel_cases(km)
           + exchange_cases(cals["current"]))
  for c in cases:
    if not c["within_10pct"]:
      c["note"] = MISS_NOTES.get((c["kind"], c["name"]), UNEXPLAINED)
  missed = {(c["kind"], c["name"]) for c in cases if not c["within_10pct"]}
  held = [c for c in cases if c["role"] == "held-out"]
  return {
      "cases": cases,
      "misses": [f"{k}: {n}" for k, n in sorted(missed)],
      "unexplained": [f"{k}: {n}" for k, n in sorted(missed) if (k, n) not in MISS_NOTES],
      "stale_notes": [f"{k}: {n}" for k, n in sorted(MISS_NOTES) if (k, n) not in missed],
      # Current code (``CURRENT_ERAS``) on 4 GPUs: e2e, memory and speedup cases of
      # 4-GPU runs, and the exchange alone on 4 x H100.
      "four_gpu_current_cases": sum(c["role"] == "held-out" and c.get("era") in CURRENT_ERAS
                                    and c.get("devices") == 4 for c in cases),
      "max_abs_error": max(abs(c["error"]) for c in cases),
      "gate_met": not missed,
      "max_abs_error_held_out": max(abs(c["error"]) for c in held),
      "within_10pct": sum(c["within_10pct"] for c in cases),
      "calibrations": {k: dataclasses.asdict(v) for k, v in cals.items()},
      "task_s": km.task_s,
  }
