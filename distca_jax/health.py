"""Step health: the running statistics a step's loss and gradient norm are checked against
(`spike_check`, inside the compiled step), and the host-side watch that stops a run after
`train.max_bad_steps` skipped steps in a row (`BadStepWatch`, `TrainingDiverged`)."""

from __future__ import annotations

import collections
import shlex

import jax.numpy as jnp
import numpy as np

from distca_jax.errors import UserError

# The running statistics a step's loss and gradient norm are checked against (`spike_check`).
HEALTH_FIELDS = ("good_steps", "log_loss_mean", "log_loss_rise_sq", "log_grad_norm_mean",
                 "log_grad_norm_rise_sq")
HEALTH_DECAY = 0.95  # exponential moving average over ~20 good steps
# The smallest standard deviations a spike is measured in (log space): 5% for the loss, 25% for
# the gradient norm, which varies ~3x between healthy steps of the tiny config.
MIN_LOG_STD_LOSS, MIN_LOG_STD_GRAD_NORM = 0.05, 0.25


def spike_check(health, loss, grad_norm, sigmas: float, warmup: int):
  """((loss spike, gradient-norm spike), limits, new health) of one step against the running
  statistics ``health``.

  A spike is a loss or gradient norm whose log lies more than ``sigmas`` running deviations
  (the root mean square of its rises above the mean, at least ``MIN_LOG_STD_*``) above its
  running mean, once ``warmup`` good steps have
  built the statistics (``sigmas`` = 0: never). ``limits`` are the two thresholds (loss, gradient
  norm; inf before the warmup). The returned statistics take in this step; the caller decides
  which steps they keep (``make_train_step``)."""
  n, ml, vl, mg, vg = (health[i] for i in range(len(HEALTH_FIELDS)))
  x = jnp.log(jnp.maximum(loss, 1e-30).astype(jnp.float32))
  g = jnp.log(jnp.maximum(grad_norm, 1e-30).astype(jnp.float32))
  active = (n >= warmup) & (sigmas > 0)
  lim_x = jnp.where(active, ml + sigmas * jnp.maximum(jnp.sqrt(vl), MIN_LOG_STD_LOSS), jnp.inf)
  lim_g = jnp.where(active, mg + sigmas * jnp.maximum(jnp.sqrt(vg), MIN_LOG_STD_GRAD_NORM),
                    jnp.inf)
  spike = (x > lim_x, g > lim_g)
  # Moving averages (a plain average until the window fills) of the log and of its squared rise
  # above the mean (a falling loss, the normal trend, widens nothing).
  beta = jnp.minimum(HEALTH_DECAY, n / (n + 1.0))
  rise = lambda v, m: jnp.square(jnp.maximum(v - m, 0.0))
  new = jnp.stack([n + 1, beta * ml + (1 - beta) * x, beta * vl + (1 - beta) * rise(x, ml),
                   beta * mg + (1 - beta) * g, beta * vg + (1 - beta) * rise(g, mg)])
  return spike, (jnp.exp(lim_x), jnp.exp(lim_g)), new


class TrainingDiverged(UserError):
  """`train.max_bad_steps` consecutive steps were skipped (a non-finite or spiking loss or
  gradient norm). ``first_bad`` / ``last_bad``: their 0-based indices; ``resume``: the config
  overrides of the advised rerun (a lower learning rate), which `command_line` spells out."""

  def __init__(self, message: str, first_bad: int = 0, last_bad: int = 0,
               resume: dict | None = None):
    super().__init__(message)
    self.first_bad, self.last_bad, self.resume = first_bad, last_bad, resume or {}

  def command_line(self, argv: list[str]) -> str:
    """``argv`` (an entry point's command line) with the ``resume`` overrides in place of any
    earlier value of theirs."""
    keep = [a for a in argv if not any(a.startswith(f"--config.{k}=") for k in self.resume)]
    return " ".join(shlex.quote(a) for a in keep + [f"--config.{k}={v:g}"
                                                     for k, v in self.resume.items()])


def _reason(m: dict, step: int) -> str:
  """Why step ``step`` (0-based) was skipped, from its metrics."""
  loss, gnorm = float(m["loss"]), float(m["grad_norm"])
  if not (np.isfinite(loss) and np.isfinite(gnorm)):
    return f"step {step + 1}: loss {loss:.4g}, gradient norm {gnorm:.4g}"
  parts = [f"loss {loss:.4g} over its spike limit {float(m['loss_limit']):.4g}"
           if loss > float(m["loss_limit"]) else "",
           f"gradient norm {gnorm:.4g} over its spike limit {float(m['grad_norm_limit']):.4g}"
           if gnorm > float(m["grad_norm_limit"]) else ""]
  return f"step {step + 1}: " + " and ".join(p for p in parts if p)


class BadStepWatch:
  """Follows the skipped steps (`TrainState.bad_steps`) and stops the run after `max_bad` in a
  row, reading each step's count only once it has reached the host: every step starts its copy
  (`copy_to_host_async`) and `poll` reads the ones that are ready, so the loop never waits for a
  step to finish. `streak` is the run of skipped steps ending at the last step read (0: that step
  was good) and `streak_start` its first step (0-based)."""

  def __init__(self, max_bad: int):
    self.max_bad = max_bad
    self.streak, self.streak_start, self.first_reason = 0, None, ""
    self._pending: collections.deque = collections.deque()

  def add(self, step: int, metrics: dict) -> None:
    metrics["bad_steps"].copy_to_host_async()
    self._pending.append((step, metrics))

  def poll(self, wait: bool = False) -> None:
    """Reads the steps whose count is on the host (`wait`: all of them); raises
    TrainingDiverged (without advice: the loop adds it) at `max_bad` in a row."""
    while self._pending and (wait or self._pending[0][1]["bad_steps"].is_ready()):
      step, m = self._pending.popleft()
      self.streak = int(m["bad_steps"])
      if self.streak == 1:
        self.streak_start, self.first_reason = step, _reason(m, step)
      if self.streak >= self.max_bad:
        first = step - self.streak + 1
        raise TrainingDiverged(
            f"steps {first + 1}..{step + 1} ({self.streak} in a row, train.max_bad_steps="
            f"{self.max_bad}) had a non-finite or spiking loss or gradient norm and were skipped "
            f"({self.first_reason})", first, step)
