"""Will the compiled train step fit in device memory? The pre-flight check and its error.

`check_fits` compares XLA's buffer assignment of the compiled step (`memory_fields`) with the
device's memory (`memory_stats()['bytes_limit']`, what the allocator may hand out) before the first
step; devices that report no limit (CPUs) are not checked. A step that does not fit, or an
out-of-memory error at run time, raises `DoesNotFit` with the need and the capacity;
`distca_jax.aot.explain_does_not_fit` adds the estimated need of the knobs that lower it (the
entry point does so; estimating compiles variants, so it runs only when the step does not fit).
"""

from __future__ import annotations

import logging

import jax

from distca_jax.errors import UserError

MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                 "alias_size_in_bytes", "generated_code_size_in_bytes")
GIB = 1 << 30


def memory_fields(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled program, bytes per device ({} when not reported):
  MEMORY_FIELDS and ``total_per_device_bytes`` = arguments + outputs + temporaries - aliases
  (donated state aliases its output, so this bounds the live peak)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  out = {f: int(getattr(mem, f, 0) or 0) for f in MEMORY_FIELDS}
  out["total_per_device_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                   + out["temp_size_in_bytes"] - out["alias_size_in_bytes"])
  return out


def format_bytes(n: int) -> str:
  """GiB to two decimals, or MiB below 1 GiB."""
  return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


class DoesNotFit(UserError):
  """The train step needs more memory per device than the device has."""

  def __init__(self, need: int | None, capacity: int, at_run_time: str = ""):
    self.need, self.capacity, self.at_run_time = need, capacity, at_run_time
    self.knobs = ""
    super().__init__(self._line())

  def _line(self) -> str:
    need = "an unknown amount" if self.need is None else format_bytes(self.need)
    what = (f"ran out of device memory ({self.at_run_time})" if self.at_run_time
            else "does not fit in device memory")
    return (f"the train step {what}: it needs {need} per device (XLA's buffer assignment) and the "
            f"device has {format_bytes(self.capacity)} (bytes_limit)"
            + (f"; {self.knobs}" if self.knobs else
               "; lower model.remat, raise mesh.tensor or lower tokens_per_rank"))

  def with_knobs(self, knobs: str) -> "DoesNotFit":
    self.knobs = knobs
    self.args = (self._line(),)
    return self


def device_capacity_bytes(device) -> int | None:
  """The bytes the device's allocator may use, or None where the device reports none (CPU)."""
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except  # backends without memory stats
    stats = None
  if not stats or "bytes_limit" not in stats:
    logging.debug("device %s reports no memory limit: no memory pre-flight", device)
    return None
  return int(stats["bytes_limit"])


def step_need_bytes(compiled) -> int | None:
  return memory_fields(compiled).get("total_per_device_bytes")


def check_fits(compiled, device, capacity: int | None = None) -> int | None:
  """The compiled step's need in bytes per device; raises DoesNotFit if it exceeds `capacity`
  (default: the device's bytes_limit; no check when neither is known)."""
  need = step_need_bytes(compiled)
  capacity = capacity if capacity is not None else device_capacity_bytes(device)
  if need is not None and capacity is not None and need > capacity:
    raise DoesNotFit(need, capacity)
  return need


def raise_if_out_of_memory(err: Exception, need: int | None, device,
                           capacity: int | None = None) -> None:
  """Raises DoesNotFit from `err` if it is an out-of-memory error (RESOURCE_EXHAUSTED)."""
  text = str(err)
  if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
    return
  capacity = capacity if capacity is not None else device_capacity_bytes(device)
  first = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
  raise DoesNotFit(need, capacity or 0, at_run_time=first) from err
