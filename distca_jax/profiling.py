"""Profiled steps: where a step's device time goes, per rank, and which rank straggles.

  capture(fn, *args, logdir)   one jitted call under `jax.profiler.trace` -> its trace file
  load_events(trace_path)      the trace's device-side kernels / ops as `DeviceEvent`s
  step_report(events)          per device: busy time, time per category, exposed communication;
                               across devices: max / mean of attention, matmul, compute, busy
  format_report(report)        the same as a markdown table, one row per device
  step_breakdown(events, op_names)  per device: time per kernel class of a train step (attention,
                               collective, LM head + loss, optimizer, matmul, copy, elementwise)
                               and host gaps; `hlo_op_names(compiled.as_text())` gives op_names
  profile_train_step(...)      all of the above for one train step, report.json + report.md written

All times are unions of intervals (a device running two kernels at once on two streams is busy
once), computed exactly by the small pure functions `merge_intervals`, `subtract_intervals` and
`total_length`.

What jax 0.11 writes (read from the xprof/tsl sources and checked on a CPU trace made here):
- `jax.profiler.trace(logdir)` writes LOGDIR/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/ with
  <host>.xplane.pb and <host>.trace.json.gz (Chrome trace-event JSON: "X" events with `ts` and
  `dur` in microseconds; "M" events naming processes and threads; Perfetto and XProf open it).
  The JSON holds at most 1e6
  events (the latest are dropped beyond that; `load_events` warns), so profile one step.
- GPU: each GPU is a process named "/device:GPU:N" (pid 1 + N, N the host-local ordinal). Its
  threads are CUDA streams, named "Stream #<id>" or "Stream #<id>(<kinds>)", with one event per
  kernel or memcpy, named after the kernel (a display name; `args.long_name` holds the full one
  when they differ) and linked to HLO by `args.hlo_op` / `args.hlo_module`. Derived lines ("XLA
  Ops", "XLA Modules", "Steps", ...; thread ids from 0xdeadbeef) repeat the same time and are
  skipped, as are "CUPTI overhead" lines.
- CPU: there are no device processes. Everything is in one process "/host:CPU"; XLA:CPU's thunk
  executor writes one event per executed HLO thunk, named after the HLO op (`ynn_fusion.1`,
  `wrapped_tanh`, `all-reduce`, `while.14`, ...) with args device_ordinal / hlo_module / hlo_op,
  on the PjRt client's worker threads ("tf_XLAPjRtCpuClient/..."). Those events are the device
  events on CPU, with the thread as stream. Matmuls run inside `ynn_fusion`s (YNNPACK), so on CPU
  they land in 'other'; a collective's event includes its rendezvous wait for the other devices.
- Control-flow thunks (`while.N`, conditionals) enclose their body's thunks on the same thread;
  `load_events` keeps the innermost events only (on GPU a stream never nests, so this changes
  nothing there).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import re
import socket
import statistics
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

import jax

from distca_jax.model import LM_HEAD_SCOPE

# ------------------------------------------------------------------------------------------------
# Kernel categories
# ------------------------------------------------------------------------------------------------
# Regular expressions searched (re.search) in the lower-cased kernel name, then in its long name
# and its HLO op name; the first category with a match wins, in this order. Attention comes first
# because FlashAttention-3 kernels are CUTLASS templates (`cutlass::device_kernel<flash::...>`)
# that the matmul patterns would also match. Names matching nothing are 'other'; the report lists
# the top 'other' names by time, so a new GPU kernel family shows up there: add it here.
CATEGORY_PATTERNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", (
        r"flash",             # FlashAttention 2/3 kernels (flash_fwd_kernel, FlashAttnFwdSm90,
                              # FlashAttnBwdSm90, flash_bwd_dot_do_o_kernel, ...) and the FFI
                              # targets of flash-attn3-jax: flash_mha_{,varlen_}{fwd,bwd}
        r"fmha",              # fused MHA kernels (cuDNN, CK's FmhaFwd / FmhaBwd, xformers)
        r"sdpa",              # cuDNN fused scaled-dot-product attention graphs
        r"attention|attn",    # attention kernels named as such (ours: mosaic_attention_*;
                              # tokamax)
    )),
    ("collective", (
        r"nccl",              # every NCCL kernel: ncclDevKernel_AllGather_RING_LL, ..._SendRecv
        # HLO collectives (all-to-all.3, all-gather-start.1, ...) and kernels named after them;
        # (?<![a-z]) keeps e.g. "small_reduce" out.
        r"(?<![a-z])all[-_ ]?to[-_ ]?all",
        r"(?<![a-z])all[-_ ]?gather",
        r"(?<![a-z])reduce[-_ ]?scatter",
        r"(?<![a-z])all[-_ ]?reduce",
        r"(?<![a-z])collective[-_ ]?(?:permute|broadcast)",
        r"send[-_ ]?recv",
        r"(?<![a-z])(?:send|recv)(?![a-z])",  # HLO send / recv (-done) ops
    )),
    ("matmul", (
        r"gemm",              # cuBLAS(Lt) / CUTLASS gemm kernels (sm90_xmma_gemm_...,
                              # ampere_..._gemm) and XLA's Triton GEMM fusions (gemm_fusion_dot_...)
        r"cublas",
        r"cutlass",
        r"nvjet",             # cuBLASLt's Hopper kernels (nvjet_tst_..., nvjet_hsh_...)
        r"xmma",
        r"wgmma",
        r"matmul",
        r"cijk",              # rocBLAS / hipBLASLt (Cijk_Alik_Bljk_...)
        r"(?<![a-z])dot(?![a-z])",  # HLO dot ops and dot fusions (dot.3, fusion_dot_1)
    )),
)
CATEGORIES = tuple(name for name, _ in CATEGORY_PATTERNS) + ("other",)
_COMPILED = tuple((name, re.compile("|".join(f"(?:{p})" for p in pats)))
                  for name, pats in CATEGORY_PATTERNS)

# Trace layout (see the module docstring).
DEVICE_PROCESS_RE = re.compile(r"/device:GPU:(\d+)")
DERIVED_TID_MIN = 0xDEADBEEF        # xprof's first derived-line thread id ...
DERIVED_TID_SPAN = 512              # ... and a generous bound on how many follow it
DERIVED_LINE_NAMES = frozenset({
    "Steps", "XLA Modules", "XLA Ops", "XLA TraceMe", "TensorFlow Ops", "TensorFlow Name Scope",
    "Framework Ops", "Framework Name Scope", "Source code", "Launch Stats", "CUPTI overhead",
    "Host Offload Op Start", "Host Offload Op End",
})
TRACE_GLOB = "*.trace.json.gz"
TRACE_EVENT_CAP = 1_000_000         # the exporter keeps the earliest this many events
OTHER_TOP = 10                      # 'other' names listed in a report's text
OTHER_KEPT = 60                     # names kept per class in the report's dict (its JSON)
OTHER_TOP_OPS = 3                   # HLO instructions listed per 'other' name
TOP_NAMED = ("attention", "other")   # categories whose top kernel names a report lists
_NEST_EPS_US = 1e-2                 # trace timestamps are rounded to the ns: containment slack


# ------------------------------------------------------------------------------------------------
# Interval arithmetic (pure; intervals are (start, end) with start <= end)
# ------------------------------------------------------------------------------------------------
Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
  """The union as sorted, disjoint, non-empty intervals (touching intervals are joined)."""
  merged: list[Interval] = []
  for start, end in sorted(intervals):
    if end < start:
      raise ValueError(f"interval ({start}, {end}) ends before it starts")
    if end == start:
      continue
    if merged and start <= merged[-1][1]:
      if end > merged[-1][1]:
        merged[-1] = (merged[-1][0], end)
    else:
      merged.append((start, end))
  return merged


def subtract_intervals(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
  """a minus b; both merged (sorted, disjoint). The result is merged too."""
  out: list[Interval] = []
  j = 0
  for start, end in a:
    while j < len(b) and b[j][1] <= start:
      j += 1
    cur = start
    k = j
    while k < len(b) and b[k][0] < end:
      if b[k][0] > cur:
        out.append((cur, b[k][0]))
      cur = max(cur, b[k][1])
      if cur >= end:
        break
      k += 1
    if cur < end:
      out.append((cur, end))
  return out


def total_length(merged: Iterable[Interval]) -> float:
  """Summed length of disjoint intervals."""
  return sum(end - start for start, end in merged)


# ------------------------------------------------------------------------------------------------
# Events and classification
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceEvent:
  """One device-side kernel / op execution.

  device: the device number (GPU: N of "/device:GPU:N", host-local; CPU: XLA's device_ordinal).
  stream: the CUDA stream line ("Stream #13(Kernel)") or, on CPU, the executing thread's name.
  name: kernel (GPU) or HLO op (CPU) name as the trace shows it.
  start_us, dur_us: trace clock, microseconds.
  hlo_op, long_name: `args.hlo_op` and `args.long_name` when the trace has them, else "".
  bytes: a memcpy's size (`size:N` of `args.memcpy_details`), else 0.
  """
  device: int
  stream: str
  name: str
  start_us: float
  dur_us: float
  hlo_op: str = ""
  long_name: str = ""
  bytes: int = 0

  @property
  def end_us(self) -> float:
    return self.start_us + self.dur_us


@functools.lru_cache(maxsize=None)  # kernel names repeat across a trace's events
def classify(name: str) -> str:
  """'attention', 'collective', 'matmul' or 'other' for a kernel / op name (CATEGORY_PATTERNS)."""
  lower = name.lower()
  for category, pattern in _COMPILED:
    if pattern.search(lower):
      return category
  return "other"


def event_category(ev: DeviceEvent) -> str:
  """The category of the first of (name, long_name, hlo_op) that is not 'other'."""
  for name in (ev.name, ev.long_name, ev.hlo_op):
    if name:
      category = classify(name)
      if category != "other":
        return category
  return "other"


# ------------------------------------------------------------------------------------------------
# Capture and parse
# ------------------------------------------------------------------------------------------------
def capture(fn: Callable, *args, logdir: str) -> tuple[Any, str]:
  """Runs `fn(*args)` under the profiler and blocks on its result.

  The arguments are made ready first, so the trace holds this call's work only.

  Returns:
    (fn's result, path of the `*.trace.json.gz` written under `logdir`).
  """
  result, path, _ = _capture_timed(fn, args, logdir)
  return result, path


def _capture_timed(fn: Callable, args: tuple, logdir: str) -> tuple[Any, str, float]:
  logdir = os.path.abspath(logdir)
  os.makedirs(logdir, exist_ok=True)
  jax.block_until_ready(args)
  started = time.time()
  with jax.profiler.trace(logdir):
    t0 = time.perf_counter()
    result = fn(*args)
    jax.block_until_ready(result)
    wall_s = time.perf_counter() - t0
  return result, _newest_trace(logdir, since=started), wall_s


def _newest_trace(logdir: str, since: float) -> str:
  """This host's trace file written after `since` (run folders are named to the second and a
  later capture in the same second overwrites the file, so go by modification time)."""
  paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", TRACE_GLOB))
  fresh = [p for p in paths if os.path.getmtime(p) >= since - 1.0]
  mine = [p for p in fresh if os.path.basename(p).startswith(socket.gethostname() + ".")]
  candidates = mine or fresh
  if not candidates:
    raise RuntimeError(f"jax.profiler.trace wrote no {TRACE_GLOB} under {logdir}/plugins/profile "
                       f"(found {sorted(paths)}); is another profiler session running?")
  return max(candidates, key=os.path.getmtime)


def load_events(trace_path: str) -> list[DeviceEvent]:
  """Device-side events of a trace, innermost only, sorted by (device, start).

  GPU traces: the kernels and memcpys on every "/device:GPU:N" process's stream lines. Traces
  without device processes (CPU): XLA:CPU's per-thunk events (those carrying `device_ordinal` and
  `hlo_op`). See the module docstring for the layout.
  """
  opener = gzip.open if trace_path.endswith(".gz") else open
  with opener(trace_path, "rt") as f:
    data = json.load(f)
  raw = data["traceEvents"] if isinstance(data, dict) else data
  if len(raw) >= TRACE_EVENT_CAP:
    warnings.warn(f"{trace_path} holds {len(raw)} events, the exporter's cap: the latest events "
                  "were dropped and the report undercounts the end of the step. Profile a "
                  "smaller step, or raise the cap with TF_PROFILER_TRACE_VIEWER_MAX_EVENTS (read "
                  "by the exporter in recent versions) before the run")
  process, thread = {}, {}
  for e in raw:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e.get("args", {}).get("name", "")
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
  device_of_pid = {}
  for pid, name in process.items():
    m = DEVICE_PROCESS_RE.search(name)
    if m:
      device_of_pid[pid] = int(m.group(1))

  events = []
  for e in raw:
    if e.get("ph") != "X" or "ts" not in e:
      continue
    pid, tid = e.get("pid"), e.get("tid")
    args = e.get("args") or {}
    stream = thread.get((pid, tid), str(tid))
    if device_of_pid:
      if pid not in device_of_pid or _is_derived_line(tid, stream):
        continue
      device = device_of_pid[pid]
    elif "device_ordinal" in args and "hlo_op" in args:
      device = int(args["device_ordinal"])
    else:
      continue
    events.append(DeviceEvent(device=device, stream=stream, name=str(e.get("name", "")),
                              start_us=float(e["ts"]), dur_us=float(e.get("dur", 0.0)),
                              hlo_op=str(args.get("hlo_op", "")),
                              long_name=str(args.get("long_name", "")),
                              bytes=_memcpy_bytes(args.get("memcpy_details"))))
  return sorted(_innermost(events), key=lambda ev: (ev.device, ev.start_us, ev.stream, ev.name))


def _memcpy_bytes(details) -> int:
  """`size:N` of a memcpy's details ("kind_src:device kind_dst:device size:N dest:1 async:1")."""
  m = re.search(r"\bsize:(\d+)", str(details or ""))
  return int(m.group(1)) if m else 0


