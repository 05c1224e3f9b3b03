"""Core-attention kernel benchmark: ours (Mosaic GPU), FlashAttention-3, cuDNN, Pallas-Triton `mha`.

Workloads (32 query heads, 8 KV heads, head dim 128, bf16, one GPU):
  dense-L            one causal sequence of L tokens (L = 4K, 16K, 64K);
  ca-sS              a fused CA-task batch of 16K query tokens: tasks are tail shards [b - S, b)
                     of documents with b uniform in [S, 16K], each with its own key prefix [0, b)
                     (S = 64 ... 4096), as a DistCA attention server receives them;
  sched-W-mS         the fused call of one attention server under the real scheduler: step
                     ``--sched-step`` of workload W (pretrain or prolong) from
                     ``WorkloadSampler(W, tokens_per_row=--sched-tokens).step_doclens(step, S)``
                     over S = ``--sched-servers`` ranks, planned by ``plan_lib.schedule`` with
                     ``min_shard`` = S_min (64 ... 4096) and ``--sched-tolerance``; the task table
                     is the chosen server's row of ``plan_to_metadata`` (cu_seqlens_q/k with
                     trailing empty task slots), exactly what the data plane hands the kernel.
                     Server (``--sched-server``): 'max' (default) is the most loaded server after
                     balancing (most pairs): one fused call per server and the one the step waits
                     for; an index picks that server; 'all' packs every server's tasks into one
                     call without padding (the whole batch's mix, but 8x one server's size).
                     Layout: ``plan_to_metadata`` with fixed caps, as in training (the compiled
                     step never changes shape): ``Capacity.envelope`` of the required capacities
                     of that workload's plans at every min_shard of 64 ... 4096, so every name
                     gets the same number of task slots whichever subset a run selects.
                     Buffers (``--sched-buffers``): 'used' (default) ends the Q/KV buffers at the
                     server's last task, so the row measures the kernel on the scheduler's task
                     mix, comparable with ca-s; 'envelope' keeps the capacity's padding rows, as
                     the data plane allocates them (one buffer shape per W, so a kernel
                     compiles once per W); padding rows count no FLOPs but the kernels pay
                     for them (flash3 masks its padding rows; its launch shape follows the tasks).
``--workloads`` takes names and the families 'dense', 'ca', 'sched' (all sizes of that family).
``--windows W1,W2,...`` adds every workload again as a sliding-window layer's call of window W
(name suffix ``-wW``; 0 = the full-causal call itself): each task keeps its queries and keeps only
the keys its window reads, ``min(lk, lq + W - 1)`` of them (a window layer's task ``[a, b)`` reads
keys ``[max(0, a - W + 1), b)``), and every kernel runs with ``window=W``; pairs and FLOPs count
the windowed mask. ``--quick-windows`` = ``--kernels flash3,mosaic --workloads
dense-16384,ca-s512,ca-s4096,sched-prolong-m512 --windows 128,1024,4096``. cuDNN runs dense
windowed workloads (``local_window_size``), `mha` none.
cuDNN (top-left causal alignment, no per-task key ranges) and `mha` (no varlen) run the dense
workloads only; on CA and scheduler batches they are recorded as not applicable. FLOPs come from
the task table (distca_jax.plan.cost.core_attention_flops: forward 4*H*D*pairs,
forward+backward 3.5x forward); padding rows add none.

Each backend runs in its own subprocess, so a crash or a missing package costs only its own
entries, which are recorded with the error. Backends: mosaic[:preset] (ours), flash3, cudnn,
mha (JAX's Pallas-Triton example, jax.experimental.pallas.ops.gpu.attention), blockwise (the CPU
kernel) and reference (plain jnp, small sizes only). Run (on a GPU machine):
  python -m experiments.kernel_bench --quick   # the table in results/kernel_bench.md
  python -m experiments.kernel_bench           # every backend and workload (slower)
CPU smoke test (tiny shapes; the blockwise kernel and the jnp reference):
  python -m experiments.kernel_bench --tiny --out /tmp/kernel_bench_tiny.json
Writes <out>.json and <out>.md (same stem) with the command, device, wall times and every entry.

``--kernels`` names the kernels to run (``--backends``, its old name, stops with a line naming
it). The JSON keeps the field names ``backends``, ``backend`` (per entry), ``backend_wall_s``: ``write_markdown`` and the results already written read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

import experiments
from distca_jax.plan import cost as plan_cost

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DENSE_LENGTHS = (4096, 16384, 65536)
SHARD_LENGTHS = (4096, 2048, 1024, 512, 256, 128, 64)
SCHED_FAMILIES = ("pretrain", "prolong")
SCHED_MIN_SHARDS = (64, 128, 256, 512, 1024, 2048, 4096)
BACKENDS = ("mosaic", "flash3", "cudnn", "mha")
ALL_BACKENDS = BACKENDS + ("blockwise", "reference")
FAMILIES = {
    "dense": [f"dense-{n}" for n in DENSE_LENGTHS],
    "ca": [f"ca-s{s}" for s in SHARD_LENGTHS],
    "sched": [f"sched-{w}-m{m}" for w in SCHED_FAMILIES for m in SCHED_MIN_SHARDS],
}
# Full-size settings; --tiny and --quick override some of them, explicit flags override both.
FULL = dict(heads=NUM_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16",
            tokens=16384, max_doc=16384, sched_tokens=16384, sched_servers=8, trials=5,
            min_trial_s=0.05, kernels=",".join(BACKENDS),
            workloads="dense,ca,sched", row_multiple=128, windows="0")
# A representative subset for one short GPU run: the dense anchor, the composability ends of the
# synthetic sweep and three min_shard values of each scheduler workload; ours against flash3.
QUICK = dict(kernels="flash3,mosaic", workloads=",".join(
    ["dense-16384", "ca-s128", "ca-s512", "ca-s4096"]
    + [f"sched-{w}-m{m}" for w in SCHED_FAMILIES for m in (128, 512, 2048)]))
# Sliding-window layers' calls (``--windows``): ours against flash3 at three windows.
QUICK_WINDOWS = dict(kernels="flash3,mosaic", windows="128,1024,4096",
                     workloads="dense-16384,ca-s512,ca-s4096,sched-prolong-m512")
# CPU smoke test: tiny shapes, every workload family, the blockwise kernel and the jnp reference.
TINY = dict(heads=4, kv_heads=2, head_dim=32, tokens=256, max_doc=256, sched_tokens=256,
            sched_servers=4, trials=2, min_trial_s=0.0, row_multiple=16,
            kernels="reference,blockwise",
            workloads="dense-128,ca-s16,ca-s64,sched-pretrain-m16,sched-prolong-m64")
# Named tilings of the Mosaic GPU kernels (custom_ops/mosaic_attention.BlockSizes); "mosaic" means
# "mosaic:default".
MOSAIC_PRESETS = {
    "default": {},
    "nopp": dict(pingpong=False),  # forward without ping-pong scheduling of the two warpgroups
    # the two-kernel backward: a dQ kernel over query tiles and a dK/dV kernel over key tiles
    # (7 products per tile pair; the default is one kernel with dQ through TMA reduce-add, 5)
    "two-kernel": dict(fused_bwd=False),
    "two-kernel-unpaired": dict(fused_bwd=False, bwd_pairs=False),  # one product per wait
    "dq128": dict(fused_bwd=False, block_kv_dq=128),  # two-kernel, dQ kernel's steps 128 keys
    # two-kernel, dK/dV on an aligned copy of K/V, gathered before and after the kernel
    "dkv-gather": dict(fused_bwd=False, dkv_in_place=False),
    # forward and dQ CTAs in head-major order (the heads of one KV group far apart in time)
    "head-major": dict(group_adjacent=False),
}
_SCHED_NAME = re.compile(r"sched-([a-z]+)-m(\d+)")


@dataclasses.dataclass
class Workload:
  """One kernel call: its task table, buffer sizes and (scheduler workloads) plan statistics.

  ``cu_q`` / ``cu_k`` are [N + 1] task boundaries; ``q_rows`` / ``kv_rows`` the buffer rows
  (>= cu_q[-1] / cu_k[-1]; rows past the last task are padding); ``max_q`` / ``max_k`` the static
  bounds flash3 needs (the longest task; padding rows are masked, not computed).
  """
  name: str
  kind: str  # "dense", "ca" or "sched"
  cu_q: list[int]
  cu_k: list[int]
  max_q: int
  max_k: int
  q_rows: int = 0
  kv_rows: int = 0
  info: dict = dataclasses.field(default_factory=dict)
  window: int = 0

  def __post_init__(self):
    self.q_rows = self.q_rows or self.cu_q[-1]
    self.kv_rows = self.kv_rows or self.cu_k[-1]
    if self.q_rows < self.cu_q[-1] or self.kv_rows < self.cu_k[-1]:
      raise ValueError(f"{self.name}: buffers ({self.q_rows=}, {self.kv_rows=}) smaller than the "
                       f"task table ({self.cu_q[-1]=}, {self.cu_k[-1]=})")

  @property
  def num_tasks(self) -> int:
    """Tasks with at least one query row (empty trailing slots not counted)."""
    return sum(1 for a, b in zip(self.cu_q[:-1], self.cu_q[1:]) if b > a)


@dataclasses.dataclass(frozen=True)
class SchedConfig:
  """How scheduler workloads are sampled and planned (see the module docstring)."""
  tokens_per_rank: int
  servers: int
  step: int
  tolerance: float
  server: str  # "max", "all" or a server index
  buffers: str  # "used" or "envelope"
  seed: int
  q_heads: int
  kv_heads: int
  head_dim: int


def expand_workload_names(spec: str) -> list[str]:
  """Comma list of names and families ('dense', 'ca', 'sched') -> names, first occurrence kept."""
  out = []
  for item in (s.strip() for s in spec.split(",")):
    if not item:
      continue
    for name in FAMILIES.get(item, [item]):
      if name not in out:
        out.append(name)
  if not out:
    raise ValueError(f"--workloads {spec!r} names no workload; use e.g. 'dense,ca,sched'")
  return out


def _sched_plan(family: str, min_shard: int, cfg: SchedConfig, cache: dict):
  """(doc_lens, Plan) of ``family`` at ``min_shard``, memoized in ``cache``."""
  from distca_jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from distca_jax.data.workloads import WorkloadSampler  # pylint: disable=import-outside-toplevel
  key = (family, min_shard)
  if key not in cache:
    if (family, "doc_lens") not in cache:
      sampler = WorkloadSampler(family, tokens_per_row=cfg.tokens_per_rank, seed=cfg.seed)
      cache[(family, "doc_lens")] = sampler.step_doclens(cfg.step, cfg.servers)
    doc_lens = cache[(family, "doc_lens")]
    cache[key] = plan_lib.schedule(doc_lens, cfg.servers, tokens_per_rank=cfg.tokens_per_rank,

                                       options=plan_lib.PlanOptions(
                                           tolerance=cfg.tolerance, min_shard=min_shard,
                                           q_heads=cfg.q_heads, kv_heads=cfg.kv_heads,
                                           head_dim=cfg.head_dim))
  return cache[key]


def make_sched_workload(name: str, cfg: SchedConfig, cache: dict | None = None) -> Workload:
  """The task table one server's fused kernel call gets for ``sched-<family>-m<min_shard>``."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from distca_jax import plan as plan_lib  # pylint: disable=import-outside-toplevel
  from distca_jax.data.workloads import WORKLOADS  # pylint: disable=import-outside-toplevel
  match = _SCHED_NAME.fullmatch(name)
  if not match or match.group(1) not in WORKLOADS or int(match.group(2)) < 1:
    raise ValueError(f"bad scheduler workload {name=}; use sched-<{'|'.join(sorted(WORKLOADS))}>-"
                     "m<min_shard>, e.g. sched-pretrain-m512")
  family, min_shard = match.group(1), int(match.group(2))
  cache = {} if cache is None else cache
  plan = _sched_plan(family, min_shard, cfg, cache)
  # Fixed caps as in training: the envelope over the whole min_shard sweep (plus this one), so
  # every standard name of a family gets the same shapes whichever subset a run selects.
  sweep = sorted(set(SCHED_MIN_SHARDS) | {min_shard})
  cap = plan_lib.Capacity.envelope(
      [plan_lib.required_capacity(_sched_plan(family, m, cfg, cache)) for m in sweep])
  meta = plan_lib.plan_to_metadata(plan, cap)
  loads = np.asarray(plan.loads_after, np.float64)
  num_servers = plan.num_servers
  if cfg.server == "all":
    servers = list(range(num_servers))
  elif cfg.server == "max":
    servers = [int(np.argmax(loads))]  # ties: lowest index
  else:
    servers = [int(cfg.server)]
    if not 0 <= servers[0] < num_servers:
      raise ValueError(f"--sched-server {cfg.server} is not in [0, {num_servers}); "
                       "use 'max', 'all' or a server index")
  if len(servers) == 1:
    [s] = servers
    # Exactly the data plane's arrays: Nt + 1 boundaries (empty trailing slots); its buffers have
    # q_tokens / kv_tokens rows.
    cu_q = meta.cu_seqlens_q[s].astype(np.int64)
    cu_k = meta.cu_seqlens_k[s].astype(np.int64)
    if cfg.buffers == "envelope":
      q_rows, kv_rows = cap.q_tokens, cap.kv_tokens
    elif cfg.buffers == "used":
      q_rows, kv_rows = int(cu_q[-1]), int(cu_k[-1])
    else:
      raise ValueError(f"--sched-buffers {cfg.buffers!r}: use 'used' or 'envelope'")
  else:
    if cfg.buffers != "used":
      raise ValueError(f"--sched-server all packs every server's tasks without padding; "
                       f"--sched-buffers {cfg.buffers!r} does not apply, use 'used'")
    # Every server's used tasks back to back, no padding: one call over the whole batch's mix.
    lq = np.concatenate([np.diff(meta.cu_seqlens_q[s])[:meta.num_tasks[s]] for s in servers])
    lk = np.concatenate([np.diff(meta.cu_seqlens_k[s])[:meta.num_tasks[s]] for s in servers])
    cu_q = np.concatenate([[0], np.cumsum(lq)])
    cu_k = np.concatenate([[0], np.cumsum(lk)])
    q_rows, kv_rows = int(cu_q[-1]), int(cu_k[-1])
  lq, lk = np.diff(cu_q), np.diff(cu_k)
  used = lq > 0
  # flash3's static bounds cover the real tasks (padding rows are masked, not computed).
  max_q = int(max(lq.max(initial=0), 1))
  max_k = int(max(lk.max(initial=0), 1))
  mean = loads.mean() if loads.size else 0.0
  info = dict(
      family=family, min_shard=min_shard, step=cfg.step, servers=num_servers,
      tokens_per_rank=cfg.tokens_per_rank, tolerance=cfg.tolerance,
      server="all" if len(servers) > 1 else servers[0], buffers=cfg.buffers,
      documents=int(plan.doc_lens.size), plan_tasks=int(len(plan.tasks)),
      moves=int(plan.num_moves), imbalance_before=float(plan.imbalance_before),
      imbalance_after=float(plan.imbalance_after), degraded=bool(plan.degraded),
      degraded_reason=plan.degraded_reason,
      load_over_mean=float(loads[servers].sum() / (mean * len(servers))) if mean > 0 else 1.0,
      # Tasks whose key range extends before their queries: pieces the balancer split off.
      tasks_with_prefix=int(((lq < lk) & used).sum()),
      q_len_min=int(lq[used].min()) if used.any() else 0,
      q_len_median=float(np.median(lq[used])) if used.any() else 0.0,
      q_len_max=int(lq.max(initial=0)),
      kv_len_max=int(lk.max(initial=0)), capacity=dataclasses.asdict(cap))
  return Workload(name, "sched", cu_q.tolist(), cu_k.tolist(), max_q, max_k, q_rows, kv_rows,
                  info)


