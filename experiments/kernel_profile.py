"""Where our Pallas core-attention kernel loses to FlashAttention-3: a per-kernel profile.

For each workload and backend (one GPU, bf16, 32 query heads, 8 KV heads, head dim 128):
  1. times forward and forward+backward (kernel_bench's `_time`: median of trials of back-to-back
     calls; backward = forward+backward - forward);
  2. captures one jax.profiler trace (``distca_jax.profiling.capture``) of ``--trace-calls``
     forward+backward calls, each synced and followed by ``--trace-gap-s`` of idle time so the calls
     separate on the device timeline, and breaks one call's device time down per kernel (name,
     count, microseconds, share) with each kernel's role and phase and its achieved TFLOP/s;
  3. ours: records the launch configuration of the three kernels (BlockSizes, warps, stages, grid,
     programs with work), a tile model of the work they execute (tiles visited x matmuls per tile,
     including masked and padded tiles and the backward's recomputation), and where obtainable the
     compiled kernels' registers / shared memory / occupancy (see "Resources" below);
  4. writes OUT.json and OUT.md (same stem; command and device at the top) with a "where the gap
     is" table: per phase, our time against flash3's and the ratio.

Workloads (names as in kernel_bench.py, whose builders are imported, not copied): dense-16384 (one
causal sequence), ca-s512 / ca-s128 (fused CA-task batches of 16K query tokens, tail shards of 512
/ 128 tokens with their key prefixes) and sched-prolong-m512 / -m128 (the most loaded attention
server's task table under the real scheduler, min_shard 512 / 128, 8 ranks x 16K tokens).

FLOP convention (exact, from the task table; padding rows count none):
  forward F = 4 * H * D * pairs (``ops.core_attention_flops``); backward B = 2.5 F
  (``ops.BACKWARD_FLOPS_RATIO``: the 5 useful matmuls S, dP, dV, dK, dQ against the forward's 2).
  A phase's FLOPs are split among that phase's attention kernels (ours: fwd; dq and dkdv; flash3:
  FlashAttnFwd; FlashAttnBwd) in proportion to their device time, so every attention kernel of a
  phase shows the phase's achieved rate over attention kernels. Other kernels (XLA glue: block
  tables, delta, padding; flash3's bwd pre/post-processing and scheduler) get no FLOPs; a phase's
  "TFLOP/s incl. glue" divides its FLOPs by all its kernels' time.
  Ours also gets "executed TFLOP/s" from the tile model: tiles x matmuls x 2 * tile_q * tile_k *
  D_pad over the kernel's time (forward 2 matmuls per tile, dq 3, dkdv 4: our backward recomputes
  S and dP in both kernels, 7 matmuls where FlashAttention's has 5).

Phases: a kernel's phase comes from its name (attention kernels, FA3 pre/post-processing); other
kernels of a call are 'forward' if they start before the call's last forward attention kernel
ends, else 'backward' ('unknown' when a call has no forward attention kernel, as on CPU).

Resources (registers, shared memory, occupancy): CUPTI's per-launch "kernel_details" in the
trace's xplane.pb (read with ``jax.profiler.ProfileData``; ``profiling.load_events`` reads the
trace JSON, where the profiler leaves this stat out), for both backends' kernels. Jax's Pallas
Triton lowering does not expose them: it hands the Triton IR to XLA, which compiles it and keeps
the shared-memory size in its launch thunk. For ours, ``--triton-ir`` (default on a GPU) also
compiles the forward+backward once more as module ``jit_kprof_ir_probe`` with XLA's dump enabled
for that module only (``--xla_dump_to``, ``--xla_dump_hlo_module_re``) and counts in its PTX which
matrix instructions and copies each kernel uses (``wgmma.mma_async`` = Hopper warpgroup MMA,
``mma.sync`` = Ampere MMA, ``cp.async.bulk.tensor`` = TMA, ``cp.async`` = Ampere async copy);
``--triton-pass-logs`` adds Triton's pass logs (shared memory Triton allocated, MMA layout
versions, dots left as ``tt.dot``). The dump is deleted afterwards unless ``--keep-xla-dump``.

Each backend runs in its own subprocess (a crash or a missing package costs only its entries).
flash3 runs only if ``flash_attn3_jax`` imports; otherwise its entries say why.
Run (on a GPU machine):
  python experiments/kernel_profile.py --out results/kernel_profile.json
CPU smoke test (tiny shapes, ours in the Pallas interpreter against the jnp reference; rows are
XLA:CPU thunks, not kernels):
  python experiments/kernel_profile.py --tiny --out /tmp/kernel_profile_tiny.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Iterable, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = os.path.dirname(os.path.abspath(__file__))
for _path in (REPO, EXPERIMENTS):
  if _path not in sys.path:
    sys.path.insert(0, _path)

import kernel_bench as kb  # noqa: E402  (the workload builders and timing helper we reuse)

# kernel_bench's timing helper: warm-up, then trials of back-to-back calls synced at the end.
time_calls = kb._time  # pylint: disable=protected-access

OURS = "pallas"
BACKENDS = ("pallas", "flash3", "reference")
FULL = dict(heads=kb.NUM_HEADS, kv_heads=kb.NUM_KV_HEADS, head_dim=kb.HEAD_DIM, dtype="bfloat16",
            tokens=16384, max_doc=16384, sched_tokens=16384, sched_servers=8, trials=5,
            min_trial_s=0.05, interpret=False, backends="pallas,flash3",
            workloads="dense-16384,ca-s512,ca-s128,sched-prolong-m512,sched-prolong-m128",
            trace_calls=3, trace_gap_s=0.02, triton_ir=True)
# CPU smoke test: ~256 tokens, 2 query heads / 1 KV head, head dim 16, ours interpreted.
TINY = dict(heads=2, kv_heads=1, head_dim=16, tokens=256, max_doc=256, sched_tokens=256,
            sched_servers=4, trials=2, min_trial_s=0.0, interpret=True,
            backends="pallas,reference", workloads="dense-256,ca-s64,sched-prolong-m64",
            trace_calls=2, trace_gap_s=0.05, triton_ir=False)
# Tiles for --tiny: bigger than BlockSizes.for_interpret() (fewer interpreted grid steps, so the
# test stays fast) while the 64-token shards still span several tiles.
TINY_BLOCK = 32
TRITON_IR_MODULE = "kprof_ir_probe"  # the jitted function whose XLA module is dumped
MD_KERNEL_ROWS = 15  # kernel rows per (workload, backend) in the markdown; the JSON has all

# ------------------------------------------------------------------------------------------------
# Kernel roles (pure)
# ------------------------------------------------------------------------------------------------
# (role, phase, pattern searched in the lower-cased "name long_name"); the first match wins.
# Attention roles (ATTENTION_ROLES) carry their phase's FLOPs; the others are auxiliary.
ROLE_PATTERNS: tuple[tuple[str, str | None, str], ...] = (
    ("fwd", "forward", r"varlen_attention_fwd"),
    ("dq", "backward", r"varlen_attention_dq"),
    ("dkdv", "backward", r"varlen_attention_dkv"),
    # FlashAttention-3 (cutlass::device_kernel<flash::...>): pre/post-processing and the
    # split-KV combine first, since their names also contain FlashAttnBwd / FlashAttnFwd.
    ("bwd-pre", "backward", r"bwdpreprocess|bwd_preprocess|dot_do_o"),
    ("bwd-post", "backward", r"bwdpostprocess|bwd_postprocess|convert_?dq|convert_?dkv"),
    ("fwd-combine", "forward", r"fwdcombine|fwd_combine"),
    ("fwd", "forward", r"flashattnfwd|flash_fwd"),
    ("bwd", "backward", r"flashattnbwd|flash_bwd"),
    ("scheduler", None, r"prepare_varlen|prepare_scheduler|scheduler_metadata"),
)
ATTENTION_ROLES = frozenset({"fwd", "dq", "dkdv", "bwd"})
_ROLE_RES = tuple((role, phase, re.compile(p)) for role, phase, p in ROLE_PATTERNS)
_SHORT_RES = tuple(re.compile(p) for p in (
    r"varlen_attention_\w+", r"FlashAttn\w+", r"flash_\w+", r"prepare_varlen\w*"))


def kernel_role(name: str, long_name: str = "") -> tuple[str, str | None]:
  """(role, phase or None) of a kernel from its names; ('glue', None) if nothing matches."""
  text = f"{name} {long_name}".lower()
  for role, phase, pattern in _ROLE_RES:
    if pattern.search(text):
      return role, phase
  return "glue", None


def short_kernel_name(name: str, long_name: str = "") -> str:
  """A readable name: the flash::/our kernel identifier inside a template name, else the name."""
  for text in (name, long_name):
    for pattern in _SHORT_RES:
      m = pattern.search(text)
      if m:
        return m.group(0)
  return name if len(name) <= 64 else name[:61] + "..."


# ------------------------------------------------------------------------------------------------
# Trace analysis (pure; events are profiling.DeviceEvent: device, stream, name, start_us,
# dur_us, long_name, end_us)
# ------------------------------------------------------------------------------------------------


def split_calls(events: Sequence[Any], gap_us: float) -> list[list[Any]]:
  """Splits a trace of back-to-back calls into calls at idle gaps longer than ``gap_us``.

  Events are sorted by start; a new call begins where an event starts more than ``gap_us``
  after every earlier event has ended (so overlapping streams stay in one call).
  """
  calls: list[list[Any]] = []
  end = -math.inf
  for ev in sorted(events, key=lambda e: (e.start_us, e.dur_us)):
    if not calls or ev.start_us > end + gap_us:
      calls.append([])
      end = -math.inf
    calls[-1].append(ev)
    end = max(end, ev.end_us)
  return calls


def assign_phases(call: Sequence[Any]) -> list[tuple[Any, str, str]]:
  """(event, role, phase) for one call's events (phase rule in the module docstring)."""
  roles = [kernel_role(ev.name, ev.long_name) for ev in call]
  fwd_ends = [ev.end_us for ev, (role, phase) in zip(call, roles)
              if role in ATTENTION_ROLES and phase == "forward"]
  fwd_end = max(fwd_ends) if fwd_ends else None
  out = []
  for ev, (role, phase) in zip(call, roles):
    if phase is None:
      phase = "unknown" if fwd_end is None else (
          "forward" if ev.start_us < fwd_end else "backward")
    out.append((ev, role, phase))
  return out


