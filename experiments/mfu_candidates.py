"""Layouts of the whole Llama-3-8B with FSDP on 4 x 80 GB (configs/llama3_8b_4gpu.py) that could
raise its MFU, sized and estimated on the CPU for a GPU run to check (gpu_suite.sh four-8b-mfu).

  python -m experiments.mfu_candidates --aot-dir /tmp/mfu_aot --out results/fsdp/mfu_candidates

Per candidate (a remat policy, tokens per GPU, the backend; overrides of the shipped config):
- memory: XLA's plan of the train step compiled ahead of time on 4 fake CPU devices
  (`experiments.aot_memory ... --override attention.kernel=blockwise`, one process per candidate,
  its JSON kept in --aot-dir and reused), turned into a GPU estimate with the one measured point
  of each backend (the shipped config on 4 x H100, `results/fsdp/raw/e2e_8b_pretrain_*.json`).
  Arguments are the same on both platforms; r is the GPU's temporaries over the CPU's at that
  point (per backend). A candidate differs from that point by a change of tokens (full remat
  at its tokens minus at 48K, CPU) and a change of policy (the candidate minus full remat at its
  tokens, CPU). 'low' scales both by r; 'high' scales a decrease by r and counts an increase 1:1
  (saved activations are the same bytes on both platforms). Plus FlashAttention-3's backward
  workspace outside XLA's plan (`memory.flash3_bwd_workspace_bytes` at the run's distca caps;
  packed_dp's sequence count is inferred from its measured workspace). Fits: high + workspace
  within the H100's allocator limit less a 3% margin.
- executed / counted FLOPs: MFU counts 6 N per token for the linear layers and the LM head and
  3x the forward for document-masked attention. The backward reruns a fraction of each layer's
  linear forward (counted here from the gradient's jaxpr of 8B-shaped layers under each policy);
  FlashAttention's backward is 2.5x its forward (3.5x in all), plus 1x where the policy reruns
  the kernel's forward.
- MFU: a two-rate model, step = counted x (linear share x exec / r_lin + attention share x exec x
  imbalance / r_att) + F, r_lin and r_att fitted to the measured Pretrain distca and ProLong
  packed_dp rows (distca's imbalance after planning; packed_dp's whole step scaled by its
  ceiling), checked on the other two rows. F, per-step costs that do not scale with tokens (the
  FSDP weight all-gathers and gradient reduce-scatters, the optimizer), is 0 if hidden under
  compute and F_max if not overlapped at all.
"""

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys

import experiments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/llama3_8b_4gpu.py"
DEVICES = 4
MEASURED = "results/fsdp/raw/e2e_8b_{workload}_{backend}.json"
BASE_TOKENS = 49_152
# An H100 80GB's allocator limit at XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (results/four/README.md).
LIMIT_BYTES = 78_222_091_878
MARGIN = 0.03
# F_max: all_to_all GB/s at 300 MB off-device on 2 x H100 (results/collective_bench_h100,
# default runs) for the FSDP collectives; HBM3 bandwidth for the optimizer's passes.
COLLECTIVE_BYTES_PER_S = 222e9
HBM_BYTES_PER_S = 3.35e12
WARMUP, STEPS = 2, 6  # the e2e runs' warm-up and timed steps (the batches the FLOPs are counted on)

# (remat, tokens per GPU, model.remat_mlp_layers, data.context_length, backend)
CANDIDATES = [
    ("full", 49152, 0, 0, "distca"), ("full", 57344, 0, 0, "distca"),
    ("full", 65536, 0, 0, "distca"), ("full", 57344, 0, 49152, "distca"),
    ("full", 65536, 0, 49152, "distca"), ("full", 16384, 0, 0, "distca"),
    ("full", 24576, 0, 0, "distca"),
    ("save_attention", 16384, 0, 0, "distca"), ("save_attention", 16384, 2, 0, "distca"),
    ("save_attention", 24576, 0, 0, "distca"), ("save_attention", 32768, 0, 0, "distca"),
    ("save_qkv_out", 24576, 0, 0, "distca"), ("save_qkv_out", 32768, 0, 0, "distca"),
    ("none", 16384, 0, 0, "distca"), ("save_dots", 16384, 0, 0, "distca"),
    ("full", 49152, 0, 0, "packed_dp"), ("full", 65536, 0, 0, "packed_dp"),
    ("full", 16384, 0, 0, "packed_dp"), ("full", 24576, 0, 0, "packed_dp"),
    ("save_attention", 16384, 0, 0, "packed_dp"), ("save_attention", 16384, 4, 0, "packed_dp"),
    ("save_attention", 16384, 8, 0, "packed_dp"), ("save_attention", 20480, 0, 0, "packed_dp"),
    ("save_attention", 24576, 0, 0, "packed_dp"), ("save_attention", 32768, 0, 0, "packed_dp"),
]


