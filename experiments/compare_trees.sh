#!/usr/bin/env bash
# One-GPU training steps of two source trees on the same batches, in one call, alternating:
#   bash experiments/compare_trees.sh OLD_TREE OUTDIR [e2e_bench arguments]
# OLD_TREE is an export of another commit (e.g. `git archive REV distca_jax custom_ops configs
# experiments data | tar -x -C .carry/old`); the new one is this tree, or NEW_TREE when set (another
# export). Run from the repository root (the wheels in .whl/). Each tree runs
# experiments/e2e_bench.py (default: packed_dp and distca, Pretrain, 64K tokens, 4 layers of
# configs/gpu_bench.py) REPEATS times, old and new alternating, and OUTDIR/compare_trees.md gets
# each run's median step, the new/old ratio and whether the losses agree.
# Needs the wheels the GPU image lacks in .whl/ (flash-attn3-jax, ml_collections, tensorboardX).
set -u
OLD=${1:?usage: compare_trees.sh OLD_TREE OUTDIR [e2e_bench args]}
OUT=${2:?usage: compare_trees.sh OLD_TREE OUTDIR [e2e_bench args]}
shift 2
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--backends packed_dp,distca --workloads pretrain --tokens 65536
                                --layers 4 --steps 10 --warmup 2)
NEW=$(cd "${NEW_TREE:-$PWD}" && pwd)
OLD=$(cd "$OLD" && pwd)
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)  # each run works in its own tree
SITE=
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && SITE=/tmp/site:
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# Compiled programs persist across the runs (each tree compiles once; later runs hit the cache).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
for rep in $(seq 1 "${REPEATS:-2}"); do
  for tree in old new; do
    dir=$OLD; [ $tree = new ] && dir=$NEW
    echo "=== $tree run $rep"
    bench=(experiments/e2e_bench.py); [ -f "$dir/experiments/__init__.py" ] && bench=(-m experiments.e2e_bench)
    (cd "$dir" && PYTHONPATH=$SITE$dir timeout "${RUN_TIMEOUT:-280}" python3 "${bench[@]}" \
      "${ARGS[@]}" --out "$OUT/${tree}_$rep" > "$OUT/${tree}_$rep.log" 2>&1)
    echo "rc=$?"; tail -n 4 "$OUT/${tree}_$rep.log"
  done
done
python3 - "$OUT" "${ARGS[*]}" <<'EOF'
import glob, json, os, statistics, sys
out, args = sys.argv[1], sys.argv[2]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "*_[0-9]*.json"))):
  tree = os.path.basename(path).split("_")[0]
  for r in json.load(open(path))["results"]:
    if "step_ms_median" not in r:  # a failed run: its error is in the table and the log
      continue
    key = (r["workload"], r["tokens"], r["backend"], r.get("nano_batches", 1))
    runs.setdefault(key, {}).setdefault(tree, []).append(r)
lines = ["# Two trees, one GPU, same batches", "", f"- e2e_bench arguments: `{args}`",
         "- each cell: median step ms of each run (old and new alternate); ratio = median of new "
         "runs / median of old runs", "",
         "| workload | tokens | backend | old ms | new ms | new / old | max loss diff |",
         "|---|---|---|---|---|---|---|"]
for key, by in sorted(runs.items()):
  old, new = by.get("old", []), by.get("new", [])
  fmt = lambda rs: ", ".join(f"{r['step_ms_median']:.1f}" for r in rs) or "-"
  ratio = (statistics.median(r["step_ms_median"] for r in new)
           / statistics.median(r["step_ms_median"] for r in old)) if old and new else float("nan")
  same = (f"{max(abs(a - b) for r in old + new for a, b in zip(r['losses'], old[0]['losses'])):.2e}"
          if old and new else "-")
  lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt(old)} | {fmt(new)} | {ratio:.3f} | {same} |")
open(os.path.join(out, "compare_trees.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
