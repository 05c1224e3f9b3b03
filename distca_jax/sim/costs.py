"""Measured costs of the step simulator: model shapes, compute rates, collectives, memory.

Every constant here is either measured in this repository (with the file it comes from) or a
stated parameter. ``Calibration`` holds them; ``fit_calibration`` derives the compute ones from
committed one-GPU runs (``sim.validate.calibration_runs``), so the defaults can be re-derived.

Work model: ``metrics.work_flops``, shared with the e2e ceiling, the planner's gate and the
baselines' metrics (a token costs ``6 N``, a causal pair the kernel's forward + backward, 3.5x
forward); for time, the simulator uses the measured kernel table where it applies.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

import numpy as np

from distca_jax import metrics
from distca_jax import plan as plan_lib
from distca_jax.baselines.metrics import ModelDims
from distca_jax.checks import check_int

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_COST_TABLE = os.path.join(ROOT, "results", "cost_table_flash3_h200.json")
# The cost table's attention shapes: times scale with Hq x D for other models.
TABLE_HEADS_X_DIM = 32 * 128


# ----------------------------------------------------------------------------------------------
# Models.
# ----------------------------------------------------------------------------------------------

def check_layers(layers: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
  """``layers`` as a tuple of (count >= 1, window >= 0) pairs; one line naming a bad entry."""
  out = []
  for entry in layers:
    try:
      count, window = (int(v) for v in entry)
    except (TypeError, ValueError):
      raise ValueError(f"attention_layers entry {entry!r} must be a (count, window) pair of "
                       "ints, e.g. (5, 1024) for five window layers of 1024") from None
    if count < 1 or window < 0 or (count, window) != tuple(entry):
      raise ValueError(f"attention_layers entry {entry!r} needs count >= 1 and window >= 0 "
                       "(0 = global causal attention)")
    out.append((count, window))
  return tuple(out)

@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """What the simulator needs of a model beyond ``ModelDims``: widths for memory and TP traffic.

  Attributes:
    name: preset name.
    dims: attention shapes, layers and matmul weights (``baselines.metrics.ModelDims``).
    dim: E, the residual width.
    vocab_size: V.
    total_params: every parameter (matmul weights, input embedding, norms).
    attention_layers: the layers' attention types, ``(count, window)`` pairs (``sim.windows``:
      window 0 global causal, ``w > 0`` a sliding window of ``w`` keys; () = every layer
      global).
  """
  name: str
  dims: ModelDims
  dim: int
  vocab_size: int
  total_params: int
  attention_layers: tuple[tuple[int, int], ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "attention_layers", check_layers(self.attention_layers))

  @property
  def head_params(self) -> int:
    """Weights of the LM head (E x V)."""
    return self.dims.matmul_params - self.dims.n_layers * self.dims.layer_matmul_params

  def with_layers(self, n_layers: int) -> "ModelSpec":
    """The same shapes with ``n_layers`` layers (the benchmarks run a few of the 32)."""
    d = self.dims
    n = d.layer_matmul_params * n_layers + self.head_params
    extra = self.total_params - d.matmul_params
    return ModelSpec(self.name, dataclasses.replace(d, n_layers=n_layers, matmul_params=n),
                     self.dim, self.vocab_size, n + extra, self.attention_layers)


def model_spec(name: str, n_layers: int | None = None) -> ModelSpec:
  """Presets: 'llama3_8b' (Llama-3-8B) and 'llama3_34b' (a 34B-class Llama-3: CodeLlama-34B
  layer shapes, E 8192, 48 layers, 64/8 heads of 128, SwiGLU 22016, Llama-3 vocabulary)."""
  from distca_jax.model import ModelConfig  # pylint: disable=import-outside-toplevel
  shapes = {
      "llama3_8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        mlp_dim=14336, vocab_size=128256),
      "llama3_34b": dict(dim=8192, n_layers=48, n_heads=64, n_kv_heads=8, head_dim=128,
                         mlp_dim=22016, vocab_size=128256),
  }
  if name not in shapes:
    raise ValueError(f"unknown model {name!r}; choose one of {sorted(shapes)}")
  kw = dict(shapes[name])
  if n_layers is not None:
    kw["n_layers"] = check_int("n_layers", n_layers, 1)
  return spec_of_model(name, ModelConfig(**kw))


def spec_of_model(name: str, cfg) -> ModelSpec:
  """The ``ModelSpec`` of a ``distca_jax.model.ModelConfig`` (a run config's model)."""
  dims = ModelDims.from_model(cfg)
  total = dims.matmul_params + cfg.dim * cfg.vocab_size + (2 * cfg.n_layers + 1) * cfg.dim
  return ModelSpec(name, dims, cfg.dim, cfg.vocab_size, total)


# ----------------------------------------------------------------------------------------------
# The shared work model (``metrics.work_flops``), on ``ModelDims``.
# ----------------------------------------------------------------------------------------------
def step_work(dims: ModelDims, tokens, pairs) -> np.ndarray:
  """``metrics.work_flops`` of ``tokens`` tokens holding ``pairs`` causal pairs (all layers)."""
  return metrics.work_flops(dims.matmul_params, dims.n_layers, dims.q_heads, dims.head_dim,
                            tokens, pairs)


def linear_pairs_per_token(dims: ModelDims) -> float:
  """One token's linear work in pair units (the planner's gate; ``metrics``' definition)."""
  return 6.0 * dims.matmul_params / metrics.attention_pair_flops(dims.n_layers, dims.q_heads,
                                                                  dims.head_dim)


# ----------------------------------------------------------------------------------------------
# Calibration.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Calibration:
  """Measured rates and stated parameters (one H200 per GPU unless changed).

  Attributes:
    matmul_tflops: effective TFLOP/s of token-linear work (layers' 6 N_layer per token times
      ``remat_factor``, LM head 6 E V per token); fitted on one-GPU steps (``fit_calibration``).
    remat_factor: the layers' linear work with rematerialization: 'save_attention' reruns the
      forward linears in the backward (8 N instead of 6 N: 4/3).
    attention_scale: measured in-step core-attention time over the cost table's prediction
      (fitted; 1 = the table as measured).
    step_fixed_s: per-step time independent of tokens and layers (optimizer, launch), fitted.
    a2a_latency_s, intra_node_bw: all_to_all time = latency + bytes / bw inside a node, fitted on
      the mean of two runs on 2 x H200 (results/collective_bench.json and its latency-hiding
      scheduler twin, one program: ``sim.validate.COLLECTIVE_RUNS``); six runs on 2 x H100
      (results/collective_bench_h100/) are held out.
    inter_node_bw: bytes/s per GPU once a collective spans nodes (stated: 50 GB/s, 400 Gb/s NICs).
    gpus_per_node: GPUs of one NVLink domain.
    hbm_bytes: memory a GPU gives the step (H200 141 GB x 0.92, the launcher's fraction).
    act_bytes_per_token_layer: activation bytes a layer keeps per token at E = 4096
      ('save_attention'), fitted on the compiled steps' memory (``sim.validate.fit_memory``,
      one-GPU runs at 2, 4 and 16 layers; scales with E).
    act_bytes_per_token_fixed: per-token bytes outside the layers at E = 4096 (embedding,
      LM-head chunks, loss), fitted likewise.
    state_bytes_per_param: f32 parameters + Adam moments (12) + f32 gradients (4).
    remote_latency_s, remote_bw: distca's device-initiated exchange ('remote',
      ``custom_ops/remote_exchange.py``; 'auto' on the GPUs of one process): seconds of one
      exchange = latency + the busiest device's useful bytes (each row crosses the wire once) /
      bw, fitted on the exchange alone on a real 4-server Pretrain 128K plan, 4 x H100 of one
      host, default grid (results/four/raw/exchange_bench_grid.json: Q 228.6 MB in 1.304 ms,
      K+V 651.0 MB in 2.530 ms; ``sim.validate.remote_exchange_rows``). The latency absorbs the
      kernel's entry / exit barriers and the zeroing of unfilled receive rows.
    dense_latency_s, dense_bw: distca's dense exchange ('auto' on multi-process GPU jobs):
      seconds of one exchange = latency + wire bytes per device (``S`` blocks) / bw, fitted on
      the exchange alone on real 4-server Pretrain 128K plans, 4 x H100 of one host
      (results/four/raw/exchange_bench.log and exb_oneshot.json; ``sim.validate``); across nodes
      every exchange's bandwidth is scaled by ``inter_node_bw / intra_node_bw``.
    ragged_latency_s, ragged_bw: XLA's ragged all-to-all: seconds of one exchange = latency +
      the largest (sender, server) group's bytes / bw. Each group moves at that rate (about
      2.6 GB/s on H100s), the groups of one call side by side, so a call lasts as long as its
      largest group, whatever the other groups, the row size or the buffers hold. The latency is
      a call that moves no rows (results/micro/ragged_probe.json); the rate is fitted on the
      same 4 x H100 rows as ``dense_*`` with each row's groups replanned on the host
      (``sim.validate.ragged_fit``); the probe's other group matrices are held out.
    exchange_hidden: fraction of distca's exchange hidden behind compute: 0, since no overlap
      of the exchange has been measured on GPUs (the 4-GPU runs are single stream; ping-pong's
      overlap on several GPUs is unmeasured), so all of it is charged.
    dispatch_bw: bytes/s of distca's on-device data plane around its exchanges: the row
      gathers into the send buffers and the scatters and selects over the receive buffers run
      over the whole capped buffers (static shapes), whatever the plan fills; fitted on the
      profiled steps of the 4 x H100 128K runs, distca's elementwise kernel time over wlb's
      in the same workload (results/four/raw/s4/profiles; ``sim.validate.dispatch_fit``).
  """
  matmul_tflops: float = 585.0
  remat_factor: float = 4.0 / 3.0
  attention_scale: float = 1.0
  step_fixed_s: float = 0.0
  a2a_latency_s: float = 3.3e-4
  intra_node_bw: float = 281e9
  inter_node_bw: float = 50e9
  gpus_per_node: int = 8
  hbm_bytes: float = 141e9 * 0.92
  act_bytes_per_token_layer: float = 38e3
  act_bytes_per_token_fixed: float = 211e3
  state_bytes_per_param: float = 16.0
  remote_latency_s: float = 6.4e-4
  remote_bw: float = 344e9
  dense_latency_s: float = 8.1e-4
  dense_bw: float = 361e9
  ragged_latency_s: float = 2.4e-4
  ragged_bw: float = 2.58e9
  exchange_hidden: float = 0.0
  dispatch_bw: float = 5.1e11

  def bandwidth(self, span_gpus: int) -> float:
    """Bytes/s per GPU of a collective over ``span_gpus`` consecutive GPUs."""
    return self.intra_node_bw if span_gpus <= self.gpus_per_node else self.inter_node_bw

  def collective_s(self, bytes_per_gpu, span_gpus: int, calls: int = 1) -> np.ndarray:
    """Seconds of ``calls`` collectives moving ``bytes_per_gpu`` in all (0 for one GPU)."""
    if span_gpus <= 1:
      return np.zeros_like(np.asarray(bytes_per_gpu, np.float64))
    return calls * self.a2a_latency_s + np.asarray(bytes_per_gpu, np.float64) / self.bandwidth(
        span_gpus)


def fit_alpha_beta(mb: Sequence[float], ms: Sequence[float]) -> tuple[float, float]:
  """(latency s, bytes/s) of ``time = latency + bytes / bw`` by least squares on (MB, ms)."""
  x = np.asarray(mb, np.float64) * 1e6
  y = np.asarray(ms, np.float64) * 1e-3
  slope, icpt = np.polyfit(x, y, 1)
  return float(max(icpt, 0.0)), float(1.0 / slope)


# ----------------------------------------------------------------------------------------------
# Kernel time.
# ----------------------------------------------------------------------------------------------
class KernelModel:
  """Core-attention seconds of tasks (one layer, forward + backward) from the measured table
  (``Calibration.attention_scale`` is applied by the step model).

  ``task_s`` adds a fixed time to every task: what one more sequence of a varlen FA3 launch
  costs beyond the table (each grid point times identical tasks fused into one launch, and
  outside the grid the table scales short tasks down by causal pairs). Fitted on real task
  tables as launched (``sim.validate.fit_task_seconds``; 0 = the table alone). On the wlb
  backend's calls (results/micro/wlb_kernel_check.md) the measured excess over the table
  levels off with the number of tasks (ProLong ranks: 31, 46 and 45 ms for 85, 170 and 204
  tasks), so any fixed time per task over-charges the most tasks; charged on every task it
  stays within 9.1% there, charged on tasks below the grid only it was 14% over.
  """

  def __init__(self, table: plan_lib.CostTable | str | None = None, task_s: float = 0.0):
    if table is None or isinstance(table, (str, os.PathLike)):
      table = plan_lib.CostTable.from_json(os.fspath(table or DEFAULT_COST_TABLE))
    self.table = table
    self.task_s = float(task_s)

  def task_seconds(self, q_len, kv_len, dims: ModelDims) -> np.ndarray:
    """[N] seconds of tasks with ``q_len`` queries ending ``kv_len`` keys."""
    q = np.asarray(q_len, np.float64)
    if q.size == 0:
      return np.zeros(0)
    kv = np.asarray(kv_len, np.float64)
    heads = dims.q_heads * dims.head_dim / TABLE_HEADS_X_DIM
    return (self.table.time(q, kv) + self.task_s) * heads

  def docs_seconds(self, doc_lens, dims: ModelDims) -> float:
    """Seconds of whole documents computed where they are (one task each)."""
    lens = np.asarray([int(x) for x in doc_lens if int(x) > 0], np.float64)
    return float(self.task_seconds(lens, lens, dims).sum())


# ----------------------------------------------------------------------------------------------
# Rematerialization (``model.remat``).
# ----------------------------------------------------------------------------------------------
REMAT_POLICIES = ("save_attention", "full")


def check_remat(remat: str) -> str:
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat={remat!r} is not modelled by the simulator; use one of "
                     f"{REMAT_POLICIES} (model.remat)")
  return remat


