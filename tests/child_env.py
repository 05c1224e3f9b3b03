"""XLA_FLAGS for the tests' subprocesses on the CPU: the tests' optimization level
(``OPT_LEVEL``, which tests/conftest.py also gives the test processes) and a fake device count."""

# XLA's CPU backend at optimization level 0: the LLVM passes skipped (about half the compile time;
# the programs' HLO is unchanged, only their machine code less optimized).
OPT_LEVEL = "--xla_backend_optimization_level=0"


def cpu_xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS of a child process on the CPU: ``devices`` fake devices (None: none named, the
  count comes from ``JAX_NUM_CPU_DEVICES``) at the tests' optimization level."""
  count = [f"--xla_force_host_platform_device_count={int(devices)}"] if devices else []
  return " ".join(count + [OPT_LEVEL])
