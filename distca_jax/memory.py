"""Will the compiled train step fit in device memory? The pre-flight check and its error.

`check_fits` compares XLA's buffer assignment of the compiled step (`memory_fields`) plus the
workspaces kernels allocate outside it (`kernel_workspace_bytes`: FlashAttention-3's backward
accumulators) with the device's memory (`memory_stats()['bytes_limit']`, what the allocator may
hand out) before the first step; devices that report no limit (CPUs) are not checked. A step that does not fit, or an
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
# memory_mode 'auto' runs 'keep' only with this fraction of the device's memory to spare (else
# 'resend', when that fits; the trainer's pre-flight, priced the same way by sim.step): XLA
# allocates a step's temporaries as one block, and buffers made while a step runs (the next
# batch, the device-initiated exchange's receive buffers) can split the free memory. On 4 x H100
# 80GB, Pretrain 128K: 'keep' needed 71.63 of 72.85 GiB, ran its first step and failed the second
# allocating its 48 GiB block (results/four/README.md).
AUTO_KEEP_SPARE = 0.04


def memory_fields(compiled) -> dict[str, int]:
  """XLA's buffer assignment of a compiled program, bytes per device ({} when not reported):
  MEMORY_FIELDS, ``total_per_device_bytes`` = arguments + outputs + temporaries - aliases
  (donated state aliases its output, so this bounds the live peak) and XLA's
  ``peak_memory_in_bytes`` (0 where not reported)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {}
  out = {f: int(getattr(mem, f, 0) or 0) for f in MEMORY_FIELDS}
  out["total_per_device_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                                   + out["temp_size_in_bytes"] - out["alias_size_in_bytes"])
  # XLA's own peak of the same buffer assignment, where the backend reports one (0: none).
  out["peak_memory_in_bytes"] = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
  return out


def format_bytes(n: int) -> str:
  """GiB to two decimals, or MiB below 1 GiB."""
  return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


class DoesNotFit(UserError):
  """The train step needs more memory per device than the device has."""

  def __init__(self, need: int | None, capacity: int, at_run_time: str = "",
               workspace: int = 0):
    self.need, self.capacity, self.at_run_time = need, capacity, at_run_time
    self.workspace = workspace
    self.knobs = ""
    super().__init__(self._line())

  def _line(self) -> str:
    need = "an unknown amount" if self.need is None else format_bytes(self.need)
    if self.need is not None and self.workspace:
      need += (f" (XLA's buffer assignment {format_bytes(self.need - self.workspace)} + kernel "
               f"workspaces {format_bytes(self.workspace)})")
    what = (f"ran out of device memory ({self.at_run_time})" if self.at_run_time
            else "does not fit in device memory")
    return (f"the train step {what}: it needs {need} per device and the "
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


# FlashAttention-3's varlen backward primitive (flash-attn3-jax); see kernel_workspace_bytes.
FLASH3_VARLEN_BWD = "flash_mha_varlen_bwd"


def flash3_bwd_workspace_bytes(nq: int, nk: int, q_heads: int, kv_heads: int, head_dim: int,
                               sequences: int) -> int:
  """Bytes of FlashAttention-3's varlen backward accumulators for one call: float32 dQ
  ``[H, Nq + 128 b, D]`` and dK, dV ``[K, Nk + 128 b, D]`` (``b`` sequences, each padded to the
  kernel's 128-row blocks)."""
  b = int(sequences)
  return 4 * int(head_dim) * (int(q_heads) * (int(nq) + 128 * b)
                              + 2 * int(kv_heads) * (int(nk) + 128 * b))


def kernel_workspace_bytes(jaxpr) -> int:
  """Bytes per device the largest kernel call of ``jaxpr`` allocates outside XLA's buffer
  assignment (the calls run one at a time, so the largest one counts).

  FlashAttention-3's varlen backward takes float32 accumulators from the FFI scratch allocator:
  dQ ``[H, Nq + 128 b, D]`` and dK, dV ``[K, Nk + 128 b, D]`` each (``b`` sequences, rows padded
  to its 128-row blocks; the operand avals give ``Nq, H, D``, ``Nk, K`` and ``b``). Inside
  ``shard_map`` the avals are per device. Other kernels of the project allocate inside XLA's
  plan (Mosaic kernels' scratch is part of their custom call's buffers).
  """
  most = 0
  for e in jaxpr.eqns:
    if e.primitive.name == FLASH3_VARLEN_BWD:
      q, k = e.invars[1].aval.shape, e.invars[2].aval.shape
      b = e.invars[6].aval.shape[0] - 1
      (nq, h, d), (nk, kh, _) = q, k
      most = max(most, flash3_bwd_workspace_bytes(nq, nk, h, kh, d, b))
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
          most = max(most, kernel_workspace_bytes(inner))
  return most


def step_need_bytes(compiled, workspace: int = 0) -> int | None:
  need = memory_fields(compiled).get("total_per_device_bytes")
  return None if need is None else need + workspace


def check_fits(compiled, device, capacity: int | None = None, workspace: int = 0) -> int | None:
  """The compiled step's need in bytes per device (XLA's plan plus ``workspace``, the kernels'
  memory outside it); raises DoesNotFit if it exceeds `capacity` (default: the device's
  bytes_limit; no check when neither is known)."""
  need = step_need_bytes(compiled, workspace)
  capacity = capacity if capacity is not None else device_capacity_bytes(device)
  if need is not None and capacity is not None and need > capacity:
    raise DoesNotFit(need, capacity, workspace=workspace)
  return need


# What an allocation failure says: XLA's allocator, or a kernel's FFI scratch allocation
# (FlashAttention-3 reports a failed one as "bad optional access").
OUT_OF_MEMORY_TEXT = ("RESOURCE_EXHAUSTED", "Out of memory", "bad optional access")


def raise_if_out_of_memory(err: Exception, need: int | None, device,
                           capacity: int | None = None, workspace: int = 0) -> None:
  """Raises DoesNotFit from `err` if it is an allocation failure (``OUT_OF_MEMORY_TEXT``)."""
  text = str(err)
  if not any(t in text for t in OUT_OF_MEMORY_TEXT):
    return
  capacity = capacity if capacity is not None else device_capacity_bytes(device)
  first = text.strip().splitlines()[0][:200] if text.strip() else type(err).__name__
  raise DoesNotFit(need, capacity or 0, at_run_time=first, workspace=workspace) from err