def _is_derived_line(tid, name: str) -> bool:
  if isinstance(tid, int) and DERIVED_TID_MIN <= tid < DERIVED_TID_MIN + DERIVED_TID_SPAN:
    return True
  return name in DERIVED_LINE_NAMES


def _innermost(events: list[DeviceEvent]) -> list[DeviceEvent]:
  """Drops events that enclose a shorter, non-empty event of the same (device, stream):
  control-flow thunks whose time their bodies' events already account for. Equal intervals are
  all kept."""
  lines = collections.defaultdict(list)
  for ev in events:
    lines[(ev.device, ev.stream)].append(ev)
  kept = []
  for line in lines.values():
    line.sort(key=lambda ev: (ev.start_us, -ev.dur_us))
    container = [False] * len(line)
    open_: list[int] = []  # indices of events that may still enclose later ones
    for i, ev in enumerate(line):
      # An event ending where (or, rounded, just after) this one starts precedes it.
      while open_ and line[open_[-1]].end_us <= ev.start_us + _NEST_EPS_US:
        open_.pop()
      if ev.dur_us <= 0:
        continue
      for j in reversed(open_):
        outer = line[j]
        if outer.end_us + _NEST_EPS_US >= ev.end_us and outer.dur_us > ev.dur_us:
          container[j] = True
          break
      open_.append(i)
    kept.extend(ev for ev, is_container in zip(line, container) if not is_container)
  return kept


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def step_report(events: Sequence[DeviceEvent], *, step_time_s: float | None = None) -> dict:
  """Where each device's time went, and the spread across devices.

  Per device (microseconds):
    busy_us               union of all its events (over all streams)
    attention_us, collective_us, matmul_us, other_us   union within each category
    compute_us            union of its non-collective events
    exposed_collective_us collective time not overlapped by any non-collective event: the
                          communication nobody hid (on GPU, NCCL kernels spinning on a late peer
                          count here too)
    span_us, gaps_us      first start to last end, and the part of it with nothing running
    step_us, idle_us      with `step_time_s`: the step time and step - busy (host work, launch
                          gaps, waiting)
  Straggler summary over devices: max, mean, max/mean and argmax device of attention, matmul,
  compute and busy time. `slowest_device` is the argmax of compute time: busy time hides a slow
  rank because its peers' collectives wait (and stay busy) until it arrives.
  `attention_top`: the same for the attention kernels (forward, backward and their pre- and
  post-processing kernels, to see which part of attention a change moved).
  `other_top`: the 'other' names with the most summed time over all devices, at most
  `OTHER_KEPT` (the text report lists `OTHER_TOP`; digit suffixes such as `.12` / `_3`
  dropped), to grow CATEGORY_PATTERNS from a real trace, each with its `bytes`: the summed
  size of its memcpys (0 for kernels), and `hlo_ops`: the HLO instructions behind it with the
  most time ([name, us]; look them up in the
  compiled step's HLO text, e.g. `e2e_bench.py --profile` writes it next to the trace; names
  made later, at thunk emission, are not in that text: `command_buffer_N` groups, and on an H200
  dynamic-update-slice fusions run as memcpys).
  """
  by_device: dict[int, list[DeviceEvent]] = collections.defaultdict(list)
  for ev in events:
    by_device[ev.device].append(ev)
  step_us = None if step_time_s is None else float(step_time_s) * 1e6
  rows = []
  named_total: dict[str, dict[str, dict]] = {c: {} for c in TOP_NAMED}
  for device in sorted(by_device):
    evs = by_device[device]
    spans = {c: [] for c in CATEGORIES}
    for ev in evs:
      category = event_category(ev)
      spans[category].append((ev.start_us, ev.end_us))
      if category in named_total:
        agg = named_total[category].setdefault(_fold_digits(ev.name), {
            "total_us": 0.0, "count": 0, "devices": set(), "bytes": 0,
            "hlo_ops": collections.Counter()})
        agg["total_us"] += ev.dur_us
        agg["count"] += 1
        agg["devices"].add(device)
        agg["bytes"] += ev.bytes
        if ev.hlo_op:
          agg["hlo_ops"][ev.hlo_op] += ev.dur_us
    merged = {c: merge_intervals(v) for c, v in spans.items()}
    busy = merge_intervals(iv for m in merged.values() for iv in m)
    compute = merge_intervals(iv for c, m in merged.items() if c != "collective" for iv in m)
    span = (busy[-1][1] - busy[0][0]) if busy else 0.0
    row = {"device": device, "events": len(evs), "busy_us": total_length(busy),
           **{f"{c}_us": total_length(merged[c]) for c in CATEGORIES},
           "compute_us": total_length(compute),
           "exposed_collective_us": total_length(subtract_intervals(merged["collective"],
                                                                    compute)),
           "span_us": span, "gaps_us": span - total_length(busy)}
    if step_us is not None:
      row["step_us"] = step_us
      row["idle_us"] = step_us - row["busy_us"]
    rows.append(row)

  straggler = {}
  for key in ("attention_us", "matmul_us", "compute_us", "busy_us"):
    straggler[key] = _spread(rows, key)
  straggler["slowest_device"] = straggler["compute_us"]["argmax"]
  out = {"devices": rows, "straggler": straggler, "step_us": step_us}
  for category, totals in named_total.items():
    ranked = sorted(totals.items(), key=lambda kv: (-kv[1]["total_us"], kv[0]))[:OTHER_KEPT]
    out[f"{category}_top"] = [
        {**agg, "name": name, "devices": len(agg["devices"]),
         "hlo_ops": [[op, us] for op, us in agg["hlo_ops"].most_common(OTHER_TOP_OPS)]}
        for name, agg in ranked]
  return out


