#!/usr/bin/env bash
# Setup, run by scripts/train_tiny.sh and scripts/test.sh (no need to call it yourself): .venv
# (Python >= 3.12, the pinned jax/flax stack, the package in editable mode, test tools) and, unless
# --no-hf, .venv-hf (test-only torch + transformers reference, see setup_hf_reference.sh).
# Idempotent and quick when done: pip runs only when .venv is new or pyproject.toml / this script
# changed since the last install (a hash kept in .venv/.setup-hash).
# Override the interpreter with PYTHON=/path/to/python3.12.
set -euo pipefail
cd "$(dirname "$0")/.."

with_hf=1
for arg in "$@"; do
  case "$arg" in
    --no-hf) with_hf=0 ;;
    *) echo "setup: unknown argument '$arg'; the only option is --no-hf" >&2; exit 2 ;;
  esac
done

is_py312plus() {  # the interpreter runs, is >= 3.12 and has venv
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
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
  PY=$(find_python) || {
    echo "setup: no Python >= 3.12 with venv found; install one (Debian: apt-get install" \
         "python3.12 python3.12-venv) or set PYTHON=/path/to/python3.12" >&2
    exit 1
  }
  echo "setup: creating .venv with $PY"
  "$PY" -m venv .venv
fi
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.setup-hash 2>/dev/null)" != "$want" ]; then
  echo "setup: installing distca-jax and its pinned dependencies into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "$want" > .venv/.setup-hash
fi
if [ "$with_hf" = 1 ]; then
  bash scripts/setup_hf_reference.sh
fi
