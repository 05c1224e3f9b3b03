"""Kernel profile, trace side: each kernel's role and phase from its name, one call's device
time per kernel with achieved TFLOP/s (`kernel_breakdown`), and CUPTI's per-launch resources
(registers, shared memory, occupancy) from a trace's xplane.pb. Pure functions of the events
``distca_jax.profiling.load_events`` gives, plus one xplane reader."""

from __future__ import annotations

import glob
import math
import os
import re
from typing import Any, Sequence


# ------------------------------------------------------------------------------------------------
# Kernel roles (pure)
# ------------------------------------------------------------------------------------------------
# (role, phase, pattern searched in the lower-cased "name long_name"); the first match wins.
# Attention roles (ATTENTION_ROLES) carry their phase's FLOPs; the others are auxiliary.
ROLE_PATTERNS: tuple[tuple[str, str | None, str], ...] = (
    # Our Mosaic GPU kernels (custom_ops/mosaic_calls.py, `kernel_name`).
    ("fwd", "forward", r"mosaic_attention_fwd"),
    ("dq", "backward", r"mosaic_attention_dq"),
    ("dkdv", "backward", r"mosaic_attention_dkv"),
    ("bwd", "backward", r"mosaic_attention_bwd"),  # the default one-kernel backward
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
    r"mosaic_attention_\w+", r"FlashAttn\w+", r"flash_\w+", r"prepare_varlen\w*"))


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
                     num_calls: int | None = None) -> dict:
  """Per-kernel rows and per-phase sums of one call (means over ``num_calls``).

  Args:
    calls: the events of each call (``split_calls``), or one group holding all of them.
    num_calls: the calls the groups hold; default ``len(calls)``.
    flops_fwd, flops_bwd: the phases' useful FLOPs (module docstring).

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
  for row in rows.values():
    flops = None
    if row["attention"] and row["phase"] in phase_flops:
      att = phases[row["phase"]]["attention_us"]
      flops = phase_flops[row["phase"]] * row["phases"][row["phase"]] / att if att > 0 else None
    row["flops"] = flops
    row["tflops"] = flops / row["total_us"] / 1e6 if flops and row["total_us"] > 0 else None
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