# ------------------------------------------------------------------------------------------------
# Kernel classes of a train step (the step-time breakdown)
# ------------------------------------------------------------------------------------------------
# Name scopes around the LM head + loss (`Transformer.loss`) and the optimizer update
# (`trainer.make_train_step`); XLA keeps them in each instruction's `op_name` metadata, forward
# and backward (`transpose(jvp(<scope>))`) alike.
OPTIMIZER_SCOPE = "optimizer_update"
# The classes in priority order: a device interval belongs to the first class running then, so
# the classes' times add up to the busy time; 'host gaps' is the step time less the busy time.
STEP_CLASSES = ("attention", "collective", "lm_head_loss", "optimizer", "matmul", "copy",
                "elementwise")
_COPY_RE = re.compile(r"memcpy|(?<![a-z])copy|dynamic[-_](?:update[-_])?slice|"
                      r"(?<![a-z])(?:transpose|concatenate)(?:[._]\d+)?$")
_HLO_LINE_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?"
                          r"op_name=\"([^\"]*)\"")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> its `op_name` metadata (the JAX name stack) for every instruction of a
  compiled module's text (`compiled.as_text()`) that has one."""
  out = {}
  for line in hlo_text.splitlines():
    m = _HLO_LINE_RE.match(line)
    if m:
      out.setdefault(m.group(1), m.group(2))
  return out


