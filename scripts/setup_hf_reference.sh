#!/usr/bin/env bash
# Creates .venv-hf: the test-only environment with torch (CPU) + transformers that
# tests/test_hf_parity.py runs tests/hf_reference.py in, to get LlamaForCausalLM reference logits.
# It is separate from the JAX venv so torch never enters the training environment.
#
#   bash scripts/setup_hf_reference.sh            # -> <repo>/.venv-hf
#   DISTCA_HF_VENV=/some/dir bash scripts/...     # elsewhere; then export DISTCA_HF_PYTHON=/some/dir/bin/python
#   PYTHON=/usr/bin/python3.12 bash scripts/...   # choose the base interpreter (3.11 or 3.12)
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/...   # small CPU-only torch
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DISTCA_HF_VENV:-$REPO/.venv-hf}"
TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.23.0"  # the version the parity test was written against

# True if "$1" runs and is CPython 3.11 or 3.12 with the venv module.
usable() {
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] in ((3, 11), (3, 12)) else 1)' \
    >/dev/null 2>&1
}

find_python() {
  local c
  if [[ -n "${PYTHON:-}" ]]; then
    usable "$PYTHON" && { echo "$PYTHON"; return; }
    echo "PYTHON=$PYTHON is not a working Python 3.11/3.12 with venv" >&2; return 1
  fi
  # 3.11 first: a CPU torch wheel for cp311 is what this project's machines carry.
  for c in python3.11 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && usable "$(command -v "$c")"; then
      command -v "$c"; return
    fi
  done
  # pyenv installs that are not on PATH (its shims only expose the selected version).
  if command -v pyenv >/dev/null 2>&1; then
    local root; root="$(pyenv root)"
    for c in "$root"/versions/3.11*/bin/python3 "$root"/versions/3.12*/bin/python3; do
      [[ -x "$c" ]] && usable "$c" && { echo "$c"; return; }
    done
  fi
  echo "no Python 3.11 or 3.12 found (tried PYTHON, python3.11, python3.12, python3, pyenv);" \
       "install one (Debian: apt-get install python3 python3-venv) or set PYTHON=/path/to/python" >&2
  return 1
}

# Done already: the venv exists and was filled by this very script (same pins, same index).
want=$(cat "${BASH_SOURCE[0]}" <(echo "${TORCH_INDEX_URL:-}") | sha256sum | cut -d' ' -f1)
if [[ -x "$VENV/bin/python" && "$(cat "$VENV/.setup-hash" 2>/dev/null)" == "$want" ]]; then
  exit 0
fi
BASE="$(find_python)"
echo "base interpreter: $BASE ($("$BASE" --version 2>&1))"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$BASE" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" "transformers==$TRANSFORMERS_VERSION" safetensors numpy
"$VENV/bin/python" -c 'import torch, transformers; print("ok: torch", torch.__version__, "transformers", transformers.__version__)'
echo "$want" > "$VENV/.setup-hash"
echo "reference environment ready: $VENV/bin/python (tests find it there, or via DISTCA_HF_PYTHON)"