@dataclasses.dataclass(frozen=True)
class Candidate:
  remat: str
  tokens: int
  mlp_layers: int
  context: int
  backend: str

  @property
  def name(self) -> str:
    mlp = f"+mlp{self.mlp_layers}" if self.mlp_layers else ""
    ctx = f" (docs of {self.context // 1024}K)" if self.context else ""
    return f"{self.remat}{mlp} {self.tokens // 1024}K{ctx} {self.backend}"

  @property
  def key(self) -> str:
    return (f"{self.remat}_{self.tokens}_mlp{self.mlp_layers}_ctx{self.context}_{self.backend}")

  def overrides(self) -> list[str]:
    """The config overrides beyond the shipped config (its defaults are not repeated)."""
    out = []
    if self.remat != "full":
      out.append(f"model.remat={self.remat}")
    if self.mlp_layers:
      out.append(f"model.remat_mlp_layers={self.mlp_layers}")
    if self.tokens != BASE_TOKENS:
      out.append(f"tokens_per_rank={self.tokens}")
    if self.context:
      out.append(f"data.context_length={self.context}")
    if self.backend != "distca":
      out.append(f"attention.backend={self.backend}")
    return out

  def base(self) -> "Candidate":
    """Full remat at the same tokens, documents and backend (the policy change's reference)."""
    return Candidate("full", self.tokens, 0, self.context, self.backend)

  def reference(self) -> "Candidate":
    """The measured point: the shipped config on this backend."""
    return Candidate("full", BASE_TOKENS, 0, 0, self.backend)


def aot_command(cand: Candidate, out: str) -> list[str]:
  cmd = ["-m", "experiments.aot_memory", "--config", CONFIG, "--devices", str(DEVICES),
         "--override", "attention.kernel=blockwise"]
  for o in cand.overrides():
    cmd += ["--override", o]
  return cmd + ["--out", out]


def aot_report(cand: Candidate, aot_dir: str, run: bool) -> dict:
  """The candidate's aot_memory JSON (compiled in a child process when missing and ``run``)."""
  path = os.path.join(aot_dir, cand.key + ".json")
  if not os.path.exists(path):
    if not run:
      raise SystemExit(f"error: no AOT report {path}; pass --run to compile it")
    print(f"compiling {cand.name} ...", flush=True)
    subprocess.run([sys.executable] + aot_command(cand, path), cwd=ROOT, check=True)
  with open(path) as f:
    return json.load(f)


def load_config(cand: Candidate, workload: str = "pretrain"):
  from distca_jax import configs_io
  return configs_io.load_config(os.path.join(ROOT, CONFIG), ["attention.kernel=blockwise",
                                *cand.overrides(), f"data.workload={workload}"])


def flops_shares(c, steps: range) -> dict:
  """MFU's counted FLOPs per token over the batches of ``steps`` and the linear / attention / LM
  head shares of them (``metrics.step_flops``' model)."""
  from distca_jax import config as config_lib, metrics
  from distca_jax.data import run_source
  m = config_lib.model_config(c)
  src = run_source(c, DEVICES)
  docs = [l for s in steps for row in src.doclens(s) for l in row]
  total = metrics.step_flops(m, docs)
  tokens = float(sum(docs))
  layers = 6.0 * (metrics.matmul_params(m) - m.dim * m.vocab_size) * tokens
  head = 6.0 * m.dim * m.vocab_size * tokens
  return dict(per_token=total / tokens, lin=layers / total, head=head / total,
              att=(total - layers - head) / total)


def packed_dp_ceiling(c, steps: range) -> float:
  from distca_jax import config as config_lib
  from distca_jax.data import run_source
  from experiments.e2e_bench import ceiling, rows_by_rank
  m = config_lib.model_config(c)
  src = run_source(c, DEVICES)
  return ceiling(m, [rows_by_rank(src.doclens(s), DEVICES, c.rows_per_rank) for s in steps])