def kernel_breakdown(calls: Sequence[Sequence[Any]], flops_fwd: float, flops_bwd: float,
                     executed_flops: dict[str, float] | None = None,
                     num_calls: int | None = None) -> dict:
  """Per-kernel rows and per-phase sums of one call (means over ``num_calls``).

  Args:
    calls: the events of each call (``split_calls``), or one group holding all of them.
    num_calls: the calls the groups hold; default ``len(calls)``.
    flops_fwd, flops_bwd: the phases' useful FLOPs (module docstring).
    executed_flops: role -> executed FLOPs of that kernel per call (ours' tile model), optional.

  Returns:
    dict(calls, kernels=[row...], phases={phase: sums}, device_us (busy time summed over
    kernels), span_us (first start to last end)), times per call in microseconds.
  """
  if not calls:
    raise ValueError("kernel_breakdown needs at least one call with events; the trace had none")
  n = num_calls or len(calls)
  rows: dict[tuple[str, str], dict] = {}
  spans = []
  for call in calls:
    spans.append(max(e.end_us for e in call) - min(e.start_us for e in call))
    for ev, role, phase in assign_phases(call):
      long_name = ev.long_name
      # Keyed by both names: templated kernels (FA3's cutlass::device_kernel<flash::...>) can
      # share a display name and differ in the long one.
      row = rows.setdefault((ev.name, long_name), dict(
          name=ev.name, short_name=short_kernel_name(ev.name, long_name), long_name=long_name,
          role=role, attention=role in ATTENTION_ROLES, phases={}, count=0.0, total_us=0.0,
          streams=set()))
      row["count"] += 1
      row["total_us"] += ev.dur_us
      row["phases"][phase] = row["phases"].get(phase, 0.0) + ev.dur_us
      row["streams"].add(str(ev.stream))
  device_us = sum(r["total_us"] for r in rows.values()) / n
  phase_flops = {"forward": float(flops_fwd), "backward": float(flops_bwd)}
  phases: dict[str, dict] = {}
  for row in rows.values():
    row["count"] /= n
    row["total_us"] /= n
    row["phases"] = {p: t / n for p, t in row["phases"].items()}
    row["phase"] = max(row["phases"], key=row["phases"].get)  # where most of its time is
    row["mean_us"] = row["total_us"] / row["count"]
    row["share"] = row["total_us"] / device_us if device_us > 0 else 0.0
    row["streams"] = sorted(row["streams"])
    for phase, t in row["phases"].items():
      s = phases.setdefault(phase, dict(attention_us=0.0, other_us=0.0, total_us=0.0))
      s["attention_us" if row["attention"] else "other_us"] += t
      s["total_us"] += t
  for phase, s in phases.items():
    flops = phase_flops.get(phase)
    s["flops"] = flops
    s["tflops_attention"] = (flops / s["attention_us"] / 1e6
                             if flops and s["attention_us"] > 0 else None)
    s["tflops_incl_glue"] = flops / s["total_us"] / 1e6 if flops and s["total_us"] > 0 else None
  role_rows = collections.Counter(r["role"] for r in rows.values())
  for row in rows.values():
    flops = None
    if row["attention"] and row["phase"] in phase_flops:
      att = phases[row["phase"]]["attention_us"]
      flops = phase_flops[row["phase"]] * row["phases"][row["phase"]] / att if att > 0 else None
    row["flops"] = flops
    row["tflops"] = flops / row["total_us"] / 1e6 if flops and row["total_us"] > 0 else None
    # The tile model is per kernel: it applies only where one row has the role.
    executed = ((executed_flops or {}).get(row["role"])
                if row["attention"] and role_rows[row["role"]] == 1 else None)
    row["executed_flops"] = executed
    row["executed_tflops"] = (executed / row["total_us"] / 1e6
                              if executed and row["total_us"] > 0 else None)
  kernels = sorted(rows.values(), key=lambda r: -r["total_us"])
  return dict(calls=n, kernels=kernels, phases=phases, device_us=device_us,
              span_us=sum(spans) / n)


