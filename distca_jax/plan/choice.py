"""Which branch a distca step runs, chosen per step on the host by a calibrated price.

A distca train step has two branches (``trainer.make_train_step``): CAD (the plan's exchange,
the servers' attention) and the local branch (packed_dp's attention on each device's own rows).
Before each step the host prices both with the calibrated step model (in training
``sim.price.BranchPricer`` on the step's plans, in the replay ``sim.validate.predict_branches``:
the run's layers, remat, memory mode, exchange, caps, GPUs, device), and a
``BranchChooser`` turns the two predictions into a choice, then learns from the measured time of
the branch that ran. The rule, exactly (step ``k``; ``p_cad``, ``p_local`` the model's
predictions in seconds):

1. Corrected prices. Per branch a ratio ``r`` = measured / predicted of the steps that branch
   ran: the first measurement sets it, later ones move it by an exponential moving average
   (weight ``max(ema, 1 / n)`` for the ``n``-th measurement, so ``ema`` once ``n >= 1 / ema``);
   a branch never measured keeps 1 (the calibration's word). ``cad = r_cad p_cad``,
   ``local = r_local p_local``. A branch's ratio is never borrowed from the other branch: a
   ratio learned on CAD steps says how far the model misprices the exchange, not the local
   step, and copying it would hide exactly the mispricing the choice must see.
2. CAD's uncertainty ``sigma``: how far a CAD step may come in above its corrected price.
   ``sigma0`` until CAD has run; each CAD measurement then moves it towards ``|q - r_before| /
   r_before`` (``q`` that step's measured / predicted ratio, ``r_before`` the ratio it was
   priced with) by a moving average in which ``sigma0`` counts as one measurement (weight
   ``max(ema, 1 / (n + 1))`` for the ``n``-th), never below ``sigma_min``.
3. Regret. ``elapsed`` sums the measured times of the steps so far, ``regret`` the excess of
   each CAD step over the local price it was chosen against: ``max(0, t - local_k)``. The
   budget is ``budget x elapsed`` (1% by default); ``slack = budget x (elapsed + local) -
   regret`` is what this step may still add.
4. Margin. ``margin = max(margin0, sigma - slack / cad)``: the base margin while the budget has
   room, raised as regret nears the budget (``slack`` falls to 0: the margin reaches ``sigma``)
   and beyond it once the budget is spent (``slack`` < 0).
5. Choice. CAD iff ``cad x (1 + margin) < local`` (and both prices are finite), else local.

What this bounds: a CAD step is chosen only when ``cad (1 + sigma) - local < slack``, so a CAD
step that comes in within ``sigma`` of its corrected price adds less than ``slack`` to the
regret, and the regret stays under ``budget x elapsed`` (its own time included): the summed
excess of CAD steps over the local price they were chosen against stays under 1% of the run,
whatever the sequence of predictions, as long as each CAD step lands within ``sigma`` of its
price. A CAD step above that is seen at once (its ratio raises ``r_cad`` and ``sigma``, its
excess the regret) and the margin rises with it. The regret the guard sees is against the
corrected local price; the true regret (against the local time the step would have taken) is
what ``experiments/branch_replay.py`` measures on committed runs.

NumPy only (no jax), like the rest of ``plan``.
"""

from __future__ import annotations

import dataclasses
import math

from distca_jax.checks import check_float

BRANCHES = ("cad", "local")


@dataclasses.dataclass(frozen=True)
class ChoiceOptions:
  """The rule's constants (the trainer's ``attention.distca.branch='price'`` uses the defaults;
  ``experiments/branch_replay.py`` takes each as a flag).

  Attributes:
    margin: the base margin: CAD runs when its corrected price is below the local one by more
      than this fraction of CAD's price.
    budget: the regret budget, a fraction of the run's elapsed time.
    sigma0: CAD's uncertainty before its first measurement (the calibrated model's typical
      error on distca steps).
    sigma_min: the least uncertainty CAD keeps after measurements.
    ema: the weight of a new measurement in each branch's ratio (and in ``sigma``) once a
      branch has ``1 / ema`` measurements; earlier ones average equally.
  """
  margin: float = 0.01
  budget: float = 0.01
  sigma0: float = 0.05
  sigma_min: float = 0.01
  ema: float = 0.3

  def __post_init__(self):
    check_float("margin", self.margin, 0.0, "0: CAD runs whenever it is priced faster")
    check_float("budget", self.budget, 0.0, "a fraction of the run's time, e.g. 0.01")
    check_float("sigma0", self.sigma0, 0.0, "e.g. 0.05: the model's typical error")
    check_float("sigma_min", self.sigma_min, 0.0, "e.g. 0.01")
    if not 0.0 < self.ema <= 1.0:
      raise ValueError(f"ema={self.ema!r} must be in (0, 1] (the weight of a new measurement)")