def windowed(wl: Workload, window: int) -> Workload:
  """``wl`` as a sliding-window layer's call (module docstring): each task keeps its queries
  and its last ``lq + window - 1`` keys (all of them when fewer); buffers shrink with the keys."""
  if not window:
    return wl
  lq = [b - a for a, b in zip(wl.cu_q[:-1], wl.cu_q[1:])]
  lk = [b - a for a, b in zip(wl.cu_k[:-1], wl.cu_k[1:])]
  keep = [min(k, q + window - 1) if q else 0 for q, k in zip(lq, lk)]
  cu_k = [wl.cu_k[0]]
  for n in keep:
    cu_k.append(cu_k[-1] + n)
  return Workload(f"{wl.name}-w{window}", wl.kind, list(wl.cu_q), cu_k, wl.max_q,
                  max(keep, default=1) or 1, q_rows=wl.q_rows,
                  kv_rows=wl.kv_rows - (wl.cu_k[-1] - cu_k[-1]), info=dict(wl.info),
                  window=window)


def make_workloads(names: list[str], tokens: int, max_doc: int, seed: int,
                   sched: SchedConfig | None = None, row_multiple: int = 1,
                   windows: tuple[int, ...] = (0,)) -> list[Workload]:
  """Builds every named workload (see the module docstring); ``sched`` for sched-* names. Each
  workload's Q and KV buffer rows are rounded up to a multiple of ``row_multiple`` (padding
  rows, no FLOPs). Every workload comes once per window of ``windows`` (``windowed``; 0 = as
  built)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  out = []
  cache: dict = {}
  for name in names:
    if name.startswith("dense-"):
      length = int(name.split("-")[1])
      out.append(Workload(name, "dense", [0, length], [0, length], length, length))
    elif name.startswith("ca-s"):
      shard = int(name[4:])
      if shard > max_doc:
        raise ValueError(f"workload {name}: shard {shard} > {max_doc=}; lower the shard or raise "
                         "--max-doc")
      rng = np.random.default_rng([seed, shard])
      n = tokens // shard
      ends = rng.integers(shard, max_doc + 1, size=n)  # document length b >= shard
      cu_q = [0] + np.cumsum(np.full(n, shard)).tolist()
      cu_k = [0] + np.cumsum(ends).tolist()
      out.append(Workload(name, "ca", cu_q, cu_k, shard, int(ends.max())))
    elif name.startswith("sched-"):
      if sched is None:
        raise ValueError(f"workload {name} needs a SchedConfig (pass sched=...)")
      out.append(make_sched_workload(name, sched, cache))
    else:
      raise ValueError(f"unknown workload {name=}; use dense-<L>, ca-s<S>, sched-<W>-m<S> or a "
                       f"family {sorted(FAMILIES)}")
  out = [windowed(wl, w) for wl in out for w in windows]
  for wl in out:
    wl.q_rows = -(-wl.q_rows // row_multiple) * row_multiple
    wl.kv_rows = -(-wl.kv_rows // row_multiple) * row_multiple
  return out


# ------------------------------------------------------------------------------------------------
# Child: one backend, every workload
# ------------------------------------------------------------------------------------------------


def run_backend(backend: str, workloads: list[Workload], args, save) -> list[dict]:
  """Times one backend on every workload; ``save(entries)`` runs after each entry."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from distca_jax import ops, profiling  # pylint: disable=import-outside-toplevel

  base, _, preset = backend.partition(":")
  num_heads, num_kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
  dt = jnp.dtype(args.dtype)
  scale = 1.0 / math.sqrt(head_dim)
  # One jit per static configuration, reused across workloads: equal buffer shapes (the scheduler
  # workloads of one family share their capacity) then compile once.
  jitted: dict = {}
  entries = []
  for wl in workloads:
    t_entry = time.perf_counter()
    win = wl.window
    entry = dict(workload=wl.name, kind=wl.kind, backend=backend, tasks=wl.num_tasks,
                 task_slots=len(wl.cu_q) - 1, device=jax.devices()[0].device_kind,
                 q_tokens=wl.cu_q[-1], kv_tokens=wl.cu_k[-1], q_rows=wl.q_rows,
                 kv_rows=wl.kv_rows, window=win,
                 pairs=plan_cost.attention_pairs(wl.cu_q, wl.cu_k, win),
                 flops_fwd=plan_cost.core_attention_flops(wl.cu_q, wl.cu_k,
                                                          num_q_heads=num_heads,
                                                          head_dim=head_dim, window=win),
                 flops_fwd_bwd=plan_cost.core_attention_flops(wl.cu_q, wl.cu_k,
                                                              num_q_heads=num_heads,
                                                              head_dim=head_dim,
                                                              include_backward=True,
                                                              window=win))
    if wl.info:
      entry["sched"] = wl.info
    entries.append(entry)
    if (wl.kind != "dense" and base in ("cudnn", "mha")) or (win and base == "mha"):
      entry["status"] = "n/a"
      entry["error"] = ("cannot express CA tasks: cuDNN aligns causal masks top-left when "
                        "q_len != kv_len" if base == "cudnn" else
                        "cannot express CA tasks: dense batch layout, no per-task key ranges"
                        if wl.kind != "dense" else "no sliding window")
      save(entries)
      continue
    try:
      key = jax.random.key(args.seed)
      kq, kk, kv, kd = jax.random.split(key, 4)
      t_q, t_k = wl.q_rows, wl.kv_rows
      q = jax.random.normal(kq, (t_q, num_heads, head_dim), dt)
      k = jax.random.normal(kk, (t_k, num_kv_heads, head_dim), dt)
      v = jax.random.normal(kv, (t_k, num_kv_heads, head_dim), dt)
      do = jax.random.normal(kd, q.shape, dt)
      cu_q = jnp.asarray(wl.cu_q, jnp.int32)
      cu_k = jnp.asarray(wl.cu_k, jnp.int32)

      if base == "mosaic":
        from custom_ops import mosaic_attention  # pylint: disable=import-outside-toplevel
        preset = preset or "default"
        if preset not in MOSAIC_PRESETS:
          raise ValueError(f"unknown mosaic {preset=}; choose one of {sorted(MOSAIC_PRESETS)}")
        mbs = mosaic_attention.BlockSizes(**MOSAIC_PRESETS[preset])
        entry["block_sizes"] = dataclasses.asdict(mbs)
        static = ("mosaic", mbs, win)

        def attn(q, k, v, cu_q, cu_k, mbs=mbs, win=win):
          return mosaic_attention.mosaic_attention(q, k, v, cu_q, cu_k, block_sizes=mbs,
                                                   window=win)[0]
        inputs = (q, k, v, cu_q, cu_k)
      elif base in ("blockwise", "reference"):
        static = (base, win)

        def attn(q, k, v, cu_q, cu_k, base=base, win=win):
          return ops.core_attention(q, k, v, cu_q, cu_k, kernel=base, window=win)
        inputs = (q, k, v, cu_q, cu_k)
      elif base == "flash3":
        static = ("flash3", wl.max_q, wl.max_k, win)

        def attn(q, k, v, cu_q, cu_k, wl=wl):
          return ops.core_attention(q, k, v, cu_q, cu_k, kernel="flash3",
                                    max_seqlen_q=wl.max_q, max_seqlen_k=wl.max_k,
                                    window=wl.window)
        inputs = (q, k, v, cu_q, cu_k)
      elif base == "cudnn":
        static = ("cudnn", win)

        def attn(q, k, v, win=win):
          return jax.nn.dot_product_attention(
              q[None], k[None], v[None], is_causal=True, scale=scale, implementation="cudnn",
              local_window_size=(win - 1, 0) if win else None)[0]
        inputs = (q, k, v)
      elif base == "mha":
        import warnings  # pylint: disable=import-outside-toplevel
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          # pylint: disable-next=import-outside-toplevel
          from jax.experimental.pallas.ops.gpu import attention as pallas_mha
        group = num_heads // num_kv_heads
        # `mha` has no GQA: give it KV already repeated to all query heads (outside the timed
        # region).
        k = jnp.repeat(k, group, axis=1)
        v = jnp.repeat(v, group, axis=1)
        static = ("mha",)

        def attn(q, k, v):
          return pallas_mha.mha(q[None], k[None], v[None], None, sm_scale=scale, causal=True)[0]
        inputs = (q, k, v)
      else:
        raise ValueError(f"unknown backend {backend!r}; choose from {ALL_BACKENDS}")

      if static not in jitted:
        def fwd_bwd(*a, attn=attn):
          o, vjp = jax.vjp(lambda *x: attn(*x, *a[3:-1]), *a[:3])
          return o, vjp(a[-1])
        jitted[static] = (jax.jit(attn), jax.jit(fwd_bwd))
      fwd, fwd_bwd = jitted[static]

      o = jax.block_until_ready(fwd(*inputs))
      # A fingerprint of the task rows' output for cross-backend agreement (same seed, same
      # inputs); padding rows belong to no task and are left out.
      o_task = o[:wl.cu_q[-1]].astype(jnp.float32)
      w = jnp.sin(jnp.arange(head_dim, dtype=jnp.float32))[None, None, :]
      entry["out_fingerprint"] = float(jnp.mean(o_task * w))
      entry["out_mean_abs"] = float(jnp.mean(jnp.abs(o_task)))
      entry["out_finite"] = bool(jnp.isfinite(o_task).all())
      del o, o_task
      # The same for dQ, dK, dV, summed over heads (KV repeated to every query head agrees) and
      # weighted per row too (dK sums to zero over a task's keys): backward variants of one
      # kernel must agree with each other and with flash3.
      grads = jax.block_until_ready(fwd_bwd(*inputs, do))[1]
      fps = []
      for g, cu in zip(grads, (wl.cu_q, wl.cu_k, wl.cu_k)):
        g = g[cu[0]:cu[-1]].astype(jnp.float32).sum(axis=1)
        w_row = jnp.cos(0.37 * jnp.arange(g.shape[0], dtype=jnp.float32))[:, None]
        fps.append(float(jnp.mean(g * w[0] * w_row)))
      entry["grad_fingerprints"] = fps
      del grads, g
      tm = profiling.time_call(fwd, *inputs, iters=args.trials, min_trial_s=args.min_trial_s)
      t_fwd = tm["median_s"]
      entry.update(fwd_ms=t_fwd * 1e3, fwd_trials_ms=[t * 1e3 for t in tm["trials_s"]],
                   fwd_reps=tm["reps"], fwd_tflops=entry["flops_fwd"] / t_fwd / 1e12)
      tm = profiling.time_call(fwd_bwd, *inputs, do, iters=args.trials,
                               min_trial_s=args.min_trial_s)
      t_fb = tm["median_s"]
      entry.update(fwd_bwd_ms=t_fb * 1e3, fwd_bwd_trials_ms=[t * 1e3 for t in tm["trials_s"]],
                   fwd_bwd_reps=tm["reps"], fwd_bwd_tflops=entry["flops_fwd_bwd"] / t_fb / 1e12)
      entry["status"] = "ok"
    except Exception as e:  # pylint: disable=broad-except
      entry["status"] = "error"
      entry["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
      entry["traceback_tail"] = traceback.format_exc()[-1500:]
    entry["wall_s"] = time.perf_counter() - t_entry  # compile + checks + timing
    print(json.dumps({k: v for k, v in entry.items()
                      if not k.endswith("trials_ms") and k not in ("traceback_tail", "sched")}),
          flush=True)
    save(entries)
  return entries


# ------------------------------------------------------------------------------------------------
# Parent: one subprocess per backend, merge, write JSON + markdown
# ------------------------------------------------------------------------------------------------


def _fmt(x, digits=0):
  return "-" if x is None else f"{x:.{digits}f}"


def format_tflops(x):
  # Whole TFLOP/s on a GPU; three significant digits for the tiny CPU runs' fractions.
  return "-" if x is None else f"{x:.0f}" if x >= 10 else f"{x:.3g}"


def write_markdown(path: str, result: dict) -> None:
  backends = result["backends"]
  cfg = result["config"]
  entries = {(e["workload"], e["backend"]): e for e in result["entries"]}
  sched = cfg["sched"]
  lines = [
      "# Core-attention kernel benchmark",
      "",
      f"- command: `{result['command']}`",
      f"- device: {result['device']}; jax {result['jax_version']}; {result['date']}; "
      f"wall time {_fmt(result.get('wall_s'))} s ("
      + ", ".join(f"{b} {_fmt(s)} s" for b, s in result.get("backend_wall_s", {}).items()) + ")",
      f"- {cfg['num_heads']} query heads, {cfg['num_kv_heads']} KV heads, head dim "
      f"{cfg['head_dim']}, {cfg['dtype']}"
      + f"; CA batches: {cfg['tokens']} query tokens of tail shards [b-s, b), "
      f"b uniform in [s, {cfg['max_doc']}], seed {cfg['seed']}"
      + (f"; every workload's Q and KV buffers: its rows rounded up to a multiple of "
         f"{cfg['row_multiple']} (the data plane's buffers)" if cfg.get("row_multiple", 1) > 1
         else "; buffers ending at the last task"),
      f"- sched-W-mS: step {sched['step']} of workload W, {sched['servers']} ranks x "
      f"{sched['tokens_per_rank']} tokens, plan_lib.schedule(tolerance={sched['tolerance']}, "
      f"min_shard=S); server {sched['server']!r}"
      + (" (the most loaded after balancing)" if sched["server"] == "max" else "")
      + "; task slots of the capacity envelope over min_shard "
      f"{min(SCHED_MIN_SHARDS)}-{max(SCHED_MIN_SHARDS)}, buffers "
      + ("of the used rows" if sched["buffers"] == "used" else "of the envelope's rows")
      + " (see the table below the results)",
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
        cells.append(f"{format_tflops(e.get('fwd_tflops'))} / "
                     f"{format_tflops(e.get('fwd_bwd_tflops'))}")
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
  def fingerprint_table(title, cell):
    rows = ["", title, "", "| workload | " + " | ".join(backends) + " |",
            "|---|" + "---|" * len(backends)]
    for wl in result["workloads"]:
      cells = [cell(entries.get((wl, b)) or {}) for b in backends]
      rows.append(f"| {wl} | " + " | ".join(cells) + " |")
    return rows
  lines += fingerprint_table(
      "Output fingerprints (mean(o * w) over task rows, same inputs across backends; should "
      "agree):", lambda e: f"{e['out_fingerprint']:.3e}" if "out_fingerprint" in e else "-")
  lines += fingerprint_table(
      "Gradient fingerprints dQ / dK / dV (mean(sum over heads of g * w * w_row) over task rows; "
      "should agree):",
      lambda e: " / ".join(f"{x:.3e}" for x in e["grad_fingerprints"])
      if e.get("grad_fingerprints") else "-")
  sched_rows = []
  for wl in result["workloads"]:
    info = next((e["sched"] for e in result["entries"] if e["workload"] == wl and "sched" in e),
                None)
    if info is None:
      continue
    first = next(e for e in result["entries"] if e["workload"] == wl)
    sched_rows.append(
        f"| {wl} | {info['server']} | {first['tasks']} / {first['task_slots']} | "
        f"{info['tasks_with_prefix']} | {first['q_tokens']} / {first['q_rows']} | "
        f"{first['kv_tokens']} / {first['kv_rows']} | {info['q_len_min']} / "
        f"{info['q_len_median']:.0f} / {info['q_len_max']} | {info['load_over_mean']:.3f} | "
        f"{info['imbalance_before']:.3f} -> {info['imbalance_after']:.3f}"
        + (" (degraded)" if info["degraded"] else "") + f" | {info['moves']} |")
  if sched_rows:
    lines += ["", "Scheduler workloads: the benchmarked server's task table (tasks used / slots; "
              "tasks with a key prefix are pieces the balancer split off; token counts used / "
              "buffer rows; load = its pairs over the mean server's):", "",
              "| workload | server | tasks | with prefix | Q tokens | KV tokens | "
              "q len min / median / max | load / mean | imbalance | moves |",
              "|---|---|---|---|---|---|---|---|---|---|"] + sched_rows
  if notes:
    lines += ["", "Errors:", ""] + notes
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
  """Parses flags and fills unset ones from FULL, overlaid by --tiny / --quick."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(REPO, "results", "kernel_bench.json"))
  preset = parser.add_mutually_exclusive_group()
  preset.add_argument("--quick", action="store_true",
                      help="representative subset, flash3 + ours: " + QUICK["workloads"])
  preset.add_argument("--tiny", action="store_true",
                      help="CPU smoke test: tiny shapes, reference + the blockwise kernel")
  preset.add_argument("--quick-windows", action="store_true",
                      help="sliding-window rows, flash3 + ours: " + QUICK_WINDOWS["workloads"]
                      + " at windows " + QUICK_WINDOWS["windows"])
  parser.add_argument("--kernels", help="comma list of mosaic[:preset], flash3, cudnn, mha, "
                      "blockwise, reference; mosaic presets: " + ", ".join(MOSAIC_PRESETS)
                      + f"; default {FULL['kernels']}")
  experiments.reject_renamed_flag(parser, "--backends", "--kernels")
  parser.add_argument("--workloads", help="comma list of dense-<L>, ca-s<S>, sched-<W>-m<S> or "
                      f"the families {sorted(FAMILIES)}; default {FULL['workloads']}")
  parser.add_argument("--heads", type=int, help=f"query heads (default {NUM_HEADS})")
  parser.add_argument("--kv-heads", type=int, help=f"KV heads (default {NUM_KV_HEADS})")
  parser.add_argument("--head-dim", type=int, help=f"head dim (default {HEAD_DIM})")
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--tokens", type=int, help="query tokens per ca-s batch (default 16384)")
  parser.add_argument("--max-doc", type=int, help="ca-s: largest document length b")
  parser.add_argument("--sched-tokens", type=int, help="sched: tokens per rank (default 16384)")
  parser.add_argument("--sched-servers", type=int, help="sched: ranks = servers (default 8)")
  parser.add_argument("--sched-step", type=int, default=0, help="sched: the sampler's step")
  parser.add_argument("--sched-tolerance", type=float, default=0.05,
                      help="sched: balance goal, max load <= (1 + tolerance) * mean")
  parser.add_argument("--sched-server", default="max",
                      help="sched: 'max' (most loaded server), 'all' (every server's tasks in "
                      "one call) or a server index")
  parser.add_argument("--sched-buffers", choices=("used", "envelope"), default="used",
                      help="sched: Q/KV buffers end at the last task ('used') or keep the "
                      "capacity envelope's padding rows ('envelope')")
  parser.add_argument("--windows", help="comma list of sliding windows (keys per query; 0 = "
                      "full causal): every workload once per window (module docstring); "
                      "default 0")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--row-multiple", type=int,
                      help="round every workload's Q and KV buffer rows up to a multiple of this "
                      "(padding rows, no FLOPs). Default 128 (16 with --tiny): the training "
                      "data plane's buffer rows (distca_jax.plan.capacity.row_multiple); 1 ends "
                      "the buffers at the last task, and the mosaic kernel then pads buffers "
                      "whose rows are not a multiple of 8 (one copy per call)")
  parser.add_argument("--trials", type=int)
  parser.add_argument("--min-trial-s", type=float)
  parser.add_argument("--child-timeout-s", type=float, default=1200)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  fill = dict(FULL)
  fill.update(TINY if args.tiny else QUICK if args.quick else
              QUICK_WINDOWS if args.quick_windows else {})
  for name, value in fill.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  check_kernels(parser, args.kernels, ALL_BACKENDS + tuple(
      f"mosaic:{p}" for p in MOSAIC_PRESETS))
  if args.sched_server not in ("max", "all") and not args.sched_server.isdigit():
    parser.error(f"--sched-server {args.sched_server!r}: use 'max', 'all' or a server index")
  try:
    args.window_list = tuple(int(w) for w in args.windows.split(","))
  except ValueError:
    args.window_list = ()
  if not args.window_list or any(w < 0 for w in args.window_list):
    parser.error(f"--windows {args.windows!r}: a comma list of ints >= 0 (0 = full causal), "
                 "e.g. 0,128,1024")
  return args


def check_kernels(parser, kernels: str, names) -> None:
  """``parser.error`` naming the first kernel of the comma list ``kernels`` not in ``names``
  (and, for a removed kernel, what to run instead)."""
  from distca_jax.ops import REMOVED_KERNELS  # pylint: disable=import-outside-toplevel
  for b in kernels.split(","):
    base = b.partition(":")[0]
    if base in REMOVED_KERNELS:
      parser.error(f"--kernels: {b!r} {REMOVED_KERNELS[base]}")
    if b not in names:
      parser.error(f"--kernels: unknown kernel {b!r}; choose from {tuple(names)}")



def sched_config(args) -> SchedConfig:
  """The scheduler-workload settings of parsed flags."""
  return SchedConfig(tokens_per_rank=args.sched_tokens, servers=args.sched_servers,
                     step=args.sched_step, tolerance=args.sched_tolerance,
                     server=args.sched_server, buffers=args.sched_buffers, seed=args.seed,
                     q_heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)


def main(argv=None) -> int:
  t_main = time.time()
  args = parse_args(argv)
  names = expand_workload_names(args.workloads)
  workloads = make_workloads(names, args.tokens, args.max_doc, args.seed, sched_config(args),
                             args.row_multiple, args.window_list)
  backends = args.kernels.split(",")
  if args.child:
    return run_child(run_backend, workloads, args)

  # The parent never initializes a JAX backend: the children own the GPU's memory.
  import jax  # pylint: disable=import-outside-toplevel
  result = dict(command=experiments.command_line(__file__, argv),
                device="unknown",
                jax_version=jax.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                config=dict(tokens=args.tokens, max_doc=args.max_doc, seed=args.seed,
                            trials=args.trials, min_trial_s=args.min_trial_s,
                            num_heads=args.heads, num_kv_heads=args.kv_heads,
                            head_dim=args.head_dim, dtype=args.dtype,
                            quick=args.quick, tiny=args.tiny, row_multiple=args.row_multiple,
                            windows=list(args.window_list),
                            sched=dataclasses.asdict(sched_config(args)),
                            mosaic_presets=MOSAIC_PRESETS),
                backends=backends, workloads=[w.name for w in workloads], entries=[],
                backend_wall_s={})
  stem = os.path.splitext(args.out)[0]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  # Children get every resolved setting explicitly (no presets), and the expanded names.
  shared = ["--workloads", ",".join(names), "--tokens", str(args.tokens), "--max-doc",
            str(args.max_doc), "--seed", str(args.seed), "--trials", str(args.trials),
            "--min-trial-s", str(args.min_trial_s), "--heads", str(args.heads), "--kv-heads",
            str(args.kv_heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
            "--sched-tokens", str(args.sched_tokens), "--sched-servers", str(args.sched_servers),
            "--sched-step", str(args.sched_step), "--sched-tolerance", str(args.sched_tolerance),
            "--sched-server", args.sched_server, "--sched-buffers", args.sched_buffers,
            "--row-multiple", str(args.row_multiple), "--windows", args.windows]
  for backend in backends:
    part = f"{stem}.{backend.replace(':', '_')}.part.json"
    cmd = [*experiments.module_argv(__file__), "--child", "--kernels", backend,
           *shared, "--out", part]
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
    result["backend_wall_s"][backend] = time.time() - t0
    print(f"== {backend}: {time.time() - t0:.0f} s", flush=True)
    collect_entries(part, result, workloads, failure, lambda wl: dict(
        workload=wl.name, kind=wl.kind, backend=backend, tasks=wl.num_tasks,
        task_slots=len(wl.cu_q) - 1, q_tokens=wl.cu_q[-1], kv_tokens=wl.cu_k[-1],
        q_rows=wl.q_rows, kv_rows=wl.kv_rows, **(dict(sched=wl.info) if wl.info else {})))
    # Written after every backend, so a run cut short still leaves a table.
    save_result(stem, result, t_main, write_markdown)
  with open(f"{stem}.md") as f:
    print(f.read())
  return 0


def run_child(run_backend, workloads, args) -> int:
  """A backend process: ``run_backend(backend, workloads, args, save)``, where ``save`` writes
  the entries so far to ``args.out`` atomically (the parent reads them even after a crash)."""
  [backend] = args.kernels.split(",")

  def save(entries):
    with open(args.out + ".tmp", "w") as f:
      json.dump(entries, f)
    os.replace(args.out + ".tmp", args.out)

  run_backend(backend, workloads, args, save)
  return 0


def collect_entries(part: str, result: dict, workloads, failure, error_entry) -> None:
  """Adds a backend process's entries (the JSON list it left in ``part``, then removed) to
  ``result['entries']``, and an error entry (``error_entry(wl)`` + status, error) for every
  workload it did not report, so nothing goes missing silently."""
  done = []
  if os.path.exists(part):
    with open(part) as f:
      done = json.load(f)
    os.remove(part)
  result["entries"].extend(done)
  have = {e["workload"] for e in done}
  for wl in workloads:
    if wl.name not in have:
      result["entries"].append(dict(error_entry(wl), status="error",
                                    error=failure or "no result"))


def save_result(stem: str, result: dict, t_main: float, write_md) -> None:
  """Names the device(s) the backend processes reported, stamps the wall time and writes
  STEM.json and (through ``write_md(path, result)``) STEM.md."""
  devices = sorted({e["device"] for e in result["entries"] if "device" in e})
  result["device"] = ", ".join(devices) or "unknown (no backend process reported one)"
  result["wall_s"] = time.time() - t_main
  with open(f"{stem}.json", "w") as f:
    json.dump(result, f, indent=1)
  write_md(f"{stem}.md", result)


if __name__ == "__main__":
  sys.exit(main())