# ------------------------------------------------------------------------------------------------
# Kernel resources: CUPTI kernel_details from the xplane.pb (pure parsers + one reader)
# ------------------------------------------------------------------------------------------------
_DETAIL_RE = re.compile(r"(\w+):([\d.,]+)")


def parse_kernel_details(text: str) -> dict:
  """'regs:168 static_shared:0 dynamic_shared:147456 grid:32,130,1 block:256,1,1 occ_pct:6.25'
  -> dict(regs=168, static_shared=0, dynamic_shared=147456, grid=[32,130,1], block=[256,1,1],
  occ_pct=6.25); unknown keys kept as strings."""
  out: dict[str, Any] = {}
  for key, value in _DETAIL_RE.findall(text):
    if "," in value:
      out[key] = [int(float(v)) for v in value.split(",") if v]
    elif key == "occ_pct":
      out[key] = float(value)
    else:
      try:
        out[key] = int(value)
      except ValueError:
        out[key] = value
  return out


def kernel_details_from_xplane(trace_path: str) -> tuple[dict[str, dict], str]:
  """kernel name -> CUPTI kernel_details of its first launch, from the xplane.pb next to the trace.

  Returns (details, note); note says why details are empty when they are.
  """
  run_dir = os.path.dirname(trace_path)
  paths = sorted(glob.glob(os.path.join(run_dir, "*.xplane.pb")))
  if not paths:
    return {}, f"no *.xplane.pb next to {trace_path}"
  try:
    from jax.profiler import ProfileData  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    return {}, f"jax.profiler.ProfileData unavailable: {e!r}"
  details: dict[str, dict] = {}
  for path in paths:
    data = ProfileData.from_file(path)
    for plane in data.planes:
      if not plane.name.startswith("/device:"):
        continue
      for line in plane.lines:
        for event in line.events:
          if event.name in details:
            continue
          for key, value in event.stats:
            if key == "kernel_details":
              details[event.name] = parse_kernel_details(str(value))
              break
  return details, ("" if details else "the xplane.pb has no kernel_details stats "
                   "(CPU trace, or the profiler recorded none)")


def match_details(details: dict[str, dict], name: str, long_name: str = "") -> dict | None:
  """The kernel_details of a trace row: exact name / long name, else the one key containing the
  name (None when none or several do)."""
  for key in (name, long_name):
    if key and key in details:
      return details[key]
  hits = [value for key, value in details.items() if name and name in key]
  return hits[0] if len(hits) == 1 else None


# ------------------------------------------------------------------------------------------------
# Our kernels: launch configuration and tile model
# ------------------------------------------------------------------------------------------------


