#!/usr/bin/env bash
# One-time setup: .venv (Python 3.12, pinned jax/flax stack, the package in editable mode, test
# tools) and .venv-hf (test-only torch + transformers reference, see setup_hf_reference.sh).
# Idempotent: rerunning only checks. Override the interpreter with PYTHON=/path/to/python3.12.
set -euo pipefail
cd "$(dirname "$0")/.."

is_py312plus() {  # the interpreter runs and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_py312plus "$c" && { command -v "$c"; return; }
  done
  # pyenv installs whose shims refuse without PYENV_VERSION: the oldest >= 3.12 first, so 3.12
  # (what the GPU machines run) wins over newer ones.
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
      c="$(pyenv prefix "$v")/bin/python3"
      is_py312plus "$c" && { echo "$c"; return; }
    done
  fi
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "setup: no Python >= 3.12 found; install one or set PYTHON=" >&2; exit 1; }
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "setup: installing distca-jax and its pinned dependencies into .venv"
.venv/bin/python -m pip install -q -e ".[test]"
bash scripts/setup_hf_reference.sh
echo "setup: done. Train: .venv/bin/python -m distca_jax.train --config configs/tiny_cpu.py --workdir /tmp/distca_tiny"