@functools.cache  # one trace per distinct policy
def linear_rerun_fraction(remat: str, mlp_layers: int, n_layers: int = 2) -> float:
  """The fraction of the layers' linear forward FLOPs the backward reruns under ``remat`` with
  the first ``mlp_layers`` of the model's layers keeping their MLP activations: the dot_general
  FLOPs of the gradient's jaxpr minus those of no remat, over the forward's, for ``n_layers``
  Llama-3-8B-shaped layers with a stand-in core attention that names its inputs as the kernels
  do and costs no FLOPs; counted with no layer and with every layer keeping its MLP, weighted by
  the model's layers."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.ad_checkpoint import checkpoint_name
  from distca_jax import attention as attn_lib, config as config_lib, model as model_lib, ops

  def dots(jaxpr, mult=1.0):
    total = 0.0
    for e in jaxpr.eqns:
      if e.primitive.name == "dot_general":
        a, b = e.invars[0].aval.shape, e.invars[1].aval.shape
        (ca, cb), (ba, bb) = e.params["dimension_numbers"]
        free_a = [a[i] for i in range(len(a)) if i not in ca and i not in ba]
        free_b = [b[i] for i in range(len(b)) if i not in cb and i not in bb]
        total += mult * 2.0 * np.prod([a[i] for i in ca + ba]) * np.prod(free_a) * np.prod(free_b)
        continue
      inner_mult = mult * (e.params["length"] if e.primitive.name == "scan" else 1)
      for p in e.params.values():
        for sub in p if isinstance(p, (list, tuple)) else [p]:
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            total += dots(inner, inner_mult)
    return total

  def attend(q, k, v, layout, *, softmax_scale):
    q, k, v = (checkpoint_name(x, ops.KERNEL_INPUTS_NAME) for x in (q, k, v))
    return q * softmax_scale + jnp.repeat(k * v, q.shape[-2] // k.shape[-2], axis=-2)

  base = config_lib.model_config(load_config(Candidate("full", BASE_TOKENS, 0, 0, "distca")))
  rows, t = 1, 256
  layout = attn_lib.Layout(jnp.ones((rows, t), jnp.int32),
                           jnp.arange(t, dtype=jnp.int32)[None].repeat(rows, 0))
  tokens = jnp.zeros((rows, t), jnp.int32)

  def grad_and_fwd(pol, kept):
    cfg = dataclasses.replace(base, n_layers=n_layers, vocab_size=256, remat=pol,
                              remat_mlp_layers=kept)
    m = model_lib.Transformer(cfg, attend)
    params = jax.eval_shape(lambda: m.init(jax.random.key(0), tokens, layout)["params"])
    f = lambda p: m.apply({"params": p}, tokens, layout).astype(jnp.float32).sum()
    return dots(jax.make_jaxpr(jax.grad(f))(params).jaxpr), dots(jax.make_jaxpr(f)(params).jaxpr)

  none, fwd = grad_and_fwd("none", 0)
  plain = (grad_and_fwd(remat, 0)[0] - none) / fwd
  if not mlp_layers:
    return plain
  kept = (grad_and_fwd(remat, n_layers)[0] - none) / fwd
  return (plain * (base.n_layers - mlp_layers) + kept * mlp_layers) / base.n_layers


def attention_exec(remat: str) -> float:
  """Executed / counted FLOPs of core attention: the kernel's backward is 2.5x its forward; MFU
  counts 3x; policies that keep neither the kernel's outputs nor inputs rerun its forward."""
  reruns = remat in ("full", "save_qkv_out", "save_dots")
  return (3.5 + (1.0 if reruns else 0.0)) / 3.0


def fsdp_fixed_seconds(c) -> float:
  """F_max: one step's FSDP collectives if none overlaps compute (bf16 weights gathered twice,
  gradients reduce-scattered once, (n-1)/n of them off-device) plus the optimizer's HBM passes
  over the local f32 shard (read weight, grad, two moments; write weight, two moments)."""
  from distca_jax import config as config_lib
  m = config_lib.model_config(c)
  n = m.num_params()
  wire = 3 * (DEVICES - 1) / DEVICES * n * 2
  return wire / COLLECTIVE_BYTES_PER_S + 7 * 4 * n / DEVICES / HBM_BYTES_PER_S


