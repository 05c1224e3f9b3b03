#!/usr/bin/env bash
# Trains the tiny default (configs/tiny_cpu.py) on the CPU, setting up .venv first if needed.
# Extra arguments go to distca_jax.train (e.g. --config.num_steps=50); WORKDIR picks the workdir
# (default /tmp/distca_tiny; rerunning resumes from its checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-hf
exec .venv/bin/python -m distca_jax.train --config configs/tiny_cpu.py \
  --workdir "${WORKDIR:-/tmp/distca_tiny}" "$@"