def pallas_launch(cu_q: Sequence[int], cu_k: Sequence[int], q_rows: int, kv_rows: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, bs) -> dict:
  """Launch configuration and executed work of our three kernels on one task table.

  Uses the kernel's own block tables and loop bounds (``_query_block_table`` /
  ``_key_block_table`` / ``_key_loop_bounds`` / ``_query_window_bounds``), so the counts are the tiles the kernels visit: a forward / dq tile is one
  (query block, key block) step of a program's loop, a dkdv tile one (key block, query window)
  step for one query head of the GQA group.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from custom_ops import varlen_attention as va  # pylint: disable=import-outside-toplevel

  cu_q_N1 = jnp.asarray(cu_q, jnp.int32)
  cu_k_N1 = jnp.asarray(cu_k, jnp.int32)
  num_tasks = len(cu_q) - 1
  dpad = va.pl.next_power_of_2(int(head_dim))  # the kernel's padded D (_cols)
  group = num_heads // num_kv_heads

  # The kernel's own table builders (private: the kernel's planning code, read-only here).
  query_block_table = va._query_block_table  # pylint: disable=protected-access
  key_block_table = va._key_block_table  # pylint: disable=protected-access
  key_loop_bounds = va._key_loop_bounds  # pylint: disable=protected-access
  query_window_bounds = va._query_window_bounds  # pylint: disable=protected-access  (dkdv loop)

  # One jit per table: the tables are jnp code meant for inside jit; eagerly every op would
  # compile on its own.
  @functools.partial(jax.jit, static_argnums=(2, 3))
  def query_tables(cu_q_N1, cu_k_N1, block_q, block_k):
    meta = query_block_table(cu_q_N1, cu_k_N1, q_rows, block_q)
    n_full, n_blocks = key_loop_bounds(meta[1], meta[3], meta[4], block_k)
    return meta, n_full, n_blocks

  def query_kernel(block_q, block_k, warps, stages, matmuls):
    meta, n_full, n_blocks = query_tables(cu_q_N1, cu_k_N1, block_q, block_k)
    n_full, n_blocks = (np.asarray(x, np.int64) for x in (n_full, n_blocks))
    tiles = num_heads * int(n_blocks.sum())
    return dict(grid=[num_heads, int(meta.shape[1])], programs=num_heads * int(meta.shape[1]),
                programs_with_work=num_heads * int((n_blocks > 0).sum()),
                rows_per_program=block_q, loop_step_rows=block_k, num_warps=warps,
                threads=32 * warps, num_stages=stages, tiles=tiles,
                masked_tiles=num_heads * int((n_blocks - n_full).sum()),
                matmuls_per_tile=matmuls,
                executed_flops=float(tiles * matmuls * 2 * block_q * block_k * dpad))

  out = dict(
      block_sizes=dataclasses.asdict(bs), head_dim_padded=dpad, tasks=num_tasks,
      kernels=dict(
          varlen_attention_fwd=dict(role="fwd", **query_kernel(
              bs.block_q, bs.block_k, bs.num_warps, bs.num_stages, 2)),
          varlen_attention_dq=dict(role="dq", **query_kernel(
              bs.block_q_dq, bs.block_k_dq, bs.num_warps_dq, bs.num_stages_dq, 3))))
  @functools.partial(jax.jit, static_argnums=(2, 3))
  def key_tables(cu_q_N1, cu_k_N1, block_k, block_q):
    meta = key_block_table(cu_q_N1, cu_k_N1, kv_rows, block_k)
    _, n_windows, n_masked = query_window_bounds(meta[3], meta[1], meta[4], block_q, block_k)
    return meta, n_windows, n_masked

  meta, n_windows, n_masked = key_tables(cu_q_N1, cu_k_N1, bs.block_k_dkv, bs.block_q_dkv)
  n_windows, n_masked = (np.asarray(x, np.int64) for x in (n_windows, n_masked))
  tiles = num_heads * int(n_windows.sum())  # grid over KV heads, a loop over the group's heads
  out["kernels"]["varlen_attention_dkv"] = dict(
      role="dkdv", grid=[num_kv_heads, int(meta.shape[1])],
      programs=num_kv_heads * int(meta.shape[1]),
      programs_with_work=num_kv_heads * int((n_windows > 0).sum()),
      rows_per_program=bs.block_k_dkv, loop_step_rows=bs.block_q_dkv, heads_per_program=group,
      num_warps=bs.num_warps_dkv, threads=32 * bs.num_warps_dkv, num_stages=bs.num_stages_dkv,
      tiles=tiles, masked_tiles=num_heads * int(n_masked.sum()), matmuls_per_tile=4,
      executed_flops=float(tiles * 4 * 2 * bs.block_k_dkv * bs.block_q_dkv * dpad))
  return out


# ------------------------------------------------------------------------------------------------
# Triton IR / PTX facts from an XLA dump (pure parsers + the dump reader)
# ------------------------------------------------------------------------------------------------
PTX_PATTERNS = {
    "wgmma": r"\bwgmma\.mma_async",          # Hopper warpgroup MMA
    "mma_sync": r"\bmma\.sync\.",             # Ampere-style warp MMA
    "tma": r"\bcp\.async\.bulk\.tensor",      # TMA copies
    "cp_async": r"\bcp\.async\.c[ag]\.",      # Ampere async global->shared copies
    # Local memory in PTX means stack arrays; register spills appear only after ptxas (SASS).
    "ld_local": r"\bld\.local\.",
    "st_local": r"\bst\.local\.",
}
_PTX_RES = {k: re.compile(v) for k, v in PTX_PATTERNS.items()}
_PTX_ENTRY_RE = re.compile(r"\.entry\s+([\w$.]+)\s*\(")


def ptx_entry_stats(ptx: str) -> dict[str, dict]:
  """Per kernel entry of a PTX module: instruction counts (PTX_PATTERNS) and .maxntid / .reqntid."""
  out = {}
  starts = [(m.start(), m.group(1)) for m in _PTX_ENTRY_RE.finditer(ptx)]
  for i, (pos, name) in enumerate(starts):
    body = ptx[pos: starts[i + 1][0] if i + 1 < len(starts) else len(ptx)]
    stats = {k: len(r.findall(body)) for k, r in _PTX_RES.items()}
    m = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)", body)
    stats["threads"] = int(m.group(1)) if m else None
    out[name] = stats
  return out


_TTG_SHARED_RE = re.compile(r"(?:ttg|triton_gpu)\.shared\s*=\s*(\d+)")
_TTG_WARPS_RE = re.compile(r"\"(?:ttg|triton_gpu)\.num-warps\"\s*=\s*(\d+)")
_MMA_VERSION_RE = re.compile(r"versionMajor\s*=\s*(\d+)")


def triton_pass_log_stats(lines: Iterable[str]) -> dict:
  """Facts from a Triton pass log (XLA's <module>.<kernel>.triton-passes.log): of the last IR dump
  still at the Triton-GPU level (has ``tt.func``), the shared memory Triton allocated, the MMA
  layouts' versions, and the dot ops left (``ttng.warp_group_dot``: wgmma; ``tt.dot``: not)."""
  best: dict | None = None
  cur: dict | None = None

  def finish(section):
    nonlocal best
    if section is not None and section["tt_func"]:
      best = section

  for line in lines:
    if line.startswith("// -----// IR Dump"):
      finish(cur)
      cur = dict(pass_name=line.strip("/- \n").replace("IR Dump ", ""), tt_func=False,
                 shared_bytes=None, num_warps=None, mma_versions=set(), warp_group_dots=0,
                 tt_dots=0, async_copies=0, tma_copies=0)
      continue
    if cur is None:
      continue
    if "tt.func" in line:
      cur["tt_func"] = True
    m = _TTG_SHARED_RE.search(line)
    if m:
      cur["shared_bytes"] = int(m.group(1))
    m = _TTG_WARPS_RE.search(line)
    if m:
      cur["num_warps"] = int(m.group(1))
    if "versionMajor" in line:  # an MMA layout: #ttg.nvidia_mma<{versionMajor = 3, ...}>
      cur["mma_versions"].update(int(v) for v in _MMA_VERSION_RE.findall(line))
    if re.search(r"ttng\.warp_group_dot\b(?!_wait)", line):
      cur["warp_group_dots"] += 1
    if re.search(r"\btt\.dot\b", line):
      cur["tt_dots"] += 1
    if "async_copy_global_to_local" in line:
      cur["async_copies"] += 1
    if "async_tma_copy" in line or "descriptor_load" in line:
      cur["tma_copies"] += 1
  finish(cur)
  if best is None:
    return {}
  best["mma_versions"] = sorted(best["mma_versions"])
  del best["tt_func"]
  return best


def read_xla_dump(dump_dir: str, kernel_names: Sequence[str]) -> dict:
  """PTX entry stats and Triton pass-log facts of ``kernel_names`` from an XLA dump folder."""
  def find(pattern):  # XLA writes some dumps into per-module subfolders
    return sorted(glob.glob(os.path.join(dump_dir, "**", pattern), recursive=True))

  out: dict[str, Any] = {"files": [os.path.relpath(p, dump_dir) for p in find("*")][:20]}
  ptx_paths = find("*.ptx")
  entries: dict[str, dict] = {}
  for path in ptx_paths:
    with open(path, errors="replace") as f:
      entries.update(ptx_entry_stats(f.read()))
  kernels = {}
  for kernel in kernel_names:
    found = {name: s for name, s in entries.items() if name.startswith(kernel)}
    logs = find(f"*{kernel}*.triton-passes.log")
    ir = {}
    if logs:
      with open(logs[0], errors="replace") as f:
        ir = triton_pass_log_stats(f)
    kernels[kernel] = dict(ptx=found or None, triton_ir=ir or None,
                           ptx_entries=sorted(found), pass_logs=[os.path.basename(p)
                                                                 for p in logs])
  out["kernels"] = kernels
  out["ptx_files"] = len(ptx_paths)
  if not ptx_paths:
    out["note"] = ("XLA wrote no *.ptx for the probe module: is the module regex right, or did "
                   "a compilation cache skip compilation?")
  return out


# ------------------------------------------------------------------------------------------------
# Child: one backend, every workload
# ------------------------------------------------------------------------------------------------


def _block_sizes(args, dtype, head_dim):
  from custom_ops import BlockSizes  # pylint: disable=import-outside-toplevel
  if args.interpret:
    return BlockSizes(block_q=TINY_BLOCK, block_k=TINY_BLOCK, block_q_dq=TINY_BLOCK,
                      block_k_dq=TINY_BLOCK, block_k_dkv=TINY_BLOCK, block_q_dkv=TINY_BLOCK)
  return BlockSizes.default_for(dtype, head_dim)


def _attention_fn(backend: str, wl, bs, interpret: bool):
  """attn(q, k, v, cu_q, cu_k) -> o for a backend, as kernel_bench calls them."""
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  if backend == "pallas":
    return lambda q, k, v, cu_q, cu_k: ops.core_attention(
        q, k, v, cu_q, cu_k, backend="pallas", block_sizes=bs, interpret=interpret)
  if backend == "flash3":
    return lambda q, k, v, cu_q, cu_k: ops.core_attention(
        q, k, v, cu_q, cu_k, backend="flash3", max_seqlen_q=wl.max_q, max_seqlen_k=wl.max_k)
  if backend == "reference":
    return lambda q, k, v, cu_q, cu_k: ops.core_attention(q, k, v, cu_q, cu_k,
                                                          backend="reference")
  raise ValueError(f"unknown {backend=}; choose from {BACKENDS}")


def _fwd_bwd_fn(attn):
  """fwd_bwd(q, k, v, cu_q, cu_k, do) -> (o, (dq, dk, dv))."""
  import jax  # pylint: disable=import-outside-toplevel

  def fwd_bwd(q, k, v, cu_q, cu_k, do):
    o, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, cu_q, cu_k), q, k, v)
    return o, vjp(do)
  return fwd_bwd


