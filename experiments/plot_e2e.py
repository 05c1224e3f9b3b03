"""Plot of `experiments/e2e_bench.py` results: tokens/s per backend, one group per configuration.

  python -m experiments.plot_e2e results/e2e_2gpu_64k.json results/e2e_2gpu_128k.json \
      results/e2e_2gpu_128k_wlb.json results/e2e_2gpu_prolong_128k.json --out results/e2e_2gpu.png

Bars are tokens/s of the median step (mean tokens per step / median step time); whiskers span the
p10-p90 step times. Above each configuration's `packed_dp` bar a tick marks the balance ceiling
(packed_dp x the bound on any attention balancer's speedup, see e2e_bench.ceiling).
Needs matplotlib (in the project's test extra); runs on a laptop from the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os


def load(paths):
  rows = []
  for p in paths:
    with open(p) as f:
      doc = json.load(f)
    rows += [r for r in doc["results"] if "error" not in r]
  if not rows:
    raise SystemExit(f"no successful runs in {paths}")
  return rows


def plot(rows, out: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  groups = sorted({(r["workload"], r["tokens"]) for r in rows}, key=lambda g: (g[0], g[1]))
  backends = []
  for r in rows:
    if r["backend"] not in backends:
      backends.append(r["backend"])
  width = 0.8 / len(backends)
  fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(groups) + 0.5 * len(backends)), 4.2))
  for bi, b in enumerate(backends):
    xs, ys, lo, hi = [], [], [], []
    for gi, (wl, tok) in enumerate(groups):
      r = next((x for x in rows if x["backend"] == b and x["workload"] == wl and x["tokens"] == tok),
               None)
      if r is None:
        continue
      # Mean tokens per step (tokens_per_s is total tokens / total time), then per step time.
      per_step = r["tokens_per_s"] * sum(r["step_ms_all"]) / 1e3 / len(r["step_ms_all"])
      tps = per_step / (r["step_ms_median"] / 1e3)
      xs.append(gi + (bi - (len(backends) - 1) / 2) * width)
      ys.append(tps)
      lo.append(tps - per_step / (r["step_ms_p90"] / 1e3))
      hi.append(per_step / (r["step_ms_p10"] / 1e3) - tps)
    ax.bar(xs, ys, width, label=b, yerr=[lo, hi], capsize=2)
  for gi, (wl, tok) in enumerate(groups):
    base = next((x for x in rows if x["backend"] == "packed_dp" and x["workload"] == wl
                 and x["tokens"] == tok), None)
    if base is not None:
      per_step = base["tokens_per_s"] * sum(base["step_ms_all"]) / 1e3 / len(base["step_ms_all"])
      y = per_step / (base["step_ms_median"] / 1e3) * base["ceiling"]
      ax.plot([gi - 0.42, gi + 0.42], [y, y], "k--", lw=1)
  ax.set_xticks(range(len(groups)))
  ax.set_xticklabels([f"{wl}\n{tok // 1024}K tokens/GPU" for wl, tok in groups])
  ax.set_ylabel("tokens / s (all GPUs)")
  dev = rows[0].get("device", "?")
  ax.set_title(f"{dev} x {rows[0].get('devices', '?')}: dashed = packed_dp x balance ceiling")
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("json", nargs="+")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  plot(load(a.json), a.out or os.path.splitext(a.json[0])[0] + ".png")


if __name__ == "__main__":
  main()
