"""Where one GPU's train step goes, by kernel class, and what each candidate change buys.

  python -m experiments.step_breakdown --workloads pretrain,prolong --tokens 65536,131072 \
      --layers 16 --remat-at 131072=full \
      --flags notriton:--xla_gpu_enable_triton_gemm=false \
      --variant chunk8k:model.loss_chunk=8192 --out results/step_breakdown

Runs `experiments.e2e_bench` (the same training steps, batches and MFU accounting) once per
`--flags` entry (the baseline first, with no extra XLA flags), each in its own process because XLA
reads its flags when the backend starts, all with `--profile`, so every run also profiles one step
and reports its time by kernel class (`profiling.step_breakdown`: attention, collective, LM head
and loss, optimizer update, matmul, copy, elementwise/fusions, host gaps = step - busy).
`--variant NAME:KEY=VALUE[,...]` adds config variants (e2e_bench's), run in every flags process.
The table puts every run beside the baseline of its (workload, tokens): step time, MFU, the ratio
of step times (measured in the same device call) and the breakdown of its profiled step.
Writes OUT.json and OUT.md (the command at the top); `--merge A.json,B.json` writes one table
of earlier outputs (e.g. runs that need different `--flags`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--backends", default="distca", help="comma list (e2e_bench's)")
  p.add_argument("--workloads", default="pretrain")
  p.add_argument("--tokens", default="65536", help="tokens per GPU (comma list)")
  p.add_argument("--layers", type=int, default=16)
  p.add_argument("--steps", type=int, default=6, help="timed steps per run")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--remat-at", action="append", default=[],
                 help="TOKENS=POLICY: model.remat for runs at TOKENS tokens (memory)")
  p.add_argument("--flags", action="append", default=[],
                 help="NAME:XLA_FLAGS: one more process with these XLA flags added")
  p.add_argument("--variant", action="append", default=[],
                 help="NAME:KEY=VALUE[,KEY=VALUE] config variant (e2e_bench --variant)")
  p.add_argument("--extra", action="append", default=[], help="KEY=VALUE for every run")
  p.add_argument("--child-timeout-s", type=int, default=900)
  p.add_argument("--tiny", action="store_true", help="CPU smoke test sizes (e2e_bench --tiny)")
  p.add_argument("--merge", default="",
                 help="A.json,B.json,...: write one table of these runs' rows (no runs)")
  p.add_argument("--out", default=os.path.join(ROOT, "results", "step_breakdown"))
  return p.parse_args(argv)


def flag_sets(a) -> list[tuple[str, str]]:
  out = [("", "")]
  for f in a.flags:
    name, sep, flags = f.partition(":")
    if not sep or not name or not flags.strip():
      raise SystemExit(f"--flags {f!r}: expected NAME:--xla_flag=VALUE[ --xla_flag=VALUE]")
    out.append((name, flags.strip()))
  return out


def remat_by_tokens(a) -> dict[int, str]:
  out = {}
  for r in a.remat_at:
    tokens, sep, policy = r.partition("=")
    if not sep or not tokens.isdigit() or not policy:
      raise SystemExit(f"--remat-at {r!r}: expected TOKENS=POLICY, e.g. 131072=full")
    out[int(tokens)] = policy
  return out


def child_argv(a, tokens: int, remat: str | None, out: str) -> list[str]:
  argv = experiments.module_argv(os.path.join(os.path.dirname(__file__), "e2e_bench.py")) + [
      "--backends", a.backends, "--workloads", a.workloads, "--tokens", str(tokens),
      "--layers", str(a.layers), "--steps", str(a.steps), "--warmup", str(a.warmup),
      "--profile", "--out", out]
  for e in a.extra + ([f"model.remat={remat}"] if remat else []):
    argv += ["--extra", e]
  for v in a.variant:
    argv += ["--variant", v]
  return argv + (["--tiny"] if a.tiny else [])


def run_child(argv, flags: str, timeout_s: int, log) -> tuple[list[dict], str | None]:
  env = dict(os.environ)
  if flags:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
  out = argv[argv.index("--out") + 1]
  t0 = time.time()
  try:
    proc = subprocess.run(argv, env=env, cwd=ROOT, timeout=timeout_s, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail, error = proc.stdout[-3000:], (None if proc.returncode == 0 else
                                       f"exit {proc.returncode}")
  except subprocess.TimeoutExpired as e:
    tail = (e.stdout or b"")[-3000:]
    tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    error = f"timed out after {timeout_s} s"
  log(f"   ({time.time() - t0:.0f} s){' ' + error if error else ''}\n" +
      "\n".join("   | " + line for line in tail.splitlines()[-12:]))
  results = []
  if os.path.exists(out + ".json"):  # e2e_bench writes after every run: partial results count
    with open(out + ".json") as f:
      results = json.load(f)["results"]
  return results, error


def row_of(r: dict, flags_name: str, flags: str) -> dict:
  name = r["backend"] + (f"+{flags_name}" if flags_name else "")
  row = {"run": name, "workload": r["workload"], "tokens": r["tokens"], "xla_flags": flags,
         "overrides": r.get("overrides", [])}
  if "error" in r:
    return {**row, "error": r["error"]}
  prof = r.get("profile") or {}
  breakdown = (prof.get("breakdown") or [None])[0]
  return {**row, "step_ms": r["step_ms_median"], "mfu": r.get("mfu"), "layers": r["layers"],
          "profiled_ms": (prof["profiled_call_s"] * 1e3 if "profiled_call_s" in prof else None),
          "lm_head_share": r.get("lm_head_share"), "memory_gb": r.get("memory_gb"),
          "final_loss": r.get("final_loss"), "losses": r.get("losses"), "device": r["device"],
          "breakdown": breakdown, "breakdown_scoped": prof.get("breakdown_scoped")}


def markdown(cmd: str, stamp: str, commit: str, rows: list[dict]) -> str:
  from distca_jax import profiling
  classes = list(profiling.STEP_CLASSES) + ["host gaps"]
  device = next((r["device"] for r in rows if "device" in r), "n/a")
  lines = [f"# One-GPU step breakdown ({device})", "", f"`{cmd}`", "",
           f"{stamp}, commit {commit}. Each run: median of the timed steps; MFU by the project's "
           "document-masked FLOP count (`distca_jax/metrics.py`); `vs base`: the baseline's step "
           "time over this run's (same call, same batches); the classes are one extra profiled "
           "step (`profiled ms`: its wall time, longer than the median under the profiler), ms "
           "and % of that step (exclusive: time under two classes counts once, in the earlier "
           "column; host gaps = profiled wall time - busy).", ""]
  for key in sorted({(r["workload"], r["tokens"]) for r in rows}):
    group = [r for r in rows if (r["workload"], r["tokens"]) == key]
    base = next((r for r in group if "step_ms" in r), None)
    head = group[0]
    lines += [f"## {key[0]}, {key[1]:,} tokens, {head.get('layers', '?')} layers"
              + (f" (LM head {100 * head['lm_head_share']:.0f}% of the FLOPs)"
                 if head.get("lm_head_share") else ""), "",
              "| run | step ms | MFU | vs base | profiled ms | " + " | ".join(classes) + " |",
              "|---|---:|---:|---:|---:|" + "---:|" * len(classes)]
    for r in group:
      if "error" in r:
        lines.append(f"| {r['run']} | failed: {r['error'][:120]} |")
        continue
      mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
      speed = f"{base['step_ms'] / r['step_ms']:.3f}x" if base else "n/a"
      b = r.get("breakdown") or {}
      prof = r.get("profiled_ms") or r["step_ms"]
      cells = []
      for c in classes:
        v = b.get(c)
        if c == "host gaps" and b:
          v = prof - b["busy"]  # the profiled call's own wall time less its busy time
        cells.append("" if v is None else f"{v:.0f} ({100 * v / prof:.1f}%)")
      lines.append(f"| {r['run']} | {r['step_ms']:.1f} | {mfu} | {speed} | {prof:.0f} | "
                   + " | ".join(cells) + " |")
    lines.append("")
  flags = sorted({(r["run"], r["xla_flags"]) for r in rows if r["xla_flags"]})
  if flags:
    lines += ["XLA flags per run (added to the launcher's defaults):", ""]
    lines += [f"- {name}: `{f}`" for name, f in flags]
  return "\n".join(lines) + "\n"


def main(argv=None):
  a = parse_args(argv)
  log = lambda m: print(m, flush=True)
  cmd = experiments.command_line(__file__, argv)
  if a.merge:
    parts = [json.load(open(path)) for path in a.merge.split(",")]
    write(a, "; ".join(p["command"] for p in parts), [r for p in parts for r in p["rows"]],
          commit=",".join(sorted({p["commit"] for p in parts})))
    log(open(a.out + ".md").read())
    return
  remat = remat_by_tokens(a)
  rows, scratch = [], a.out + "_runs"
  os.makedirs(scratch, exist_ok=True)
  for tokens in [int(t) for t in a.tokens.split(",")]:
    for flags_name, flags in flag_sets(a):
      out = os.path.join(scratch, f"{tokens}_{flags_name or 'base'}")
      log(f"== {tokens} tokens/GPU, XLA flags {flags_name or 'base'}")
      results, error = run_child(child_argv(a, tokens, remat.get(tokens), out), flags,
                                 a.child_timeout_s, log)
      rows += [row_of(r, flags_name, flags) for r in results]
      if error and not results:
        rows.append({"run": f"{a.backends}+{flags_name or 'base'}", "workload": a.workloads,
                     "tokens": tokens, "xla_flags": flags, "error": error})
      write(a, cmd, rows)
  log(open(a.out + ".md").read())


def write(a, cmd: str, rows: list[dict], commit: str | None = None) -> None:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  if commit is None:
    commit = experiments.git_commit()
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out + ".json", "w") as f:
    json.dump({"command": cmd, "date": stamp, "commit": commit, "rows": rows}, f, indent=1)
  with open(a.out + ".md", "w") as f:
    f.write(markdown(cmd, stamp, commit, rows))


if __name__ == "__main__":
  sys.exit(main())
