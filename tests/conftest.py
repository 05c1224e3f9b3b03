"""Test setup: 8 fake CPU devices (set before jax is imported), CPU code compiled at XLA's backend
optimization level 0, strict numerics, and the `seed` fixture every randomized test draws from."""

import os
import zlib

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile hundreds of small programs and run each a few times: most of their time is
# XLA's CPU backend (LLVM) optimizing machine code. Level 0 skips those LLVM passes (about half
# the compile time); the programs' HLO is unchanged, only its machine code is less optimized. An
# XLA_FLAGS that names a level keeps it; GPU runs (JAX_PLATFORMS other than cpu) keep the default.
if (os.environ["JAX_PLATFORMS"] == "cpu"
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]):
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import jax  # noqa: E402  (must follow the environment setup above)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

_SEED = pytest.StashKey[int]()


@pytest.fixture
def seed(request) -> int:
  """A fixed seed per test, from its id, so every run draws the same inputs; a failing test
  prints it. DISTCA_TEST_SEED=N mixes N in, to draw other inputs: rerun with the same N to
  reproduce."""
  extra = os.environ.get("DISTCA_TEST_SEED", "")
  value = zlib.crc32(f"{request.node.nodeid}#{extra}".encode()) & ((1 << 30) - 1)
  request.node.stash[_SEED] = value
  return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  report = yield
  if report.failed and _SEED in item.stash:
    extra = os.environ.get("DISTCA_TEST_SEED")
    report.sections.append(("seed", f"seed={item.stash[_SEED]}"
                            + (f" (DISTCA_TEST_SEED={extra})" if extra else "")))
  return report
