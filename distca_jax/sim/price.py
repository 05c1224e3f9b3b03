"""The two branches of a distca train step priced in seconds on the host, from the step's plans:
what ``plan.choice.BranchChooser`` compares when ``attention.distca.branch='price'``.

``BranchPricer.prices(plans, doclens, tokens_per_row)`` -> (CAD seconds, local seconds):

* CAD: the step through the exchange with the plans the backend made (``host_plans``: one per
  nano-batch), priced by ``step.evaluate`` as the simulator prices a distca step (the run's
  layers, remat, the exchange 'auto' resolves to on this layout, the memory mode the pre-flight
  chose, the caps the plans were made under, dispatch over those buffers);
* local: packed_dp's step on the same rows (each rank its own documents), the local branch.

Calibration: the constants ``sim.validate`` fitted for the device's era, read from the committed
``results/simulator_validation.json`` (``experiments/simulate.py --validate`` writes it):
'h100' for an H100, 'h200' for an H200, else 'current' (one H200; on other devices the prices
are an H200's and the chooser's per-branch correction carries the rest). FSDP, tensor and
pipeline parallelism are not in these prices (the local branch exists without a pipeline only).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

from distca_jax import plan as plan_lib
from distca_jax.sim import costs, step

VALIDATION_JSON = os.path.join(costs.ROOT, "results", "simulator_validation.json")
# Device kind substring -> the era whose calibration prices it (first match).
DEVICE_ERAS = (("H100", "h100"), ("H200", "h200"))
FALLBACK_ERA = "current"


def era_of_device(device_kind: str) -> str:
  """The calibration era for a device kind (``DEVICE_ERAS``, else ``FALLBACK_ERA``)."""
  return next((era for key, era in DEVICE_ERAS if key in device_kind), FALLBACK_ERA)


def load_calibration(era: str, path: str = VALIDATION_JSON
                     ) -> tuple[costs.Calibration, costs.KernelModel]:
  """The fitted ``Calibration`` of ``era`` and the kernel model with its fitted time per task,
  from ``sim.validate``'s committed output."""
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} is missing: attention.distca.branch='price' reads the "
                            "step model's calibration from it (python -m experiments.simulate "
                            "--validate --json results/simulator_validation.json writes it), or "
                            "set attention.distca.branch='gain'")
  with open(path) as f:
    blob = json.load(f)
  cals = blob["calibrations"]
  if era not in cals:
    raise ValueError(f"era {era!r} is not in {path} (has {sorted(cals)})")
  return costs.Calibration(**cals[era]), costs.KernelModel(task_s=float(blob["task_s"]))


class BranchPricer:
  """Prices a step's CAD and local branches (module docstring) for one run.

  Args:
    model_cfg: the run's ``model.ModelConfig`` (its layers are the step's).
    remat: ``model.remat`` ('save_attention' or 'full': the policies the model prices).
    nano_batches: ``attention.nano_batches`` (one plan per nano-batch).
    collective: ``attention.distca.collective`` ('auto', 'remote', 'dense', 'ragged').
    memory_mode: the data plane's resolved mode ('keep' or 'resend').
    exchange_buckets: ``attention.distca.exchange_buckets``.
    buckets: ``attention.distca.buckets`` (the compiled exchange capacities; 1 = the caps').
    device_kind: ``jax.devices()[0].device_kind`` (picks the calibration: ``era_of_device``).
  """

  def __init__(self, model_cfg, *, remat: str, nano_batches: int, collective: str,
               memory_mode: str, exchange_buckets: int, device_kind: str, buckets: int = 1,
               calibration: tuple[costs.Calibration, costs.KernelModel] | None = None):
    if collective not in step.SIM_COLLECTIVES:
      raise ValueError(f"attention.distca.collective={collective!r} is not priced by the step "
                       f"model (it prices {step.SIM_COLLECTIVES}); set one of those or "
                       "attention.distca.branch='gain'")
    try:
      costs.check_remat(remat)
    except ValueError as e:
      raise ValueError(f"{e}; or set attention.distca.branch='gain'") from None
    self.era = era_of_device(device_kind)
    self.cal, self.km = calibration or load_calibration(self.era)
    self.spec = costs.spec_of_model("run", model_cfg)
    self.nano_batches = nano_batches
    self.opts = step.Options(collective=collective, memory_mode=memory_mode,
                             exchange_buckets=exchange_buckets, buckets=buckets, remat=remat,
                             nano_batches=nano_batches, local_steps=False)

  def prices(self, plans: Sequence[plan_lib.HostPlan], doclens, tokens_per_row: int
             ) -> tuple[float, float]:
    """(CAD seconds, local seconds) of the step whose ``host_plans`` are ``plans`` (one per
    nano-batch, one server group) over the batch rows ``doclens`` (data ranks x rows per
    rank, each a list of document lengths)."""
    if len(plans) != self.nano_batches:
      raise ValueError(f"got {len(plans)} plans for nano_batches={self.nano_batches}; price "
                       "one server group's plans (no pipeline)")
    s = plans[0].plan.num_servers
    if len(doclens) % s:
      raise ValueError(f"{len(doclens)} rows do not divide into {s} servers' blocks")
    r = len(doclens) // s
    layout = step.Layout(gpus=s, micro_batches=self.nano_batches)
    cad_tokens = plans[0].spec.tokens_per_device
    cad = step.evaluate([[step.distca_result(hp.plan, self.spec, self.km) for hp in plans]],
                        self.spec, self.cal, layout, self.opts, cad_tokens,
                        caps=plans[0].spec.capacity)
    ranks = [[x for row in doclens[k * r:(k + 1) * r] for x in row] for k in range(s)]
    local_tokens = tokens_per_row * r
    local = step.evaluate([[step.run_packed_dp(ranks, local_tokens, self.spec, self.km)]],
                          self.spec, self.cal, step.Layout(gpus=s), self.opts, local_tokens)
    return float(cad["step_s"]), float(local["step_s"])

  def describe(self) -> str:
    o = self.opts
    return (f"priced with the '{self.era}' calibration ({self.spec.dims.n_layers} layers, remat "
            f"'{o.remat}', exchange '{o.collective}', memory mode '{o.memory_mode}')")