def instruction_of_kernel(name: str) -> str:
  """The HLO instruction an XLA GPU kernel is named after ('loop_add_fusion_3' ->
  'loop_add_fusion.3'): kernels run inside a command buffer carry the buffer as their HLO op."""
  return re.sub(r"_(\d+)$", r".\1", name)


def step_class(ev: DeviceEvent, op_names: dict[str, str]) -> str:
  """The STEP_CLASSES entry of one event: attention and collective kernels by name; then the
  train step's LM-head/loss and optimizer scopes by the event's HLO op metadata; then matmuls;
  copies (memcpys, copy / dynamic-update-slice / transpose instructions); the rest (fusions,
  reductions, elementwise kernels) is 'elementwise'."""
  category = event_category(ev)
  if category in ("attention", "collective"):
    return category
  op_name = op_names.get(ev.hlo_op) or op_names.get(instruction_of_kernel(ev.name), "")
  if LM_HEAD_SCOPE in op_name:
    return "lm_head_loss"
  if OPTIMIZER_SCOPE in op_name:
    return "optimizer"
  if category == "matmul":
    return "matmul"
  if ev.bytes or any(_COPY_RE.search(n.lower()) for n in (ev.name, ev.hlo_op) if n):
    return "copy"
  return "elementwise"


def step_breakdown(events: Sequence[DeviceEvent], op_names: dict[str, str], *,
                   step_time_s: float | None = None) -> list[dict]:
  """Per device: milliseconds per STEP_CLASSES entry (exclusive: overlapping intervals go to the
  earlier class), 'busy', and with `step_time_s` 'host gaps' (step - busy) and 'step'."""
  by_device: dict[int, list[DeviceEvent]] = collections.defaultdict(list)
  for ev in events:
    by_device[ev.device].append(ev)
  rows = []
  for device in sorted(by_device):
    spans = {c: [] for c in STEP_CLASSES}
    for ev in by_device[device]:
      spans[step_class(ev, op_names)].append((ev.start_us, ev.end_us))
    row, covered = {"device": device}, []
    for c in STEP_CLASSES:
      mine = subtract_intervals(merge_intervals(spans[c]), covered)
      row[c] = total_length(mine) / 1e3
      covered = merge_intervals(covered + mine)
    row["busy"] = total_length(covered) / 1e3
    if step_time_s is not None:
      row["step"] = float(step_time_s) * 1e3
      row["host gaps"] = row["step"] - row["busy"]
    rows.append(row)
  return rows