def workspace_bytes(c, measured_packed_dp_ws: float) -> int:
  """FlashAttention-3's backward accumulators for the candidate's largest kernel call."""
  from distca_jax import config as config_lib, memory, trainer
  from distca_jax.plan import capacity
  m = config_lib.model_config(c)
  h, k, d = m.n_heads, m.n_kv_heads, m.head_dim
  if c.attention.backend == "distca":
    caps = capacity.resolve_capacity(dict(trainer.make_backend(c).caps), c.tokens_per_rank,
                                     c.rows_per_rank)
    return memory.flash3_bwd_workspace_bytes(caps.q_tokens, caps.kv_tokens, h, k, d, caps.tasks)
  per_row = 4 * d * (h + 2 * k)  # packed_dp: Nq = Nk = tokens, b sequences of the task table
  b = round((measured_packed_dp_ws / per_row - BASE_TOKENS) / 128)
  return memory.flash3_bwd_workspace_bytes(c.tokens_per_rank, c.tokens_per_rank, h, k, d, b)


def measured(workload: str, backend: str) -> dict:
  with open(os.path.join(ROOT, MEASURED.format(workload=workload, backend=backend))) as f:
    return json.load(f)["results"][0]


@dataclasses.dataclass
class RateModel:
  """1 / MFU = ceiling x (A_lin / r_lin + imbalance x A_att / r_att) + F x peak / C, with A the
  executed FLOPs of each class per counted FLOP and C the counted FLOPs per device and step."""
  inv_lin: float
  inv_att: float
  fixed_s: float
  peak: float

  @staticmethod
  def terms(shares: dict, remat: str, rerun: float) -> tuple[float, float]:
    return (shares["lin"] * (1 + rerun / 3) + shares["head"], shares["att"] * attention_exec(remat))

  def inv_mfu(self, shares, remat, rerun, tokens, ceiling=1.0, imbalance=1.0) -> float:
    a_lin, a_att = self.terms(shares, remat, rerun)
    counted = tokens * shares["per_token"]
    return (ceiling * (a_lin * self.inv_lin + imbalance * a_att * self.inv_att)
            + self.fixed_s * self.peak / counted)

  @classmethod
  def fit(cls, points, rerun_full: float, fixed_s: float, peak: float) -> "RateModel":
    """Solve for 1 / r_lin and 1 / r_att from two measured full-remat points."""
    import numpy as np
    rows, rhs = [], []
    for p in points:
      a_lin, a_att = cls.terms(p["shares"], "full", rerun_full)
      rows.append([p["ceiling"] * a_lin, p["ceiling"] * p["imbalance"] * a_att])
      rhs.append(1 / p["mfu"] - fixed_s * peak / (p["tokens"] * p["shares"]["per_token"]))
    x, y = np.linalg.solve(np.array(rows), np.array(rhs))
    return cls(float(x), float(y), fixed_s, peak)


def measured_points() -> dict:
  """The four measured rows of the shipped config with their FLOPs shares over their timed
  batches, the imbalance the model applies and MFU."""
  out = {}
  for workload in ("pretrain", "prolong"):
    for backend in ("distca", "packed_dp"):
      r = measured(workload, backend)
      c = load_config(Candidate("full", BASE_TOKENS, 0, 0, backend), workload)
      steps = range(WARMUP, WARMUP + len(r["step_ms_all"]))
      shares = flops_shares(c, steps)
      out[workload, backend] = dict(
          workload=workload, backend=backend, mfu=r["mfu"], tokens=r["tokens"], shares=shares,
          lm_head_share_reported=r["lm_head_share"],
          ceiling=r["ceiling"] if backend == "packed_dp" else 1.0,
          imbalance=r.get("plan_imbalance_after", 1.0) if backend == "distca" else 1.0,
          memory_gb=r["memory_gb"])
  return out