def triton_ir_probe(wl, args, bs, dump_dir: str) -> dict:
  """Compiles our forward+backward on ``wl`` as module ``jit_kprof_ir_probe`` (dumped by XLA when
  the process was started with the dump flags, see ``_dump_flags``) and reads the dump."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  fwd_bwd = _fwd_bwd_fn(_attention_fn("pallas", wl, bs, args.interpret))

  def kprof_ir_probe(q, k, v, cu_q, cu_k, do):
    return fwd_bwd(q, k, v, cu_q, cu_k, do)

  dt = jnp.dtype(args.dtype)
  shapes = (jax.ShapeDtypeStruct((wl.q_rows, args.heads, args.head_dim), dt),
            jax.ShapeDtypeStruct((wl.kv_rows, args.kv_heads, args.head_dim), dt),
            jax.ShapeDtypeStruct((wl.kv_rows, args.kv_heads, args.head_dim), dt),
            jax.ShapeDtypeStruct((len(wl.cu_q),), jnp.int32),
            jax.ShapeDtypeStruct((len(wl.cu_k),), jnp.int32),
            jax.ShapeDtypeStruct((wl.q_rows, args.heads, args.head_dim), dt))
  assert kprof_ir_probe.__name__ == TRITON_IR_MODULE
  t0 = time.perf_counter()
  jax.jit(kprof_ir_probe).lower(*shapes).compile()
  out = read_xla_dump(dump_dir, ["varlen_attention_fwd", "varlen_attention_dq",
                                 "varlen_attention_dkv"])
  out.update(workload=wl.name, compile_s=time.perf_counter() - t0)
  return out


def _dump_flags(dump_dir: str, pass_logs: bool) -> str:
  """XLA flags dumping the IR probe module only: its HLO and PTX, and with ``pass_logs`` each
  Triton kernel's pass log (the IR printed before and after every Triton pass: large)."""
  flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_module_re=.*{TRITON_IR_MODULE}.*"
  if pass_logs:
    # Newer XLA checks the emitter regex, older the pass regex; both flags exist in jaxlib 0.11.
    flags += " --xla_dump_emitter_re=triton-fusion --xla_dump_hlo_pass_re=triton-fusion-emitter"
  return flags