def attention_remat_factor(remat: str) -> float:
  """Kernel time of a layer over the table's forward + backward: 'full' reruns the kernel's
  forward in the backward (one more forward: ``1 / (1 + BWD_FWD_RATIO)`` of forward + backward);
  'save_attention' keeps its inputs and outputs. Both rerun the forward linears
  (``Calibration.remat_factor``)."""
  if check_remat(remat) == "full":
    return 1.0 + 1.0 / (1.0 + plan_lib.BWD_FWD_RATIO)
  return 1.0


# ----------------------------------------------------------------------------------------------
# Memory.
# ----------------------------------------------------------------------------------------------
def memory_bytes(spec: ModelSpec, cal: Calibration, *, tokens: float, layers: int, tp: int,
                 pp: int, in_flight: int = 1, micro_batches: int = 1, extra_bytes: float = 0.0,
                 remat: str = "save_attention", workspace_bytes: float = 0.0) -> dict[str, float]:
  """Per-GPU bytes of one rank: state, activations (``tokens`` of one micro-batch, ``layers`` of
  its stage, ``in_flight`` micro-batches kept by the pipeline schedule), strategy buffers and
  the kernels' workspace outside XLA's plan (``workspace_bytes``); ``xla_plan`` is the total
  less that workspace (what a compiled step reports).

  State: the stage's ``layers`` plus the embedding and LM head, which every pipeline stage
  holds (``distca_jax.pipeline`` replicates them over ``pipe``). Activations per token, per
  layer, what ``remat`` keeps: 'save_attention' ``act_bytes_per_token_layer`` (fitted); 'full'
  the layer's input (E values of the compute dtype), with one layer's
  ``act_bytes_per_token_layer`` live at a time while the backward recomputes it. Outside the
  layers (embedding, final norm, LM head and loss: ``act_bytes_per_token_fixed``) on the
  tokens the device runs the head on: one micro-batch's without a pipeline (micro-batches
  accumulate); under one (``pp > 1``) the head runs once after the scan on the rank's
  ``micro_batches`` micro-batches split over the ``pp`` stages.
  """
  width = spec.dim / 4096.0
  outside = spec.total_params - spec.dims.n_layers * spec.dims.layer_matmul_params
  state = (layers * spec.dims.layer_matmul_params + outside) / tp * cal.state_bytes_per_param
  if check_remat(remat) == "full":
    per_layer = (layers * spec.dim * spec.dims.dtype_bytes
                 + cal.act_bytes_per_token_layer * width)
  else:
    per_layer = layers * cal.act_bytes_per_token_layer * width
  head_tokens = tokens * micro_batches / pp if pp > 1 else tokens
  act = (tokens * in_flight * per_layer
         + head_tokens * cal.act_bytes_per_token_fixed * width) / tp
  plan = state + act + extra_bytes
  total = plan + workspace_bytes
  return {"state": state, "activations": act, "buffers": float(extra_bytes),
          "kernel_workspace": float(workspace_bytes), "xla_plan": plan, "total": total,
          "fits": bool(total <= cal.hbm_bytes)}


def pipeline_bubble_fraction(stages: int, micro_batches: int) -> float:
  """(S - 1) / (M + S - 1): the idle share of a pipeline (GPipe or 1F1B) with equal micro-batches."""
  s = check_int("stages", stages, 1)
  m = check_int("micro_batches", micro_batches, 1)
  return (s - 1) / (m + s - 1)


def pipeline_seconds(stage_s_M: np.ndarray, stages: int) -> float:
  """A pipeline's time (GPipe or 1F1B) for micro-batches whose slowest stage takes ``stage_s_M`` [M]:
  every micro-batch passes each stage once (sum) and the fill / drain waits ``S - 1`` stage
  times of the slowest micro-batch (equal micro-batches: the bubble fraction above)."""
  u = np.asarray(stage_s_M, np.float64)
  return float(u.sum() + (stages - 1) * u.max()) if u.size else 0.0


def ceil_div(a: int, b: int) -> int:
  return -(-int(a) // int(b))


def round_up(x: float, m: int) -> int:
  return int(math.ceil(x / m) * m)
