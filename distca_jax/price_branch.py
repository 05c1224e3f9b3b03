"""``attention.distca.branch='price'``: each step's branch (CAD or the train step's local
branch) chosen by the calibrated price of both (``sim.price``, ``plan.choice``), and what a host
batch's branch is (``runs_local``)."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from distca_jax import attention as attn_lib
from distca_jax import config as config_lib
from distca_jax.errors import UserError


def wanted(c, backend) -> bool:
  """Whether the run chooses each step's branch by price (``attention.distca.branch='price'``
  and a backend with a local branch); a UserError for several processes."""
  if c.attention.distca.branch != "price" or backend.local_fn is None:
    return False
  if jax.process_count() > 1:
    raise UserError("attention.distca.branch='price' decides each step from this process's "
                    f"step times, and the {jax.process_count()} processes must agree; run one "
                    "process or set attention.distca.branch='gain'")
  return True


def runs_local(np_batch: dict | list) -> bool:
  """Whether a host batch (a dict, or a process's ``LocalBatch`` blocks) takes the train step's
  local branch (``make_train_step``): its backend's ``attention.CROSSES_KEY`` rows are all
  zero; False for a batch without them."""
  key = attn_lib.EXTRA_PREFIX + attn_lib.CROSSES_KEY
  blocks = [np_batch] if isinstance(np_batch, dict) else [b for _, _, b in np_batch]
  return all(key in b for b in blocks) and not any(np.any(b[key]) for b in blocks)


class PriceBranch:
  """``attention.distca.branch='price'`` in the train loop (one process, distca with its local
  branch): before each step whose plans move rows, both branches are priced by the calibrated
  step model (``sim.price.BranchPricer`` on the step's ``host_plans``) and ``plan.choice``'s
  rule decides; a step it sends to the local branch gets its ``attention.CROSSES_KEY`` rows
  zeroed (the train step's second branch then runs). A step's time is the interval between the
  completions of it and the step before (``after_dispatch`` waits for the previous step once the
  next is dispatched, so one step stays in flight); the compiling and profiled steps give no
  time. Each decision is a line of ``WORKDIR/branches.jsonl`` (step, branch, reason, the
  corrected prices and margin in ms)."""

  def __init__(self, c, backend, source, memory_mode: str, workdir: str, device_kind: str):
    from distca_jax.plan import choice  # pylint: disable=import-outside-toplevel
    from distca_jax.sim import price  # pylint: disable=import-outside-toplevel
    self.pricer = price.BranchPricer(
        config_lib.model_config(c), remat=c.model.remat, nano_batches=c.attention.nano_batches,
        collective=c.attention.distca.collective, memory_mode=memory_mode,
        exchange_buckets=c.attention.distca.exchange_buckets, device_kind=device_kind,
        buckets=c.attention.distca.buckets)
    self.chooser = choice.BranchChooser()
    self.backend, self.source = backend, source
    self._file = (open(os.path.join(workdir, "branches.jsonl"), "a")
                  if jax.process_index() == 0 else None)
    self._choice = None
    self._pending = None  # (choice or None, metrics, timed) of the last dispatched step
    self._done_t = None

  @classmethod
  def start(cls, c, backend, source, model, workdir: str, info) -> "PriceBranch":
    """The run's pricer once the pre-flight has built ``model`` (its memory mode: 'resend' when
    the model attends with the backend's ``resend_fn``); ``info`` logs what it prices with."""
    resend = getattr(backend, "resend_fn", None)
    mode = "resend" if resend is not None and model.attend is resend else backend.memory_mode
    pricing = cls(c, backend, source, mode, workdir, jax.devices()[0].device_kind)
    info(f"distca branch 'price': {pricing.pricer.describe()}; each step's branch in "
         f"{workdir}/branches.jsonl")
    return pricing

  def record(self) -> dict:
    """The guard's state for a log record."""
    s = self.chooser.state()
    return {"branch_regret_fraction": s["regret_fraction"], "branch_ratio_cad": s["ratio_cad"],
            "branch_ratio_local": s["ratio_local"]}

  def decide(self, step: int, np_batch) -> None:
    """Chooses step ``step``'s branch before its dispatch (``np_batch``: its ``LocalBatch``)."""
    rec = {"step": step + 1}
    self._choice = None
    if runs_local(np_batch):
      rec.update(branch="local", reason="no plan moves a row")
    else:
      doclens = self.source.doclens(step)
      plans = self.backend.host_plans(doclens, self.source.tokens_per_row)
      ch = self.chooser.choose(*self.pricer.prices(plans, doclens, self.source.tokens_per_row))
      if ch.branch == "local":
        key = attn_lib.EXTRA_PREFIX + attn_lib.CROSSES_KEY
        for _, _, block in np_batch:
          block[key][...] = 0
      self._choice = ch
      rec.update(branch=ch.branch, reason=ch.reason, cad_ms=ch.cad_s * 1e3,
                 local_ms=ch.local_s * 1e3, margin=ch.margin)
    if self._file is not None:
      self._file.write(json.dumps(rec) + "\n")
      self._file.flush()

  def after_dispatch(self, m, timed: bool) -> None:
    """After dispatching the step ``decide`` last saw (its metrics ``m``; ``timed`` False for
    the compiling or a profiled step): waits for the step before it and gives the chooser that
    step's time."""
    if self._pending is not None:
      choice_prev, m_prev, timed_prev = self._pending
      jax.block_until_ready(m_prev)
      t = time.perf_counter()
      if self._done_t is not None and timed_prev and choice_prev is not None:
        self.chooser.observe(choice_prev, t - self._done_t)
      self._done_t = t
    self._pending = (self._choice, m, timed)

  def summary(self) -> str:
    s = self.chooser.state()
    n = s["cad_steps"] + s["local_steps"]
    return (f"branch 'price': of {n} timed steps whose plans moved rows {s['cad_steps']} ran "
            f"CAD, {s['local_steps']} the local branch; regret {s['regret_s'] * 1e3:.1f} ms = "
            f"{s['regret_fraction']:.2%} of their time (budget "
            f"{self.chooser.options.budget:.0%}); measured / predicted CAD "
            f"{s['ratio_cad']:.3f}, local {s['ratio_local']:.3f}; {self.pricer.describe()}")

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
