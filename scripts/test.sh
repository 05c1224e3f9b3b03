#!/usr/bin/env bash
# Runs the test suite on 8 fake CPU devices, setting up .venv and .venv-hf first if needed.
#   scripts/test.sh            # the full suite (what CI runs)
#   scripts/test.sh --fast     # the fast tier: every test not marked slow (no .venv-hf needed)
# Further arguments go to pytest (e.g. -x, -k name). The exit status is pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/setup.sh --no-hf
  exec .venv/bin/python -m pytest -q -m "not slow" tests "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
