"""FLOPs, MFU and the run's outputs: progress lines on stdout, a JSONL log, TensorBoard events.

MFU counts document-masked FLOPs, the work the model really needs for the real tokens:
  token-linear   6 * N * sum(l)                  (N: every matmul weight, the LM head included,
                                                  the input embedding lookup excluded)
  core attention 6 * layers * Hq * D * sum(l^2)  (causal, per document: l^2 / 2 pairs, 4 FLOPs per
                                                  pair and head-dim element forward, x3 for
                                                  forward + backward, Megatron's convention)
summed over the documents (pieces) l of the batch, padding excluded, divided by
(step time * devices * peak). Attention never crosses a document boundary, so packing many short
documents costs much less than sum(l)^2 would suggest; this is what the formula reflects.

MFU is the reported convention. The work model that the e2e ceiling, the planner's gate, the
baselines' metrics and the simulator (``distca_jax.sim``) share is ``work_flops``: the same
token-linear term, attention at the fused kernel's forward + backward (3.5x forward,
``plan.cost.BWD_FWD_RATIO``). With few layers the LM head dominates the counted FLOPs
(``lm_head_share``), so MFU tables state the layers and that share.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Iterable, Sequence

import jax
import numpy as np

from distca_jax.plan import cost as plan_cost
from distca_jax.model import ModelConfig

# Dense bf16 peak per device, by substring of jax's device_kind.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def matmul_params(cfg: ModelConfig) -> int:
  """N: weights that take part in a matmul per token (layers + LM head, not the embedding lookup)."""
  e, h, k, d, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim
  per_layer = e * (h + 2 * k) * d + h * d * e + 3 * e * f
  return cfg.n_layers * per_layer + e * cfg.vocab_size


def attention_pair_flops(n_layers: int, q_heads: int, head_dim: int) -> float:
  """Training FLOPs of one causal (query, key) pair over ``n_layers`` layers in the work model:
  the fused kernel's forward + backward (``plan.cost.task_flops``: 4 Hq D forward, 3.5x that
  with the backward)."""
  return float(plan_cost.task_flops(1, q_heads, head_dim)) * n_layers


def work_flops(matmul_weights: float, n_layers: int, q_heads: int, head_dim: int, tokens,
               pairs):
  """The work model shared by the e2e ceiling, the planner's gate and the simulator:
  ``6 N tokens + attention_pair_flops x pairs`` (scalars or arrays). MFU keeps its reported
  convention (``step_flops``: attention at 3x forward), so the two differ by design."""
  return (6.0 * float(matmul_weights) * np.asarray(tokens, np.float64)
          + attention_pair_flops(n_layers, q_heads, head_dim) * np.asarray(pairs, np.float64))


def step_work(cfg: ModelConfig, doc_lens: Iterable[Sequence[int]] | Sequence[int]) -> float:
  """``work_flops`` of one batch (or one rank's share) of documents: ``l (l + 1) / 2`` causal
  pairs per document of ``l`` tokens."""
  flat = np.asarray(_flatten(doc_lens), np.float64)
  return float(work_flops(matmul_params(cfg), cfg.n_layers, cfg.n_heads, cfg.head_dim,
                          flat.sum(), (flat * (flat + 1) / 2).sum()))


def linear_pairs_per_token(cfg: ModelConfig) -> float:
  """The linear layers' training work per token in causal-pair units of core attention.

  In the work model (``work_flops``) a token costs ``6 N`` and a causal pair
  ``attention_pair_flops`` (14 L Hq D), so one token's linear work is ``6 N / (14 L Hq D)``
  pairs. The CAD planner's gate weighs attention loads with it
  (``plan.predicted_step_gain``).
  """
  return 6.0 * matmul_params(cfg) / attention_pair_flops(cfg.n_layers, cfg.n_heads, cfg.head_dim)


def lm_head_share(cfg: ModelConfig, doc_lens: Iterable[Sequence[int]] | Sequence[int]) -> float:
  """The LM head's share of ``step_flops`` (MFU's FLOPs): ``6 E V sum(l) / step_flops``. With
  few layers the head dominates what MFU counts, so MFU tables state it beside the layers."""
  total = step_flops(cfg, doc_lens)
  return 6.0 * cfg.dim * cfg.vocab_size * float(sum(_flatten(doc_lens))) / total if total else 0.0


def step_flops(cfg: ModelConfig, doc_lens: Iterable[Sequence[int]] | Sequence[int]) -> float:
  """Document-masked training FLOPs (forward + backward) for one batch's document lengths."""
  flat = _flatten(doc_lens)
  sum_l = float(sum(flat))
  sum_l2 = float(sum(l * l for l in flat))
  return (6.0 * matmul_params(cfg) * sum_l
          + 6.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * sum_l2)


def _flatten(doc_lens) -> list[int]:
  out = []
  for x in doc_lens:
    if isinstance(x, (list, tuple)) or hasattr(x, "__len__"):
      out.extend(int(v) for v in x)
    else:
      out.append(int(x))
  return out


def peak_flops_per_device(override_tflops: float = 0.0) -> float | None:
  """Peak FLOP/s of one device: the override if set, else by device kind, else None (no MFU)."""
  if override_tflops > 0:
    return override_tflops * 1e12
  kind = jax.devices()[0].device_kind
  for name, tf in PEAK_TFLOPS.items():
    if name in kind:
      return tf * 1e12
  return None


class RunLog:
  """Progress lines, `metrics.jsonl` and TensorBoard events for one workdir (process 0 only)."""

  def __init__(self, workdir: str, total_steps: int, tensorboard: bool = True):
    self.total = total_steps
    self.enabled = jax.process_index() == 0
    self._jsonl = None
    self._tb = None
    self._t0 = time.time()
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter
      except ImportError as e:
        raise ImportError("TensorBoard logging needs tensorboardX: `pip install tensorboardX`, or "
                          "run with --config.tensorboard=False") from e
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, record: dict) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: float(v) for k, v in record.items()}}
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tb is not None:  # non-finite values (a skipped step's loss) stay in the JSONL only
      for k, v in record.items():
        if k != "step" and np.isfinite(v):
          self._tb.add_scalar(k, v, step)
      self._tb.flush()
    self._print(step, record)

  def _print(self, step: int, r: dict) -> None:
    width = 24
    done = int(width * step / max(1, self.total))
    bar = "#" * done + "." * (width - done)
    parts = [f"[{bar}] step {step}/{self.total}", f"loss {r['loss']:.4f}"]
    if "eval_loss" in r:
      parts.append(f"eval loss {r['eval_loss']:.4f} ppl {r['eval_ppl']:.4g}")
    if "tokens_per_s" in r:
      parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if "mfu" in r:
      parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "step_time_s" in r:
      parts.append(f"{r['step_time_s']:.3f} s/step")
      eta = r["step_time_s"] * (self.total - step)
      parts.append(f"eta {int(eta // 60)}m{int(eta % 60):02d}s")
    print(" | ".join(parts), flush=True)

  def info(self, msg: str) -> None:
    if self.enabled:
      print(msg, flush=True)
      sys.stdout.flush()

  def close(self) -> None:
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()