def format_breakdown(rows: Sequence[dict]) -> str:
  """Markdown: one row per device, ms and % of the step (of busy time without a step time)."""
  if not rows:
    return "_no device events_"
  cols = list(STEP_CLASSES) + (["host gaps"] if "host gaps" in rows[0] else [])
  lines = ["| device | " + " | ".join(cols) + " | step ms |", "|---:|" + "---:|" * (len(cols) + 1)]
  for r in rows:
    total = r.get("step", r["busy"])
    cells = [f"{r[c]:.1f} ({100 * r[c] / total:.1f}%)" if total > 0 else f"{r[c]:.1f}"
             for c in cols]
    lines.append(f"| {r['device']} | " + " | ".join(cells) + f" | {total:.1f} |")
  return "\n".join(lines)


def _spread(rows: list[dict], key: str) -> dict:
  if not rows:
    return {"max": None, "mean": None, "max_over_mean": None, "argmax": None}
  values = [r[key] for r in rows]
  top = max(values)
  mean = sum(values) / len(values)
  argmax = rows[values.index(top)]["device"]  # the lowest device number on ties
  return {"max": top, "mean": mean, "max_over_mean": top / mean if mean > 0 else None,
          "argmax": argmax}


def _fold_digits(name: str) -> str:
  """'fusion.12' and 'fusion' -> 'fusion'; 'loop_add_fusion_3' -> 'loop_add_fusion'."""
  return re.sub(r"[._]\d+(?=$|[._])", "", name)