def run_backend(backend: str, workloads: list, args, save) -> list[dict]:
  """Times, traces and breaks down one backend on every workload; ``save(entries)`` after each."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from distca_jax import ops  # pylint: disable=import-outside-toplevel
  from distca_jax import profiling  # pylint: disable=import-outside-toplevel

  dt = jnp.dtype(args.dtype)
  heads, kv_heads, head_dim = args.heads, args.kv_heads, args.head_dim
  device = jax.devices()[0]
  unavailable = None
  if backend == "flash3":
    try:
      ops.import_flash3()
    except ops.BackendUnavailableError as e:
      unavailable = str(e)
  entries = []
  bs = _block_sizes(args, dt, head_dim) if backend == OURS else None
  for wl in workloads:
    t_entry = time.perf_counter()
    flops_fwd = ops.core_attention_flops(wl.cu_q, wl.cu_k, num_q_heads=heads, head_dim=head_dim)
    entry = dict(workload=wl.name, kind=wl.kind, backend=backend, device=device.device_kind,
                 tasks=wl.num_tasks, task_slots=len(wl.cu_q) - 1, q_tokens=wl.cu_q[-1],
                 kv_tokens=wl.cu_k[-1], q_rows=wl.q_rows, kv_rows=wl.kv_rows,
                 pairs=ops.attention_pairs(wl.cu_q, wl.cu_k), flops_fwd=flops_fwd,
                 flops_bwd=flops_fwd * ops.BACKWARD_FLOPS_RATIO,
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
      attn = _attention_fn(backend, wl, bs, args.interpret)
      fwd = jax.jit(attn)
      fwd_bwd = jax.jit(_fwd_bwd_fn(attn))
      inputs = (q, k, v, cu_q, cu_k)

      # 1. Timing (kernel_bench's helper: warm-up, then trials of back-to-back calls).
      t_fwd, fwd_trials, fwd_reps = time_calls(fwd, inputs, args.min_trial_s, args.trials)
      t_fb, fb_trials, fb_reps = time_calls(fwd_bwd, (*inputs, do), args.min_trial_s,
                                            args.trials)
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
      executed = None
      if backend == OURS:
        launch = pallas_launch(wl.cu_q, wl.cu_k, wl.q_rows, wl.kv_rows, heads, kv_heads,
                               head_dim, bs)
        entry["launch"] = launch
        executed = {k["role"]: k["executed_flops"] for k in launch["kernels"].values()}
      breakdown = kernel_breakdown(split, flops_fwd, entry["flops_bwd"], executed,
                                   num_calls=args.trace_calls)
      details, note = kernel_details_from_xplane(trace_path)
      trace["kernel_details_note"] = note
      for row in breakdown["kernels"]:
        row["details"] = match_details(details, row["name"], row["long_name"])
      trace.update(breakdown)
      if not args.interpret and not any(r["attention"] and r["phase"] == "forward"
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

  # 3. Ours: Triton IR / PTX facts of the compiled kernels (first workload that ran).
  if backend == OURS and args.triton_ir_dir:
    ok = [wl for wl, e in zip(workloads, entries) if e.get("status") == "ok"]
    if ok:
      try:
        ir = triton_ir_probe(ok[0], args, bs, args.triton_ir_dir)
      except Exception as e:  # pylint: disable=broad-except
        ir = dict(error=f"{type(e).__name__}: {str(e)[:1500]}")
      for e in entries:
        e["triton_ir"] = ir
      save(entries)
  return entries


# ------------------------------------------------------------------------------------------------
# Parent: one subprocess per backend, the gap table, JSON + markdown
# ------------------------------------------------------------------------------------------------


def _ok(entry: dict | None) -> bool:
  return entry is not None and entry.get("status") == "ok"


def _ratio(a, b):
  return a / b if a is not None and b else None


def baseline_backend(entries: list[dict], ours: str = OURS) -> str | None:
  """flash3 when it produced results, else the first other backend that did (the CPU test's
  reference), else None."""
  ok = [e["backend"] for e in entries if _ok(e) and e["backend"] != ours]
  if "flash3" in ok:
    return "flash3"
  return ok[0] if ok else None


def gap_table(entries: list[dict], workloads: Sequence[str], ours: str = OURS) -> dict:
  """Per workload and phase: our time against the baseline's, from the trace and from timing.

  Trace times are the phase's kernels per call (attention + glue) and its attention kernels
  only; timed: forward, forward+backward - forward, and forward+backward. The share of the gap is
  the phase's (ours - baseline) trace time over the whole call's.
  """
  base = baseline_backend(entries, ours)
  by = {(e["workload"], e["backend"]): e for e in entries}
  rows = []
  for wl in workloads:
    o, b = by.get((wl, ours)), by.get((wl, base))
    if not (_ok(o) and _ok(b)):
      others = [e for e in entries if e["workload"] == wl and e["backend"] != ours]
      note = [f"{ours}: {o.get('status') if o else 'missing'}"] if not _ok(o) else []
      if base is None:
        note.append("no baseline backend ran (" + ", ".join(
            f"{e['backend']}: {e.get('status')}" for e in others) + ")" if others else
                    "no baseline backend requested")
      elif not _ok(b):
        note.append(f"{base}: {b.get('status') if b else 'missing'}")
      rows.append(dict(workload=wl, phase=None, note="; ".join(note)))
      continue
    # Forward and backward always (their timed columns exist even where the trace cannot tell
    # the phases apart, as on CPU), 'unknown' where the trace has it.
    phases = ["forward", "backward"]
    if "unknown" in o["trace"]["phases"] or "unknown" in b["trace"]["phases"]:
      phases.append("unknown")
    timed = {"forward": "fwd_ms", "backward": "bwd_ms", "total": "fwd_bwd_ms"}
    total_gap = (o["trace"]["device_us"] - b["trace"]["device_us"]) / 1e3
    for phase in phases + ["total"]:
      if phase == "total":
        ours_ms, base_ms = o["trace"]["device_us"] / 1e3, b["trace"]["device_us"] / 1e3
        ours_att = sum(s["attention_us"] for s in o["trace"]["phases"].values()) / 1e3
        base_att = sum(s["attention_us"] for s in b["trace"]["phases"].values()) / 1e3
        flops = o["flops_fwd"] + o["flops_bwd"]
      else:
        os_, bs_ = o["trace"]["phases"].get(phase), b["trace"]["phases"].get(phase)
        if os_ is None and bs_ is None:  # neither trace has this phase
          ours_ms = base_ms = ours_att = base_att = None
        else:
          os_, bs_ = os_ or {}, bs_ or {}
          ours_ms, base_ms = os_.get("total_us", 0.0) / 1e3, bs_.get("total_us", 0.0) / 1e3
          ours_att = os_.get("attention_us", 0.0) / 1e3
          base_att = bs_.get("attention_us", 0.0) / 1e3
        flops = {"forward": o["flops_fwd"], "backward": o["flops_bwd"]}.get(phase)
      gap = None if ours_ms is None else ours_ms - base_ms
      key = timed.get(phase)
      ours_t = o["timing"].get(key) if key else None
      base_t = b["timing"].get(key) if key else None
      rows.append(dict(
          workload=wl, phase=phase, ours_ms=ours_ms, base_ms=base_ms,
          ratio=_ratio(ours_ms, base_ms), gap_ms=gap,
          gap_share=gap / total_gap if gap is not None and total_gap else None,
          ours_attention_ms=ours_att, base_attention_ms=base_att,
          attention_ratio=_ratio(ours_att, base_att),
          ours_tflops=flops / ours_att / 1e9 if flops and ours_att else None,
          base_tflops=flops / base_att / 1e9 if flops and base_att else None,
          ours_timed_ms=ours_t, base_timed_ms=base_t, timed_ratio=_ratio(ours_t, base_t)))
  return dict(ours=ours, baseline=base, rows=rows)


def _f(x, digits=3):
  return "-" if x is None else f"{x:.{digits}f}"


_tf = kb._tflops  # pylint: disable=protected-access  (one TFLOP/s format for both tables)


def _md_escape(s: str) -> str:
  return s.replace("|", "\\|")


def write_markdown(path: str, result: dict) -> None:
  """The report: gap table, per-kernel rows, our launch configuration, Triton IR facts, errors."""
  cfg = result["config"]
  gap = result["gap"]
  base = gap["baseline"] or "baseline"
  lines = [
      "# Kernel profile: our Pallas kernel against FlashAttention-3",
      "",
      f"- command: `{result['command']}`",
      f"- device: {result['device']}; jax {result['jax_version']}; {result['date']}; wall time "
      f"{_f(result.get('wall_s'), 0)} s",
      f"- {cfg['num_heads']} query heads, {cfg['num_kv_heads']} KV heads, head dim "
      f"{cfg['head_dim']}, {cfg['dtype']}"
      + (", ours in the Pallas interpreter (CPU: rows are XLA:CPU thunks, not kernels)"
         if cfg["interpret"] else "")
      + f"; trace: {cfg['trace_calls']} forward+backward calls, {cfg['trace_gap_s']} s apart; "
      f"timing: median of {cfg['trials']} trials",
      "- backends: " + "; ".join(f"{b}: {s}" for b, s in result["backend_status"].items()),
      "- FLOPs exact from the task table: forward F = 4*H*D*pairs, backward 2.5 F. A phase's "
      "FLOPs are split among its attention kernels by device time (each shows the phase's rate); "
      "glue kernels get none. 'executed' (ours): tile model, tiles x matmuls x 2*tq*tk*Dpad "
      "(fwd 2, dq 3, dkdv 4 matmuls per tile).",
      "- phase of glue kernels: before the end of the call's forward attention kernel = forward, "
      "after = backward. Times are per call (mean over the traced calls).",
      "",
      f"## Where the gap is ({gap['ours']} vs {base})",
      "",
      "Trace: the phase's kernels per call (attention + glue); attention: attention kernels only; "
      "timed: forward, (forward+backward) - forward, forward+backward. Share: the phase's part "
      "of the whole call's trace-time gap.",
      "",
      f"| workload | phase | {gap['ours']} ms | {base} ms | ratio | gap ms | share | "
      f"attn {gap['ours']} ms | attn {base} ms | attn ratio | {gap['ours']} TFLOP/s | "
      f"{base} TFLOP/s | timed {gap['ours']} ms | timed {base} ms | timed ratio |",
      "|---|---|" + "---:|" * 13,
  ]
  for r in gap["rows"]:
    if r["phase"] is None:
      lines.append(f"| {r['workload']} | - | {_md_escape(r['note'])} |" + " |" * 12)
      continue
    lines.append(
        f"| {r['workload']} | {r['phase']} | {_f(r['ours_ms'])} | {_f(r['base_ms'])} | "
        f"{_f(r['ratio'], 2)} | {_f(r['gap_ms'])} | {_f(r['gap_share'], 2)} | "
        f"{_f(r['ours_attention_ms'])} | {_f(r['base_attention_ms'])} | "
        f"{_f(r['attention_ratio'], 2)} | {_tf(r['ours_tflops'])} | {_tf(r['base_tflops'])} | "
        f"{_f(r['ours_timed_ms'])} | {_f(r['base_timed_ms'])} | {_f(r['timed_ratio'], 2)} |")

  lines += ["", "## Per-kernel breakdown (one call)", ""]
  for e in result["entries"]:
    head = f"### {e['workload']} / {e['backend']}"
    if not _ok(e):
      lines += [head, "", f"{e.get('status')}: {_md_escape(str(e.get('error', ''))[:600])}", ""]
      continue
    t = e["trace"]
    tm = e["timing"]
    lines += [
        head, "",
        f"device time {_f(t['device_us'] / 1e3)} ms per call (span {_f(t['span_us'] / 1e3)} ms, "
        f"{t['calls']} call(s), {t['events']} events); timed forward {_f(tm['fwd_ms'])} ms "
        f"({_tf(tm['fwd_tflops'])} TFLOP/s), forward+backward {_f(tm['fwd_bwd_ms'])} ms "
        f"({_tf(tm['fwd_bwd_tflops'])} TFLOP/s)"
        + (f"; note: {t['call_split_note']}" if "call_split_note" in t else "")
        + (f"; note: {t['attention_note']}" if "attention_note" in t else ""),
        "",
        "| kernel | role | phase | count | us | share | TFLOP/s | executed TFLOP/s | regs | "
        "smem KiB | grid | block | occ % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    rows = t["kernels"]
    for row in rows[:MD_KERNEL_ROWS]:
      d = row.get("details") or {}
      smem = (d.get("static_shared", 0) + d.get("dynamic_shared", 0)) / 1024 if d else None
      lines.append(
          f"| `{_md_escape(row['short_name'])}` | {row['role']} | {row['phase']} | "
          f"{row['count']:.3g} | {row['total_us']:.1f} | {row['share']:.3f} | "
          f"{_tf(row['tflops'])} | {_tf(row['executed_tflops'])} | {d.get('regs', '-')} | "
          f"{_f(smem, 1)} | {','.join(map(str, d.get('grid', []))) or '-'} | "
          f"{','.join(map(str, d.get('block', []))) or '-'} | {_f(d.get('occ_pct'), 1)} |")
    if len(rows) > MD_KERNEL_ROWS:
      rest = rows[MD_KERNEL_ROWS:]
      lines.append(f"| {len(rest)} more | | | {sum(r['count'] for r in rest):.3g} | "
                   f"{sum(r['total_us'] for r in rest):.1f} | "
                   f"{sum(r['share'] for r in rest):.3f} | | | | | | | |")
    lines += ["", "| phase | attention us | glue us | total us | TFLOP/s attention | "
              "TFLOP/s incl. glue |", "|---|---:|---:|---:|---:|---:|"]
    for phase, s in sorted(t["phases"].items()):
      lines.append(f"| {phase} | {s['attention_us']:.1f} | {s['other_us']:.1f} | "
                   f"{s['total_us']:.1f} | {_tf(s['tflops_attention'])} | "
                   f"{_tf(s['tflops_incl_glue'])} |")
    if t.get("kernel_details_note"):
      lines += ["", f"registers / shared memory: {t['kernel_details_note']}"]
    lines.append("")

  launches = [e for e in result["entries"] if _ok(e) and "launch" in e]
  if launches:
    lines += ["## Our kernels: launch configuration and executed work", "",
              "Tiles: loop steps of all programs (dkdv: per query head of the group); executed / "
              "useful: the tile model's FLOPs over the phase's exact FLOPs (masking, partial "
              "tiles, padding of D, and the backward's recomputation).", "",
              "| workload | kernel | grid | programs (with work) | rows x step | warps | stages | "
              "tiles (masked) | matmuls / tile | executed / useful |",
              "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for e in launches:
      kernels = e["launch"]["kernels"]
      bwd_exec = kernels["varlen_attention_dq"]["executed_flops"] + \
          kernels["varlen_attention_dkv"]["executed_flops"]
      for name, k in kernels.items():
        useful = e["flops_fwd"] if k["role"] == "fwd" else e["flops_bwd"]
        ratio = (k["executed_flops"] / useful if k["role"] == "fwd" else bwd_exec / useful) \
            if useful else None
        lines.append(
            f"| {e['workload']} | {name} | {','.join(map(str, k['grid']))} | {k['programs']} "
            f"({k['programs_with_work']}) | {k['rows_per_program']} x {k['loop_step_rows']} | "
            f"{k['num_warps']} | {k['num_stages']} | {k['tiles']} ({k['masked_tiles']}) | "
            f"{k['matmuls_per_tile']} | {_f(ratio, 2)}"
            + (" (dq + dkdv)" if k["role"] != "fwd" else "") + " |")
    lines.append("")

  ir = next((e["triton_ir"] for e in result["entries"] if "triton_ir" in e), None)
  lines += ["## Our compiled Triton kernels (XLA dump of one forward+backward compile)", ""]
  if ir is None:
    lines += ["not collected (--no-triton-ir, interpret mode, or no workload ran)", ""]
  elif "error" in ir:
    lines += [f"failed: {_md_escape(ir['error'][:800])}", ""]
  else:
    lines += [f"workload {ir['workload']}; {ir['ptx_files']} PTX file(s)"
              + (f"; {ir['note']}" if ir.get("note") else ""), "",
              "| kernel | Triton shared KiB | MMA layout versions | warp_group_dot ops | "
              "tt.dot left | PTX wgmma | PTX mma.sync | PTX TMA | PTX cp.async | PTX ld/st.local | "
              "threads |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, k in ir["kernels"].items():
      tir = k.get("triton_ir") or {}
      ptx = {}
      for s in (k.get("ptx") or {}).values():
        for key, val in s.items():
          if isinstance(val, int) and key != "threads":
            ptx[key] = ptx.get(key, 0) + val
          elif key == "threads":
            ptx["threads"] = val
      shared = tir.get("shared_bytes")
      lines.append(
          f"| {name} | {_f(shared / 1024 if shared is not None else None, 1)} | "
          f"{tir.get('mma_versions', '-')} | {tir.get('warp_group_dots', '-')} | "
          f"{tir.get('tt_dots', '-')} | {ptx.get('wgmma', '-')} | {ptx.get('mma_sync', '-')} | "
          f"{ptx.get('tma', '-')} | {ptx.get('cp_async', '-')} | "
          f"{ptx.get('ld_local', '-')}/{ptx.get('st_local', '-')} | {ptx.get('threads', '-')} |")
    lines.append("")
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def parse_args(argv=None) -> argparse.Namespace:
  """Parses flags and fills unset ones from FULL, overlaid by --tiny."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default=os.path.join(REPO, "results", "kernel_profile.json"))
  parser.add_argument("--tiny", action="store_true",
                      help="CPU smoke test: tiny shapes, ours interpreted + the jnp reference")
  parser.add_argument("--backends", help=f"comma list of {BACKENDS}; default {FULL['backends']}")
  parser.add_argument("--workloads", help="comma list of kernel_bench names (dense-<L>, ca-s<S>, "
                      f"sched-<W>-m<S>); default {FULL['workloads']}")
  parser.add_argument("--heads", type=int)
  parser.add_argument("--kv-heads", type=int)
  parser.add_argument("--head-dim", type=int)
  parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--interpret", action=argparse.BooleanOptionalAction, default=None,
                      help="ours in the Pallas interpreter (CPU); default on with --tiny only")
  parser.add_argument("--tokens", type=int, help="query tokens per ca-s batch")
  parser.add_argument("--max-doc", type=int, help="ca-s: largest document length")
  parser.add_argument("--sched-tokens", type=int, help="sched: tokens per rank")
  parser.add_argument("--sched-servers", type=int, help="sched: ranks = servers")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trials", type=int)
  parser.add_argument("--min-trial-s", type=float)
  parser.add_argument("--trace-calls", type=int, help="forward+backward calls in the trace")
  parser.add_argument("--trace-gap-s", type=float, help="idle seconds after each traced call")
  parser.add_argument("--triton-ir", action=argparse.BooleanOptionalAction, default=None,
                      help="ours: dump one compile's PTX / Triton pass logs and read them "
                      "(default on a GPU)")
  parser.add_argument("--triton-pass-logs", action="store_true",
                      help="with --triton-ir: also dump and read Triton's pass logs (shared "
                      "memory Triton allocated, MMA layout versions; can be GBs)")
  parser.add_argument("--keep-xla-dump", action="store_true",
                      help="keep the XLA dump folder next to the output instead of deleting it")
  parser.add_argument("--child-timeout-s", type=float, default=1500)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--trace-dir", help="where the traces go (default: <out stem>_traces; "
                      "each (workload, backend) gets a folder to open in Perfetto / XProf)")
  parser.add_argument("--command-buffers", action=argparse.BooleanOptionalAction, default=True,
                      help="leave XLA's CUDA-graph command buffers on (default, as in training); "
                      "--no-command-buffers turns them off in case the trace shows graphs "
                      "instead of kernels")
  parser.add_argument("--triton-ir-dir", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  fill = dict(FULL)
  fill.update(TINY if args.tiny else {})
  for name, value in fill.items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.interpret:
    args.triton_ir = False  # nothing is compiled by Triton in the interpreter
  for b in args.backends.split(","):
    if b not in BACKENDS:
      parser.error(f"--backends: unknown backend {b!r}; choose from {BACKENDS}")
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
  workloads = kb.make_workloads(names, args.tokens, args.max_doc, args.seed, _sched_config(args))
  stem = os.path.splitext(os.path.abspath(args.out))[0]
  if args.child:
    return kb.run_child(run_backend, workloads, args)

  # The parent never initializes a JAX backend: the children own the GPU's memory.
  import jax  # pylint: disable=import-outside-toplevel
  os.makedirs(os.path.dirname(stem), exist_ok=True)
  trace_dir = os.path.abspath(args.trace_dir or stem + "_traces")
  backends = args.backends.split(",")
  command = " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:] if argv is None else
                     ["experiments/kernel_profile.py", *argv])
  result = dict(
      command=command, device="unknown", jax_version=jax.__version__,
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      config=dict(num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, interpret=args.interpret, tokens=args.tokens,
                  max_doc=args.max_doc, seed=args.seed, trials=args.trials,
                  min_trial_s=args.min_trial_s, trace_calls=args.trace_calls,
                  trace_gap_s=args.trace_gap_s, triton_ir=args.triton_ir,
                  triton_pass_logs=args.triton_pass_logs,
                  command_buffers=args.command_buffers, tiny=args.tiny,
                  sched=dataclasses.asdict(_sched_config(args)), trace_dir=trace_dir),
      flops_convention=__doc__[__doc__.index("FLOP convention"):__doc__.index("Phases:")].strip(),
      backends=backends, workloads=names, entries=[], backend_status={}, backend_wall_s={})
  shared = ["--workloads", ",".join(names), "--tokens", str(args.tokens), "--max-doc",
            str(args.max_doc), "--seed", str(args.seed), "--trials", str(args.trials),
            "--min-trial-s", str(args.min_trial_s), "--heads", str(args.heads), "--kv-heads",
            str(args.kv_heads), "--head-dim", str(args.head_dim), "--dtype", args.dtype,
            "--interpret" if args.interpret else "--no-interpret", "--sched-tokens",
            str(args.sched_tokens), "--sched-servers", str(args.sched_servers),
            "--trace-calls", str(args.trace_calls), "--trace-gap-s", str(args.trace_gap_s),
            "--trace-dir", trace_dir]
  for backend in backends:
    part = f"{stem}.{backend}.part.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backends", backend,
           *shared, "--out", part]
    env = dict(os.environ)
    if not args.command_buffers:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    if args.interpret:
      # CPU smoke test: compiling the interpreted kernels dominates and their times mean nothing,
      # so XLA:CPU skips its backend optimizations (about 40% less compile time).
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    dump_dir = None
    if backend == OURS and args.triton_ir:
      dump_dir = (stem + "_xla_dump") if args.keep_xla_dump else tempfile.mkdtemp(
          prefix="kprof_xla_dump_")
      os.makedirs(dump_dir, exist_ok=True)
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " "
                          + _dump_flags(dump_dir, args.triton_pass_logs)).strip()
      cmd += ["--triton-ir-dir", dump_dir]
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
    finally:
      if dump_dir and not args.keep_xla_dump:
        shutil.rmtree(dump_dir, ignore_errors=True)
    result["backend_wall_s"][backend] = time.time() - t0
    kb.collect_entries(part, result, workloads, failure,
                       lambda wl: dict(workload=wl.name, kind=wl.kind, backend=backend))
    statuses = sorted({e["status"] for e in result["entries"] if e["backend"] == backend})
    unavailable = next((e["error"] for e in result["entries"]
                        if e["backend"] == backend and e["status"] == "unavailable"), None)
    result["backend_status"][backend] = (
        f"unavailable ({unavailable.split('. Import failed')[0]})" if unavailable else
        "ok" if statuses == ["ok"] else "/".join(statuses)) + (
        " (ours)" if backend == OURS else "")
    print(f"== {backend}: {time.time() - t0:.0f} s", flush=True)
    # Written after every backend, so a run cut short still leaves a report.
    result["gap"] = gap_table(result["entries"], names)
    kb.save_result(stem, result, t_main, write_markdown)
  with open(f"{stem}.md") as f:
    print(f.read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
