#!/usr/bin/env bash
# Installs lowbit and what it needs on a fresh machine.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test dependencies
# torch goes in first: a CPU machine gets the CPU build (torch==2.13.0), so that the
# package's own `torch` requirement is already met and never pulls a CUDA wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -q -e ".${extra}"
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