def format_report(report: dict) -> str:
  """Markdown: one row per device (milliseconds), the straggler summary, the top 'other' names."""
  rows = report["devices"]
  if not rows:
    return "_no device events in the trace_"
  has_idle = report.get("step_us") is not None
  cols = [("busy", "busy_us"), ("attention", "attention_us"), ("matmul", "matmul_us"),
          ("collective", "collective_us"), ("exposed coll.", "exposed_collective_us"),
          ("other", "other_us"), ("compute", "compute_us"), ("gaps", "gaps_us")]
  if has_idle:
    cols.append(("idle (step - busy)", "idle_us"))
  lines = ["| device | " + " | ".join(f"{c} ms" for c, _ in cols) + " |",
           "|---:|" + "---:|" * len(cols)]
  for r in rows:
    lines.append(f"| {r['device']} | " + " | ".join(f"{r[k] / 1e3:.3f}" for _, k in cols) + " |")
  s = report["straggler"]
  lines.append("")
  if has_idle:
    lines.append(f"step time {report['step_us'] / 1e3:.3f} ms")
  lines.append(f"slowest device: {s['slowest_device']} (most compute time)")
  for key, label in (("compute_us", "compute"), ("attention_us", "attention"),
                     ("matmul_us", "matmul"), ("busy_us", "busy")):
    v = s[key]
    ratio = "n/a" if v["max_over_mean"] is None else f"{v['max_over_mean']:.3f}"
    lines.append(f"- {label}: max {v['max'] / 1e3:.3f} ms (device {v['argmax']}), mean "
                 f"{v['mean'] / 1e3:.3f} ms, max/mean {ratio}")
  if report.get("breakdown"):
    scoped = ("" if report.get("breakdown_scoped") else
              " (no HLO text: LM head/loss and optimizer counted in the other classes)")
    lines += ["", f"Step time by kernel class, ms (% of the step){scoped}:", "",
              format_breakdown(report["breakdown"])]
  if report.get("attention_top"):
    lines += ["", "Attention kernels by summed time:", "", "| name | total ms | count | devices |",
              "|---|---:|---:|---:|"]
    for o in report["attention_top"][:OTHER_TOP]:
      lines.append(f"| `{o['name'][:120].replace('|', chr(92) + '|')}` | "
                   f"{o['total_us'] / 1e3:.3f} | {o['count']} | {o['devices']} |")
  if report["other_top"]:
    lines += ["", "Top 'other' names by summed time (add patterns to "
              "profiling.CATEGORY_PATTERNS for kernels that belong elsewhere):", "",
              "| name | total ms | count | devices | memcpy GB (GB/s) | top HLO ops (ms) |",
              "|---|---:|---:|---:|---:|---|"]
    for o in report["other_top"][:OTHER_TOP]:
      name = o["name"].replace("|", "\\|")
      ops = ", ".join(f"`{op}` {us / 1e3:.1f}" for op, us in o.get("hlo_ops", []))
      nbytes = o.get("bytes", 0)
      copied = (f"{nbytes / 1e9:.2f} ({nbytes / 1e3 / o['total_us']:.0f})"
                if nbytes and o["total_us"] > 0 else "")
      lines.append(f"| `{name[:120]}` | {o['total_us'] / 1e3:.3f} | {o['count']} | "
                   f"{o['devices']} | {copied} | {ops} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Train steps
# ------------------------------------------------------------------------------------------------
def profile_train_step(step_fn: Callable, state, batch, logdir: str, *,
                       step_time_s: float | None = None):
  """One `step_fn(state, batch) -> (state, metrics)` call, profiled and reported.

  Writes LOGDIR/report.json and LOGDIR/report.md next to the trace. `step_time_s` (for idle time)
  defaults to the profiled call's wall time, which includes dispatch and profiler overhead; pass
  an unprofiled step time to measure idle time against that instead.

  Returns:
    (new state, metrics, report): report as `step_report` plus 'breakdown' (`step_breakdown`;
    the LM-head/loss and optimizer classes need a compiled `step_fn`, whose HLO text maps kernels
    to the train step's name scopes: 'breakdown_scoped'), 'trace_path', 'profiled_call_s' (wall
    time of the profiled call) and 'step_time_from' ('profiled call' or 'argument').
  """
  (state, metrics), path, wall_s = _capture_timed(step_fn, (state, batch), logdir)
  events = load_events(path)
  if not events:
    raise RuntimeError(f"no device events found in {path}: expected '/device:GPU:N' processes "
                       "with stream threads, or XLA:CPU thunk events; open the trace in "
                       "https://ui.perfetto.dev and update profiling.load_events")
  step_s = wall_s if step_time_s is None else step_time_s
  report = step_report(events, step_time_s=step_s)
  as_text = getattr(step_fn, "as_text", None)  # a compiled step: its HLO names the scopes
  op_names = hlo_op_names(as_text()) if callable(as_text) else {}
  report["breakdown"] = step_breakdown(events, op_names, step_time_s=step_s)
  report["breakdown_scoped"] = bool(op_names)
  report["step_time_from"] = "profiled call" if step_time_s is None else "argument"
  report["profiled_call_s"] = wall_s
  report["trace_path"] = path
  with open(os.path.join(logdir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(logdir, "report.md"), "w") as f:
    f.write(format_report(report) + "\n")
  return state, metrics, report


def time_call(fn: Callable, *args, iters: int, warmup: int = 0, min_trial_s: float = 0.0,
              max_reps: int = 50) -> dict:
  """Wall seconds per call of ``fn(*args)`` to completion (the benchmarks' one timer).

  One compiling call and ``warmup`` more run untimed, then ``iters`` timed trials. A trial runs
  ``reps`` back-to-back calls synced at the end and counts their mean: ``reps`` = 1, or with
  ``min_trial_s`` > 0 as many calls (at most ``max_reps``) as fill ``min_trial_s``, judged from one
  more timed call (short kernels then time launch-bound work, not the sync). Returns
  ``{'median_s', 'min_s', 'trials_s', 'reps'}``.
  """
  for _ in range(1 + warmup):
    jax.block_until_ready(fn(*args))
  reps = 1
  if min_trial_s > 0:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    reps = max(1, min(max_reps, math.ceil(min_trial_s / one)))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = None
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / reps)
  return {"median_s": statistics.median(ts), "min_s": min(ts), "trials_s": ts, "reps": reps}


def write_tables(stem: str, result: dict, markdown: str) -> None:
  """A benchmark's result table: ``stem.json`` (``result``, non-JSON values as strings) and
  ``stem.md`` (``markdown``); prints the markdown and where both went."""
  os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(stem + ".md", "w") as f:
    f.write(markdown + "\n")
  print(markdown)
  print(f"wrote {stem}.json and {stem}.md")

