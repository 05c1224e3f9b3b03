"""Kernel profile, report side: where our kernel's time goes against the baseline's, per phase
(`gap_table`), and the markdown of a whole profile (`write_markdown`). "Ours" is the backend
the profile explains (the first one it ran)."""

from __future__ import annotations

from typing import Sequence

from experiments import kernel_bench as kb

MD_KERNEL_ROWS = 15  # kernel rows per (workload, backend) in the markdown; the JSON has all


def _ok(entry: dict | None) -> bool:
  return entry is not None and entry.get("status") == "ok"


def _ratio(a, b):
  return a / b if a is not None and b else None


def baseline_backend(entries: list[dict], ours: str) -> str | None:
  """flash3 when it produced results, else the first other backend that did (the CPU test's
  reference), else None."""
  ok = [e["backend"] for e in entries if _ok(e) and e["backend"] != ours]
  if "flash3" in ok:
    return "flash3"
  return ok[0] if ok else None


def gap_table(entries: list[dict], workloads: Sequence[str], ours: str) -> dict:
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


_tf = kb.format_tflops  # one TFLOP/s format for both tables


def _md_escape(s: str) -> str:
  return s.replace("|", "\\|")


def write_markdown(path: str, result: dict) -> None:
  """The report: gap table, per-kernel rows (with their resources where recorded), errors."""
  cfg = result["config"]
  gap = result["gap"]
  base = gap["baseline"] or "baseline"
  lines = [
      f"# Kernel profile: {gap['ours']} against {base}",
      "",
      f"- command: `{result['command']}`",
      f"- device: {result['device']}; jax {result['jax_version']}; {result['date']}; wall time "
      f"{_f(result.get('wall_s'), 0)} s",
      f"- {cfg['num_heads']} query heads, {cfg['num_kv_heads']} KV heads, head dim "
      f"{cfg['head_dim']}, {cfg['dtype']}"
      + (" (CPU: rows are XLA:CPU thunks, not kernels)" if cfg["tiny"] else "")
      + f"; trace: {cfg['trace_calls']} forward+backward calls, {cfg['trace_gap_s']} s apart; "
      f"timing: median of {cfg['trials']} trials",
      "- backends: " + "; ".join(f"{b}: {s}" for b, s in result["backend_status"].items()),
      "- FLOPs exact from the task table: forward F = 4*H*D*pairs, backward 2.5 F. A phase's "
      "FLOPs are split among its attention kernels by device time (each shows the phase's rate); "
      "glue kernels get none.",
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
        "| kernel | role | phase | count | us | share | TFLOP/s | regs | smem KiB | grid | "
        "block | occ % |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    rows = t["kernels"]
    for row in rows[:MD_KERNEL_ROWS]:
      d = row.get("details") or {}
      smem = (d.get("static_shared", 0) + d.get("dynamic_shared", 0)) / 1024 if d else None
      lines.append(
          f"| `{_md_escape(row['short_name'])}` | {row['role']} | {row['phase']} | "
          f"{row['count']:.3g} | {row['total_us']:.1f} | {row['share']:.3f} | "
          f"{_tf(row['tflops'])} | {d.get('regs', '-')} | "
          f"{_f(smem, 1)} | {','.join(map(str, d.get('grid', []))) or '-'} | "
          f"{','.join(map(str, d.get('block', []))) or '-'} | {_f(d.get('occ_pct'), 1)} |")
    if len(rows) > MD_KERNEL_ROWS:
      rest = rows[MD_KERNEL_ROWS:]
      lines.append(f"| {len(rest)} more | | | {sum(r['count'] for r in rest):.3g} | "
                   f"{sum(r['total_us'] for r in rest):.1f} | "
                   f"{sum(r['share'] for r in rest):.3f} | | | | | | |")
    lines += ["", "| phase | attention us | glue us | total us | TFLOP/s attention | "
              "TFLOP/s incl. glue |", "|---|---:|---:|---:|---:|---:|"]
    for phase, s in sorted(t["phases"].items()):
      lines.append(f"| {phase} | {s['attention_us']:.1f} | {s['other_us']:.1f} | "
                   f"{s['total_us']:.1f} | {_tf(s['tflops_attention'])} | "
                   f"{_tf(s['tflops_incl_glue'])} |")
    if t.get("kernel_details_note"):
      lines += ["", f"registers / shared memory: {t['kernel_details_note']}"]
    lines.append("")

  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")
