#!/usr/bin/env bash
# Runs the test suite on 8 fake CPU devices, setting up .venv and .venv-hf first if needed.
#   scripts/test.sh            # the full suite (what CI runs)
#   scripts/test.sh --fast     # the fast tier: every test not marked slow (no .venv-hf needed)
# Further arguments go to pytest (e.g. -x, -k name; -n 0 runs in this one process). The exit
# status is pytest's. The tests run on 2 pytest-xdist workers, one per core of a 2-core machine
# (DISTCA_TEST_WORKERS=N for another count), a test file per worker at a time; tests/conftest.py's
# SERIAL_TESTS run the multi-process tests one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=(-n "${DISTCA_TEST_WORKERS:-2}" --dist loadfile)
if [ "${1:-}" = "--fast" ]; then
  shift
  bash scripts/setup.sh --no-hf
  exec .venv/bin/python -m pytest -q "${workers[@]}" -m "not slow" tests "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "${workers[@]}" tests "$@"