def estimate(cand: Candidate, aot: dict, points: dict, models: list, reruns: dict) -> dict:
  """One candidate's row: memory estimates, FLOPs ratio, MFU and tokens/s estimates."""
  ref_point = points["pretrain", cand.backend]
  cpu = {k: aot[k.key]["total_per_device_bytes"] for k in (cand, cand.base(), cand.reference())}
  ref_cpu = aot[cand.reference().key]
  gpu_ref = ref_point["memory_gb"]["total"] * 1e9
  ratio = ref_point["memory_gb"]["temporaries"] * 1e9 / ref_cpu["temp_size_in_bytes"]
  d_tokens = cpu[cand.base()] - cpu[cand.reference()]
  d_policy = cpu[cand] - cpu[cand.base()]
  low = gpu_ref + ratio * (d_tokens + d_policy)
  high = gpu_ref + (1 if d_tokens > 0 else ratio) * d_tokens + (1 if d_policy > 0 else ratio) * d_policy
  c = load_config(cand)
  ws = workspace_bytes(c, ref_point["memory_gb"]["kernel_workspace"] * 1e9)
  need = high + ws
  steps = range(WARMUP, WARMUP + STEPS)
  shares = flops_shares(c, steps)
  rerun = reruns[cand.remat, cand.mlp_layers]
  a_lin, a_att = RateModel.terms(shares, cand.remat, rerun)
  ceiling = packed_dp_ceiling(c, steps) if cand.backend == "packed_dp" else 1.0
  imbalance = ref_point["imbalance"]
  mfu = [1 / m.inv_mfu(shares, cand.remat, rerun, cand.tokens, ceiling, imbalance) for m in models]
  peak = models[0].peak
  tokens_s = [DEVICES * cand.tokens / (cand.tokens * shares["per_token"] / (u * peak)) for u in mfu]
  gib = lambda b: round(b / 2**30, 2)
  return dict(
      candidate=cand.name, key=cand.key, backend=cand.backend, remat=cand.remat,
      tokens_per_gpu=cand.tokens, remat_mlp_layers=cand.mlp_layers,
      document_context=cand.context or cand.tokens, overrides=cand.overrides(),
      aot_command="python " + " ".join(aot_command(cand, "OUT.json")[:-2]),
      cpu_aot_gib=gib(cpu[cand]), gpu_temp_ratio=round(ratio, 4), gpu_plan_gib_low=gib(low),
      gpu_plan_gib_high=gib(high), flash3_workspace_gib=gib(ws), need_gib_high=gib(need),
      need_gib_low=gib(low + ws), limit_gib=gib(LIMIT_BYTES),
      margin=round(1 - need / LIMIT_BYTES, 4), fits=bool(need <= (1 - MARGIN) * LIMIT_BYTES),
      counted_gflop_per_token=round(shares["per_token"] / 1e9, 2),
      shares={k: round(v, 4) for k, v in shares.items() if k != "per_token"},
      linear_rerun_fraction=round(rerun, 4), attention_exec=round(attention_exec(cand.remat), 4),
      executed_over_counted=round(a_lin + a_att, 4), ceiling=round(ceiling, 4),
      imbalance_assumed=round(imbalance, 4) if cand.backend == "distca" else None,
      mfu_est_hidden_fixed=round(mfu[0], 4), mfu_est_exposed_fixed=round(mfu[1], 4),
      tokens_per_s_est=[round(t) for t in tokens_s])


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--aot-dir", required=True, help="aot_memory JSONs, one per candidate key")
  p.add_argument("--run", action="store_true", help="compile the candidates whose JSON is missing")
  p.add_argument("--out", default="", help="write OUT.json and OUT.md")
  a = p.parse_args()
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from distca_jax import metrics
  cands = [Candidate(*t) for t in CANDIDATES]
  need = {k for c in cands for k in (c, c.base(), c.reference())}
  os.makedirs(a.aot_dir, exist_ok=True)
  aot = {k.key: aot_report(k, a.aot_dir, a.run) for k in sorted(need, key=lambda k: k.key)}
  reruns = {(c.remat, c.mlp_layers): linear_rerun_fraction(c.remat, c.mlp_layers)
            for c in cands + [cands[0].reference()]}
  points = measured_points()
  peak = metrics.PEAK_TFLOPS["H100"] * 1e12
  fixed = fsdp_fixed_seconds(load_config(cands[0]))
  fit_on = [points["pretrain", "distca"], points["prolong", "packed_dp"]]
  models = [RateModel.fit(fit_on, reruns["full", 0], f, peak) for f in (0.0, fixed)]
  check = {f"{w} {b}": dict(measured=round(pt["mfu"], 4), model=[round(1 / m.inv_mfu(
      pt["shares"], "full", reruns["full", 0], pt["tokens"], pt["ceiling"], pt["imbalance"]), 4)
      for m in models]) for (w, b), pt in points.items()}
  rows = [estimate(c, aot, points, models, reruns) for c in cands]
  shipped = {r["backend"]: r for r in rows if r["remat"] == "full" and r["tokens_per_gpu"] ==
             BASE_TOKENS and r["document_context"] == BASE_TOKENS}
  for r in rows:
    r["mfu_est_over_shipped"] = round(r["mfu_est_hidden_fixed"]
                                      / shipped[r["backend"]]["mfu_est_hidden_fixed"], 3)
  report = dict(
      commit=experiments.git_commit(), device=f"CPU AOT, {DEVICES} fake devices (XLA:CPU buffer assignment); "
      "GPU figures are estimates from the measured 4 x H100 run", config=CONFIG,
      limit_gib=round(LIMIT_BYTES / 2**30, 2), margin=MARGIN, fixed_s_max=round(fixed, 4),
      rates=[dict(fixed_s=round(m.fixed_s, 4), r_lin=round(1 / m.inv_lin, 4),
                  r_att=round(1 / m.inv_att, 4)) for m in models],
      model_check=check, rows=rows)
  print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1))
  for r in rows:
    print(f"{r['candidate']:40s} cpu {r['cpu_aot_gib']:6.2f}  gpu {r['gpu_plan_gib_low']:6.2f}-"
          f"{r['gpu_plan_gib_high']:6.2f} +ws {r['flash3_workspace_gib']:4.2f} = "
          f"{r['need_gib_high']:6.2f} fits {r['fits']!s:5s} exec/counted "
          f"{r['executed_over_counted']:.3f} MFU {100 * r['mfu_est_hidden_fixed']:.1f}/"
          f"{100 * r['mfu_est_exposed_fixed']:.1f}%", flush=True)
  if a.out:
    with open(a.out + ".json", "w") as f:
      json.dump(report, f, indent=1)
    with open(a.out + ".md", "w") as f:
      f.write(markdown(report, os.path.relpath(a.out, ROOT)))