@dataclasses.dataclass(frozen=True)
class Choice:
  """One step's decision: the branch, the corrected prices it compared, the margin and slack
  it used, a one-line reason (what the trainer logs), and the model's two predictions (what
  ``BranchChooser.observe`` divides the measured time by)."""
  branch: str
  cad_s: float
  local_s: float
  margin: float
  slack_s: float
  reason: str
  predicted_cad_s: float
  predicted_local_s: float


class BranchChooser:
  """The rule of the module docstring, one instance per run: ``choose`` before a step,
  ``observe(choice, seconds)`` with that step's measured time once known. Choices may be
  observed later than the next ``choose`` (a trainer that learns a step's time only after
  dispatching the next); each updates the state when observed."""

  def __init__(self, options: ChoiceOptions | None = None):
    self.options = options or ChoiceOptions()
    self.ratio = {b: 1.0 for b in BRANCHES}
    self.count = {b: 0 for b in BRANCHES}
    self.sigma = self.options.sigma0
    self.elapsed_s = 0.0
    self.regret_s = 0.0
    self.steps = {b: 0 for b in BRANCHES}

  def choose(self, predicted_cad_s: float, predicted_local_s: float) -> Choice:
    """The branch of the next step from the model's two predictions (seconds)."""
    for name, v in (("predicted_cad_s", predicted_cad_s), ("predicted_local_s",
                                                           predicted_local_s)):
      if not (isinstance(v, (int, float)) and v > 0 and not math.isnan(v)):
        raise ValueError(f"{name}={v!r} must be a positive number of seconds (the step model's "
                         "price of that branch)")
    o = self.options
    cad = self.ratio["cad"] * float(predicted_cad_s)
    local = self.ratio["local"] * float(predicted_local_s)
    slack = o.budget * (self.elapsed_s + local) - self.regret_s
    margin = max(o.margin, self.sigma - slack / cad) if math.isfinite(cad) else math.inf
    run_cad = math.isfinite(cad) and cad * (1.0 + margin) < local
    gain = local / cad - 1.0 if math.isfinite(cad) else -math.inf
    reason = (f"cad {cad * 1e3:.1f} ms vs local {local * 1e3:.1f} ms (gain {gain:+.3f}, "
              f"margin {margin:.3f}, regret {self.regret_s * 1e3:.1f} ms of budget "
              f"{o.budget * (self.elapsed_s + local) * 1e3:.1f} ms)")
    return Choice("cad" if run_cad else "local", cad, local, margin, slack, reason,
                  float(predicted_cad_s), float(predicted_local_s))

  def observe(self, choice: Choice, measured_s: float) -> None:
    """The measured time of the step ``choice`` decided: updates the ratio of the branch that
    ran (and CAD's ``sigma``), the elapsed time and the regret."""
    if not isinstance(choice, Choice):
      raise ValueError(f"choice={choice!r} must be the Choice that choose() returned for the "
                       "step")
    if not (isinstance(measured_s, (int, float)) and measured_s > 0):
      raise ValueError(f"measured_s={measured_s!r} must be the step's positive wall time in "
                       "seconds")
    p_cad, p_local = choice.predicted_cad_s, choice.predicted_local_s
    b = choice.branch
    q = float(measured_s) / (p_cad if b == "cad" else p_local)
    self.count[b] += 1
    w = max(self.options.ema, 1.0 / self.count[b])
    before = self.ratio[b]
    self.ratio[b] = q if self.count[b] == 1 else (1.0 - w) * before + w * q
    if b == "cad":
      dev = abs(q - before) / before
      ws = max(self.options.ema, 1.0 / (self.count[b] + 1))  # sigma0 counts as one measurement
      self.sigma = max(self.options.sigma_min, (1.0 - ws) * self.sigma + ws * dev)
      self.regret_s += max(0.0, float(measured_s) - choice.local_s)
    self.steps[b] += 1
    self.elapsed_s += float(measured_s)

  def state(self) -> dict[str, float]:
    """What a run's summary reports: steps per branch, ratios, sigma, elapsed and regret
    (seconds) and the regret as a fraction of the elapsed time."""
    return {"cad_steps": self.steps["cad"], "local_steps": self.steps["local"],
            "ratio_cad": self.ratio["cad"], "ratio_local": self.ratio["local"],
            "sigma": self.sigma, "elapsed_s": self.elapsed_s, "regret_s": self.regret_s,
            "regret_fraction": self.regret_s / self.elapsed_s if self.elapsed_s else 0.0}
