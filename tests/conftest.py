"""Test setup: 8 fake CPU devices (set before jax is imported) and strict numerics."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the environment setup above)

jax.config.update("jax_numpy_rank_promotion", "raise")