def markdown(report: dict, out: str) -> str:
  """The report's header, candidate table and model check as Markdown."""
  lim = report["limit_gib"]
  lines = [
      "# The whole Llama-3-8B with FSDP on 4 x 80 GB: candidate layouts for a higher MFU "
      "(CPU estimates)", "",
      f"- config: `{report['config']}` plus each row's overrides; Pretrain, distca unless the "
      "row says packed_dp.",
      f"- commit: `{report['commit']}`; device: {report['device']}.",
      f"- command: `python -m experiments.mfu_candidates --aot-dir AOT --run --out {out}`; it "
      "runs one `python -m experiments.aot_memory --config configs/llama3_8b_4gpu.py --devices 4 "
      "--override attention.kernel=blockwise --override KEY=VALUE ... --out AOT/KEY.json` per "
      "candidate and per full-remat reference (each row's command is in the JSON).",
      f"- fits: the high GPU estimate plus the FlashAttention-3 workspace within the H100 80GB's "
      f"allocator limit ({lim} GiB) less {100 * report['margin']:.0f}% "
      f"({lim * (1 - report['margin']):.2f} GiB).", "",
      "| candidate | overrides | CPU AOT GiB | est. GPU plan GiB (low-high) | FA3 workspace GiB "
      "| need GiB (high) | fits | counted GFLOP/token (attention share) | linear rerun "
      "| executed / counted FLOPs | est. MFU (F hidden / exposed) | est. MFU / shipped "
      "| est. tokens/s (F hidden) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in report["rows"]:
    over = " ".join(f"`{o}`" for o in r["overrides"]) or "(shipped)"
    lines.append(
        f"| {r['candidate']} | {over} | {r['cpu_aot_gib']:.2f} | {r['gpu_plan_gib_low']:.2f}-"
        f"{r['gpu_plan_gib_high']:.2f} | {r['flash3_workspace_gib']:.2f} | "
        f"{r['need_gib_high']:.2f} | {'**yes**' if r['fits'] else 'no'} "
        f"({100 * r['margin']:.1f}%) | {r['counted_gflop_per_token']:.1f} "
        f"({100 * r['shares']['att']:.0f}%) | {r['linear_rerun_fraction']:.3f} | "
        f"{r['executed_over_counted']:.3f} | {100 * r['mfu_est_hidden_fixed']:.1f}% / "
        f"{100 * r['mfu_est_exposed_fixed']:.1f}% | {r['mfu_est_over_shipped']:.3f} | "
        f"{r['tokens_per_s_est'][0]:,} |")
  rates = report["rates"]
  lines += ["", f"Rates fitted (fraction of the H100's dense bf16 peak): linear {rates[0]['r_lin']:.3f}, "
            f"attention {rates[0]['r_att']:.3f} with F = 0; {rates[1]['r_lin']:.3f} / "
            f"{rates[1]['r_att']:.3f} with F = F_max = {report['fixed_s_max']:.3f} s.", "",
            "| measured row (48K, full remat) | measured MFU | model (F = 0 / F_max) |",
            "|---|---|---|"]
  for name, v in report["model_check"].items():
    lines.append(f"| {name} | {100 * v['measured']:.1f}% | {100 * v['model'][0]:.1f}% / "
                 f"{100 * v['model'][1]:.1f}% |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
